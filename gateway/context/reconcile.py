"""What a request adds to a stored conversation (pure).

The new messages of a client that sends only those, resends its whole history, trims it, or
edits it (a branch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from gateway.context.history import ConversationView, NotLoaded, is_feedback, message_key
from gateway.types import Message


def _common_prefix(incoming: Sequence[Message], stored_keys: Sequence[bytes]) -> int:
    n = min(len(incoming), len(stored_keys))
    i = 0
    while i < n and message_key(incoming[i]) == stored_keys[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What a request adds to the stored conversation.

    Its new messages, and where the stored history is cut first when the client's version
    diverged from it (None: nowhere).

    A branch is a regeneration when the new messages are the first of those it leaves behind,
    unchanged: the client resent its history up to before an answer, to have another one. Any
    other branch is an edit: a message of the client's differs from the stored one.
    """

    new: list[Message]
    branch_at: int | None = None
    regenerated: bool = False
    # The first stored message the branch leaves behind: (its response id, its position there).
    left_from: tuple[str, int] | None = None


def _branch(new: Sequence[Message], branch_at: int, view: ConversationView) -> Reconciled:
    """The branch at `branch_at` (a position in the stored history, loaded whole) adding `new`."""
    left = view.keys("history")[branch_at:]
    regenerated = 0 < len(new) <= len(left) and all(
        message_key(message) == key for message, key in zip(new, left, strict=False)
    )
    left_from = (view.history_owner[branch_at], view.history_pos[branch_at]) if left else None
    return Reconciled(list(new), branch_at, regenerated, left_from)


def _is_text_answer(message: Message) -> bool:
    """An assistant message of text alone (no tool calls), which an answer can go on from."""
    text = message.get("content")
    return (
        message.get("role") == "assistant"
        and isinstance(text, str)
        and bool(text)
        and not message.get("tool_calls")
    )


def _going_on(incoming: Sequence[Message], view: ConversationView) -> Reconciled | None:
    """A request that ends with the stored last answer (as stored, or text going on from it),
    after nothing or after the stored messages before that answer (the history's, or the
    transcript's with feedback: a whole or a trimmed history): the client asks that answer to go
    on (a prefill; an answer cut short). It is taken back and sent once, as the request's last
    message, and the answer to come is stored in its place. So is a request of no message but
    its system prompt, which else would have two answers in a row stored. None otherwise."""
    if not view.history:
        return None
    stored = view.history[-1]
    if not incoming:  # (a system prompt alone: nothing new to answer)
        if not _is_text_answer(stored):
            return None
        incoming = [stored]
    last = incoming[-1]
    if last.get("role") != "assistant" or stored.get("role") != "assistant":
        return None
    goes_on = (
        _is_text_answer(last)
        and _is_text_answer(stored)
        and cast(str, last["content"]).startswith(cast(str, stored["content"]))
    )
    if not goes_on and message_key(last) != view.keys("history")[-1]:
        return None
    if view.partial:
        raise NotLoaded("taking back the stored answer needs all of the history")
    history, transcript = view.keys("history"), view.keys("transcript")
    before = [message_key(m) for m in incoming[:-1]]
    k = len(before)
    for kept in (history, transcript):
        if k < len(kept) and kept[-1] == history[-1] and kept[len(kept) - 1 - k : -1] == before:
            return _branch(incoming[-1:], len(history) - 1, view)
    return None


def reconcile(incoming: Sequence[Message], view: ConversationView) -> Reconciled:
    """Match the request's messages (system prompt already split off) with the stored ones.

    What a resent copy brings beside its last turn holds no feedback (see `_past_feedback_out`).
    """
    matched = _match(incoming, view)
    new = _past_feedback_out(matched.new)
    return matched if len(new) == len(matched.new) else dataclasses.replace(matched, new=new)


def _past_feedback_out(new: list[Message]) -> list[Message]:
    """`new` without the feedback of its past turns (those an answer in it follows: a resent
    copy that keeps the feedback its client sent): a feedback-only turn goes whole, its reply
    too, and feedback beside other messages goes alone. Each was forwarded once, when it was
    new, and was sent again, its reply then stored as history for good."""
    last_answer = max((i for i, m in enumerate(new) if m.get("role") == "assistant"), default=-1)
    if not any(is_feedback(m) for m in new[:last_answer]):
        return new
    out: list[Message] = []
    i = 0
    while i <= last_answer:
        j = i
        while j <= last_answer and new[j].get("role") != "assistant":
            j += 1
        said = new[i:j]  # a turn's input, then its answer from j on
        k = j
        while k <= last_answer and new[k].get("role") in ("assistant", "tool"):
            k += 1
        if said and all(is_feedback(m) for m in said):
            i = k  # (a feedback-only turn: its answer goes with it)
            continue
        out += [m for m in said if not is_feedback(m)] + new[j:k]
        i = k
    return out + new[last_answer + 1 :]


def _match(incoming: Sequence[Message], view: ConversationView) -> Reconciled:
    """`reconcile`'s rules, in order:
    - starts with everything stored: the rest is new (a full-history client);
    - starts with part of the stored history, then differs (an edited message, a regenerated
      answer): the conversation branches where they differ and continues with the client's
      messages; only when the request holds an assistant message before its last one (a client
      that resends history resends answers; one that sends only new messages never does);
    - starts with the stored history's last messages (a client that trims its history): the
      overlap is dropped;
    - starts with a stored run that is not the tail, an answer among it (a trimmed history that
      was edited or regenerated): a branch after that run;
    - differs from the stored history in its first message alone, an answer among the rest (the
      first message edited), or in its beginning alone, laid against the stored end (its first
      turn edited, a message put before it): a branch where that copy begins;
    - else every message is new. The last message is always new: one that is the stored last
      answer, or text going on from it, after nothing or after what is stored before that answer,
      takes that answer back to go on from it (a prefill).
    """
    n = len(incoming)
    if n > 1 and view.partial:
        raise NotLoaded("matching a resent history needs all of it")
    going_on = _going_on(incoming, view)
    if going_on is not None:
        return going_on
    if n <= 1 or not view.transcript:
        return Reconciled(list(incoming))
    transcript = view.keys("transcript")
    common = _common_prefix(incoming, transcript)
    if common >= len(transcript):  # all of it, feedback included
        return Reconciled(list(incoming[min(common, n - 1) :]))
    history = view.keys("history")
    m = len(history)
    shared = min(_common_prefix(incoming, history), n - 1)
    if shared >= m:
        return Reconciled(list(incoming[shared:]))
    answered = _answers(incoming[: n - 1])
    if answered:
        toolless = _without_tool_results(incoming, view, shared)
        if toolless is not None:
            return toolless
    common = min(common, n - 1)
    if common > shared and answered:
        # The client's copy still holds messages left out of history (deleted since, or
        # feedback): it diverges where it leaves the transcript, and what it resends before
        # that is not new.
        return _branch(incoming[common:], _in_history(transcript[:common], history), view)
    keys = [message_key(msg) for msg in incoming[: n - 1]]
    table = _failure_table(keys)
    # The longest overlap with the stored tail: the transcript's (a copy that still holds
    # messages left out of history since) or the history's (a copy without them).
    k = max(_matched_at_end(keys, table, transcript), _matched_at_end(keys, table, history))
    if shared > 0 and answered and not (k == len(keys) and not _answers(incoming[:shared])):
        # (A copy that is the stored tail whole, its start alone the stored start, no answer in
        # it, is a trimmed one whose first message repeats the conversation's: "continue".)
        return _branch(incoming[shared:], shared, view)
    if k and not _answers(incoming[k : n - 1]):
        return Reconciled(list(incoming[k:]))
    # An overlap after which answers follow (one "ok" like the stored last): a copy that was
    # edited is likelier, else it is the overlap still.
    edited = _edited_elsewhere(incoming, keys, table, view) if answered else None
    return edited if edited is not None else Reconciled(list(incoming[k:]))


def _answers(messages: Sequence[Message]) -> bool:
    return any(message.get("role") == "assistant" for message in messages)


def _edited_elsewhere(
    incoming: Sequence[Message], keys: Sequence[bytes], table: Sequence[int], view: ConversationView
) -> Reconciled | None:
    """A resent history, an answer among it, that neither starts nor ends as the stored one
    whole (None: none of these):
    - its end the stored end, an answer among it, its beginning not (its first turn edited, a
      message put before it, a trimmed one with its new first message edited): the client's
      version from where its copy begins, laid against the stored end (it was appended whole,
      every message twice);
    - a trimmed one edited or regenerated: a branch after the stored run it starts with;
    - one whose first message alone was edited, its end edited too: a branch at the start."""
    transcript, history = view.keys("transcript"), view.keys("history")
    same_end = incoming[len(keys) - _common_suffix(keys, history) : len(keys)]
    if _answers(same_end) and any(message.get("role") == "user" for message in same_end):
        # (a whole turn in common at least: one answer alike, "ok", is no evidence)
        return _branch(incoming, max(0, len(history) - len(keys)), view)
    first_answer = [msg.get("role") for msg in incoming].index("assistant")
    trimmed = _trimmed_divergence(keys, table, first_answer, transcript)
    if trimmed is not None:  # a run of the transcript: branch after its history messages
        shared, end = trimmed
        return _branch(incoming[shared:], _in_history(transcript[:end], history), view)
    trimmed = _trimmed_divergence(keys, table, first_answer, history)
    if trimmed is not None:
        shared, branch_at = trimmed
        return _branch(incoming[shared:], branch_at, view)
    after_first = _common_prefix(incoming[1 : len(incoming) - 1], history[1:])
    if _answers(incoming[1 : 1 + after_first]):
        return _branch(incoming, 0, view)
    return None


def _common_suffix(keys: Sequence[bytes], stored: Sequence[bytes]) -> int:
    n = 0
    while n < len(keys) and n < len(stored) and keys[-1 - n] == stored[-1 - n]:
        n += 1
    return n


def _without_tool_results(
    incoming: Sequence[Message], view: ConversationView, shared: int
) -> Reconciled | None:
    """The match of a resent history that leaves the stored tool results out; None: it is not one.

    A client may resend its calls without their results (they are not its to edit, and a
    request holding calls without results is answered by the stored ones): matched against the
    history less its `tool` messages, past where the whole history matched, it is not an edit.
    The stored results stay, and are sent."""
    history = view.history
    kept = [i for i, message in enumerate(history) if message.get("role") != "tool"]
    if len(kept) == len(history):
        return None
    keys = view.keys("history")
    n = len(incoming)
    if shared < n and incoming[shared].get("role") == "tool":
        return None  # (the client's message there is a result, as stored or edited: not left out)
    matched = min(_common_prefix(incoming, [keys[i] for i in kept]), n - 1)
    before = sum(1 for i in kept if i < shared)  # how far the whole history's match went, so counted
    if matched < before or (matched == before and history[shared].get("role") != "tool"):
        return None  # (it stopped at a message of the client's, not at a result it left out)
    if matched >= len(kept):
        return Reconciled(list(incoming[matched:]))
    return _branch(incoming[matched:], kept[matched], view)


def _in_history(transcript: Sequence[bytes], history: Sequence[bytes]) -> int:
    """How many history messages are among these first transcript messages.

    History is the transcript less deleted and feedback messages, in the same order.
    """
    h = 0
    for key in transcript:
        if h < len(history) and history[h] == key:
            h += 1
    return h


def _failure_table(keys: Sequence[bytes]) -> list[int]:
    """Knuth-Morris-Pratt: for each prefix of `keys`, its longest proper border.

    Matching with it is linear: a resent history of 50,000 messages once took minutes of the
    event loop.
    """
    table = [0] * len(keys)
    k = 0
    for i in range(1, len(keys)):
        while k and keys[i] != keys[k]:
            k = table[k - 1]
        if keys[i] == keys[k]:
            k += 1
        table[i] = k
    return table


def _matches(keys: Sequence[bytes], table: Sequence[int], stored: Sequence[bytes]) -> list[int]:
    """For each position of `stored`, the longest prefix of `keys` that ends there."""
    out = []
    k = 0
    for key in stored:
        while k and (k == len(keys) or key != keys[k]):
            k = table[k - 1]
        if k < len(keys) and key == keys[k]:
            k += 1
        out.append(k)
    return out


def _matched_at_end(keys: Sequence[bytes], table: Sequence[int], stored: Sequence[bytes]) -> int:
    """The longest prefix of `keys` that `stored` ends with (0: none)."""
    if not keys or not stored:
        return 0
    return _matches(keys, table, stored)[-1]


def _trimmed_divergence(
    keys: Sequence[bytes], table: Sequence[int], first_answer: int, history: Sequence[bytes]
) -> tuple[int, int] | None:
    """Where a trimmed history diverges: (messages matched, history kept), or None.

    A trimmed history diverges with an edit or a regenerate from a client that resends only its
    newest messages: the request's first messages (`keys`, all but the last; `table`, their
    failure table) match a stored run that is not the tail, an answer among them. The longest run
    wins, then the newest; None when no run holds an answer.
    """
    if not keys or not history:
        return None
    # A run holds an answer once it is longer than the request's messages before its first one.
    best: tuple[int, int] | None = None
    for end, run in enumerate(_matches(keys, table, history), start=1):
        if run > first_answer and (best is None or run >= best[0]):
            best = (run, end)
    return best


def new_messages(incoming: Sequence[Message], view: ConversationView) -> list[Message]:
    """The part of a request that is not yet stored (see `reconcile`; a branch aside)."""
    return reconcile(incoming, view).new
