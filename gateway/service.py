"""The one place that wires store + context + upstream for a chat-completions turn.

A turn: validate → lock the conversation → load its view → work out what is new → build the
upstream message list → call the provider → record the reply → commit (response log durable,
then index) → release. Anything that fails or is cancelled is abandoned: it stays in its
response log marked incomplete and never enters history.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config import Settings
from gateway.context import (
    ConversationView,
    Message,
    Turn,
    clean_message,
    new_messages,
    repair_tool_calls,
    split_system,
)
from gateway.context.window import REQUEST_OVERHEAD_TOKENS, Window, fit_window, omitted_marker
from gateway.exceptions import (
    ContextLengthExceeded,
    ConversationTooLarge,
    GatewayError,
    InvalidRequest,
    NotFound,
    UpstreamProtocolError,
    UpstreamStatusError,
)
from gateway.ids import check_conversation_id, mint_response_id
from gateway.lifecycle import build_recap, user_key, zone
from gateway.models import ModelFacts, WindowFacts
from gateway.store.base import ResponseLog, Store
from gateway.summarizer import Summarizer, Summary, current_summary, snap_to_turn_end
from gateway.tokens import count_message, counter_for, truncate_text
from gateway.upstream import Route, Router

log = logging.getLogger("gateway.service")

# Consumed by the gateway, never forwarded (providers that validate arguments reject them).
GATEWAY_FIELDS = frozenset({"conversation_id", "session_id", "agent_id", "response_id", "user_timezone"})
# Never forwarded: a client must not redirect the gateway or choose its credentials.
FORBIDDEN_FIELDS = frozenset({"api_base", "base_url", "api_key", "api_version", "extra_headers"})
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_OUTPUT_FIELDS = ("role", "content", "tool_calls", "function_call", "name", "refusal")
# Counting more text than this runs in a worker thread, off the event loop.
_COUNT_OFF_LOOP_CHARS = 20_000
# A provider reporting fewer prompt tokens than this share of ours probably cut the prompt.
_TRUNCATION_RATIO = 0.7
_TRUNCATION_MIN_TOKENS = 256
# A summary or recap squeezed below this many tokens is left out instead.
_MIN_SIZED_TOKENS = 24


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


def _size(messages: list[Message]) -> int:
    total = 0
    for m in messages:
        content = m.get("content")
        total += len(content) if isinstance(content, str) else len(orjson.dumps(content))
    return total


async def _off_loop_if_large(messages: list[Message], work: Callable[[], Any]) -> Any:
    if _size(messages) > _COUNT_OFF_LOOP_CHARS:
        return await asyncio.to_thread(work)
    return work()


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

    def snapshot(self, view: ConversationView, new_messages: int, sent: list[Message]) -> dict[str, Any]:
        included = list(dict.fromkeys(view.history_owner[self.kept_from :]))
        return {
            "type": "context",
            "encoding": self.encoding,
            "context_window": self.context_window,
            "context_window_source": self.facts.source if self.facts else None,
            "calibration": self.facts.calibration.to_dict() if self.facts else None,
            "reserve_tokens": self.reserve,
            "budget": self.window.budget,
            "stored_messages": len(view.history) + len(view.system or []),
            "stored_turns": view.turns,
            "new_messages": new_messages,
            "sent_messages": len(sent),
            "truncated": self.window.omitted,
            "tokens": self.window.tokens,
            "summary_version": self.summary.version if self.summary else None,
            "summary_covers_messages": self.summary.covered if self.summary else 0,
            "summary_covers_through": self.summary.covers_through if self.summary else None,
            "included_response_ids": included,
            "messages": sent,
        }


def check_size(cap: int, cid: str, view: ConversationView, adding: int) -> None:
    """A conversation past the cap gets a clear 400 instead of an ever slower load."""
    stored = len(view.transcript)
    if cap and stored + adding > cap:
        raise ConversationTooLarge(
            f"Conversation {cid!r} holds {stored} messages; this turn would take it past the cap of "
            f"{cap} (storage.max_conversation_messages). Reset it (POST /v1/conversations/{cid}/reset) "
            "or start a new conversation.",
            param="conversation_id",
        )


def _check_message_fields(m: dict[str, Any], i: int) -> None:
    """The shapes OpenAI itself enforces, so nothing malformed is stored and replayed later."""
    content = m.get("content")
    if content is not None and not isinstance(content, str):  # noqa: SIM102 - one rule, one error
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            raise InvalidRequest(
                f"messages[{i}].content must be a string, an array of content parts, or null",
                param=f"messages[{i}].content",
            )
    for key in ("name", "tool_call_id"):
        if key in m and m[key] is not None and not isinstance(m[key], str):
            raise InvalidRequest(f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidRequest(
            f"messages[{i}].tool_call_id is required for a tool message", param=f"messages[{i}].tool_call_id"
        )
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(
                f"messages[{i}].tool_calls must be an array on an assistant message",
                param=f"messages[{i}].tool_calls",
            )
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(call, dict)
                or not isinstance(call.get("id"), str)
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), str)
            ):
                raise InvalidRequest(
                    f"messages[{i}].tool_calls[{j}] must be "
                    "{id, type: 'function', function: {name, arguments}}",
                    param=f"messages[{i}].tool_calls[{j}]",
                )


@dataclass(slots=True)
class ChatRequest:
    """A validated chat-completions request."""

    body: dict[str, Any]
    model: str
    messages: list[Message]
    stream: bool
    include_usage: bool
    conversation_id: str | None
    # Continue from this response (Responses API): from the conversation's newest response, or
    # from a fork made at an older one. Decided under the conversation's lock.
    previous_response_id: str | None = None

    @classmethod
    def parse(cls, body: Any, *, header_conversation_id: str | None = None) -> ChatRequest:
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty array", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
            role = m.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role must be one of {', '.join(sorted(MESSAGE_ROLES))}",
                    param=f"messages[{i}].role",
                )
            _check_message_fields(m, i)
            if "is_feedback" in m and not isinstance(m["is_feedback"], bool):
                raise InvalidRequest(
                    f"messages[{i}].is_feedback must be a boolean", param=f"messages[{i}].is_feedback"
                )
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean", param="stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        include_usage = bool((options or {}).get("include_usage"))
        cid: str | None = None
        if body.get("conversation_id") is not None:
            cid = check_conversation_id(body["conversation_id"], param="conversation_id")
        elif header_conversation_id is not None:
            cid = check_conversation_id(header_conversation_id, param="X-Conversation-Id")
        elif body.get("session_id") is not None:
            cid = check_conversation_id(body["session_id"], param="session_id")
        elif body.get("agent_id") is not None:
            cid = check_conversation_id(body["agent_id"], param="agent_id")
        return cls(body, model, messages, stream, include_usage, cid)


@dataclass(slots=True)
class PreparedTurn:
    """Everything decided before the provider is called; closing it releases the lock."""

    request: ChatRequest
    response_id: str
    route: Route
    upstream_body: dict[str, Any]
    log: ResponseLog
    new: list[Message]
    system_in: list[Message] | None
    stack: AsyncExitStack
    started: float = field(default_factory=time.perf_counter)
    upstream_started: float = 0.0
    done: bool = False
    commit_task: asyncio.Future[None] | None = None
    encoding: str | None = None
    new_tokens: list[int] | None = None
    system_tokens: list[int] | None = None
    plan: ContextPlan | None = None
    store: Store | None = None
    created: float | None = None
    timings: dict[str, float] | None = None
    usage: dict[str, Any] | None = None
    upstream_truncated: bool = False
    recap: Message | None = None
    final_message: Message | None = None
    finish_reason: str | None = None
    first_of_user: str | None = None  # a new conversation of this end user: index it for recaps
    replan: Callable[[], Awaitable[ContextPlan]] | None = None  # after a provider's refusal
    refits: int = 0
    view: ConversationView | None = None

    @property
    def conversation_id(self) -> str | None:
        return self.request.conversation_id


def output_message(message: Any) -> Message:
    """The assistant message as it will be replayed: known fields, nulls dropped."""
    if not isinstance(message, dict):
        raise UpstreamProtocolError("The provider's reply has no message")
    out: Message = {"role": "assistant"}
    for key in _OUTPUT_FIELDS[1:]:
        value = message.get(key)
        if value is not None and value != []:
            out[key] = value
    if "tool_calls" in out:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": c.get("type") or "function", "function": c.get("function")}
            for c in out["tool_calls"]
            if isinstance(c, dict)
        ]
        out.setdefault("content", None)
    else:
        out.setdefault("content", "")
    return out


class StreamAccumulator:
    """Rebuilds the assistant message of choice 0 from a chunk stream."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                self.refusal.append(delta["refusal"])
            for call in delta.get("tool_calls") or ():
                slot = self.tool_calls.setdefault(
                    int(call.get("index", 0)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                if call.get("type"):
                    slot["type"] = call["type"]
                fn = call.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def message(self) -> Message:
        message: Message = {"role": "assistant", "content": "".join(self.content)}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            if not message["content"]:
                message["content"] = None
        return message


async def _settle(task: asyncio.Future[None]) -> None:
    """Wait for a commit to finish even while being cancelled: the conversation lock must not
    be released before the turn is on disk, or the next request would miss it."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 - the commit's own caller reports it
            break
    if cancelled:
        raise asyncio.CancelledError()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChatService:
    def __init__(self, settings: Settings, router: Router, summarizer: Summarizer | None = None) -> None:
        self.settings = settings
        self.router = router
        self.facts = summarizer.facts if summarizer is not None else ModelFacts(settings)
        self.summarizer = summarizer or Summarizer(settings, router, facts=self.facts)
        self._warned_truncation: set[str | None] = set()
        self.clock: Callable[[], float] = time.time
        self.warm_up: asyncio.Future[Any] | None = None  # tokenizer loading, set at startup
        self.on_context_refusal: Callable[[str], None] = lambda outcome: None  # metrics hook

    # -- preparing ----------------------------------------------------------------------------
    async def prepare(self, request: ChatRequest, store: Store) -> PreparedTurn:
        """Lock and load the conversation, fit the window, and open the response log.
        The caller must `close` the returned turn."""
        store.refuse_if_failed()  # before the provider is asked for an answer nobody could keep
        route = self.router.resolve(request.model)
        response_id = mint_response_id(request.model)
        stack = AsyncExitStack()
        try:
            cid = request.conversation_id
            view = ConversationView()
            if cid is not None:
                cid = await self._lock_conversation(request, store, stack)
                view = await store.load(cid)
            system_in, rest = split_system(request.messages)
            recap: Message | None = None
            recap_from: list[str] = []
            if request.body.get("user_timezone") is not None:
                if not isinstance(request.body["user_timezone"], str):
                    raise InvalidRequest("'user_timezone' must be an IANA zone name", param="user_timezone")
                zone(request.body["user_timezone"], self.settings.sessions.default_timezone)
            if self.warm_up is not None and not self.warm_up.done():
                await asyncio.shield(self.warm_up)  # never load a tokenizer on the event loop
            encoding, count = counter_for(request.model)
            plan: ContextPlan | None = None
            if cid is None:
                new = list(rest)
                sent = [clean_message(m) for m in request.messages]
                new_tokens: list[int] | None = None
                system_tokens: list[int] | None = None
            else:
                new = new_messages(rest, view)
                # + 1: the reply this turn would store
                check_size(self.settings.storage.max_conversation_messages, cid, view, len(new) + 1)
                new_tokens = await _off_loop_if_large(
                    [*system_in, *new], lambda: [count(clean_message(m)) for m in new]
                )
                system_tokens = [count(m) for m in system_in] if system_in else None
                if view.turns == 0:
                    recap, recap_from = await self._recap(request, store, cid, count)
                replan = functools.partial(
                    self._plan,
                    request,
                    route,
                    view,
                    store,
                    cid,
                    system_in,
                    system_tokens,
                    new,
                    new_tokens,
                    encoding,
                    count,
                    recap or view.recap,
                )
                plan = await replan()
                sent = plan.window.messages
            stored_system = system_in if system_in and system_in != view.system else None
            params = {
                k: v
                for k, v in request.body.items()
                if k not in GATEWAY_FIELDS and k not in FORBIDDEN_FIELDS and k != "messages"
            }
            upstream_body = {**params, "model": route.model, "messages": sent}
            if plan is not None and plan.facts is not None and plan.facts.num_ctx_option:
                # Ollama cuts prompts to its runtime num_ctx silently: say the window planned for.
                options = upstream_body.get("options")
                if options is None or (isinstance(options, dict) and "num_ctx" not in options):
                    upstream_body["options"] = {**(options or {}), "num_ctx": plan.facts.tokens}
            record: dict[str, Any] = {
                "type": "request",
                "response_id": response_id,
                "conversation_id": cid,
                "created": self.clock(),
                "model": request.model,
                "provider": route.provider,
                "upstream_model": route.model,
                "stream": request.stream,
                "params": {k: v for k, v in params.items() if k != "model"},
                "system": stored_system,
                "input": new,
            }
            if recap is not None:
                record["recap"] = recap
                record["recap_conversations"] = recap_from
            if isinstance(request.body.get("user_timezone"), str):
                record["user_timezone"] = request.body["user_timezone"]
            if new_tokens is not None:
                record["encoding"] = encoding
                record["input_tokens"] = new_tokens
                if stored_system is not None:
                    record["system_tokens"] = system_tokens
            response_log = store.start(response_id, record)
            if plan is not None:
                snapshot = plan.snapshot(view, len(new), sent)
                snapshot["recap_conversations"] = recap_from if recap is not None else None
                snapshot["recap"] = bool(recap or view.recap)
                response_log.append(snapshot)
            else:
                response_log.append(
                    {
                        "type": "context",
                        "stateless": True,
                        "new_messages": len(new),
                        "sent_messages": len(sent),
                        "messages": sent,
                    }
                )
            turn = PreparedTurn(
                request, response_id, route, upstream_body, response_log, new, stored_system, stack
            )
            turn.encoding = encoding
            turn.new_tokens = new_tokens
            turn.system_tokens = system_tokens if stored_system is not None else None
            turn.plan = plan
            turn.store = store
            turn.view = view
            if plan is not None:
                turn.replan = replan
            turn.created = record["created"]
            turn.recap = recap
            turn.first_of_user = (
                request.body["user"]
                if view.turns == 0 and isinstance(request.body.get("user"), str)
                else None
            )
            return turn
        except BaseException:
            await stack.aclose()
            raise

    async def _lock_conversation(self, request: ChatRequest, store: Store, stack: AsyncExitStack) -> str:
        """Lock the request's conversation (held until the turn closes) and return its id. With
        `previous_response_id`: when that response is no longer the newest, the turn moves to a
        fork made at it; decided under the lock, so a turn landing meanwhile cannot slip in."""
        cid = request.conversation_id
        assert cid is not None
        timeout = self.settings.storage.lock_timeout
        previous = request.previous_response_id
        if previous is None:
            await stack.enter_async_context(store.lock(cid, timeout))
            return cid
        async with AsyncExitStack() as source:
            await source.enter_async_context(store.lock(cid, timeout))
            ids = [e for e in await store.read_index(cid) if isinstance(e, str)]
            if ids and ids[-1] == previous:
                stack.push_async_exit(source.pop_all())
                return cid
            if previous not in ids:
                raise NotFound(
                    f"Response {previous!r} is no longer part of a conversation", param="previous_response_id"
                )
            fork = f"{cid[:100]}.fork-{secrets.token_hex(6)}"
            await stack.enter_async_context(store.lock(fork, timeout))
            await store.fork(cid, fork, previous)
        request.conversation_id = fork
        return fork

    async def _plan(
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
    ) -> ContextPlan:
        """Decide what of the stored conversation goes upstream (SPEC section 7)."""
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
        summary = None
        if ctx.strategy == "summarize":
            summary = current_summary(await store.read_summaries(cid), view)
        covered = summary.covered if summary else 0
        history = view.history
        # The first unit, kept ahead of the cut when configured and no summary covers it.
        first_end = 0
        if ctx.keep_first and covered == 0 and history:
            first_end = 1
            while first_end < len(history) and history[first_end].get("role") == "tool":
                first_end += 1
        # Only the newest max_history_messages (or keep_recent_messages) can be sent.
        newest = max(ctx.max_history_messages, ctx.keep_recent_messages)
        lower = max(covered, first_end, len(history) - newest - 1)
        while lower > max(covered, first_end) and history[lower].get("role") == "tool":
            lower -= 1
        hist = history[lower:]
        hist_tokens = [int(n or 0) for n in view.history_tokens[lower:]]
        clean_new = [clean_message(m) for m in new]
        combined = [*hist, *clean_new]
        repaired = view.has_tools or any("tool_calls" in m or m.get("role") == "tool" for m in clean_new)
        if repaired:
            known = {id(m): n for m, n in zip(combined, [*hist_tokens, *new_tokens], strict=True)}
            conversation = repair_tool_calls(combined)
            conversation_tokens = [known[id(m)] if id(m) in known else count(m) for m in conversation]
            new_ids = {id(m) for m in clean_new}
            first_new = next((i for i, m in enumerate(conversation) if id(m) in new_ids), len(conversation))
        else:  # no tool calls anywhere: nothing to repair
            conversation = combined
            conversation_tokens = [*hist_tokens, *new_tokens]
            first_new = len(hist)
        facts = await self.facts.window(route, request.model, store)
        window_size = facts.tokens
        requested = request.body.get("max_completion_tokens") or request.body.get("max_tokens") or 0
        requested = requested if isinstance(requested, int) and requested > 0 else 0
        # The client's own max_tokens when sent; else reserve_tokens, at most a quarter of the window.
        reserve = requested or min(ctx.reserve_tokens, window_size // 4)
        budget = facts.calibration.our_budget(window_size - reserve)
        system_msgs = [clean_message(m) for m in system]
        # Summary and recap are sized from the window: together at most half of what the
        # system prompt and the current request leave (the rest is for the newest turns).
        free = budget - REQUEST_OVERHEAD_TOKENS - sum(system_tokens) - sum(conversation_tokens[first_new:])
        summary_message, summary_tokens = self._sized(
            summary.message() if summary else None, free // 3, request.model, count
        )
        recap, recap_tokens = self._sized(recap, free // 6, request.model, count)
        first = [clean_message(m) for m in history[:first_end]] if first_end and lower > 0 else []
        window = fit_window(
            system=system_msgs,
            system_tokens=system_tokens,
            conversation=conversation,
            conversation_tokens=conversation_tokens,
            first_new=first_new,
            budget=budget,
            max_history_messages=ctx.max_history_messages,
            marker_tokens=lambda n: marker_cost(encoding, n),
            summary=summary_message,
            summary_tokens=summary_tokens,
            recap=recap,
            recap_tokens=recap_tokens,
            omitted_before=lower - covered - (first_end if first else 0),
            first=first,
            first_tokens=[count(m) for m in first],
            keep_recent=ctx.keep_recent_messages,
        )
        if repaired:
            positions = {id(m): lower + i for i, m in enumerate(hist)}
            kept_abs = next(
                (positions[id(m)] for m in conversation[window.history_start :] if id(m) in positions),
                len(history),
            )
        else:
            kept_abs = lower + min(window.history_start, len(hist))
        target = None
        if ctx.strategy == "summarize" and window.omitted > 0 and history:
            # Cover what fell out plus half of what is kept, so the next turns fit too.
            end = snap_to_turn_end(view, kept_abs + (len(history) - kept_abs) // 2)
            if end > covered:
                target = view.history_owner[end - 1]
        return ContextPlan(
            window=window,
            encoding=encoding,
            context_window=window_size,
            reserve=reserve,
            summary=summary,
            kept_from=kept_abs,
            summary_target=target,
            facts=facts,
        )

    @staticmethod
    def _sized(
        message: Message | None, limit: int, model: str, count: Callable[[Message], int]
    ) -> tuple[Message | None, int]:
        """`message` (a summary or recap) cut to at most `limit` tokens; None when too little
        room is left for it to say anything."""
        if message is None:
            return None, 0
        tokens = count(message)
        if tokens <= limit:
            return message, tokens
        if limit < _MIN_SIZED_TOKENS:
            return None, 0
        text = message.get("content")
        cut = {**message, "content": truncate_text(text, limit - 8, model) if isinstance(text, str) else ""}
        return cut, count(cut)

    async def _commit(self, turn: PreparedTurn, message: Message, record: dict[str, Any]) -> None:
        output_tokens = None
        if turn.encoding is not None and turn.new_tokens is not None:
            _, count = counter_for(turn.request.model)
            output_tokens = await _off_loop_if_large([message], lambda: count(message))
            record["message_tokens"] = output_tokens
        self._learn_from_usage(turn, record)
        turn.log.append(record)
        stored = Turn(
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
            user=turn.request.body.get("user") if isinstance(turn.request.body.get("user"), str) else None,
            recap=turn.recap,
            timezone=turn.request.body.get("user_timezone")
            if isinstance(turn.request.body.get("user_timezone"), str)
            else None,
        )
        # Shielded: a client disconnect must never interrupt the write of an answered turn.
        turn.commit_task = asyncio.ensure_future(
            turn.log.commit(turn.conversation_id, stored if turn.conversation_id else None)
        )
        await asyncio.shield(turn.commit_task)
        turn.done = True

    async def close(self, turn: PreparedTurn, exc: BaseException | None = None) -> None:
        """Abandon the turn unless it was committed, then release the conversation."""
        try:
            if turn.commit_task is not None:
                await _settle(turn.commit_task)
                turn.done = True
            if not turn.done:
                turn.done = True
                if isinstance(exc, asyncio.CancelledError) or exc is None:
                    reason, error = "cancelled", None
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
        if turn.store is not None:
            await self.facts.save(turn.route, turn.store)
        if committed and turn.first_of_user and turn.conversation_id and turn.store is not None:
            with contextlib.suppress(GatewayError):  # the turn is safe; only recaps would miss it
                await turn.store.append_side(
                    "users",
                    user_key(turn.first_of_user),
                    {"conversation_id": turn.conversation_id, "at": turn.created},
                )
        if plan is not None and plan.summary_target and turn.conversation_id and committed and turn.store:
            self.summarizer.schedule(
                turn.store, turn.conversation_id, plan.summary_target, turn.request.model
            )

    async def _recap(
        self, request: ChatRequest, store: Store, cid: str, count: Callable[[Message], int]
    ) -> tuple[Message | None, list[str]]:
        """The "Earlier today" recap for a user's new conversation (SPEC section 8)."""
        sessions = self.settings.sessions
        user = request.body.get("user")
        if not sessions.recap or not isinstance(user, str) or not user:
            return None, []
        tz = zone(request.body.get("user_timezone"), sessions.default_timezone)
        return await build_recap(
            store, user, tz, exclude=cid, now=self.clock(), max_tokens=sessions.recap_max_tokens, count=count
        )

    def _learn_from_usage(self, turn: PreparedTurn, record: dict[str, Any]) -> None:
        """Calibrate counting from the provider's `prompt_tokens` (which already includes cached
        tokens, for OpenAI and llama.cpp alike), and flag a provider that silently dropped part
        of the prompt (Ollama's num_ctx): it saw under 70% of what it should have."""
        plan = turn.plan
        usage = record.get("usage")
        if plan is None or not isinstance(usage, dict):
            return
        theirs = usage.get("prompt_tokens")
        ours = plan.window.total_tokens
        if not isinstance(theirs, int) or isinstance(theirs, bool) or theirs <= 0:
            return
        calibration = plan.facts.calibration if plan.facts is not None else None
        expected = calibration.ratio * ours + calibration.overhead if calibration else float(ours)
        if ours < _TRUNCATION_MIN_TOKENS or theirs >= expected * _TRUNCATION_RATIO:
            self.facts.observe(turn.route, ours, theirs)
            return
        record["upstream_truncation_suspected"] = {"prompt_tokens": theirs, "our_count": ours}
        turn.upstream_truncated = True
        if turn.route.upstream.reports_real_usage:
            self.facts.truncated(turn.route, theirs)
        if turn.conversation_id in self._warned_truncation:
            return  # recorded on every response, logged once per conversation
        if len(self._warned_truncation) < 100_000:
            self._warned_truncation.add(turn.conversation_id)
        log.warning(
            orjson.dumps(
                {
                    "event": "upstream_truncation_suspected",
                    "response_id": turn.response_id,
                    "conversation_id": turn.conversation_id,
                    "provider": turn.route.provider,
                    "prompt_tokens": theirs,
                    "our_count": ours,
                }
            ).decode()
        )

    def _response_record(
        self, turn: PreparedTurn, message: Message, finish_reason: Any, usage: Any, raw: Any = None
    ) -> dict[str, Any]:
        end = time.perf_counter()
        record: dict[str, Any] = {
            "type": "response",
            "message": message,
            "finish_reason": finish_reason,
            "usage": usage,
            "timings": {
                "upstream_ms": round((end - turn.upstream_started) * 1000, 3),
                "total_ms": round((end - turn.started) * 1000, 3),
            },
        }
        if raw is not None and raw != message:
            record["upstream_message"] = raw
        turn.timings = record["timings"]
        turn.usage = usage if isinstance(usage, dict) else None
        return record

    # -- non-streaming ------------------------------------------------------------------------
    async def _refit(self, turn: PreparedTurn, exc: UpstreamStatusError) -> None:
        """The provider refused the prompt as too long: learn what it said, plan the window
        again and let the caller retry once; else a 400 context_length_exceeded."""
        refusal = exc.refusal
        assert refusal is not None
        plan = turn.plan
        window = plan.context_window if plan is not None else (refusal.window or 0)
        ours = plan.window.total_tokens if plan is not None else 0
        self.facts.refused(turn.route, ours, refusal, window)
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
                }
            ).decode()
        )
        if turn.replan is None or turn.refits > 0 or turn.view is None:
            self.on_context_refusal("refused")
            raise ContextLengthExceeded(
                f"The provider refused the prompt as too long for the model's context window: {exc.message}",
                param="messages",
            ) from exc
        turn.refits += 1
        self.on_context_refusal("retried")
        plan = await turn.replan()  # ContextLengthExceeded if the request alone cannot fit
        turn.plan = plan
        turn.upstream_body["messages"] = plan.window.messages
        options = turn.upstream_body.get("options")
        if plan.facts is not None and plan.facts.num_ctx_option and isinstance(options, dict):
            options["num_ctx"] = plan.facts.tokens
        snapshot = plan.snapshot(turn.view, len(turn.new), plan.window.messages)
        snapshot["after_refusal"] = {"message": refusal.message[:500], "window": refusal.window}
        turn.log.append(snapshot)

    async def complete(self, turn: PreparedTurn) -> dict[str, Any]:
        turn.upstream_started = time.perf_counter()
        while True:
            try:
                completion = await turn.route.upstream.complete(turn.upstream_body)
                break
            except UpstreamStatusError as exc:
                if exc.refusal is None:
                    raise
                await self._refit(turn, exc)
        choices = completion.get("choices")
        if not choices or not isinstance(choices[0], dict):
            raise UpstreamProtocolError(f"Provider {turn.route.provider!r} returned no choices")
        raw = choices[0].get("message")
        message = output_message(raw)
        record = self._response_record(
            turn, message, choices[0].get("finish_reason"), completion.get("usage"), raw
        )
        await self._commit(turn, message, record)
        turn.final_message = message
        turn.finish_reason = choices[0].get("finish_reason")
        completion["id"] = turn.response_id
        completion["model"] = turn.request.model
        if turn.conversation_id is not None:
            completion["conversation_id"] = turn.conversation_id
        return completion

    # -- streaming ----------------------------------------------------------------------------
    async def open_chunks(self, turn: PreparedTurn) -> AsyncIterator[dict[str, Any]]:
        """Start the provider's stream and wait for its first chunk, so that errors before
        the first byte still become proper HTTP statuses; then return the chunk stream, which
        commits the turn after the last chunk (and raises GatewayError on a broken stream)."""
        turn.upstream_started = time.perf_counter()
        while True:
            chunks = turn.route.upstream.stream(turn.upstream_body).__aiter__()
            try:
                first: dict[str, Any] | None = await chunks.__anext__()
                break
            except StopAsyncIteration:
                first = None
                break
            except UpstreamStatusError as exc:
                if exc.refusal is None:
                    raise
                await self._refit(turn, exc)
        return self._chunks(turn, chunks, first)

    async def open_stream(self, turn: PreparedTurn) -> AsyncIterator[bytes]:
        """open_chunks rendered as chat-completions server-sent events."""
        return self._sse(turn, await self.open_chunks(turn))

    async def _chunks(
        self, turn: PreparedTurn, chunks: AsyncIterator[dict[str, Any]], first: dict[str, Any] | None
    ) -> AsyncIterator[dict[str, Any]]:
        acc = StreamAccumulator()
        cid = turn.conversation_id
        model = turn.request.model
        try:
            chunk = first
            while chunk is not None:
                acc.add(chunk)
                chunk["id"] = turn.response_id
                chunk["model"] = model
                if cid is not None:
                    chunk["conversation_id"] = cid
                yield chunk
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    chunk = None
            if acc.finish_reason is None:
                provider = turn.route.provider
                raise UpstreamProtocolError(f"Provider {provider!r} ended the stream before finishing")
            message = acc.message()
            record = self._response_record(turn, message, acc.finish_reason, acc.usage)
            await self._commit(turn, message, record)
            turn.final_message = message
            turn.finish_reason = acc.finish_reason
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _sse(self, turn: PreparedTurn, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        include_usage = turn.request.include_usage
        try:
            async for chunk in chunks:
                if chunk.get("choices") or include_usage:
                    yield sse(chunk)
        except Exception as exc:  # noqa: BLE001 - headers are sent: every failure is reported in-band
            error = (
                exc
                if isinstance(exc, GatewayError)
                else UpstreamProtocolError(
                    f"Provider {turn.route.provider!r} sent a malformed stream ({type(exc).__name__})"
                )
            )
            if not isinstance(exc, GatewayError):
                log.warning("malformed stream from %s: %r", turn.route.provider, exc)
            # As OpenAI does: an error event, no [DONE].
            await self.close(turn, error)
            yield sse(error.to_dict())
            return
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        yield SSE_DONE
