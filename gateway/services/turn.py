"""One turn's state while it runs, and the steps of a turn that need no service.

Those steps: taking the conversation's lock (and forking for `previous_response_id`), settling a
commit, and the `response` record."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TypeVar, cast

import orjson

from gateway.context import ConversationView, Turn, clean_message, split_system
from gateway.context.accounting import prompt_accounting
from gateway.context.lifecycle import zone
from gateway.context.recap_text import is_recap, recap_conversations
from gateway.context.reconcile import Reconciled
from gateway.context.steps import Head
from gateway.context.tail import checkpoint
from gateway.exceptions import (
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    NotFound,
    UpstreamStatusError,
)
from gateway.services.cache import ConversationCache
from gateway.services.models import ModelFacts
from gateway.services.planning import ContextPlan, TurnInputs
from gateway.services.requests import FORBIDDEN_FIELDS, GATEWAY_FIELDS, OWN, ChatRequest
from gateway.store.base import ResponseLog, Store
from gateway.types import JSONObject, Message, Record, Timings, Usage
from gateway.upstream import Route
from gateway.writers import writer

T = TypeVar("T")
log = logging.getLogger("gateway.services")


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """What a closed turn came to, for the caller's log line, metrics and reply.

    Returned by `ChatService.close`, the same value however often a turn is closed."""

    response_id: str
    conversation_id: str | None
    model: str
    provider: str
    stream: bool
    committed: bool
    message: Message | None  # the stored answer (None unless committed)
    finish_reason: str | None
    created: float | None
    new_messages: int
    sent_messages: int
    elapsed_ms: float
    usage: Usage | None
    timings: Timings | None
    window_tokens: dict[str, int] | None  # what the planner counted, by part (None: stateless)
    budget: int | None
    truncated: int | None  # messages left out of the window
    summary_version: int | None
    upstream_truncated: bool  # the provider counted far fewer prompt tokens than were sent
    stored_messages: int | None = None  # as the context snapshot says (None: stateless)
    included_response_ids: list[str] | None = None
    output_tokens: int | None = None  # our count of the answer (None: not counted)
    prompt_counted: int | None = None  # a stateless prompt the provider did not count: ours
    error: GatewayError | None = None  # why it was not stored, when a GatewayError says so
    cache: JSONObject | None = None  # the provider's prompt and cached-token figures (accounting)
    upstream_body: JSONObject | None = None  # what the provider was sent: its model, parameters, messages
    response_model: str | None = None  # the model the provider says answered
    served: JSONObject | None = None  # how the provider says it served it (`stream.served_by`)
    cut: bool | None = None  # this turn moved the window's head (None: stateless)
    summary_covers: int | None = None  # history messages the summary sent stands for
    recap: bool = False  # an "earlier today" recap was sent
    context_window: int | None = None  # the window planned for, as the context snapshot says
    calibration: JSONObject | None = None  # the token-count calibration it was planned with
    started_ns: int | None = None  # when the turn began, wall clock (`elapsed_ms` later it closed)

    @property
    def prompt_ours(self) -> int | None:
        """Our count of the prompt sent: the window planned, else a stateless prompt's (None: none)."""
        return (self.window_tokens or {}).get("total", self.prompt_counted)


@dataclass(slots=True)
class PreparedTurn:
    """Everything decided before the provider is called; the service's own working state.

    Callers read only its identity: `response_id`, `conversation_id`. Closing it releases the
    lock and gives the `TurnOutcome`."""

    request: ChatRequest
    response_id: str
    route: Route
    upstream_body: JSONObject
    log: ResponseLog
    new: list[Message]
    system_in: list[Message] | None
    stack: AsyncExitStack
    started: float = field(default_factory=time.perf_counter)
    # The same moment on the wall clock, read then: provider calls' spans are timed on it, and a
    # start counted back from the close would move with any step of that clock meanwhile.
    started_ns: int = field(default_factory=time.time_ns)
    upstream_started: float = 0.0
    done: bool = False
    commit_task: asyncio.Future[None] | None = None
    encoding: str | None = None
    new_tokens: list[int] | None = None
    system_tokens: list[int] | None = None
    plan: ContextPlan | None = None
    store: Store | None = None
    created: float | None = None
    timings: Timings | None = None
    usage: Usage | None = None
    upstream_truncated: bool = False
    recap: Message | None = None
    final_message: Message | None = None
    output_tokens: int | None = None
    prompt_counted: int | None = None  # stateless, the provider's count missing: ours (metrics)
    finish_reason: str | None = None
    first_of_user: str | None = None  # a new conversation of this end user: index it for recaps
    replan: Callable[..., Awaitable[ContextPlan]] | None = None  # after a provider's refusal (hold=False)
    refits: int = 0
    tenant: str = ""
    branch_at: int | None = None  # history cut back here first (the client's version diverged)
    view: ConversationView | None = None
    outcome: TurnOutcome | None = None  # set by the first close
    context: Record | None = None  # the window sent: its latest context snapshot
    cache: JSONObject | None = None  # the provider's prompt and cached-token figures
    response_model: str | None = None  # the model the provider says answered
    served: JSONObject | None = None  # how the provider says it served it (`stream.served_by`)

    @property
    def waited_on_provider(self) -> float:
        """Seconds its plan waited on the provider (its window asked), off the call's deadline."""
        return self.plan.facts.waited if self.plan is not None and self.plan.facts is not None else 0.0

    def note_context(self, snapshot: Record) -> None:
        """Log the window sent (the context snapshot); the turn's log line repeats its counts."""
        self.log.append(snapshot)
        self.context = snapshot

    def close_outcome(self, committed: bool, error: GatewayError | None = None) -> TurnOutcome:
        plan = self.plan
        elapsed = time.perf_counter() - self.started
        messages = self.upstream_body.get("messages")
        context = self.context or {}
        stored, included = context.get("stored_messages"), context.get("included_response_ids")
        cut, covers = context.get("cut"), context.get("summary_covers_messages")
        return TurnOutcome(
            response_id=self.response_id,
            conversation_id=self.conversation_id,
            model=self.request.model,
            provider=self.route.provider,
            stream=self.request.stream,
            committed=committed,
            message=self.final_message if committed else None,
            finish_reason=self.finish_reason if committed else None,
            created=self.created,
            new_messages=len(self.new),
            sent_messages=len(messages) if isinstance(messages, list) else 0,
            elapsed_ms=round(elapsed * 1000, 3),
            started_ns=self.started_ns,
            usage=self.usage,
            timings=self.timings,
            window_tokens=dict(plan.window.tokens) if plan is not None else None,
            budget=plan.window.budget if plan is not None else None,
            truncated=plan.window.omitted if plan is not None else None,
            summary_version=plan.summary.version if plan is not None and plan.summary else None,
            upstream_truncated=self.upstream_truncated,
            stored_messages=stored if isinstance(stored, int) else None,
            included_response_ids=included if isinstance(included, list) else None,
            output_tokens=self.output_tokens,
            prompt_counted=self.prompt_counted,
            error=error,
            cache=self.cache,
            upstream_body=self.upstream_body,
            response_model=self.response_model,
            served=self.served,
            cut=cut if isinstance(cut, bool) else None,
            summary_covers=covers if isinstance(covers, int) and covers > 0 else None,
            recap=context.get("recap") is True,
            context_window=window if isinstance(window := context.get("context_window"), int) else None,
            calibration=calibration if isinstance(calibration := context.get("calibration"), dict) else None,
        )

    @property
    def conversation_id(self) -> str | None:
        return self.request.conversation_id

    def closed(self) -> TurnOutcome:
        """The outcome of the closed turn.

        Its owner closed it: `ChatService.closing`, or the end of its `TurnStream`."""
        if self.outcome is None:
            raise RuntimeError(f"turn {self.response_id} is not closed")
        return self.outcome

    @property
    def planned_tokens(self) -> int | None:
        """The prompt as the window plan counted it, in the gateway's count.

        None: a stateless turn, not planned."""
        return self.plan.window.total_tokens if self.plan is not None else None


DELETIONS = ("delete_item", "delete_response")


@dataclass(frozen=True, slots=True)
class BranchAt:
    """Where a turn continuing an earlier response branches: the conversation's index up to that
    response (`end` entries), and the deletions made since of what the branch shares."""

    end: int
    deletions: list[JSONObject]


def branch_at(index: list[str | Record], previous: str) -> BranchAt | None:
    """Where a turn continuing `previous` branches from the conversation `index` is of; None when
    it goes on in the conversation itself.

    It goes on when `previous` is the newest response (a deleted one is no longer in the
    conversation: the one before it may be its newest), unless a reset since emptied the
    conversation: the turn's history is the response's, as a branch made at it has."""
    deleted = {
        m.get("response_id") for m in index if isinstance(m, dict) and m.get("type") == "delete_response"
    }
    ids = [e for e in index if isinstance(e, str) and e not in deleted]
    if previous not in ids:
        raise NotFound(
            f"Response {previous!r} is no longer part of a conversation", param="previous_response_id"
        )
    end = index.index(previous) + 1
    later = [m for m in index[end:] if isinstance(m, dict)]
    if ids[-1] == previous and not any(m.get("type") == "reset" for m in later):
        return None
    shared = set(ids[: ids.index(previous) + 1])
    return BranchAt(end, [m for m in later if m.get("type") in DELETIONS and m.get("response_id") in shared])


async def lock_conversation(request: ChatRequest, store: Store, stack: AsyncExitStack, timeout: float) -> str:
    """Lock the request's conversation (held until the turn closes) and return its id.

    With `previous_response_id`: when the turn does not go on in that response's conversation
    (`branch_at`), it moves to a fork made at it; decided under the lock, so a turn landing
    meanwhile cannot slip in."""
    cid = request.conversation_id
    assert cid is not None
    previous = request.previous_response_id
    if previous is None:
        await stack.enter_async_context(store.lock(cid, timeout))
        return cid
    async with AsyncExitStack() as source:
        await source.enter_async_context(store.lock(cid, timeout))
        branch = branch_at(await store.read_index(cid), previous)
        if branch is None:
            stack.push_async_exit(source.pop_all())
            return cid
        fork = f"{cid[:100]}.fork-{secrets.token_hex(6)}"
        await stack.enter_async_context(store.lock(fork, timeout))
        await store.fork(cid, fork, previous)
        for marker in branch.deletions:  # (the fork keeps them)
            await store.append_marker(fork, marker)
    request.conversation_id = fork
    return fork


def timings_until_now(turn: PreparedTurn) -> Timings:
    """The provider's time since the turn's call began, and the turn's whole time, until now."""
    end = time.perf_counter()
    return {
        "upstream_ms": round((end - turn.upstream_started) * 1000, 3),
        "total_ms": round((end - turn.started) * 1000, 3),
    }


@dataclass(frozen=True, slots=True)
class Planned:
    """What a turn decided before its response log opens: what is new, and the window for it."""

    view: ConversationView
    new: list[Message]
    system_in: list[Message]
    encoding: str | None = None
    new_tokens: list[int] | None = None
    system_tokens: list[int] | None = None
    branch: Reconciled | None = None  # the client's history diverged: where, and which kind
    recap: Message | None = None  # the recap this turn starts its conversation with
    recap_from: list[str] = field(default_factory=list)
    inputs: TurnInputs | None = None  # (None: a stateless request, nothing planned)
    plan: ContextPlan | None = None

    @classmethod
    def stateless(cls, request: ChatRequest) -> Planned:
        system_in, rest = split_system(request.messages)
        return cls(view=ConversationView(), new=list(rest), system_in=system_in)

    @property
    def sent(self) -> list[Message]:
        """The messages the provider gets."""
        if self.plan is None:
            return [clean_message(m) for m in [*self.system_in, *self.new]]
        return self.plan.window.messages

    def without_prefill(self, prefill: str | None) -> Planned:
        """What of the turn is stored as its input: all that is new but the client's prefill.

        A prefill (the request's last message, assistant text, which the answer goes on from)
        is stored as the beginning of the answer (`with_prefill`), so that the conversation
        goes on as one assistant message, not two in a row."""
        last = self.new[-1] if self.new else None
        if (
            prefill is None
            or last is None
            or last.get("role") != "assistant"
            or last.get("content") != prefill
        ):
            return self
        tokens = self.new_tokens[:-1] if self.new_tokens is not None else None
        return dataclasses.replace(self, new=self.new[:-1], new_tokens=tokens)

    @property
    def stored_system(self) -> list[Message] | None:
        """The system prompt this turn sets, when it changes the stored one."""
        return self.system_in if self.system_in and self.system_in != self.view.system else None


def check_timezone(request: ChatRequest, default: str) -> None:
    """`user_timezone`, when sent, names an IANA zone (a 400 otherwise)."""
    value = request.body.get("user_timezone")
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidRequest("'user_timezone' must be an IANA zone name", param="user_timezone")
    zone(value, default)


def client_params(request: ChatRequest) -> JSONObject:
    """The client's parameters a provider may see (gateway-only and forbidden fields left out).

    Forbidden and gateway-only fields are left out of a literal `extra_body` object too (the SDK
    merges its `extra_body` into the request; a client that sends the field itself is passed
    on)."""
    params = {
        k: v
        for k, v in request.body.items()
        if k not in GATEWAY_FIELDS and k not in FORBIDDEN_FIELDS and k != "messages" and not k.startswith(OWN)
    }
    nested = params.get("extra_body")
    if isinstance(nested, dict) and not _NOT_NESTED.isdisjoint(nested):
        params["extra_body"] = {k: v for k, v in nested.items() if k not in _NOT_NESTED}
    return params


# Left out of a literal `extra_body` too: the forbidden fields, and the gateway's own (a client
# that meant them for the gateway sent them where the SDK would not have).
_NOT_NESTED = FORBIDDEN_FIELDS | GATEWAY_FIELDS


def request_record(
    request: ChatRequest, response_id: str, route: Route, cid: str | None, created: float, planned: Planned
) -> Record:
    """The `request` record a response log opens with."""
    params = client_params(request)
    record: Record = {
        "type": "request",
        "response_id": response_id,
        "conversation_id": cid,
        "created": created,
        "writer": writer(),  # host/pid/start: a reader can tell an attempt whose process died
        "model": request.model,
        "provider": route.provider,
        "upstream_model": route.model,
        "stream": request.stream,
        "params": {k: v for k, v in params.items() if k != "model"},
        "system": planned.stored_system,
        "input": planned.new,
    }
    if cid is not None:
        record["before"] = checkpoint(planned.view)  # lets a later load start at this turn
    if planned.recap is not None:
        record["recap"] = planned.recap
        record["recap_conversations"] = planned.recap_from
    branch = planned.branch
    if branch is not None:
        record["branch_at"] = branch.branch_at  # the client's history diverged here
        record["branch"] = "regenerated" if branch.regenerated else "edited"
        if branch.left_from is not None:  # the first stored message it leaves behind
            rid, position = branch.left_from
            record["branch_left"] = {"response_id": rid, "position": position}
    if request.echo is not None:
        record["responses"] = request.echo
    if request.from_messages_api:
        record["api"] = "messages"
    if isinstance(request.body.get("user_timezone"), str):
        record["user_timezone"] = request.body["user_timezone"]
    if planned.new_tokens is not None:
        record["encoding"] = planned.encoding
        record["input_tokens"] = planned.new_tokens
        if planned.stored_system is not None:
            record["system_tokens"] = planned.system_tokens
    return record


def context_snapshot(planned: Planned, response_id: str) -> Record:
    """The `context` record: the window sent and the figures behind it (SPEC section 7)."""
    sent, view, plan = planned.sent, planned.view, planned.plan
    if plan is None:
        return {
            "type": "context",
            "stateless": True,
            "new_messages": len(planned.new),
            "sent_messages": len(sent),
            "messages": sent,
        }
    snapshot = plan.snapshot(view, len(planned.new), sent, response_id)
    recapped = planned.recap or view.recap
    # The conversations of the recap as sent (sized to this window: maybe fewer).
    sent_recap = next((m for m in sent if is_recap(m)), None) if recapped else None
    snapshot["recap_conversations"] = recap_conversations(sent_recap) if sent_recap else None
    snapshot["recap"] = bool(recapped)
    return snapshot


def response_record(
    turn: PreparedTurn,
    message: Message,
    finish_reason: object,
    usage: object,
    raw: object = None,
    provider_timings: object = None,
    served: JSONObject | None = None,
    text_after: int | None = None,
) -> Record:
    """The `response` record; `provider_timings`: llama.cpp's `timings`, with its cache figures;
    `served`: how the provider served it (`stream.served_by`); `text_after`: how many calls a
    stream gave before the text (the Responses API lists them first)."""
    timings = timings_until_now(turn)
    record: Record = {
        "type": "response",
        "message": message,
        "finish_reason": finish_reason,
        "usage": usage,
        "timings": timings,
    }
    if served is not None:
        record["served"] = turn.served = served
    if text_after:
        record["text_after_calls"] = text_after
    if raw is not None and raw != message:
        record["upstream_message"] = raw
    turn.cache = prompt_accounting(usage, provider_timings)
    if turn.cache is not None:
        record["cache"] = turn.cache
    if turn.context is not None and "window_from" in turn.context:
        # The head the window had, for the next turn (a turn is read back without its context).
        record["head"] = {k: turn.context.get(k) for k in ("window_from", "summary_version")}
    turn.timings = timings
    turn.usage = cast(Usage, usage) if isinstance(usage, dict) else None
    turn.finish_reason = finish_reason if isinstance(finish_reason, str) else None
    return record


def expired(view: ConversationView, ttl: float, now: float) -> bool:
    """`sessions.ttl`: has the conversation been idle longer than that (0: never expires)?"""
    return ttl > 0 and view.last_activity is not None and view.turns > 0 and now - view.last_activity > ttl


async def archive_expired(store: Store, cache: ConversationCache, cid: str) -> ConversationView:
    """Archive an expired conversation when it is next used; the request then starts it afresh.

    This runs under the conversation's lock: not only the background pass does it."""
    await store.delete_conversation(cid, archive=True)
    cache.forget(store, cid)
    log.info(orjson.dumps({"event": "conversation_expired", "conversation_id": cid}).decode())
    return ConversationView()


def has_uncounted_parts(messages: list[Message]) -> bool:
    """Does a message hold a part other than text (an image, a file), which a provider counts
    its own way (an image: hundreds to thousands of tokens) and the gateway only estimates?"""
    return any(
        isinstance(part, dict) and part.get("type") != "text"
        for message in messages
        if isinstance(content := message.get("content"), list)
        for part in content
    )


async def refit(
    turn: PreparedTurn, exc: UpstreamStatusError, facts: ModelFacts, on_refusal: Callable[[str], None]
) -> None:
    """Act on the provider's refusal of the prompt as too long.

    Learn what it said, plan the window again and let the caller retry once; else raise a 400
    context_length_exceeded."""
    refusal = exc.refusal
    assert refusal is not None
    plan = turn.plan
    window = plan.context_window if plan is not None else (refusal.window or 0)
    ours = plan.window.total_tokens if plan is not None else 0
    sent = plan.window.messages if plan is not None else []
    this_prompt = facts.refused(turn.route, ours, refusal, window, uncounted=has_uncounted_parts(sent))
    log.warning(
        orjson.dumps(
            {
                "event": "context_refused",
                "response_id": turn.response_id,
                "conversation_id": turn.conversation_id,
                "provider": turn.route.provider,
                "planned_window": window,
                "our_count": ours,
                "provider_window": refusal.window,
                "provider_count": refusal.prompt_tokens,
                "retry": turn.replan is not None and turn.refits == 0,
                "retry_window": this_prompt,
            }
        ).decode()
    )
    if turn.replan is None or turn.refits > 0 or turn.view is None:
        on_refusal("refused")
        raise ContextLengthExceeded(
            f"The provider refused the prompt as too long for the model's context window: {exc.message}",
            param="messages",
        ) from exc
    turn.refits += 1
    try:
        # ContextLengthExceeded if the request alone cannot fit
        plan = await turn.replan(hold=False, cap=this_prompt)
    except ContextLengthExceeded:
        on_refusal("refused")  # no second call: the client gets the 400
        raise
    on_refusal("retried")
    turn.plan = plan
    turn.upstream_body["messages"] = plan.window.messages
    options = turn.upstream_body.get("options")
    if plan.facts is not None and plan.facts.num_ctx_option and isinstance(options, dict):
        options["num_ctx"] = plan.facts.tokens
    snapshot = plan.snapshot(turn.view, len(turn.new), plan.window.messages, turn.response_id)
    snapshot["after_refusal"] = {"message": refusal.message[:500], "window": refusal.window}
    turn.note_context(snapshot)


def with_prefill(prefill: str | None, message: Message) -> Message:
    """The answer as stored: the client's prefill (`ChatRequest.prefill`), then what the model added.

    An answer that begins with the prefill has it already: llama.cpp says it again in a whole
    answer (not in a stream)."""
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if not prefill or text.startswith(prefill):
        return message
    return {**message, "content": prefill + text}


def added_to(prefill: str | None, message: Message | None) -> Message | None:
    """What the model added to the client's prefill: its answer without the prefill said again."""
    content = message.get("content") if message is not None else None
    if not prefill or message is None or not isinstance(content, str) or not content.startswith(prefill):
        return message
    return {**message, "content": content[len(prefill) :]}


def stored_turn(turn: PreparedTurn, message: Message, output_tokens: int | None) -> Turn:
    """The turn as the conversation's view takes it once committed (what its log records)."""
    body = turn.request.body
    return Turn(
        turn.response_id,
        tuple(turn.new),
        message,
        tuple(turn.system_in) if turn.system_in is not None else None,
        encoding=turn.encoding if turn.new_tokens is not None else None,
        input_tokens=tuple(turn.new_tokens) if turn.new_tokens is not None else None,
        output_tokens=output_tokens,
        system_tokens=tuple(turn.system_tokens) if turn.system_tokens is not None else None,
        created=turn.created,
        model=turn.request.model,
        user=turn.request.end_user,
        recap=turn.recap,
        timezone=body.get("user_timezone") if isinstance(body.get("user_timezone"), str) else None,
        branch_at=turn.branch_at,
        head=Head.of(turn.context) if turn.context is not None else None,  # (as `head` records it)
    )
