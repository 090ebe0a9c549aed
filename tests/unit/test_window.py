"""fit_window: pure rules, and hypothesis properties over random conversations with tool calls."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.context import repair_tool_calls
from gateway.context.tools import UNANSWERED_TOOL_RESULT
from gateway.context.window import REQUEST_OVERHEAD_TOKENS, fit_window, omitted_marker, tool_units
from gateway.exceptions import ContextLengthExceeded
from tests.helpers import assert_openai_tool_order

Message = dict[str, Any]


def count(m: Message) -> int:
    """A deterministic stand-in tokenizer: 4 framing + 1 per word (tests need no tiktoken)."""
    text = str(m.get("content") or "") + " ".join(
        (c.get("function") or {}).get("arguments", "") for c in m.get("tool_calls") or []
    )
    return 4 + len(text.split())


def marker_tokens(n: int) -> int:
    return count(omitted_marker(n))


def fit(
    system: list[Message],
    history: list[Message],
    new: list[Message],
    budget: int,
    max_msgs: int = 1000,
    **kw: Any,
):
    conversation = repair_tool_calls([*history, *new])
    first_new = next((i for i, m in enumerate(conversation) if any(m is n for n in new)), len(conversation))
    return fit_window(
        system=system,
        system_tokens=[count(m) for m in system],
        conversation=conversation,
        conversation_tokens=[count(m) for m in conversation],
        first_new=first_new,
        budget=budget,
        max_history_messages=max_msgs,
        marker_tokens=marker_tokens,
        **kw,
    )


def u(text: str) -> Message:
    return {"role": "user", "content": text}


def a(text: str) -> Message:
    return {"role": "assistant", "content": text}


def call(cid: str) -> Message:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def result(cid: str, text: str = "ok") -> Message:
    return {"role": "tool", "tool_call_id": cid, "content": text}


SYSTEM = [{"role": "system", "content": "be kind"}]


def test_everything_fits_nothing_omitted() -> None:
    history = [u("a"), a("b"), u("c"), a("d")]
    w = fit(SYSTEM, history, [u("e")], budget=1000)
    assert w.messages == [*SYSTEM, *history, u("e")]
    assert w.omitted == 0 and w.tokens["total"] == sum(count(m) for m in w.messages) + REQUEST_OVERHEAD_TOKENS


def test_drops_oldest_first_and_inserts_marker_after_system() -> None:
    history = [u(f"old {i}") for i in range(10)]
    w = fit(SYSTEM, history, [u("now")], budget=60)
    assert w.messages[0] == SYSTEM[0]
    assert w.messages[1]["content"] == f"[{w.omitted} earlier messages omitted]"
    assert w.messages[-1] == u("now")
    kept = w.messages[2:-1]
    assert kept == history[len(history) - len(kept) :]
    assert w.omitted == len(history) - len(kept) > 0
    assert w.tokens["total"] <= 60


def test_max_history_messages() -> None:
    history = [u(str(i)) for i in range(20)]
    w = fit(SYSTEM, history, [u("now")], budget=10_000, max_msgs=5)
    assert w.messages[2:-1] == history[-5:] and w.omitted == 15


def test_tool_unit_is_never_split_and_never_starts_with_tool() -> None:
    history = [u("q"), call("c1"), result("c1", "one two three four five six"), a("done"), u("q2"), a("r2")]
    fitted = 0
    kept_the_unit = 0
    for budget in range(20, 120):
        try:
            w = fit(SYSTEM, history, [u("now")], budget=budget)
        except ContextLengthExceeded:
            continue
        fitted += 1
        body = [m for m in w.messages if m not in SYSTEM and not str(m.get("content", "")).startswith("[")]
        assert body[0]["role"] != "tool"
        if call("c1") in body:
            kept_the_unit += 1
            assert result("c1", "one two three four five six") in body
    # Budgets that fit something, and budgets that keep the tool unit, were both exercised.
    assert fitted >= 50 and kept_the_unit >= 10, (fitted, kept_the_unit)


def test_new_tool_results_pin_their_stored_call() -> None:
    history = [u("x " * 30), a("y " * 30), u("weather?"), call("c9")]
    w = fit(SYSTEM, history, [result("c9", "sunny")], budget=45)
    assert w.messages[-2:] == [call("c9"), result("c9", "sunny")]


def test_request_alone_too_big_is_context_length_exceeded() -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        fit(SYSTEM, [u("a")], [u("word " * 500)], budget=100)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"


def test_summary_and_recap_are_kept_in_order() -> None:
    summary = {"role": "system", "content": "Summary: name is Bob"}
    recap = {"role": "system", "content": "Earlier today: ..."}
    w = fit(
        SYSTEM,
        [u("a") for _ in range(30)],
        [u("now")],
        budget=60,
        summary=summary,
        summary_tokens=count(summary),
        recap=recap,
        recap_tokens=count(recap),
    )
    assert w.messages[:3] == [*SYSTEM, summary, recap]
    assert w.messages[3]["content"].endswith("earlier messages omitted]")


def test_omitted_before_counts_in_marker() -> None:
    w = fit(SYSTEM, [u("a"), a("b")], [u("now")], budget=1000, omitted_before=7)
    assert w.messages[1]["content"] == "[7 earlier messages omitted]" and w.omitted == 7


def test_deterministic() -> None:
    history = [u(f"m {i} " * (i % 7)) for i in range(50)]
    assert (
        fit(SYSTEM, history, [u("z")], budget=120).messages
        == fit(SYSTEM, history, [u("z")], budget=120).messages
    )


# -- properties --------------------------------------------------------------------------------


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    out: list[Message] = []
    n_turns = draw(st.integers(0, 25))
    for t in range(n_turns):
        out.append(u(" ".join(["w"] * draw(st.integers(0, 30)))))
        kind = draw(st.sampled_from(["text", "tools", "abandoned"]))
        if kind == "text":
            out.append(a(" ".join(["r"] * draw(st.integers(0, 30)))))
        else:
            ids = [f"t{t}_{k}" for k in range(draw(st.integers(1, 3)))]
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": i,
                            "type": "function",
                            "function": {"name": "f", "arguments": "x " * draw(st.integers(0, 10))},
                        }
                        for i in ids
                    ],
                }
            )
            if kind == "tools":
                out.extend(result(i, "v " * draw(st.integers(0, 10))) for i in ids)
                out.append(a("after tools"))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=conversations(),
    budget=st.integers(30, 600),
    max_msgs=st.integers(0, 60),
    new_words=st.integers(0, 20),
)
def test_window_properties(history: list[Message], budget: int, max_msgs: int, new_words: int) -> None:
    new = [u(" ".join(["n"] * new_words))]
    try:
        w = fit(SYSTEM, history, new, budget=budget, max_msgs=max_msgs)
    except ContextLengthExceeded:
        # Only when the fixed part alone (system + request + marker) cannot fit.
        fixed = REQUEST_OVERHEAD_TOKENS + count(SYSTEM[0]) + count(new[0])
        assert fixed + marker_tokens(len(history) + 5) > budget
        return
    # Within budget, by the same counter.
    assert sum(count(m) for m in w.messages) + REQUEST_OVERHEAD_TOKENS <= budget
    assert w.tokens["total"] <= budget
    # System prompt first; the current request last.
    assert w.messages[0] == SYSTEM[0] and w.messages[-1] == new[0]
    # Valid for OpenAI's tool rules (the final list, with the marker removed).
    body = [m for m in w.messages[1:] if not (m["role"] == "system" and "omitted" in m["content"])]
    assert_openai_tool_order(body)
    assert body[0]["role"] != "tool"
    # Suffix-preserving: what is kept is exactly the newest part of the repaired conversation.
    repaired = repair_tool_calls([*history, *new])
    assert body == repaired[len(repaired) - len(body) :]
    # Marker iff something was left out, and it counts exactly the stored messages left out
    # (not a result the repair added for an unanswered call).
    cut = repaired[: len(repaired) - len(body)]
    omitted = sum(1 for m in cut if m.get("content") != UNANSWERED_TOOL_RESULT)
    has_marker = any(m["role"] == "system" and "omitted" in m["content"] for m in w.messages)
    assert has_marker == (omitted > 0)
    if omitted:
        assert w.messages[1]["content"] == f"[{omitted} earlier messages omitted]"
    # max_history_messages: the history part (everything but the request) never exceeds it.
    assert len(body) - 1 <= max_msgs


def test_tool_units() -> None:
    msgs = [u("a"), call("c"), result("c"), a("b"), result("zz")]
    assert tool_units(msgs) == [(0, 1), (1, 3), (3, 4), (4, 5)]


def test_the_marker_counts_stored_messages_not_the_results_repair_adds() -> None:
    """An unanswered tool call in the cut part gets a synthetic result from the repair: left
    out with it, it is not counted among the earlier messages omitted (it was never stored)."""
    history = [u("q0"), call("c1"), u("no, stop"), a("ok"), *[u(f"old {i}") for i in range(6)]]
    w = fit(SYSTEM, history, [u("now")], budget=50)
    kept = [m for m in w.messages[2:-1]]
    assert kept == history[len(history) - len(kept) :]
    assert w.omitted == len(history) - len(kept)  # stored messages only
    assert w.messages[1]["content"] == f"[{w.omitted} earlier messages omitted]"
