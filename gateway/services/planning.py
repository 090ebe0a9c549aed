"""Planning a turn's window: what of the stored conversation goes upstream (SPEC section 7),
sized from the model's window and calibration; and learning from what the provider reported."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway.config import ContextSettings, Settings
from gateway.context import (
    ConversationView,
    Message,
    clean_message,
    repair_tool_calls,
)
from gateway.context.calibration import UNCALIBRATED
from gateway.context.history import item_key
from gateway.context.lifecycle import shrink_recap, zone
from gateway.context.steps import Head
from gateway.context.summary import Summary, current_summary, snap_to_turn_end, summary_version
from gateway.context.window import REQUEST_OVERHEAD_TOKENS, Window, fit_window, omitted_marker
from gateway.exceptions import ContextLengthExceeded, InvalidRequest
from gateway.services.models import ModelFacts, WindowFacts
from gateway.services.recap import build_recap
from gateway.services.requests import ChatRequest
from gateway.store.base import LRU, Store
from gateway.tokens import count_message, get_encoding, truncate_text
from gateway.types import Record
from gateway.upstream import Route

log = logging.getLogger("gateway.services")

# Counting more text than this runs in a worker thread, off the event loop.
_COUNT_OFF_LOOP_CHARS = 20_000
# A provider reporting fewer prompt tokens than this share of ours probably cut the prompt.
_TRUNCATION_RATIO = 0.7
_UNCALIBRATED_TRUNCATION_RATIO = 0.5
_TRUNCATION_MIN_TOKENS = 256
# Conversations whose suspected truncation was logged (the newest this many are remembered).
WARNED_LIMIT = 4096
# A summary or recap squeezed below this many tokens is left out instead.
_MIN_SIZED_TOKENS = 24
# Windows checked against a server's own count before one is sent as it is.
_EXACT_TRIES = 4


_MARKER_COSTS: dict[tuple[str, int], int] = {}


def marker_cost(encoding: str, omitted: int) -> int:
    """Tokens of the `[N earlier messages omitted]` marker; depends only on N's digit count
    (counted once per encoding and width, with the widest number of that width)."""
    digits = len(str(omitted))
    key = (encoding, digits)
    cost = _MARKER_COSTS.get(key)
    if cost is None:
        model = "gpt-4o" if encoding == "o200k_base" else ""
        cost = _MARKER_COSTS[key] = count_message(omitted_marker(int("9" * digits)), model)
    return cost


def history_needed(max_history_messages: int, keep_recent_messages: int) -> int:
    """Stored history messages a window looks at (`Planner.plan`'s `lower` on): the newest
    max_history_messages (or keep_recent_messages) and the one before them."""
    return max(max_history_messages, keep_recent_messages) + 1


def _size(messages: list[Message]) -> int:
    total = 0
    for m in messages:
        content = m.get("content")
        total += len(content) if isinstance(content, str) else len(orjson.dumps(content))
    return total


def first_unit(conversation: list[Message]) -> int:
    """How many messages the conversation's first unit holds (its first message, with the tool
    results that follow it)."""
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
    """The window of the request alone (no history): planned with the budget the refusal said
    it needs (its marker's cost added when that comes next)."""
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


async def off_loop_if_large(messages: list[Message], work: Callable[[], Any]) -> Any:
    if _size(messages) > _COUNT_OFF_LOOP_CHARS:
        return await asyncio.to_thread(work)
    return work()


def cut_to(model: str) -> Callable[[Message, int], Message]:
    """A summary's text cut to a number of tokens (its start kept)."""

    def cut(message: Message, limit: int) -> Message:
        text = message.get("content")
        return {**message, "content": truncate_text(text, limit - 8, model) if isinstance(text, str) else ""}

    return cut


@dataclass(frozen=True, slots=True)
class _Frame:
    """What every window planned for a turn shares: the view, the request and the head's room."""

    settings: ContextSettings
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

    def part(self, summary: Summary | None) -> _Part:
        """The stored history a window drawing on `summary` may send, and the request."""
        ctx, view, count = self.settings, self.view, self.count
        covered = summary.covered if summary else 0
        # Positions count every stored message; a partial view holds its newest ones (the
        # loaded part is `history`, from `loaded_from`): NotLoaded when more is needed.
        history, total = view.history, view.history_count
        # The first unit, kept ahead of the cut when configured and no summary covers it.
        first_end = 0
        if ctx.keep_first and covered == 0 and total:
            first_end = 1 + view.loaded_from(0)
            while first_end < len(history) and history[first_end].get("role") == "tool":
                first_end += 1
        # Only the newest max_history_messages (or keep_recent_messages) can be sent.
        newest = max(ctx.max_history_messages, ctx.keep_recent_messages)
        lower = max(covered, first_end, total - newest - 1)
        while lower > max(covered, first_end) and history[view.loaded_from(lower)].get("role") == "tool":
            lower -= 1
        hist = history[view.loaded_from(lower) :]
        hist_tokens = [int(n or 0) for n in view.history_tokens[view.loaded_from(lower) :]]
        clean_new = [clean_message(m) for m in self.new]
        combined = [*hist, *clean_new]
        repaired = view.has_tools or any("tool_calls" in m or m.get("role") == "tool" for m in clean_new)
        if repaired:
            known = {id(m): n for m, n in zip(combined, [*hist_tokens, *self.new_tokens], strict=True)}
            conversation = repair_tool_calls(combined)
            conversation_tokens = [known[id(m)] if id(m) in known else count(m) for m in conversation]
            new_ids = {id(m) for m in clean_new}
            first_new = next((i for i, m in enumerate(conversation) if id(m) in new_ids), len(conversation))
            if clean_new and first_new == len(conversation):
                raise orphan_results(clean_new)
        else:  # no tool calls anywhere: nothing to repair
            conversation = combined
            conversation_tokens = [*hist_tokens, *self.new_tokens]
            first_new = len(hist)
        first = [clean_message(m) for m in history[:first_end]] if first_end and lower > 0 else []
        return _Part(
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
class _Part:
    """The messages a window may draw on, from stored position `lower` on, with the request."""

    frame: _Frame
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
        """The request's first new message kept from `conversation[index]` on, when no stored
        message is (its index among the new messages)."""
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
        ctx, count = frame.settings, frame.count
        # Summary and recap: together at most half of what the system prompt and the request
        # leave (the rest is for the newest turns). Sized from the window as a whole first, so
        # that they are the same on every turn; from what this request leaves when that fails.
        request_tokens = sum(conversation_tokens[first_new:])
        left = budget - REQUEST_OVERHEAD_TOKENS - sum(frame.system_tokens) - request_tokens
        for free in (frame.head_room, left):
            summary_message, summary_tokens = Planner.sized(
                summary.message() if summary else None, free // 3, count, cut_to(frame.model)
            )
            # A recap is packed again as it was built (newest conversations, their newest lines).
            recap_message, recap_tokens = Planner.sized(
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
                    max_history_messages=ctx.max_history_messages,
                    marker_tokens=lambda n: marker_cost(frame.encoding, n),
                    summary=summary_message,
                    summary_tokens=summary_tokens,
                    recap=recap_message,
                    recap_tokens=recap_tokens,
                    omitted_before=self.lower - covered + unsent - self.first_end,
                    first=first,
                    first_tokens=first_tokens,
                    keep_recent=ctx.keep_recent_messages,
                    hold=hold if first_new == self.first_new else None,
                    cut_share=ctx.cut_to,
                )
            except ContextLengthExceeded:
                if free != frame.head_room or not (summary_tokens or recap_tokens):
                    raise
        raise AssertionError("unreachable")  # (the second size raises or returns)

    def fit_request(self, hold: int | None, budget: int) -> Window:
        """The window within `budget`; what the client resent before its newest user message is
        history, cut oldest first, when the request does not fit whole."""
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
            ctx, total = self.frame.settings, self.frame.view.history_count
            covered = self.summary.covered if self.summary else 0
            unit = first_unit(conversation) if ctx.keep_first and not total and not covered else 0
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


@dataclass(frozen=True, slots=True)
class _Fitted:
    window: Window
    part: _Part
    server_tokens: int | None


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """The window chosen for a turn and the facts behind it (the manifest)."""

    window: Window
    encoding: str
    context_window: int
    reserve: int
    summary: Summary | None
    kept_from: int  # index in stored history of the first message sent
    summary_target: str | None  # response id a new summary should cover through
    facts: WindowFacts | None = None
    server_tokens: int | None = None  # the server's own count of the prompt, when it gave one
    new_from: int | None = None  # no stored message sent: the first new message sent, by index
    cut: bool = False  # the window was cut (its head changed) rather than held as it was

    def window_from(self, view: ConversationView, response_id: str) -> str | None:
        """The item key of the first stored message the history began with (the turn's own
        first message sent when none was; None: the conversation's first message)."""
        if self.kept_from == 0:
            return None
        if self.kept_from < view.history_count:
            i = view.loaded_from(self.kept_from)
            return item_key(view.history_owner[i], view.history_pos[i])
        return item_key(response_id, self.new_from) if self.new_from is not None else None

    def snapshot(
        self, view: ConversationView, new_messages: int, sent: list[Message], response_id: str
    ) -> Record:
        included = list(dict.fromkeys(view.history_owner[view.loaded_from(self.kept_from) :]))
        return {
            "type": "context",
            "encoding": self.encoding,
            "context_window": self.context_window,
            "context_window_source": self.facts.source if self.facts else None,
            "calibration": self.facts.calibration.to_dict() if self.facts else None,
            "reserve_tokens": self.reserve,
            "budget": self.window.budget,
            "stored_messages": view.history_count + len(view.system or []),
            "stored_turns": view.turns,
            "new_messages": new_messages,
            "sent_messages": len(sent),
            "truncated": self.window.omitted,
            "tokens": self.window.tokens,
            "summary_version": self.summary.version if self.summary else None,
            "summary_covers_messages": self.summary.covered if self.summary else 0,
            "summary_covers_through": self.summary.covers_through if self.summary else None,
            "included_response_ids": included,
            "server_prompt_tokens": self.server_tokens,
            # The head: where the history began, and whether this turn cut (moved it).
            "window_from": self.window_from(view, response_id),
            "cut": self.cut,
            "messages": sent,
        }


class Planner:
    """Plans windows for one gateway: the model facts and summarizer it asks are shared."""

    def __init__(self, settings: Settings, facts: ModelFacts) -> None:
        self.settings = settings
        self.facts = facts
        # Conversations already warned about (the newest WARNED_LIMIT: bounded memory).
        self._warned_truncation: LRU[str | None, bool] = LRU(WARNED_LIMIT)
        # (store, conversation) -> the head a summary for the next cut was asked at, and its target.
        self._asked: LRU[tuple[int, str], tuple[int, str]] = LRU(WARNED_LIMIT)

    async def window_needs(self, store: Store, cid: str) -> dict[str, Any]:
        """What a turn's window needs loaded (`ConversationCache.load`'s `tail` and `through`):
        the newest history messages it can send, a few more (a tool-call unit is never cut),
        and the turn the newest rolling summary covers through."""
        ctx = self.settings.context
        through = None
        if ctx.strategy == "summarize":
            summaries = await store.read_side("summaries", cid)
            versions = (r.get("covers_through") for r in reversed(summaries) if r.get("type") == "summary")
            last = next(versions, None)
            through = last if isinstance(last, str) else None
        return {
            "tail": history_needed(ctx.max_history_messages, ctx.keep_recent_messages) + 16,
            "through": through,
        }

    async def plan(
        self,
        request: ChatRequest,
        route: Route,
        view: ConversationView,
        store: Store,
        cid: str,
        system_in: list[Message],
        system_in_tokens: list[int] | None,
        new: list[Message],
        new_tokens: list[int],
        encoding: str,
        count: Callable[[Message], int],
        recap: Message | None = None,
        *,
        hold: bool = True,
    ) -> ContextPlan:
        """Decide what of the stored conversation goes upstream (SPEC section 7).

        The window keeps the previous turn's head (`view.head`: where its history began and the
        summary it sent) while everything from there fits; otherwise it is cut in a step, down
        to `cut_to` of the budget, starting at the newest summary's coverage when that fits.
        `hold=False` cuts regardless (after the provider refused the previous plan)."""
        ctx = self.settings.context
        if view.encoding != encoding or view.needs_count:
            # Counted once per stored message; only a model-family switch recounts.
            if len(view.history) > 64:
                await asyncio.to_thread(view.count_tokens, encoding, count)
            else:
                view.count_tokens(encoding, count)
        if system_in:
            system, system_tokens = system_in, list(system_in_tokens or [])
        else:
            system = view.system or []
            system_tokens = [int(n or 0) for n in (view.system_tokens or [])]
        facts = await self.facts.window(route, request.model, store)
        window_size = facts.tokens
        requested = request.body.get("max_completion_tokens") or request.body.get("max_tokens") or 0
        requested = requested if isinstance(requested, int) and requested > 0 else 0
        # The client's own max_tokens when sent; else reserve_tokens, at most a quarter of the window.
        reserve = requested or min(ctx.reserve_tokens, window_size // 4)
        # A server that counts prompts itself is asked for the exact count of the window
        # planned (below): planned from the calibration's best estimate, without its margin.
        calibration = replace(facts.calibration, margin=0) if facts.counts_prompts else facts.calibration
        budget = calibration.our_budget(window_size - reserve)
        tools = request.body.get("tools")
        tools_tokens = tools_cost(orjson.dumps(tools).decode(), encoding) if tools else 0
        records = await store.read_side("summaries", cid) if ctx.strategy == "summarize" else []
        newest = current_summary(records, view) if records else None
        frame = _Frame(
            settings=ctx,
            view=view,
            system=[clean_message(m) for m in system],
            system_tokens=system_tokens,
            new=new,
            new_tokens=new_tokens,
            count=count,
            model=request.model,
            encoding=encoding,
            recap=recap,
            tools_tokens=tools_tokens,
            # Summary and recap are sized from the window, not from the request: the head of
            # the prompt stays the same from turn to turn (request-sized when it must shrink).
            head_room=window_size - reserve - REQUEST_OVERHEAD_TOKENS - sum(system_tokens) - tools_tokens,
        )
        head = view.head or Head()  # (none recorded: as if the window began at the beginning)
        start = view.position_of(head.start) if head.start is not None else 0
        held_summary = summary_version(records, view, head.summary) if head.summary is not None else None
        fit = functools.partial(self._fit, frame, budget=budget, limit=window_size - reserve, facts=facts)
        fitted: _Fitted | None = None
        if hold and start is not None and (head.summary is None or held_summary is not None):
            with contextlib.suppress(ContextLengthExceeded):  # (the cut decides what the request needs)
                fitted = await fit(held_summary, start, route, request)
            if fitted is not None and not fitted.window.held:
                fitted = None
        cut = fitted is None
        if fitted is None:  # a cut: the newest summary enters here, and only here
            fitted = await fit(newest, newest.covered if newest is not None else None, route, request)
        window, part = fitted.window, fitted.part
        kept_abs = part.absolute(window.history_start, view.history_count)
        target = None
        if ctx.strategy == "summarize" and view.history_count and not (newest and newest.covered > kept_abs):
            # The summary for the next cut, until there is one: its coverage is chosen once per
            # head (asking again for the same is no new work; a later one would be).
            asked = self._asked.get((id(store), cid))
            if asked is not None and asked[0] == kept_abs:
                target = asked[1]
            else:
                target = self._summary_target(frame, part, window, budget)
                if target is not None:
                    self._asked[(id(store), cid)] = (kept_abs, target)
        summary = part.summary
        return ContextPlan(
            window=window,
            encoding=encoding,
            context_window=window_size,
            reserve=reserve,
            summary=summary if window.tokens.get("summary") else None,  # (None: not sent)
            kept_from=kept_abs,
            summary_target=target,
            facts=facts,
            server_tokens=fitted.server_tokens,
            new_from=part.new_index(window.history_start),
            cut=cut,
        )

    async def _fit(
        self,
        frame: _Frame,
        summary: Summary | None,
        hold_at: int | None,
        route: Route,
        request: ChatRequest,
        *,
        budget: int,
        limit: int,
        facts: WindowFacts,
    ) -> _Fitted:
        """The window drawn on `summary` (or none), holding its history at position `hold_at`
        when all from there fits; checked with the server's own count where it gives one."""
        part = frame.part(summary)
        hold = part.index_of(hold_at) if hold_at is not None else None
        fit_request = functools.partial(part.fit_request, hold)
        try:
            window = fit_request(budget)
        except ContextLengthExceeded as exc:
            if facts.counts_prompts:
                # The calibration's estimate is not the judge where the server counts: the
                # request alone is planned (no history) and its own count decides, below.
                # (Digits or emoji seen earlier, or tools a template leaves out, made the
                # estimate refuse requests the model takes.)
                window = request_alone(fit_request, exc)
            else:
                # The margin covers the worst count the calibration has seen (one prompt of
                # digits can make it large): a request that fits the best estimate without it
                # is sent, and the provider has the last word (a refusal is learned from and
                # retried once).
                best = replace(facts.calibration, margin=0).our_budget(limit)
                if best <= budget:
                    raise
                window = fit_request(best)
        server_tokens = None
        if facts.counts_prompts:
            exact = await self._fit_exactly(route, request, window, fit_request, budget, limit, facts)
            window, server_tokens = exact
        return _Fitted(window, part, server_tokens)

    def _summary_target(self, frame: _Frame, part: _Part, window: Window, budget: int) -> str | None:
        """The response a new summary should cover through: the oldest turns of this window's
        history that the next cut will drop, (1 - cut_to) of the budget (or of
        max_history_messages). Asked for as soon as the history holds them, so that it is ready
        at that cut, where the window then starts with the summary and nothing in between."""
        ctx, view = frame.settings, frame.view
        start, end = window.history_start, part.first_new
        tokens = part.conversation_tokens
        ends = []
        need, used = (1 - ctx.cut_to) * budget, 0
        for i in range(start, end):
            used += tokens[i]
            if used >= need:
                ends.append(i + 1)
                break
        if ctx.max_history_messages and end - start >= math.ceil((1 - ctx.cut_to) * ctx.max_history_messages):
            ends.append(start + math.ceil((1 - ctx.cut_to) * ctx.max_history_messages))
        if not ends:
            return None
        position = snap_to_turn_end(view, part.absolute(max(ends), view.history_count))
        if position <= (part.summary.covered if part.summary else 0) or position > view.history_count:
            return None
        return view.history_owner[view.loaded_from(position - 1)]

    async def _fit_exactly(
        self,
        route: Route,
        request: ChatRequest,
        window: Window,
        fit_request: Callable[[int], Window],
        budget: int,
        limit: int,
        facts: WindowFacts,
    ) -> tuple[Window, int | None]:
        """The window checked against the server's own count of its prompt (tools included), cut
        further while that count is over `limit` (window less the answer's reserve): exact, so
        no margin is needed, and no prompt the server counts higher than the calibration
        expected (digits, emoji, other scripts) takes the answer's room. Without the server's
        count, the plan made with the calibration's margin."""
        asked = ("tools", "tool_choice", "chat_template_kwargs")
        extra: dict[str, object] = {"model": route.model}  # (the provider's name: vLLM checks it)
        extra.update((k, request.body[k]) for k in asked if k in request.body)

        def ratio(counted: int, window: Window) -> float:
            # This window's own (the calibration's is an average: digits, say, count 3x theirs)
            return max(counted / max(window.tokens.get("total", 0), 1), 0.2)

        async def count(window: Window) -> int | None:
            return await route.upstream.count_prompt({**extra, "messages": window.messages})

        for _ in range(_EXACT_TRIES):
            counted = await count(window)
            if counted is None:  # (as without it: the margin, unless only the best estimate fits)
                try:
                    return fit_request(facts.calibration.our_budget(limit)), None
                except ContextLengthExceeded:
                    return window, None
            if counted <= limit:
                if window.omitted and counted < limit:
                    # Room left (the calibration overestimated this history): one larger try.
                    room = int((limit - counted) * 0.9 / ratio(counted, window))
                    larger_budget = window.tokens.get("total", budget) + room
                    if isinstance(self.settings.context.max_context_tokens, int):
                        larger_budget = min(larger_budget, budget)  # a configured window is kept
                    larger = fit_request(larger_budget)
                    if larger.omitted < window.omitted:
                        more = await count(larger)
                        if more is not None and more <= limit:
                            return larger, more
                return window, counted
            over = math.ceil((counted - limit) / ratio(counted, window)) + 1
            budget = min(budget, window.tokens.get("total", budget)) - over
            try:
                window = fit_request(budget)
            except ContextLengthExceeded as exc:  # the request alone does not fit: said in the
                # server's terms (the budget cut here is the gateway's own count, scaled by this
                # window's ratio: "more than the -1054 the window allows")
                alone = f" (the request alone: {counted})" if not window.tokens.get("history") else ""
                raise ContextLengthExceeded(
                    f"This request does not fit the model's context window: {facts.tokens} tokens less "
                    f"{facts.tokens - limit} for the answer leave {limit} for the prompt, and the server "
                    f"counts more than that before any history{alone}; shorten it",
                    param="messages",
                    needs=exc.needs,
                ) from None
        return window, None  # (still over: sent, and the server has the last word)

    @staticmethod
    def sized(
        message: Message | None,
        limit: int,
        count: Callable[[Message], int],
        shrink: Callable[[Message, int], Message | None],
    ) -> tuple[Message | None, int]:
        """`message` (a summary or recap) within `limit` tokens, made smaller by `shrink` when
        it is larger; None when too little room is left for it to say anything."""
        if message is None:
            return None, 0
        tokens = count(message)
        if tokens <= limit:
            return message, tokens
        if limit < _MIN_SIZED_TOKENS:
            return None, 0
        smaller = shrink(message, limit)
        return (smaller, count(smaller)) if smaller is not None else (None, 0)

    async def recap(
        self,
        request: ChatRequest,
        store: Store,
        load: Callable[[str], Awaitable[ConversationView]],
        cid: str,
        count: Callable[[Message], int],
        now: float,
    ) -> tuple[Message | None, list[str]]:
        """The "Earlier today" recap for a user's new conversation (SPEC section 8)."""
        sessions = self.settings.sessions
        user = request.body.get("user")
        if not sessions.recap or not isinstance(user, str) or not user:
            return None, []
        tz = zone(request.body.get("user_timezone"), sessions.default_timezone)
        return await build_recap(
            store, load, user, tz, exclude=cid, now=now, max_tokens=sessions.recap_max_tokens, count=count
        )

    def learn_from_usage(
        self, plan: ContextPlan | None, route: Route, record: Record, cid: str | None, rid: str
    ) -> bool:
        """Calibrate counting from the provider's count of the whole prompt (the response's
        `cache` figures: cached and uncached tokens together, where a provider reports them
        apart, as Anthropic does), and flag a provider that silently dropped part of the prompt
        (Ollama's num_ctx): it saw under 70% of what it should have."""
        cache = record.get("cache")
        if plan is None or not isinstance(cache, dict):
            return False
        theirs = cache.get("prompt_tokens")
        ours = plan.window.total_tokens
        if not isinstance(theirs, int) or isinstance(theirs, bool) or theirs <= 0:
            return False
        # (what was learned: the plan's may keep a configured window in our count, ratio 1)
        calibration = self.facts.calibration(route) if plan.facts is not None else None
        if calibration is not None and calibration.samples > 0:
            expected, ratio = calibration.ratio * ours + calibration.overhead, _TRUNCATION_RATIO
        else:
            # Not calibrated yet: a provider may simply count fewer tokens than we do (a larger
            # vocabulary, a rough count), so only a cut to under half is taken for truncation.
            expected, ratio = float(ours), _UNCALIBRATED_TRUNCATION_RATIO
        if ours < _TRUNCATION_MIN_TOKENS or theirs >= expected * ratio:
            prior = calibration or UNCALIBRATED
            if theirs < prior.ratio * ours + prior.overhead and _has_tools(plan.window):
                # Chat templates render tool definitions and calls their own way, or not at all
                # (SmolLM2's leaves them out): such a prompt may teach that the model counts
                # more, never that it counts less (it once halved the planned ratio).
                return False
            self.facts.observe(route, ours, theirs)
            return False
        if plan.facts is not None and not plan.facts.cuts_silently:
            # llama.cpp and vLLM refuse what does not fit: a low count is their chat template's
            # (one that leaves `tools` out), not a cut. Not learned from: it would understate.
            return False
        record["upstream_truncation_suspected"] = {"prompt_tokens": theirs, "our_count": ours}
        if route.upstream.reports_real_usage:
            self.facts.truncated(route, theirs)
        if self._warned_truncation.get(cid):
            return True  # recorded on every response, logged once per conversation
        self._warned_truncation[cid] = True
        log.warning(
            orjson.dumps(
                {
                    "event": "upstream_truncation_suspected",
                    "response_id": rid,
                    "conversation_id": cid,
                    "provider": route.provider,
                    "prompt_tokens": theirs,
                    "our_count": ours,
                }
            ).decode()
        )
        return True


def _has_tools(window: Window) -> bool:
    """Did the prompt carry tool definitions, tool calls or tool results?"""
    return bool(window.tokens.get("tools")) or any(
        m.get("tool_calls") or m.get("role") == "tool" for m in window.messages
    )


@functools.lru_cache(maxsize=64)
def tools_cost(tools_json: str, encoding: str) -> int:
    """Tokens of a request's tool definitions: counted once, as a client sends the same
    definitions with every turn."""
    return len(get_encoding(encoding).encode(tools_json, disallowed_special=()))


def orphan_results(new: list[Message]) -> InvalidRequest:
    """The request's new input was only `tool` results that answer no pending call: there is
    nothing to send (providers refuse an orphan result, and an empty list)."""
    ids = ", ".join(repr(m.get("tool_call_id")) for m in new)
    return InvalidRequest(
        f"The request's new messages are only tool results that answer no tool call (tool_call_id {ids}): "
        "a 'tool' message must follow the assistant message whose tool_calls it answers",
        param="messages",
    )
