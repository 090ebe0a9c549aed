"""What a list shows of a conversation (`services/listing.py`): made from a change alone when it
is committed, it is what the whole conversation shows after that change; made from a view
resumed at a checkpoint, it is what the whole view shows; kept rows are read back whole or not
at all."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.context import ConversationView, Turn
from gateway.context.history import PREVIEW_CHARS
from gateway.context.tail import checkpoint, resume
from gateway.services.listing import FORMAT, Listing
from gateway.types import Message

Change = Callable[[ConversationView], None]

_texts = st.sampled_from(["hi", "a longer question " * 12, "", "weather?"])
_encodings = st.sampled_from(["cl100k_base", "o200k_base", None])


@st.composite
def messages(draw: st.DrawFn) -> list[Message]:
    out: list[Message] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["user", "user", "feedback", "parts", "tool"]))
        text = draw(_texts)
        if kind == "user":
            out.append({"role": "user", "content": text})
        elif kind == "feedback":
            out.append({"role": "user", "content": text, "is_feedback": True})
        elif kind == "parts":
            parts = [{"type": "text", "text": text}, {"type": "text", "text": "x"}]
            out.append({"role": "user", "content": parts})
        else:
            out.append({"role": "tool", "tool_call_id": "c1", "content": text})
    return out


@st.composite
def changes(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """Turns (with system prompts, feedback, branches, answers or none, counted in one encoding
    or another or not at all, users) and the markers a list row follows (creation, metadata,
    resets)."""
    out: list[tuple[str, Any]] = []
    for n in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["turn", "turn", "turn", "metadata", "reset", "created"]))
        at = 1000.0 + n
        if kind == "turn":
            inputs = draw(messages())
            encoding = draw(_encodings)
            system = [{"role": "system", "content": draw(_texts)}] if draw(st.booleans()) else None
            output = {"role": "assistant", "content": draw(_texts)} if draw(st.booleans()) else None
            counted = encoding is not None
            out.append(
                (
                    "turn",
                    dict(
                        response_id=f"r{n}",
                        input=tuple(inputs),
                        output=output,
                        system=tuple(system) if system else None,
                        encoding=encoding,
                        input_tokens=tuple(draw(st.integers(1, 50)) for _ in inputs) if counted else None,
                        output_tokens=draw(st.integers(1, 50)) if counted and output else None,
                        system_tokens=tuple(7 for _ in system) if counted and system else None,
                        created=at,
                        user=draw(st.sampled_from([None, "ann", "bob"])),
                        branch_back=draw(st.sampled_from([None, 0, 1, 3])),
                    ),
                )
            )
        elif kind == "metadata":
            out.append(("marker", {"type": "metadata", "metadata": {"n": str(n)}, "at": at}))
        elif kind == "reset":
            out.append(("marker", {"type": "reset", "keep_system_message": draw(st.booleans()), "at": at}))
        else:
            out.append(("marker", {"type": "conversation", "created_at": int(at), "metadata": {"k": "v"}}))
    return out


def as_change(view: ConversationView, kind: str, spec: Any) -> tuple[Change, ConversationView]:
    """The change, and the view it is planned on (a branch: on the client's version, cut back,
    as a turn plans it)."""
    if kind == "marker":
        return (lambda v: v.apply_marker(copy.deepcopy(spec))), view
    fields = dict(spec)
    back = fields.pop("branch_back")
    branch_at = max(0, view.history_count - back) if back is not None else None
    turn = Turn(**fields, branch_at=branch_at)
    return (lambda v: v.extend(turn)), view.branched(branch_at) if branch_at is not None else view


@settings(max_examples=300, deadline=None)
@given(changes())
def test_the_listing_a_change_brings_is_the_listing_after_it(steps: list[tuple[str, Any]]) -> None:
    view = ConversationView()
    for kind, spec in steps:
        if kind == "turn" and spec["encoding"] is not None:  # as the planner counts what it sends
            view.count_tokens(spec["encoding"], lambda m: len(str(m.get("content"))) + 1)
        change, planned = as_change(view, kind, spec)
        counted = planned.history_tokens_total() is not None
        if kind == "turn" and spec["encoding"] is not None:
            assert counted
        brought = Listing.after(planned, change)
        change(view)
        assert not view.partial
        whole = Listing.of(view)
        assert whole is not None
        if counted:  # else the list makes it (every message counted then)
            assert brought == whole
        assert whole.messages == len(view.history) and whole.turns == view.turns


def test_a_view_resumed_at_a_checkpoint_lists_as_the_whole_view() -> None:
    whole = ConversationView()
    points = []
    for n in range(6):
        points.append(checkpoint(whole))
        text = f"question {n} " * (30 if n == 2 else 1)
        turn = Turn(
            f"r{n}",
            ({"role": "user", "content": text},),
            {"role": "assistant", "content": f"answer {n}"},
            encoding="cl100k_base",
            input_tokens=(5 + n,),
            output_tokens=3,
            created=100.0 + n,
            user="ann",
        )
        whole.extend(turn)
        if n >= 3:  # resumed at turn 3: turns 3.. applied to it
            if n == 3:
                partial = resume(points[3], frozenset({"r0", "r1", "r2"}), None, None)
            partial.extend(turn)
    assert partial.partial and Listing.of(partial) == Listing.of(whole)
    # A feedback-only tail: the preview is the checkpoint's.
    feedback = Turn("r6", ({"role": "user", "content": "thumbs", "is_feedback": True},), None, created=107.0)
    resumed = resume(checkpoint(whole), frozenset(whole.response_ids), None, None)
    resumed.extend(feedback)
    whole.extend(feedback)
    assert Listing.of(resumed) == Listing.of(whole)
    assert Listing.of(whole).preview == "question 5 "  # type: ignore[union-attr]


def test_a_checkpoint_of_an_older_gateway_lists_nothing() -> None:
    """Without the tokens and preview of what it stands on, a resumed view cannot tell: the
    list then reads the whole conversation."""
    whole = ConversationView()
    whole.extend(Turn("r0", ({"role": "user", "content": "hi"},), {"role": "assistant", "content": "yo"}))
    point = {k: v for k, v in checkpoint(whole).items() if k not in ("tokens", "preview")}
    assert Listing.of(resume(point, frozenset({"r0"}), None, None)) is None
    # Nothing stood before it: nothing is missing.
    assert Listing.of(resume(checkpoint(ConversationView()), frozenset(), None, None)) is not None


def test_the_preview_is_the_newest_user_message_cut() -> None:
    view = ConversationView()
    long = "word " * 100
    view.extend(Turn("r0", ({"role": "user", "content": long},), {"role": "assistant", "content": "ok"}))
    view.extend(Turn("r1", ({"role": "tool", "tool_call_id": "c", "content": "42"},), None))
    listing = Listing.of(view)
    assert listing is not None and listing.preview == long[:PREVIEW_CHARS]


def test_a_kept_row_reads_back_whole_or_not_at_all() -> None:
    listing = Listing(3, 6, 120, 1.0, 2.5, "ann", {"k": "v"}, "hello")
    assert Listing.from_record(listing.record()) == listing
    assert Listing.from_record({**listing.record(), "created_at": None}) == Listing(
        3, 6, 120, None, 2.5, "ann", {"k": "v"}, "hello"
    )
    for damaged in (
        None,
        [],
        {**listing.record(), "format": FORMAT + 1},
        {**listing.record(), "turns": -1},
        {**listing.record(), "messages": True},
        {**listing.record(), "tokens": 1.5},
        {**listing.record(), "last_activity": "yesterday"},
        {**listing.record(), "user": 7},
        {**listing.record(), "metadata": {"k": 1}},
        {**listing.record(), "preview": None},
        {k: v for k, v in listing.record().items() if k != "metadata"},
    ):
        assert Listing.from_record(damaged) is None, damaged


@pytest.mark.parametrize("back", [1, 4])
def test_a_branch_into_what_is_not_loaded_brings_no_listing(back: int) -> None:
    view = ConversationView()
    for n in range(3):
        view.extend(
            Turn(
                f"r{n}",
                ({"role": "user", "content": f"q{n}"},),
                {"role": "assistant", "content": f"a{n}"},
                encoding="cl100k_base",
                input_tokens=(2,),
                output_tokens=2,
            )
        )
    edited = Turn("r3", ({"role": "user", "content": "edited"},), None, branch_at=view.history_count - back)
    assert Listing.after(view, lambda v: v.extend(edited)) is None  # the list makes it
