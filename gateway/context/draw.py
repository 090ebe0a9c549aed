"""The messages a window may draw on, and the window fitted from them (pure).

A turn's window is planned from a `Frame` (the view, the request, what the head may take) and
one `Part` of it per summary considered: the stored history from the summary's coverage (or
the newest `max_history_messages`) on, repaired, with the request. `Part.fit_request` fits it
within a budget (`fit_window`), the summary and the recap sized for the window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.context.history import ConversationView, clean_message, repair_tool_calls
from gateway.context.recap_text import shrink_recap
from gateway.context.summary import Summary
from gateway.context.window import REQUEST_OVERHEAD_TOKENS, Window, fit_window, omitted_marker
from gateway.exceptions import ContextLengthExceeded, InvalidRequest
from gateway.tokens import count_message, truncate_text
from gateway.types import Message

# A summary or recap squeezed below this many tokens is left out instead.
MIN_SIZED_TOKENS = 24

_MARKER_COSTS: dict[tuple[str, int], int] = {}


def marker_cost(encoding: str, omitted: int) -> int:
    """Tokens of the `[N earlier messages omitted]` marker.

    They depend only on N's digit count (counted once per encoding and width, with the widest
    number of that width).
    """
    digits = len(str(omitted))
    key = (encoding, digits)
    cost = _MARKER_COSTS.get(key)
    if cost is None:
        model = "gpt-4o" if encoding == "o200k_base" else ""
        cost = _MARKER_COSTS[key] = count_message(omitted_marker(int("9" * digits)), model)
    return cost


def first_unit(conversation: list[Message]) -> int:
    """How many messages the conversation's first unit holds.

    The first unit is its first message, with the tool results that follow it.
    """
    end = 1 if conversation else 0
    while end < len(conversation) and conversation[end].get("role") == "tool":
        end += 1
    return end


def newest_user_message(conversation: list[Message], first_new: int) -> int | None:
    """Where the newest user message is, when the new messages have others before it."""
    for i in range(len(conversation) - 1, first_new, -1):
        if conversation[i].get("role") == "user":
            return i
    return None


def request_alone(fit_request: Callable[[int], Window], exc: ContextLengthExceeded) -> Window:
    """The window of the request alone (no history).

    It is planned with the budget the refusal said it needs (its marker's cost added when that
    comes next).
    """
    for _ in range(3):
        if exc.needs is None:
            raise exc
        try:
            return fit_request(exc.needs)
        except ContextLengthExceeded as again:
            if again.needs is None or again.needs <= exc.needs:
                raise
            exc = again
    raise exc


def summary_cut(model: str) -> Callable[[Message, int], Message]:
    """A summary's text cut to a number of tokens (its start kept)."""

    def cut(message: Message, limit: int) -> Message:
        text = message.get("content")
        return {**message, "content": truncate_text(text, limit - 8, model) if isinstance(text, str) else ""}

    return cut


def sized(
    message: Message | None,
    limit: int,
    count: Callable[[Message], int],
    shrink: Callable[[Message, int], Message | None],
) -> tuple[Message | None, int]:
    """`message` (a summary or recap) within `limit` tokens, or None.

    It is made smaller by `shrink` when it is larger; None when too little room is left for it to
    say anything.
    """
    if message is None:
        return None, 0
    tokens = count(message)
    if tokens <= limit:
        return message, tokens
    if limit < MIN_SIZED_TOKENS:
        return None, 0
    smaller = shrink(message, limit)
    return (smaller, count(smaller)) if smaller is not None else (None, 0)


def orphan_results(results: list[Message]) -> InvalidRequest:
    """The error for a request whose new `tool` results answer no pending call.

    Providers refuse such a result; stored, it would be kept and never sent.
    """
    ids = ", ".join(repr(m.get("tool_call_id")) for m in results)
    return InvalidRequest(
        f"The request's new messages hold tool results that answer no tool call (tool_call_id {ids}): "
        "a 'tool' message must follow the assistant message whose tool_calls it answers",
        param="messages",
    )


@dataclass(frozen=True, slots=True)
class Frame:
    """What every window planned for a turn shares: the view, the request and the head's room."""

    max_history: int  # max_history_messages
    keep_recent: int  # keep_recent_messages
    keep_first: bool
    cut_to: float
    view: ConversationView
    system: list[Message]
    system_tokens: list[int]
    new: list[Message]
    new_tokens: list[int]
    count: Callable[[Message], int]
    model: str
    encoding: str
    recap: Message | None
    tools_tokens: int
    head_room: int  # the window less the answer, the framing, the system prompt and the tools

    def part(self, summary: Summary | None, overlap_from: int | None = None) -> Part:
        """The stored history a window drawing on `summary` may send, and the request.

        It begins where the summary's coverage ends, or at `overlap_from` when that is before:
        the newest turns a summary of the whole conversation covers too (post-processing's) are
        still sent as they are."""
        view, count = self.view, self.count
        covered = summary.covered if summary else 0
        floor = covered if overlap_from is None else min(covered, max(0, overlap_from))
        # Positions count every stored message; a partial view holds its newest ones (the
        # loaded part is `history`, from `loaded_from`): NotLoaded when more is needed.
        history, total = view.history, view.history_count
        # The first unit, kept ahead of the cut when configured and no summary covers it.
        first_end = 0
        if self.keep_first and covered == 0 and total:
            first_end = 1 + view.loaded_from(0)
            while first_end < len(history) and history[first_end].get("role") == "tool":
                first_end += 1
        # Only the newest max_history_messages (or keep_recent_messages) can be sent.
        newest = max(self.max_history, self.keep_recent)
        lower = max(floor, first_end, total - newest - 1)
        while lower > max(floor, first_end) and history[view.loaded_from(lower)].get("role") == "tool":
            lower -= 1
        hist = history[view.loaded_from(lower) :]
        hist_tokens = [int(n or 0) for n in view.history_tokens[view.loaded_from(lower) :]]
        clean_new = [clean_message(m) for m in self.new]
        combined = [*hist, *clean_new]
        repaired = view.has_tools or any("tool_calls" in m or m.get("role") == "tool" for m in clean_new)
        if repaired:
            known = {id(m): n for m, n in zip(combined, [*hist_tokens, *self.new_tokens], strict=True)}
            conversation = repair_tool_calls(combined, goes_on=not clean_new)  # (nothing new: no results)
            conversation_tokens = [known[id(m)] if id(m) in known else count(m) for m in conversation]
            new_ids = {id(m) for m in clean_new}
            first_new = next((i for i, m in enumerate(conversation) if id(m) in new_ids), len(conversation))
            kept = {id(m) for m in conversation}
            dropped = [m for m in clean_new if id(m) not in kept and m.get("role") == "tool"]
            if dropped:  # (a request's own result that answers no call: providers refuse it)
                raise orphan_results(dropped)
        else:  # no tool calls anywhere: nothing to repair
            conversation = combined
            conversation_tokens = [*hist_tokens, *self.new_tokens]
            first_new = len(hist)
        first = [clean_message(m) for m in history[:first_end]] if first_end and lower > 0 else []
        return Part(
            frame=self,
            summary=summary,
            lower=lower,
            hist=hist,
            new_of={id(m): i for i, m in enumerate(clean_new)},
            conversation=conversation,
            conversation_tokens=conversation_tokens,
            first_new=first_new,
            repaired=repaired,
            first=first,
            first_tokens=[count(m) for m in first],
            first_end=first_end if lower > 0 else 0,
        )


@dataclass(frozen=True, slots=True)
class Part:
    """The messages a window may draw on, from stored position `lower` on, with the request."""

    frame: Frame
    summary: Summary | None
    lower: int
    hist: list[Message]
    new_of: dict[int, int]  # id of a new message -> its index in the request's new messages
    conversation: list[Message]
    conversation_tokens: list[int]
    first_new: int
    repaired: bool
    first: list[Message]
    first_tokens: list[int]
    first_end: int  # the first unit's end, when it is kept ahead of the cut (else 0)

    def index_of(self, position: int) -> int | None:
        """Stored history position `position` as an index into `conversation` (None: not in it)."""
        if position < self.lower or position - self.lower > len(self.hist):
            return None
        if not self.repaired:
            return position - self.lower
        if position - self.lower == len(self.hist):
            return self.first_new
        message = self.hist[position - self.lower]
        return next((i for i, m in enumerate(self.conversation) if m is message), None)

    def absolute(self, index: int, total: int) -> int:
        """`conversation[index]` as a stored history position (`total`: a new message)."""
        if not self.repaired:
            return self.lower + min(index, len(self.hist))
        positions = {id(m): self.lower + i for i, m in enumerate(self.hist)}
        return next((positions[id(m)] for m in self.conversation[index:] if id(m) in positions), total)

    def new_index(self, index: int) -> int | None:
        """The index among the new messages of the first one kept from `conversation[index]` on.

        Given only when no stored message is kept from there on (else None).
        """
        kept = self.conversation[index:]
        if any(id(m) not in self.new_of for m in kept[: max(0, self.first_new - index)]):
            return None
        return next((self.new_of[id(m)] for m in kept if id(m) in self.new_of), None)

    def fit(
        self,
        first_new: int,
        conversation: list[Message],
        conversation_tokens: list[int],
        first: list[Message],
        first_tokens: list[int],
        budget: int,
        hold: int | None,
    ) -> Window:
        """`fit_window` over these messages, the summary and recap sized for the window."""
        frame, summary = self.frame, self.summary
        count = frame.count
        # Summary and recap: together at most half of what the system prompt and the request
        # leave (the rest is for the newest turns). Sized from the window as a whole first, so
        # that they are the same on every turn; from what this request leaves when that fails.
        request_tokens = sum(conversation_tokens[first_new:])
        left = budget - REQUEST_OVERHEAD_TOKENS - sum(frame.system_tokens) - request_tokens
        for free in (frame.head_room, left):
            summary_message, summary_tokens = sized(
                summary.message() if summary else None, free // 3, count, summary_cut(frame.model)
            )
            # A recap is packed again as it was built (newest conversations, their newest lines).
            recap_message, recap_tokens = sized(
                frame.recap, free // 6, count, lambda message, limit: shrink_recap(message, limit, count)[0]
            )
            # A summary with too little room to say anything is left out: what it covers is
            # then simply omitted (the marker counts it), and nothing claims it was sent.
            covered = summary.covered if summary else 0
            unsent = covered if summary is not None and summary_message is None else 0
            try:
                return fit_window(
                    tools_tokens=frame.tools_tokens,
                    system=frame.system,
                    system_tokens=frame.system_tokens,
                    conversation=conversation,
                    conversation_tokens=conversation_tokens,
                    first_new=first_new,
                    budget=budget,
                    max_history_messages=frame.max_history,
                    marker_tokens=lambda n: marker_cost(frame.encoding, n),
                    summary=summary_message,
                    summary_tokens=summary_tokens,
                    recap=recap_message,
                    recap_tokens=recap_tokens,
                    omitted_before=self.lower - covered + unsent - self.first_end,
                    first=first,
                    first_tokens=first_tokens,
                    keep_recent=frame.keep_recent,
                    hold=hold if first_new == self.first_new else None,
                    cut_share=frame.cut_to,
                )
            except ContextLengthExceeded:
                if free != frame.head_room or not (summary_tokens or recap_tokens):
                    raise
        raise AssertionError("unreachable")  # (the second size raises or returns)

    def fit_request(self, hold: int | None, budget: int) -> Window:
        """The window within `budget`.

        What the client resent before its newest user message is history, cut oldest first, when
        the request does not fit whole.
        """
        conversation, tokens = self.conversation, self.conversation_tokens
        try:
            return self.fit(self.first_new, conversation, tokens, self.first, self.first_tokens, budget, hold)
        except ContextLengthExceeded:
            # What the client sent before its newest user message (a chat moved onto the
            # gateway in one request, or everything after an edited message) is history it
            # resent: cut oldest first, as stored history is. Only the newest user message
            # and what follows it are the request proper.
            request_from = newest_user_message(conversation, self.first_new)
            if request_from is None:
                raise
            total = self.frame.view.history_count
            covered = self.summary.covered if self.summary else 0
            unit = first_unit(conversation) if self.frame.keep_first and not total and not covered else 0
            if 0 < unit < request_from:  # the conversation's first message came in this request
                return self.fit(
                    request_from - unit,
                    conversation[unit:],
                    tokens[unit:],
                    conversation[:unit],
                    tokens[:unit],
                    budget,
                    None,
                )
            return self.fit(request_from, conversation, tokens, self.first, self.first_tokens, budget, None)
