"""Fitting a conversation into the model's context window (pure, deterministic).

Always kept: the system prompt, the summary, the recap, the current request (and the stored
tool-call unit it answers); then the conversation's first unit when asked (`first`). Then
history is kept newest first, whole units at a time — an assistant `tool_calls` message travels
with its `tool` results — until the token budget or `max_history_messages` is reached (the
newest `keep_recent` messages ignore the latter). So the answer before the newest question is
dropped only with everything older. A cut drops whole turns: the kept history does not begin
with an answer whose question was left out (but for the answer before the current request).
Where history was cut, a marker system message says so.

Cuts are made in steps (`hold`, `cut_share`): a window whose history still fits from where the
previous turn's began keeps that start, so the head of the prompt is unchanged and the
provider's prompt cache holds; one that does not is cut down to `cut_share` of the budget, and
the following turns append to that new head until it is full again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.context.steps import cut_start, holds
from gateway.context.tools import UNANSWERED_TOOL_RESULT
from gateway.exceptions import ContextLengthExceeded
from gateway.types import Message

# Framing a chat request costs on top of its messages (OpenAI: every reply is primed).
REQUEST_OVERHEAD_TOKENS = 3


def omitted_marker(count: int) -> Message:
    return {"role": "system", "content": f"[{count} earlier messages omitted]"}


def tool_units(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """Split messages into [start, end) units.

    An assistant `tool_calls` message and the `tool` messages right after it form one unit; every
    other message is a unit of its own.
    """
    units: list[tuple[int, int]] = []
    i = 0
    n = len(messages)
    while i < n:
        j = i + 1
        if messages[i].get("role") == "assistant" and messages[i].get("tool_calls"):
            while j < n and messages[j].get("role") == "tool":
                j += 1
        units.append((i, j))
        i = j
    return units


def _recent_cost(messages: Sequence[Message], tokens: Sequence[int], end: int, keep: int) -> int:
    """Tokens of the newest whole units before `end` that hold at least `keep` messages."""
    cost = 0
    start = end
    while start > 0 and end - start < keep:
        start -= 1
        cost += tokens[start]
        while start > 0 and messages[start].get("role") == "tool":
            start -= 1
            cost += tokens[start]
    return cost


def _whole_turns_from(
    conversation: Sequence[Message], start: int, pinned_from: int, keep_recent: int, omitted_before: int
) -> int:
    """Where history that would begin at `start` begins, whole turns: never with an answer whose
    question was left out (chat templates that require user/assistant alternation reject it),
    but at the next question, unless that answer is the one before the current request or among
    the newest `keep_recent` messages. Nothing left out before `start`: `start` itself."""
    while (
        (omitted_before or start) and start < pinned_from and conversation[start].get("role") == "assistant"
    ):
        head_end = start + 1
        while head_end < pinned_from and conversation[head_end].get("role") == "tool":
            head_end += 1
        if head_end >= pinned_from or pinned_from - head_end < keep_recent:
            break
        start = head_end
    return start


def _with_its_question(
    conversation: Sequence[Message],
    tokens: Sequence[int],
    start: int,
    pinned_from: int,
    room: int,
    max_messages: int,
) -> int:
    """A cut's history that begins with an answer (the one before the request, a tool exchange
    and all, kept without its question) begins with its question instead when the whole `room`
    and `max_messages` still hold it: the low water is where a cut aims, the whole window what
    it may not pass."""
    if conversation[start].get("role") != "assistant":
        return start
    question = start - 1
    while question > 0 and conversation[question].get("role") in ("assistant", "tool"):
        question -= 1  # (back over the exchange the answer ends: calls, results)
    if conversation[question].get("role") != "user":
        return start
    fits = pinned_from - question <= max_messages and sum(tokens[question:pinned_from]) <= room
    return question if fits else start


@dataclass(frozen=True, slots=True)
class Window:
    """What goes upstream, and the numbers that explain it."""

    messages: list[Message]
    budget: int
    history_start: int  # index in `conversation` of the first message kept
    omitted: int  # history messages left out (after any summary's coverage)
    tokens: dict[str, int] = field(default_factory=dict)
    held: bool = False  # the history starts where `hold` said: the head of the prompt is unchanged

    @property
    def total_tokens(self) -> int:
        return self.tokens.get("total", 0)


def fit_window(
    *,
    system: Sequence[Message],
    system_tokens: Sequence[int],
    conversation: Sequence[Message],
    conversation_tokens: Sequence[int],
    first_new: int,
    budget: int,
    max_history_messages: int,
    marker_tokens: Callable[[int], int],
    summary: Message | None = None,
    summary_tokens: int = 0,
    recap: Message | None = None,
    recap_tokens: int = 0,
    omitted_before: int = 0,
    first: Sequence[Message] = (),
    first_tokens: Sequence[int] = (),
    keep_recent: int = 0,
    tools_tokens: int = 0,
    hold: int | None = None,
    cut_share: float = 1.0,
) -> Window:
    """Choose the messages to send.

    `conversation` is the stored history (after any summary's coverage) followed by the new
    messages, starting at `first_new`; `conversation_tokens` are their counts;
    `omitted_before` history messages were already left out before `conversation` (negative: so
    many of its first messages a summary covers too, not left out when cut); `first` is
    the conversation's first unit, sent ahead of the marker when it fits (`keep_first`);
    `tools_tokens` is what the request's tool definitions cost (fixed, like the request).
    `hold` is where in `conversation` the previous window's history began: the history starts
    there again when all of it fits (`Window.held`). Otherwise it is cut: kept newest first
    within `cut_share` of the budget (and of `max_history_messages`), the newest unit within the
    whole budget. Raises ContextLengthExceeded when even the fixed part (system, summary,
    recap, current request) does not fit the budget.
    """
    n = len(conversation)
    # The current request, plus the stored tool-call message its tool results answer.
    pinned_from = min(first_new, n)
    while 0 < pinned_from < n and conversation[pinned_from].get("role") == "tool":
        pinned_from -= 1
    pinned_tokens = sum(conversation_tokens[pinned_from:])
    fixed = (
        REQUEST_OVERHEAD_TOKENS
        + tools_tokens
        + sum(system_tokens)
        + summary_tokens
        + recap_tokens
        + pinned_tokens
    )
    if fixed > budget:
        raise ContextLengthExceeded(
            f"This request needs {fixed} tokens before any history, more than the {budget} the "
            "model's context window allows (the window less reserve_tokens and the calibration's "
            "margin, in the gateway's count); shorten it",
            param="messages",
            needs=fixed,
        )
    # Walk back from the newest stored message, a whole unit at a time (tool results belong
    # to the assistant message before them). Room is kept for the widest possible marker.
    marker_bound = marker_tokens(max(1, omitted_before + pinned_from + len(first)))
    first_cost = sum(first_tokens)
    dropped_first = 0
    recent_cost = _recent_cost(conversation, conversation_tokens, pinned_from, keep_recent)
    if first and fixed + first_cost + recent_cost + marker_bound > budget:
        # Kept only when it fits beside the current request and the newest keep_recent messages.
        dropped_first, first, first_cost = len(first), (), 0
    fixed += first_cost
    room = budget - fixed
    held = (
        hold is not None
        and holds(
            conversation_tokens[hold:pinned_from],
            room - (marker_bound if omitted_before + hold > 0 else 0),
            max(max_history_messages, keep_recent),
        )
        # (a head that began with the answer before its turn's request, its question left out,
        # is no longer that answer once a turn follows: it is cut again)
        and _whole_turns_from(conversation, hold, pinned_from, keep_recent, omitted_before) == hold
    )
    kept_from = (
        hold
        if held and hold is not None
        else _whole_turns_from(
            conversation,
            cut_start(
                conversation,
                conversation_tokens,
                pinned_from,
                room=room,
                low_room=int(budget * cut_share) - fixed,
                max_messages=max_history_messages
                if cut_share >= 1
                else int(max_history_messages * cut_share),
                keep_recent=keep_recent,
                marker=lambda start: marker_bound if omitted_before + start > 0 else 0,
            ),
            pinned_from,
            keep_recent,
            omitted_before,
        )
    )
    if not held and 0 < kept_from < pinned_from:
        kept_from = _with_its_question(
            conversation,
            conversation_tokens,
            kept_from,
            pinned_from,
            room - marker_bound,
            max(max_history_messages, keep_recent),
        )
    # Stored messages left out: a result the repair added for an unanswered call is not one.
    added = sum(1 for m in conversation[:kept_from] if m.get("content") == UNANSWERED_TOOL_RESULT)
    omitted = max(0, omitted_before + kept_from - added) + dropped_first
    marker_cost = marker_tokens(omitted) if omitted else 0
    if omitted and fixed + marker_cost > budget:
        raise ContextLengthExceeded(
            f"This request needs {fixed + marker_cost} tokens before any history, more than the "
            f"{budget} the model's context window allows; shorten it",
            param="messages",
            needs=fixed + marker_cost,
        )
    messages: list[Message] = [*system]
    if summary is not None:
        messages.append(summary)
    if recap is not None:
        messages.append(recap)
    messages.extend(first)
    if omitted:
        messages.append(omitted_marker(omitted))
    messages.extend(conversation[kept_from:])
    history_tokens = sum(conversation_tokens[kept_from:pinned_from])
    new_tokens = sum(conversation_tokens[pinned_from:])
    tokens = {
        "system": sum(system_tokens),
        "summary": summary_tokens,
        "recap": recap_tokens,
        "history": history_tokens + first_cost,
        "new": new_tokens,
        "marker": marker_cost,
        "overhead": REQUEST_OVERHEAD_TOKENS,
    }
    if tools_tokens:  # the request's tool definitions: the provider counts them in the prompt
        tokens["tools"] = tools_tokens
    tokens["total"] = sum(tokens.values())
    return Window(
        messages=messages, budget=budget, history_start=kept_from, omitted=omitted, tokens=tokens, held=held
    )
