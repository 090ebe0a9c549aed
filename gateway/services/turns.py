"""The one place that wires store + context + upstream for a chat-completions turn.

A turn: validate → lock the conversation → load its view → work out what is new → build the
upstream message list → call the provider → record the reply → commit (response log durable,
then index) → release. Anything that fails or is cancelled is abandoned: it stays in its
response log marked incomplete and never enters history.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, cast

from gateway.config import Settings
from gateway.context import (
    ConversationView,
    Message,
    Turn,
    clean_message,
    reconcile,
    split_system,
)
from gateway.context.history import NotLoaded, leading_results
from gateway.context.lifecycle import user_key
from gateway.coroutines import await_commit, run_to_end, while_waiting
from gateway.exceptions import (
    ClientDisconnected,
    GatewayError,
    ShuttingDown,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
    shutting_down,
)
from gateway.ids import mint_response_id
from gateway.pacing import StartGate
from gateway.services.cache import ConversationCache
from gateway.services.counting import PromptCount, branch_view, prompt_count
from gateway.services.listing import Listing
from gateway.services.models import ModelFacts
from gateway.services.planning import Planner, TurnInputs, off_loop_if_large
from gateway.services.recap import stale_recap_sources, withdrawal
from gateway.services.requests import ChatRequest, check_size
from gateway.services.stream import StreamAccumulator, output_message, served_by, stream_error
from gateway.services.turn import (
    Planned,
    PreparedTurn,
    TurnOutcome,
    archive_expired,
    check_timezone,
    client_params,
    context_snapshot,
    expired,
    lock_conversation,
    refit,
    request_record,
    response_record,
    stored_turn,
    timings_until_now,
    with_prefill,
)
from gateway.services.usage import UsageLearning
from gateway.store import Store, StoreRegistry
from gateway.tokens import counter_for
from gateway.types import JSONObject, Record, as_list, first_choice
from gateway.upstream import Route, Router
from gateway.upstream.base import Chunk
from gateway.upstream.cache_hints import CACHE_KEY, cache_key

log = logging.getLogger("gateway.services")


class TurnStream:
    """A turn's chunks as its provider streams them.

    The stream owns the turn from its first chunk on: the turn is closed when the chunks end
    (committed), when they fail (with the failure, raised as the gateway's error), or when the
    stream is closed before that."""

    def __init__(
        self,
        turn: PreparedTurn,
        relay: AsyncGenerator[Chunk, None],
        close: Callable[[PreparedTurn, BaseException | None], Awaitable[TurnOutcome]],
    ) -> None:
        self.turn = turn
        self.relay = relay
        self.close_turn = close

    def __aiter__(self) -> AsyncGenerator[Chunk, None]:
        return self.relay  # (iterated directly: no layer of this object's own per chunk)

    async def aclose(self, exc: BaseException | None = None) -> TurnOutcome:
        """Stop the stream and close its turn; return the outcome of the turn's first close.

        `exc` is what stopped it, for the turn's outcome: a client that left is a cancellation."""
        outcome = await self.close_turn(self.turn, exc)
        await self.relay.aclose()
        return outcome

    @property
    def outcome(self) -> TurnOutcome:
        """The turn's outcome once the stream ended."""
        return self.turn.closed()


class ChatService:
    """The chat turn: prepare (lock, load, plan), complete or stream, commit, close."""

    def __init__(
        self,
        settings: Settings,
        router: Router,
        *,
        stores: StoreRegistry | None = None,
        facts: ModelFacts | None = None,
        cache: ConversationCache | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.stores = stores or StoreRegistry(settings)
        self.cache = cache or ConversationCache.of(settings)
        self.facts = facts or ModelFacts(settings)
        # Asks the background summarizer for coverage (tenant, conversation, through, model).
        self.schedule_summary: Callable[[str, str, str, str], None] = lambda *args: None
        self.planner = Planner(settings, self.facts)
        self.usage = UsageLearning(self.facts)
        self.clock: Callable[[], float] = time.time
        self.warm_up: asyncio.Future[Any] | None = None  # tokenizer loading, set at startup
        self.on_context_refusal: Callable[[str], None] = lambda outcome: None  # metrics hook
        self.starts = StartGate(settings.server.starts_per_pass)

    # -- preparing ----------------------------------------------------------------------------
    async def _recap_checked(self, store: Store, cid: str, view: ConversationView) -> ConversationView:
        """The view whose recap no longer quotes a conversation deleted from since it was made.

        The lock is held: the withdrawal is recorded here, a marker, as a deletion records it."""
        others = functools.partial(self.cache.load, store, keep=False)
        stale = await stale_recap_sources(store, others, view)
        if not stale:
            return view
        await store.append_marker(cid, withdrawal(stale))
        return await self._load(store, cid)

    async def _load(self, store: Store, cid: str) -> ConversationView:
        """The conversation as far back as a turn's window needs it."""
        return await self.cache.load(store, cid, **await self.planner.window_needs(store, cid))

    async def prepare(self, request: ChatRequest, tenant: str = "") -> PreparedTurn:
        """Lock and load the conversation, fit the window, and open the response log.

        The turn is closed by its owner: `closing` (the caller's block), else the `TurnStream`
        of `open_chunks` once it began."""
        # The gateway's own time starts here: a wait for this pass's share of starts, the lock,
        # the load and the plan.
        started, started_ns = time.perf_counter(), time.time_ns()
        await self.starts.enter()
        store = await self.stores.get(tenant)
        store.refuse_if_failed()  # before the provider is asked for an answer nobody could keep
        route = self.router.resolve(request.model)
        response_id = mint_response_id(request.model)
        stack = AsyncExitStack()
        try:
            cid, view = await self._locked_view(request, store, stack)
            check_timezone(request, self.settings.sessions.default_timezone)
            if cid is None:  # stateless: the request as it is, nothing planned
                planned = Planned.stateless(request)
            else:
                reload = functools.partial(self.cache.load, store, cid)
                planned = await self._planned(request, route, store, cid, cid, view, reload)
            view = planned.view
            upstream_body = self._upstream_body(request, route, tenant, cid, planned)
            created = self.clock()
            kept = planned.without_prefill(request.prefill)  # (sent whole, as planned)
            if kept is planned:
                request.prefill = None  # (not new: a history resent with it already stored)
            record = request_record(request, response_id, route, cid, created, kept)
            response_log = store.start(response_id, record)
            turn = PreparedTurn(
                request,
                response_id,
                route,
                upstream_body,
                response_log,
                kept.new,
                planned.stored_system,
                stack,
                started,
                started_ns,
                encoding=planned.encoding,
                new_tokens=kept.new_tokens,
                system_tokens=planned.system_tokens if planned.stored_system is not None else None,
                plan=planned.plan,
                store=store,
                view=view,
                tenant=tenant,
                branch_at=planned.branch.branch_at if planned.branch is not None else None,
                replan=functools.partial(self.planner.plan, planned.inputs) if planned.inputs else None,
                created=created,
                recap=planned.recap,
                first_of_user=request.end_user if view.turns == 0 else None,
            )
            turn.note_context(context_snapshot(planned, response_id))
            return turn
        except BaseException:
            await stack.aclose()
            raise

    async def _locked_view(
        self, request: ChatRequest, store: Store, stack: AsyncExitStack
    ) -> tuple[str | None, ConversationView]:
        """The conversation's id (a branch's, when the turn makes one) and view, locked in `stack`.

        An expired conversation is archived, a recap quoting deleted ones withdrawn."""
        if request.conversation_id is None:
            return None, ConversationView()
        cid = await lock_conversation(request, store, stack, self.settings.storage.lock_timeout)
        view = await self._load(store, cid)
        if expired(view, self.settings.sessions.ttl, self.clock()):
            view = await archive_expired(store, self.cache, cid)
        if view.recap is not None:
            view = await self._recap_checked(store, cid, view)
        return cid, view

    async def _planned(
        self,
        request: ChatRequest,
        route: Route,
        store: Store,
        cid: str,
        planned_as: str,
        view: ConversationView,
        reload: Callable[[], Awaitable[ConversationView]],
    ) -> Planned:
        """What of `view` is new in the request, and the window planned for it.

        The window is a turn's, or a count's. `reload` gives the whole conversation when a
        partial view cannot tell."""
        if self.warm_up is not None and not self.warm_up.done():
            await asyncio.shield(self.warm_up)  # never load a tokenizer on the event loop
        encoding, count = counter_for(request.model)
        system_in, rest = split_system(request.messages)
        kept = request.system_prompt_count
        if kept is not None and len(system_in) > kept and (view.system or view.history_count):
            system_in, rest = system_in[:kept], [*system_in[kept:], *rest]
        for attempt in range(2):
            try:
                reconciled = reconcile(rest, view)
                new = reconciled.new
                if not rest and new:  # a system prompt alone: the stored answer taken back goes on
                    request.prefill = cast(str, new[-1]["content"])
                branch = reconciled if reconciled.branch_at is not None else None
                if reconciled.branch_at is not None:
                    view = view.branched(reconciled.branch_at)  # planned on the client's version
                # Results for a feedback turn's tool calls go on from it: sent with it, feedback too.
                goes_on = view.pending_feedback_calls(new) if branch is None else []
                if goes_on:  # (the results it begins with; what follows them is the client's turn)
                    k = len(leading_results(new))
                    new = [*(cast(Message, {**m, "is_feedback": True}) for m in new[:k]), *new[k:]]
                # + 1: the reply this turn would store
                check_size(self.settings.storage.max_conversation_messages, cid, view, len(new) + 1)
                new_tokens = await off_loop_if_large(
                    [*system_in, *new],
                    lambda: [count(clean_message(m)) for m in new],  # noqa: B023 - run at once
                )
                system_tokens = [count(m) for m in system_in] if system_in else None
                recap: Message | None = None
                recap_from: list[str] = []
                if view.turns == 0:
                    others = functools.partial(self.cache.load, store, keep=False)  # (not cached)
                    recap, recap_from = await self.planner.recap(
                        request, store, others, planned_as, count, self.clock()
                    )
                inputs = TurnInputs(
                    request, route, view, store, planned_as, system_in, system_tokens,
                    [*goes_on, *new], [*(count(m) for m in goes_on), *new_tokens],
                    encoding, count, recap or view.recap,
                )  # fmt: skip
                plan = await self.planner.plan(inputs)
                return Planned(
                    view=view,
                    new=new,
                    system_in=system_in,
                    encoding=encoding,
                    new_tokens=new_tokens,
                    system_tokens=system_tokens,
                    branch=branch,
                    recap=recap,
                    recap_from=recap_from,
                    inputs=inputs,
                    plan=plan,
                )
            except NotLoaded:  # a partial view cannot tell: the whole conversation can
                if attempt:
                    raise
                view = await reload()
        raise AssertionError("unreachable")  # (the second attempt returns or raises)

    def _upstream_body(
        self, request: ChatRequest, route: Route, tenant: str, cid: str | None, planned: Planned
    ) -> JSONObject:
        """The request the provider gets: the client's parameters, the window's messages."""
        upstream_body = {**client_params(request), "model": route.model, "messages": planned.sent}
        if "metadata" in upstream_body and upstream_body.get("store") is not True:
            # The gateway keeps the tag itself; OpenAI refuses `metadata` without `store: true`.
            del upstream_body["metadata"]
        upstream_body[CACHE_KEY] = cache_key(tenant, cid)  # for the provider's cache hints, never sent on
        plan = planned.plan
        if plan is not None and plan.facts is not None and plan.facts.num_ctx_option:
            # Ollama cuts prompts to its runtime num_ctx silently: say the window planned for.
            options = upstream_body.get("options")
            if options is None or (isinstance(options, dict) and "num_ctx" not in options):
                upstream_body["options"] = {**(options or {}), "num_ctx": plan.facts.tokens}
        return upstream_body

    async def _commit(self, turn: PreparedTurn, message: Message, record: Record) -> None:
        # Shielded, the answer's count included (a long one is counted in a thread, a wait): a
        # client disconnect must never interrupt the write of an answered turn.
        work = self._count_and_commit(turn, message, record)
        turn.commit_task = asyncio.ensure_future(work) if turn.log.commit_waits else run_to_end(work)
        await asyncio.shield(turn.commit_task)
        turn.done = True

    async def _count_and_commit(self, turn: PreparedTurn, message: Message, record: Record) -> None:
        if turn.request.prefill is not None:  # the answer as the conversation goes on with it
            message = record["message"] = with_prefill(turn.request.prefill, message)
            record["prefill"] = turn.request.prefill
        output_tokens = None
        if turn.encoding is not None and turn.new_tokens is not None:
            _, count = counter_for(turn.request.model)
            output_tokens = await off_loop_if_large([message], lambda: count(message))
            record["message_tokens"] = turn.output_tokens = output_tokens
        elif turn.plan is None and not record.get("usage"):
            # A stateless answer its provider did not count (a stream without a usage chunk):
            # ours, so that its tokens reach the metrics as a conversation's turn's do.
            _, count = counter_for(turn.request.model)
            sent = [
                cast(Message, m) for m in as_list(turn.upstream_body.get("messages")) if isinstance(m, dict)
            ]
            turn.prompt_counted, turn.output_tokens = await off_loop_if_large(
                [*sent, message], lambda: (sum(count(m) for m in sent), count(message))
            )
        if turn.plan is not None:
            turn.upstream_truncated = self.usage.learn(
                turn.plan.window, turn.plan.facts, turn.route, record, turn.conversation_id, turn.response_id
            )
        turn.log.append(record)
        await self._commit_and_note(turn, stored_turn(turn, message, output_tokens))

    async def _commit_and_note(self, turn: PreparedTurn, stored: Turn) -> None:
        cid = turn.conversation_id
        # What a list shows of the conversation with this turn, kept with it (the lock is held:
        # the view the turn was planned on is the conversation as it stands).
        view = turn.view if cid is not None else None
        listing = Listing.after(view, lambda stand_in: stand_in.extend(stored)) if view is not None else None
        turn.log.list_as(listing.record() if listing is not None else None)
        appended = await turn.log.commit(cid)
        if cid is not None and turn.store is not None:
            self.cache.appended(turn.store, cid, appended, lambda view: view.extend(stored))
            if turn.first_of_user:  # before the answer: the user's next turn may recap it
                try:
                    await turn.store.append_side(
                        "users", user_key(turn.first_of_user), {"conversation_id": cid, "at": turn.created}
                    )
                except Exception as exc:  # noqa: BLE001 - the turn is committed: only recaps miss it
                    log.warning("could not note %s among its user's conversations: %s", cid, exc)

    @asynccontextmanager
    async def closing(
        self, turn: PreparedTurn, *, on_failure_only: bool = False
    ) -> AsyncIterator[PreparedTurn]:
        """The turn, closed when the block ends (`on_failure_only`: only when it fails).

        With `on_failure_only`, a stream that began closes it then. The exception that ends the
        block is the turn's outcome, a shutdown's cancellation raised on as the error the client
        is told."""
        try:
            yield turn
        except BaseException as exc:
            failure = shutting_down(exc) or exc
            await self.close(turn, failure)
            if failure is exc:
                raise
            raise failure from None
        if not on_failure_only:
            await self.close(turn)

    async def close(self, turn: PreparedTurn, exc: BaseException | None = None) -> TurnOutcome:
        """Abandon the turn unless it was committed, then release the conversation.

        Closing again gives the first close's outcome."""
        if turn.outcome is not None:
            return turn.outcome
        try:
            if turn.commit_task is not None:
                await await_commit(turn.commit_task)
                turn.done = True
            if not turn.done:
                turn.done = True
                if isinstance(exc, asyncio.CancelledError | ClientDisconnected) or exc is None:
                    reason, error = "cancelled", None
                elif isinstance(exc, ShuttingDown):  # (cancelled by the server's stop: it says so)
                    reason, error = "cancelled", exc.to_dict()["error"]
                elif isinstance(exc, GatewayError):
                    reason, error = "error", exc.to_dict()["error"]
                else:
                    reason, error = "error", {"message": repr(exc)[:500], "type": "server_error"}
                await asyncio.shield(turn.log.abandon(reason, error))
        finally:
            await turn.stack.aclose()
        plan = turn.plan
        task = turn.commit_task
        committed = task is not None and task.done() and not task.cancelled() and task.exception() is None
        if isinstance(exc, UpstreamTimeout | UpstreamUnreachable):
            self.facts.unanswered(turn.route)
        if turn.store is not None:
            await self.facts.save(turn.route, turn.store)
        if plan is not None and plan.summary_target and turn.conversation_id and committed and turn.store:
            self.schedule_summary(turn.tenant, turn.conversation_id, plan.summary_target, turn.request.model)
        if turn.timings is None and turn.upstream_started:  # a call that failed: its time so far
            turn.timings = timings_until_now(turn)
        failure = exc if isinstance(exc, GatewayError) else None
        if failure is None and task is not None and task.done() and not task.cancelled():
            commit_error = task.exception()
            failure = commit_error if isinstance(commit_error, GatewayError) else None
        turn.outcome = turn.close_outcome(committed, failure)
        return turn.outcome

    # -- non-streaming ------------------------------------------------------------------------
    async def complete(self, turn: PreparedTurn) -> Chunk:
        turn.upstream_started = time.perf_counter()
        while True:
            try:
                # The log's file work is done once the request is on its way.
                completion = await while_waiting(
                    turn.route.upstream.complete(turn.upstream_body, waited=turn.waited_on_provider),
                    turn.log.meanwhile,
                )
                break
            except UpstreamStatusError as exc:
                if exc.refusal is None:
                    raise
                await refit(turn, exc, self.facts, self.on_context_refusal)
        choice = first_choice(completion)
        if not choice:
            raise UpstreamProtocolError(f"Provider {turn.route.provider!r} returned no choices")
        raw = choice.get("message")
        message = output_message(raw)
        answered_by = completion.get("model")
        if isinstance(answered_by, str):
            turn.response_model = answered_by
        usage, timings = completion.get("usage"), completion.get("timings")
        finish = choice.get("finish_reason")
        record = response_record(turn, message, finish, usage, raw, timings, served_by(completion))
        await self._commit(turn, message, record)
        turn.final_message = message
        completion["id"] = turn.response_id
        completion["model"] = turn.request.model
        completion["created"] = int(turn.created or 0)  # (the stored completion's: its request's time)
        if turn.conversation_id is not None:
            completion["conversation_id"] = turn.conversation_id
        return completion

    # -- streaming ----------------------------------------------------------------------------
    async def open_chunks(self, turn: PreparedTurn) -> TurnStream:
        """Start the provider's stream, wait for its first chunk, then return the chunk stream.

        Waiting for the first chunk lets errors before the first byte still become proper HTTP
        statuses. The chunk stream commits the turn after the last chunk (and raises GatewayError
        on a broken stream) and closes it."""
        turn.upstream_started = time.perf_counter()
        while True:
            chunks = turn.route.upstream.stream(
                turn.upstream_body, waited=turn.waited_on_provider
            ).__aiter__()
            try:
                first: Chunk | None = await while_waiting(chunks.__anext__(), turn.log.meanwhile)
                break
            except StopAsyncIteration:
                first = None
                break
            except UpstreamStatusError as exc:
                if exc.refusal is None:
                    raise
                await refit(turn, exc, self.facts, self.on_context_refusal)
        await self.visible(turn)  # the stream's head names the response: a GET must find it
        return TurnStream(turn, self._chunks(turn, chunks, first), self.close)

    @staticmethod
    async def visible(turn: PreparedTurn) -> None:
        """Return once the turn's response log can be read by its id, from any process.

        Before the id is handed out (a stream's head, a background response's answer): a client
        may read it at once. Never raises."""
        await turn.log.visible()

    async def _chunks(
        self, turn: PreparedTurn, chunks: AsyncIterator[Chunk], first: Chunk | None
    ) -> AsyncGenerator[Chunk, None]:
        """The relay: every chunk renamed to the turn's response, the answer committed after the last.

        The turn is closed when it ends or fails (a failure raised as the gateway's error: a
        shutdown's as `ShuttingDown`, anything else as a malformed stream)."""
        acc = StreamAccumulator()
        # What every chunk is renamed to: the turn's response (as its stored completion says it).
        head: dict[str, object] = {
            "id": turn.response_id,
            "model": turn.request.model,
            "created": int(turn.created or 0),
        }
        if turn.conversation_id is not None:
            head["conversation_id"] = turn.conversation_id
        # From the chunk that finishes the answer on, chunks are held back until the turn is
        # committed: a client that stops reading at `finish_reason` must not take an answer
        # the store then failed to keep for a saved one (it gets an in-band error instead).
        held: list[Chunk] = []
        failure: BaseException | None = None
        try:
            chunk = first
            while chunk is not None:
                acc.add(chunk)
                if turn.response_model is None:
                    answered_by = chunk.get("model")
                    if isinstance(answered_by, str):
                        turn.response_model = answered_by
                chunk.update(head)
                if acc.finish_reason is None:
                    yield chunk
                else:
                    held.append(chunk)
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    chunk = None
            if acc.finish_reason is None:
                provider = turn.route.provider
                raise UpstreamProtocolError(f"Provider {provider!r} ended the stream before finishing")
            message = acc.message()
            record = response_record(
                turn, message, acc.finish_reason, acc.usage, None, acc.timings, acc.served, acc.text_after
            )
            await self._commit(turn, message, record)
            turn.final_message = message
            for chunk in held:
                yield chunk
        except GeneratorExit:
            raise  # (closed by its reader: a cancellation)
        except asyncio.CancelledError as exc:
            failure = shutting_down(exc) or exc
            if failure is exc:
                raise
            raise failure from None
        except Exception as exc:  # noqa: BLE001 - every failure of a stream that began is said
            failure = stream_error(exc, turn.route.provider)
            if failure is exc:
                raise
            raise failure from None
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.close(turn, failure)

    # -- counting -----------------------------------------------------------------------------
    async def count(self, request: ChatRequest, tenant: str = "") -> PromptCount:
        """Plan the window a turn of `request` would send, as `prepare` does, and stop there.

        With no conversation, the prompt a stateless turn sends: the request as it came.

        No lock held (but waited for, with `previous_response_id`), no response log, nothing
        stored or sent. The conversation is read as it stands (as any reader reads it) and
        planned on a copy; a turn of another request may land meanwhile, as it may before the
        counted turn itself is sent."""
        store = await self.stores.get(tenant)
        route = self.router.resolve(request.model)
        cid = request.conversation_id
        if cid is None:  # stateless: the request as it is sent, nothing planned
            sent = await self.planner.as_sent(request, route, store)
            return prompt_count(sent, self.facts.calibration(route))
        if request.previous_response_id is not None:  # (one still running: once it ended)
            await store.settled(cid, self.settings.storage.lock_timeout)
        view, planned_as = await self._counted_view(store, cid, request.previous_response_id)

        async def reload() -> ConversationView:
            return (await self._counted_view(store, cid, None, whole=True))[0]

        planned = await self._planned(request, route, store, cid, planned_as, view, reload)
        assert planned.plan is not None  # (a conversation's turn is always planned)
        return prompt_count(planned.plan, self.facts.calibration(route))

    async def _counted_view(
        self, store: Store, cid: str, previous: str | None, *, whole: bool = False
    ) -> tuple[ConversationView, str]:
        """A copy of the view a turn would plan on, and the conversation id it plans as.

        As a turn would see it: the branch a turn would make at `previous` when that is not the
        newest response (planned as a new branch: no summaries yet); an expired conversation as
        the fresh one it becomes; a recap that quotes deleted conversations without them, as a
        turn withdraws them."""
        branch = await branch_view(store, cid, previous, self.cache.skipped) if previous else None
        if branch is not None:
            view, cid = branch, f"{cid[:100]}.fork-{secrets.token_hex(6)}"
        else:
            view = (await (self.cache.load(store, cid) if whole else self._load(store, cid))).copy()
        if expired(view, self.settings.sessions.ttl, self.clock()):
            return ConversationView(), cid
        others = functools.partial(self.cache.load, store, keep=False)
        stale = await stale_recap_sources(store, others, view)
        if stale:
            view.apply_marker(withdrawal(stale))
        return view, cid
