"""Plan a turn's window: what of the stored conversation goes upstream (SPEC section 7).

The window is sized from the model's window and calibration (`ModelFacts`), held or cut in
steps (`gateway.context.steps`), drawn from the messages `gateway.context.draw` lays out, and
checked with the server's own count where it gives one."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway.config import Settings
from gateway.context import (
    ConversationView,
    Message,
    clean_message,
    split_system,
)
from gateway.context.draw import Frame, Part, request_alone
from gateway.context.history import item_key
from gateway.context.lifecycle import zone
from gateway.context.steps import Head
from gateway.context.summary import Summary, current_summary, snap_to_turn_end, summary_version
from gateway.context.window import REQUEST_OVERHEAD_TOKENS, Window, fit_window
from gateway.exceptions import ContextLengthExceeded
from gateway.services.models import ModelFacts, WindowFacts
from gateway.services.recap import build_recap
from gateway.services.requests import ChatRequest
from gateway.store.base import LRU, Store
from gateway.tokens import counter_for, get_encoding
from gateway.types import Record
from gateway.upstream import Route

log = logging.getLogger("gateway.services")

# Counting more text than this runs in a worker thread, off the event loop. tiktoken lets go of
# the GIL while it encodes, so the loop runs on meanwhile; the hand-off costs the loop about
# 60-80 us, what counting 1,000-1,500 characters costs on it (measured: 5,000 characters 260-300
# us on the loop against 100-115 us with the hand-off), so text a few times that goes.
COUNT_OFF_LOOP_CHARS = 4_000
# Conversations whose summary target is remembered (the newest this many).
ASKED_LIMIT = 4096
# Windows checked against a server's own count before one is sent as it is.
_EXACT_TRIES = 4


def history_needed(max_history_messages: int, keep_recent_messages: int) -> int:
    """Stored history messages a window looks at (`Planner.plan`'s `lower` on).

    The newest max_history_messages (or keep_recent_messages) and the one before them."""
    return max(max_history_messages, keep_recent_messages) + 1


def _size(messages: list[Message]) -> int:
    total = 0
    for m in messages:
        content = m.get("content")
        total += len(content) if isinstance(content, str) else len(orjson.dumps(content))
    return total


async def off_loop_if_large(messages: list[Message], work: Callable[[], Any]) -> Any:
    """`work()` (a count of `messages`), in a worker thread when their text is large."""
    if _size(messages) > COUNT_OFF_LOOP_CHARS:
        return await asyncio.to_thread(work)
    return work()


@dataclass(frozen=True, slots=True)
class TurnInputs:
    """What a turn's window is planned from (and planned again from, after a refusal)."""

    request: ChatRequest
    route: Route
    view: ConversationView
    store: Store
    cid: str
    system_in: list[Message]
    system_tokens: list[int] | None
    new: list[Message]
    new_tokens: list[int]
    encoding: str
    count: Callable[[Message], int]
    recap: Message | None


@dataclass(frozen=True, slots=True)
class _Fitted:
    window: Window
    part: Part
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
    pinned: int = 0  # the first stored messages, sent ahead of the cut (`keep_first`)

    def window_from(self, view: ConversationView, response_id: str) -> str | None:
        """The item key of the first stored message the history began with.

        The turn's own first message sent when none was (also when the conversation had none
        stored: a long chat moved in by its first request, cut among its own messages); None: the
        conversation's first message."""
        if self.kept_from < view.history_count:
            if self.kept_from == 0:
                return None
            i = view.loaded_from(self.kept_from)
            return item_key(view.history_owner[i], view.history_pos[i])
        if self.new_from is None or (self.kept_from == 0 and self.new_from == 0):
            return None
        return item_key(response_id, self.new_from)

    def snapshot(
        self, view: ConversationView, new_messages: int, sent: list[Message], response_id: str
    ) -> Record:
        owners = view.history_owner
        pinned = owners[view.loaded_from(0) : view.loaded_from(self.pinned)] if self.pinned else []
        included = list(dict.fromkeys([*pinned, *owners[view.loaded_from(self.kept_from) :]]))
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


# OpenAI's words for an input over the model's window with `truncation: "disabled"`.
INPUT_TOO_LONG = (
    "Your input exceeds the context window of this model. Please adjust your input and try again."
)


def _answer_field(request: ChatRequest) -> tuple[str, int]:
    """The field the client asked its answer's room with (max_completion_tokens, else
    max_tokens), and that room; 0: none."""
    name = "max_completion_tokens" if request.body.get("max_completion_tokens") else "max_tokens"
    requested = request.body.get(name) or 0
    return name, requested if isinstance(requested, int) and requested > 0 else 0


def _answer_tokens(request: ChatRequest) -> int:
    """The room the client asked for its answer (max_completion_tokens, max_tokens); 0: none."""
    return _answer_field(request)[1]


def refuse_cut(plan: ContextPlan) -> None:
    """`truncation: "disabled"`: the window must send the whole conversation, else a 400.

    Nothing left out and nothing folded into a summary (but a compaction's, which the client
    asked for: the conversation goes on from it); else the 400 OpenAI answers an input over the
    window."""
    summary = plan.summary
    folded = summary.covered if summary is not None and not summary.compaction else 0
    left_out = plan.window.omitted + folded
    if left_out:
        raise ContextLengthExceeded(
            f"{INPUT_TOO_LONG} (truncation is 'disabled', and the window the gateway plans for this "
            f"model ({plan.context_window} tokens, less {plan.reserve} for the answer) would leave out "
            f"{left_out} earlier messages of the conversation; with 'auto' the gateway cuts them.)",
            param="input",
        )


class Planner:
    """Plans windows for one gateway: the model facts and summarizer it asks are shared."""

    def __init__(self, settings: Settings, facts: ModelFacts) -> None:
        self.settings = settings
        self.facts = facts
        # (store, conversation) -> the head a summary for the next cut was asked at, and its target.
        self._asked: LRU[tuple[int, str], tuple[int, str]] = LRU(ASKED_LIMIT)

    async def window_needs(self, store: Store, cid: str) -> dict[str, Any]:
        """What a turn's window needs loaded (`ConversationCache.load`'s `tail` and `through`).

        The newest history messages it can send, a few more (a tool-call unit is never cut), and
        the turn the newest rolling summary covers through."""
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

    async def plan(self, inputs: TurnInputs, *, hold: bool = True, cap: int | None = None) -> ContextPlan:
        """Decide what of the stored conversation goes upstream (SPEC section 7).

        The window keeps the previous turn's head (`view.head`: where its history began and the
        summary it sent) while everything from there fits; otherwise it is cut in a step, down
        to `cut_to` of the budget, starting at the newest summary's coverage when that fits.
        `hold=False` cuts regardless (after the provider refused the previous plan), as does a
        compaction made for this turn (`request.compaction_version`). `cap`: a window this plan
        alone must fit (the retry of a prompt the provider counted higher than we could).

        The answer's reserve, when the client set none, is halved for a request that does not
        fit beside it."""
        view, request = inputs.view, inputs.request
        if view.encoding != inputs.encoding or view.needs_count:
            # Counted once per stored message; only a model-family switch recounts.
            if len(view.history) > 64:
                await asyncio.to_thread(view.count_tokens, inputs.encoding, inputs.count)
            else:
                view.count_tokens(inputs.encoding, inputs.count)
        facts = await self.facts.window(inputs.route, request.model, inputs.store)
        if cap is not None and cap < facts.tokens:
            facts = dataclasses.replace(facts, tokens=cap, source=f"this prompt's retry (was {facts.tokens})")
        reserve, budget = self._budget(request, facts)
        try:
            return await self._plan_with(inputs, facts, reserve, budget, hold=hold)
        except ContextLengthExceeded as refused:
            if _answer_tokens(request):  # the client's own room for its answer is kept
                raise
            # The reserve is the gateway's choice, not the client's: a request that does not fit
            # beside it is sent with half of it left for the answer, as the provider would take
            # it, rather than refused (the same request with no conversation goes through).
            # (A cut: the request alone did not fit beside the whole reserve, let alone a held head.)
            reserve //= 2
            budget = self._budget(request, facts, reserve)[1]
            try:
                return await self._plan_with(inputs, facts, reserve, budget, hold=False)
            except ContextLengthExceeded:
                raise refused from None

    async def as_sent(self, request: ChatRequest, route: Route, store: Store) -> ContextPlan:
        """A stateless request's prompt as it is sent: its messages as they came, none left out.

        No window is fitted (a request with no conversation goes to the provider whole, and one
        too long for it is the provider's to refuse); the model's window and the answer's room
        are said beside it, as a plan says them, and the server's own count where it gives one."""
        facts = await self.facts.window(route, request.model, store)
        encoding, count = counter_for(request.model)
        system, rest = split_system(request.messages)
        system, rest = [clean_message(m) for m in system], [clean_message(m) for m in rest]
        tools = request.body.get("tools")
        window = fit_window(
            system=system,
            system_tokens=[count(m) for m in system],
            conversation=rest,
            conversation_tokens=[count(m) for m in rest],
            first_new=0,  # (all of it is the request, never cut)
            budget=sys.maxsize,
            max_history_messages=0,
            marker_tokens=lambda omitted: 0,
            tools_tokens=tools_cost(orjson.dumps(tools).decode(), encoding) if tools else 0,
        )
        return ContextPlan(
            window=window,
            encoding=encoding,
            context_window=facts.tokens,
            reserve=_answer_tokens(request) or self._default_reserve(facts),
            summary=None,
            kept_from=0,
            summary_target=None,
            facts=facts,
            server_tokens=await server_count(route, request, window.messages)
            if facts.counts_prompts
            else None,
        )

    def _default_reserve(self, facts: WindowFacts) -> int:
        """The answer's room when the client asks for none: reserve_tokens, at most a quarter of
        the window."""
        return min(self.settings.context.reserve_tokens, facts.tokens // 4)

    async def _plan_with(
        self, inputs: TurnInputs, facts: WindowFacts, reserve: int, budget: int, *, hold: bool
    ) -> ContextPlan:
        """The plan for a window of `facts.tokens` less `reserve` for the answer (`budget`: ours)."""
        ctx, view, route, request, store = (
            self.settings.context,
            inputs.view,
            inputs.route,
            inputs.request,
            inputs.store,
        )
        window_size = facts.tokens
        head = view.head or Head()  # (none recorded: as if the window began at the beginning)
        compacted = request.compaction_version is not None  # for this turn: a cut, to start at it
        hold = hold and not compacted
        # Summaries are read when made (summarize), or when one is in use or just made (a
        # compaction, on any strategy: the conversation goes on from it).
        reads = ctx.strategy == "summarize" or head.summary is not None or compacted
        records = await store.read_side("summaries", inputs.cid) if reads else []
        newest = current_summary(records, view) if records else None
        frame = self._frame(inputs, window_size - reserve)
        start = view.position_of(head.start) if head.start is not None else 0
        held_summary = summary_version(records, view, head.summary) if head.summary is not None else None
        fit = functools.partial(self._fit, frame, budget=budget, limit=window_size - reserve, facts=facts)
        fitted: _Fitted | None = None
        held = start is not None and not head.after_reset
        if hold and held and (head.summary is None or held_summary is not None):
            with contextlib.suppress(ContextLengthExceeded):  # (the cut decides what the request needs)
                fitted = await fit(held_summary, start, route, request)
            if fitted is not None and not fitted.window.held:
                fitted = None
            if fitted is not None and fitted.window.omitted and _closes_more(newest, held_summary):
                # Messages in neither the summary nor the window (a cut came before its summary
                # was ready: an edit, a request of many messages), and a newer summary is ready:
                # a cut now lets it in, where holding kept the gap until the next cut.
                fitted = None
        cut = fitted is None
        if fitted is None:  # a cut: the newest summary enters here, and only here
            fitted = await fit(newest, newest.covered if newest is not None else None, route, request)
            if newest is not None and not newest.compaction and fitted.window.held:
                low_water = ctx.cut_to * budget
                fitted = await self._newest_turns_kept(fit, fitted, newest, low_water, route, request)
        # A new system prompt moves the head too (the provider's cache serves none of the prompt).
        cut = cut or bool(inputs.system_in and view.turns and frame.system != _cleaned(view.system))
        window, part = fitted.window, fitted.part
        kept_abs = part.absolute(window.history_start, view.history_count)
        target = None
        if ctx.strategy == "summarize" and view.history_count and not (newest and newest.covered > kept_abs):
            target = self._next_summary((id(store), inputs.cid), kept_abs, frame, part, window, budget)
            if target is None and window.omitted:
                # Messages in neither the summary nor the window (a cut came first: an edit, a
                # request of many messages): a summary through them, asked now, closes the gap
                # at the next turn (`_closes_more`); the next cut's was not due for turns yet.
                gap_end = snap_to_turn_end(view, kept_abs)
                if gap_end > (newest.covered if newest is not None else 0) and gap_end <= view.history_count:
                    target = view.history_owner[view.loaded_from(gap_end - 1)]
        summary = part.summary
        chosen = ContextPlan(
            window=window,
            encoding=inputs.encoding,
            context_window=window_size,
            reserve=reserve,
            summary=summary if window.tokens.get("summary") else None,  # (None: not sent)
            kept_from=kept_abs,
            summary_target=target,
            facts=facts,
            server_tokens=fitted.server_tokens,
            new_from=part.new_index(window.history_start),
            cut=cut,
            pinned=part.first_end if part.first and any(m is part.first[0] for m in window.messages) else 0,
        )
        if request.truncation == "disabled":
            refuse_cut(chosen)
        return chosen

    @staticmethod
    async def _newest_turns_kept(
        fit: Callable[..., Awaitable[_Fitted]],
        fitted: _Fitted,
        summary: Summary,
        low_water: float,
        route: Route,
        request: ChatRequest,
    ) -> _Fitted:
        """The cut's window, its newest turns kept where `summary` covers them too.

        A summary of the whole conversation (post-processing's, made while it was idle) covers
        the turns a cut keeps: the window from its end held the new message alone. When what it
        holds is under half the cut's low water, the window is cut as without a summary and the
        summary goes in front of it (covering some of its turns too)."""
        if fitted.window.tokens.get("history", 0) * 2 >= low_water:
            return fitted
        plain = await fit(None, None, route, request)
        start = plain.part.absolute(plain.window.history_start, plain.part.frame.view.history_count)
        return await fit(summary, start, route, request) if start < summary.covered else fitted

    def _frame(self, inputs: TurnInputs, room: int) -> Frame:
        """What every window of the turn shares, `room` being the window less the answer's reserve.

        Summary and recap are sized from the window, not from the request (`head_room`: what the
        system prompt, the framing and the tools leave of `room`), so that the head of the prompt
        stays the same from turn to turn (sized from the request only when it must shrink)."""
        ctx, view = self.settings.context, inputs.view
        if inputs.system_in:
            system, system_tokens = inputs.system_in, list(inputs.system_tokens or [])
        else:
            system = view.system or []
            system_tokens = [int(n or 0) for n in (view.system_tokens or [])]
        tools = inputs.request.body.get("tools")
        tools_tokens = tools_cost(orjson.dumps(tools).decode(), inputs.encoding) if tools else 0
        return Frame(
            max_history=ctx.max_history_messages,
            keep_recent=ctx.keep_recent_messages,
            keep_first=ctx.keep_first,
            cut_to=ctx.cut_to,
            view=view,
            system=[clean_message(m) for m in system],
            system_tokens=system_tokens,
            new=inputs.new,
            new_tokens=inputs.new_tokens,
            count=inputs.count,
            model=inputs.request.model,
            encoding=inputs.encoding,
            recap=inputs.recap,
            tools_tokens=tools_tokens,
            head_room=room - REQUEST_OVERHEAD_TOKENS - sum(system_tokens) - tools_tokens,
        )

    def _budget(
        self, request: ChatRequest, facts: WindowFacts, reserve: int | None = None
    ) -> tuple[int, int]:
        """The answer's reserve (in the provider's tokens) and the prompt's budget (in ours).

        The reserve is `reserve` when given; else the client's own max_tokens when sent, else
        reserve_tokens, at most a quarter of the window."""
        if reserve is None:
            name, asked = _answer_field(request)
            if asked >= facts.tokens:
                raise ContextLengthExceeded(
                    f"'{name}' of {asked} leaves no room for the prompt in the model's context "
                    f"window of {facts.tokens} tokens; lower it",
                    param=name,
                )
            reserve = asked or self._default_reserve(facts)
        # A server that counts prompts itself is asked for the exact count of the window
        # planned (below): planned from the calibration's best estimate, without its margin.
        calibration = replace(facts.calibration, margin=0) if facts.counts_prompts else facts.calibration
        return reserve, calibration.our_budget(facts.tokens - reserve)

    async def _fit(
        self,
        frame: Frame,
        summary: Summary | None,
        hold_at: int | None,
        route: Route,
        request: ChatRequest,
        *,
        budget: int,
        limit: int,
        facts: WindowFacts,
    ) -> _Fitted:
        """The window drawn on `summary` (or none), checked with the server's own count where given.

        It holds its history at position `hold_at` when all from there fits."""
        # A start inside what a summary (not a compaction) covers: those turns are sent as well.
        overlap = hold_at if summary is not None and not summary.compaction and hold_at is not None else None
        part = frame.part(summary, overlap)
        # (a start among the first messages kept ahead of the cut is the history after them)
        hold = part.index_of(max(hold_at, part.first_end)) if hold_at is not None else None
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

    def _next_summary(
        self, key: tuple[int, str], kept_from: int, frame: Frame, part: Part, window: Window, budget: int
    ) -> str | None:
        """The summary for the next cut, until there is one: its coverage is chosen once per head.

        Asking again for the same is no new work; a later one would be. One chosen through a
        response no longer in the history (an edit after the head left it on the abandoned
        branch) is chosen again: its summary would not apply, and the cut would find none."""
        asked = self._asked.get(key)
        if asked is not None and asked[0] == kept_from and asked[1] in frame.view.history_end:
            return asked[1]
        target = self._summary_target(frame, part, window, budget)
        if target is not None:
            self._asked[key] = (kept_from, target)
        return target

    def _summary_target(self, frame: Frame, part: Part, window: Window, budget: int) -> str | None:
        """The response a new summary should cover through.

        The summary covers the oldest turns of this window's history that the next cut will drop,
        (1 - cut_to) of the budget (or of max_history_messages). It is asked for as soon as the
        history holds them, so that it is ready at that cut, where the window then starts with the
        summary and nothing in between."""
        view, share = frame.view, 1 - frame.cut_to
        start, end = window.history_start, part.first_new
        tokens = part.conversation_tokens
        ends = []
        need, used = share * budget, 0
        for i in range(start, end):
            used += tokens[i]
            if used >= need:
                ends.append(i + 1)
                break
        drops = math.ceil(share * frame.max_history)
        if frame.max_history and end - start >= drops:
            ends.append(start + drops)
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
        """The window checked against the server's own count of its prompt (tools included).

        It is cut further while that count is over `limit` (window less the answer's reserve):
        exact, so no margin is needed, and no prompt the server counts higher than the
        calibration expected (digits, emoji, other scripts) takes the answer's room. Without the
        server's count, the plan made with the calibration's margin."""

        def ratio(counted: int, window: Window) -> float:
            # This window's own (the calibration's is an average: digits, say, count 3x theirs)
            return max(counted / max(window.tokens.get("total", 0), 1), 0.2)

        async def count(window: Window) -> int | None:
            return await server_count(route, request, window.messages)

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
        user = request.end_user
        if not sessions.recap or user is None:
            return None, []
        tz = zone(request.body.get("user_timezone"), sessions.default_timezone)
        return await build_recap(
            store, load, user, tz, exclude=cid, now=now, max_tokens=sessions.recap_max_tokens, count=count
        )


async def server_count(route: Route, request: ChatRequest, messages: list[Message]) -> int | None:
    """The server's own count of a prompt of `messages` with the request's tools (None: it gives none)."""
    extra: dict[str, object] = {"model": route.model}  # (the provider's name: vLLM checks it)
    extra.update(
        (k, request.body[k]) for k in ("tools", "tool_choice", "chat_template_kwargs") if k in request.body
    )
    return await route.upstream.count_prompt({**extra, "messages": messages})


@functools.lru_cache(maxsize=64)
def tools_cost(tools_json: str, encoding: str) -> int:
    """Tokens of a request's tool definitions.

    Counted once, as a client sends the same definitions with every turn."""
    return len(get_encoding(encoding).encode(tools_json, disallowed_special=()))


def _cleaned(system: list[Message] | None) -> list[Message]:
    return [clean_message(m) for m in system or []]


def _closes_more(newest: Summary | None, held: Summary | None) -> bool:
    """Does the newest summary cover more than the one the head holds?"""
    return newest is not None and newest.covered > (held.covered if held is not None else 0)
