"""Cuts in steps, the pure rule: a window starts where the previous one did until it is full.

A provider reuses its cache of a prompt's head only while that head is unchanged (llama.cpp's
`cache_prompt`, OpenAI's and Anthropic's prompt caches). A window cut one turn at a time
changes its head on every turn; a window cut down to a low-water mark (`[context] cut_to`, a
share of the budget) keeps its head for the turns that follow, until the prompt is full again.
The previous window's start is remembered per conversation as a `Head`: the stored message the
history began with (an item key, which deletions do not move) and the summary version it sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.types import JSONObject, Message


@dataclass(frozen=True, slots=True)
class Head:
    """Where a turn's window began: its first stored message and the summary it sent.

    `start` is that message's item key (`response_id#position`), None when the window began
    with the conversation's first message; `summary` the summary version sent, if any."""

    start: str | None = None
    summary: int | None = None
    # The conversation was reset since: the next window is a cut (what the prompt began with is gone).
    after_reset: bool = False

    @classmethod
    def of(cls, context: JSONObject) -> Head | None:
        """The head a context snapshot (or a response record's `head`) recorded.

        None for one written before heads were.
        """
        if "window_from" not in context:
            return None
        start, summary = context.get("window_from"), context.get("summary_version")
        return cls(
            start if isinstance(start, str) else None,
            summary if isinstance(summary, int) and not isinstance(summary, bool) else None,
        )


def holds(tokens: Sequence[int], room: int, max_messages: int) -> bool:
    """Does the history from the previous window's start still fit (tokens and count)?"""
    return len(tokens) <= max_messages and sum(tokens) <= room


def cut_start(
    conversation: Sequence[Message],
    tokens: Sequence[int],
    end: int,
    *,
    room: int,
    low_room: int,
    max_messages: int,
    keep_recent: int,
    marker: Callable[[int], int],
) -> int:
    """Where the history starts after a cut.

    It keeps whole units newest first, the newest within `room` and the rest within `low_room`
    and `max_messages` (the newest `keep_recent` messages past the latter); `marker(start)` is
    what the marker costs for a start.
    """
    kept_from = end
    used = 0
    kept_messages = 0
    while end > 0:
        start = end - 1
        cost = tokens[start]
        while start > 0 and conversation[start].get("role") == "tool":
            start -= 1
            cost += tokens[start]
        size = end - start
        over_count = kept_messages + size > max_messages and kept_messages >= keep_recent
        limit = room if kept_messages < max(keep_recent, 1) else low_room
        if over_count or used + cost + marker(start) > limit:
            break
        used += cost
        kept_messages += size
        kept_from = start
        end = start
    return kept_from
