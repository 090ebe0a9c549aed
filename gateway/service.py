"""The one place that wires store + context + upstream for a chat-completions turn.

A turn: validate → lock the conversation → load its view → work out what is new → build the
upstream message list → call the provider → record the reply → commit (response log durable,
then index) → release. Anything that fails or is cancelled is abandoned: it stays in its
response log marked incomplete and never enters history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
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
from gateway.exceptions import GatewayError, InvalidRequest, UpstreamProtocolError
from gateway.ids import check_conversation_id, mint_response_id
from gateway.store.base import ResponseLog, Store, now
from gateway.upstream import Route, Router

log = logging.getLogger("gateway.service")

GATEWAY_FIELDS = frozenset({"conversation_id", "agent_id", "user_timezone"})
# Never forwarded: a client must not redirect the gateway or choose its credentials.
FORBIDDEN_FIELDS = frozenset({"api_base", "base_url", "api_key", "api_version", "extra_headers"})
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_OUTPUT_FIELDS = ("role", "content", "tool_calls", "function_call", "name", "refusal")


@dataclass(slots=True)
class ChatRequest:
    """A validated chat-completions request."""

    body: dict[str, Any]
    model: str
    messages: list[Message]
    stream: bool
    include_usage: bool
    conversation_id: str | None

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
            if m.get("role") not in MESSAGE_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role must be one of {', '.join(sorted(MESSAGE_ROLES))}",
                    param=f"messages[{i}].role",
                )
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
    def __init__(self, settings: Settings, store: Store, router: Router) -> None:
        self.settings = settings
        self.store = store
        self.router = router

    # -- preparing ----------------------------------------------------------------------------
    async def prepare(self, request: ChatRequest) -> PreparedTurn:
        """Lock and load the conversation, and open the response log. Caller must `close`."""
        route = self.router.resolve(request.model)
        response_id = mint_response_id(request.model)
        stack = AsyncExitStack()
        try:
            cid = request.conversation_id
            view = ConversationView()
            if cid is not None:
                await stack.enter_async_context(self.store.lock(cid, self.settings.storage.lock_timeout))
                view = await self.store.load(cid)
            system_in, rest = split_system(request.messages)
            if cid is None:
                new = list(rest)
                sent = [clean_message(m) for m in request.messages]
            else:
                new = new_messages(rest, view)
                system = system_in or view.system or []
                sent = repair_tool_calls(
                    [*map(clean_message, system), *view.history, *map(clean_message, new)]
                )
            stored_system = system_in if system_in and system_in != view.system else None
            params = {
                k: v
                for k, v in request.body.items()
                if k not in GATEWAY_FIELDS and k not in FORBIDDEN_FIELDS and k != "messages"
            }
            upstream_body = {**params, "model": route.model, "messages": sent}
            record = {
                "type": "request",
                "response_id": response_id,
                "conversation_id": cid,
                "created": now(),
                "model": request.model,
                "provider": route.provider,
                "upstream_model": route.model,
                "stream": request.stream,
                "params": {k: v for k, v in params.items() if k != "model"},
                "system": stored_system,
                "input": new,
            }
            response_log = self.store.start(response_id, record)
            response_log.append(
                {
                    "type": "context",
                    "stored_messages": len(view.history) + len(view.system or []),
                    "stored_turns": view.turns,
                    "new_messages": len(new),
                    "sent_messages": len(sent),
                    "system_messages": len(system_in or view.system or []),
                }
            )
            return PreparedTurn(
                request, response_id, route, upstream_body, response_log, new, stored_system, stack
            )
        except BaseException:
            await stack.aclose()
            raise

    async def _commit(self, turn: PreparedTurn, message: Message, record: dict[str, Any]) -> None:
        turn.log.append(record)
        stored = Turn(
            turn.response_id,
            tuple(turn.new),
            message,
            tuple(turn.system_in) if turn.system_in is not None else None,
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
        return record

    # -- non-streaming ------------------------------------------------------------------------
    async def complete(self, turn: PreparedTurn) -> dict[str, Any]:
        turn.upstream_started = time.perf_counter()
        completion = await turn.route.upstream.complete(turn.upstream_body)
        choices = completion.get("choices")
        if not choices or not isinstance(choices[0], dict):
            raise UpstreamProtocolError(f"Provider {turn.route.provider!r} returned no choices")
        raw = choices[0].get("message")
        message = output_message(raw)
        record = self._response_record(
            turn, message, choices[0].get("finish_reason"), completion.get("usage"), raw
        )
        await self._commit(turn, message, record)
        completion["id"] = turn.response_id
        completion["model"] = turn.request.model
        if turn.conversation_id is not None:
            completion["conversation_id"] = turn.conversation_id
        return completion

    # -- streaming ----------------------------------------------------------------------------
    async def open_stream(self, turn: PreparedTurn) -> AsyncIterator[bytes]:
        """Start the provider's stream and wait for its first chunk, so that errors before
        the first byte still become proper HTTP statuses; then return the SSE byte stream."""
        turn.upstream_started = time.perf_counter()
        chunks = turn.route.upstream.stream(turn.upstream_body).__aiter__()
        try:
            first: dict[str, Any] | None = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        return self._sse(turn, chunks, first)

    async def _sse(
        self, turn: PreparedTurn, chunks: AsyncIterator[dict[str, Any]], first: dict[str, Any] | None
    ) -> AsyncIterator[bytes]:
        acc = StreamAccumulator()
        cid = turn.conversation_id
        model = turn.request.model
        include_usage = turn.request.include_usage
        try:
            chunk = first
            while chunk is not None:
                acc.add(chunk)
                chunk["id"] = turn.response_id
                chunk["model"] = model
                if cid is not None:
                    chunk["conversation_id"] = cid
                if chunk.get("choices") or include_usage:
                    yield sse(chunk)
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    chunk = None
            if acc.finish_reason is None:
                raise UpstreamProtocolError(
                    f"Provider {turn.route.provider!r} ended the stream before finishing"
                )
            message = acc.message()
            await self._commit(
                turn, message, self._response_record(turn, message, acc.finish_reason, acc.usage)
            )
        except GatewayError as exc:
            # Headers are already sent: report the error in-band, as OpenAI does.
            await self.close(turn, exc)
            yield sse(exc.to_dict())
            return
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        yield SSE_DONE
