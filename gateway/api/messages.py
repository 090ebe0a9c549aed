"""Anthropic's Messages API, in Anthropic's shapes, run as chat turns.

`POST /v1/messages` (streaming and not) and `POST /v1/messages/count_tokens`.

A request is translated into a chat-completions request (`context/anthropic.py`) and driven
through the same service as `/v1/chat/completions`, so a conversation continues across chat
completions, Responses and Messages in any order. The message `id` is the gateway's minted
response id (`{model-slug}-{12 hex}`, not Anthropic's `msg_...`: Anthropic's SDKs take any id,
and the id names the response log, as on the other APIs). Errors are in Anthropic's shape (the
app's error handlers render every error under /v1/messages so), after the stream began as an
`error` event.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import (
    JSONBody,
    SSEResponse,
    anthropic_error_response,
    read_json,
    services_of,
    tenant_of,
    turn_headers,
    until_disconnect,
)
from gateway.api.observe import failed_response, log_line, refused, stream_closed
from gateway.api.responses import count_details, output_cap
from gateway.api.schemas import NOT_AN_OBJECT, CountTokensRequest, MessageCreate
from gateway.api.validation import parse_chat, validate
from gateway.context import anthropic
from gateway.exceptions import GatewayError, InvalidRequest, shutting_down
from gateway.services.requests import ChatRequest, take_prefill
from gateway.services.turn import PreparedTurn, TurnOutcome, added_to
from gateway.services.turns import TurnStream
from gateway.types import JSONObject, as_list, as_object

log = logging.getLogger("gateway.api")

EVENT = "message"  # the log line's `event`
# The gateway's own fields, as chat completions take them (the SDK's `extra_body`): the
# conversation's name and the user's time zone.
EXTENSIONS = ("conversation_id", "session_id", "agent_id", "user_timezone", "is_feedback")


def _check_version(request: Request) -> None:
    """Anthropic's API requires `anthropic-version`: any version is accepted, none is a 400."""
    if not request.headers.get("anthropic-version"):
        raise InvalidRequest("anthropic-version: header is required", param="anthropic-version")


def _chat(body: object, header_conversation_id: str | None) -> ChatRequest:
    """The chat turn of a Messages request, checked."""
    if not isinstance(body, dict):
        raise InvalidRequest(NOT_AN_OBJECT)
    validate(MessageCreate, body)
    model = body["model"]
    chat_body = anthropic.chat_request(body, cap=output_cap(model))
    chat_body.update({key: body[key] for key in EXTENSIONS if body.get(key) is not None})
    chat = parse_chat(chat_body, header_conversation_id=header_conversation_id)
    chat.from_messages_api = True  # (recorded: not a chat completion for the stored-completions lists)
    take_prefill(chat)  # (the message returned is what the model added: `added_to`)
    return chat


def _headers(turn: PreparedTurn) -> dict[str, str]:
    """A turn's headers, and its response id as `request-id` (the SDK's `_request_id`)."""
    return {**turn_headers(turn), "request-id": turn.response_id}


def _error_of(turn: PreparedTurn) -> Callable[[GatewayError], Response]:
    """Anthropic's error for a turn that failed: its `request_id` is the turn's response id."""
    return functools.partial(anthropic_error_response, request_id=turn.response_id)


def _message(turn: PreparedTurn, outcome: TurnOutcome, completion: JSONObject | None) -> JSONObject:
    """The `message` of a completed turn: what was stored, with the provider's usage."""
    choices = as_list((completion or {}).get("choices"))
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    stop = anthropic.matched_stop(choice.get("stop_reason"), turn.request.body.get("stop"))
    usage = anthropic.message_usage(
        outcome.usage,
        outcome.cache,
        output_tokens=outcome.output_tokens,
        estimate=(outcome.window_tokens or {}).get("total"),
    )
    message = anthropic.message_object(
        message_id=turn.response_id,
        model=turn.request.model,
        message=added_to(turn.request.prefill, outcome.message),
        finish_reason=outcome.finish_reason,
        usage=usage,
        matched=stop,
    )
    if turn.conversation_id is not None:
        message["conversation_id"] = turn.conversation_id
    return message


def sse(payload: JSONObject) -> bytes:
    """One of Anthropic's events: its `type` is the event's name."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class EchoCut:
    """The client's prefill left out of a streamed answer that says it again first (as
    `added_to` leaves it out of a whole one): Anthropic's answer holds what the model added.

    Text that may be the prefill said again is held until it is known: then left out, or sent."""

    def __init__(self, prefill: str) -> None:
        self.prefill = prefill
        self.held = ""
        self.done = False

    def text(self, piece: str) -> str:
        if self.done:
            return piece
        seen = self.held + piece
        if len(seen) < len(self.prefill) and self.prefill.startswith(seen):
            self.held = seen
            return ""
        self.done, self.held = True, ""
        return seen[len(self.prefill) :] if seen.startswith(self.prefill) else seen

    def chunk(self, chunk: JSONObject) -> JSONObject:
        """`chunk` with its text as the client is to get it (held text goes out before a call)."""
        choices = as_list(chunk.get("choices"))
        choice = as_object(choices[0]) if choices and not self.done else {}
        delta = as_object(choice.get("delta"))
        content = delta.get("content")
        if not isinstance(content, str) and not (self.held and delta.get("tool_calls")):
            return chunk
        text = self.text(content) if isinstance(content, str) else ""
        if delta.get("tool_calls") and not self.done:  # (the answer went elsewhere: a call)
            text, self.held, self.done = self.held + text, "", True
        return {**chunk, "choices": [{**choice, "delta": {**delta, "content": text}}, *choices[1:]]}

    def rest(self) -> JSONObject:
        """A chunk with what was held when the answer ended (it was not the prefill after all)."""
        self.done, held = True, self.held
        self.held = ""
        return {"choices": [{"index": 0, "delta": {"content": held}}]}


async def message_events(turn: PreparedTurn, chunks: TurnStream) -> AsyncIterator[bytes]:
    """The turn's chunks as Anthropic's event stream.

    `message_start`, `ping`, the content blocks, `message_delta` (how it stopped, the usage),
    `message_stop`. The turn is committed and closed before `message_delta`; a failure once the
    stream began is an `error` event, as Anthropic sends it, after which nothing more comes."""
    model = turn.request.model
    yield sse(
        anthropic.message_start(turn.response_id, model, turn.planned_tokens or 0, turn.conversation_id)
    )
    yield sse({"type": "ping"})
    blocks = anthropic.BlockEvents()
    echo = EchoCut(turn.request.prefill) if turn.request.prefill else None
    try:
        async for chunk in chunks:
            for payload in blocks.feed(echo.chunk(chunk) if echo is not None else chunk):
                yield sse(payload)
    except GatewayError as error:  # (the stream closed its turn with it)
        yield sse(anthropic.error_body(error.status_code, error.message))
        return
    if echo is not None and echo.held:  # (the answer ended inside what looked like the prefill)
        for payload in blocks.feed(echo.rest()):
            yield sse(payload)
    for payload in blocks.close():
        yield sse(payload)
    outcome = chunks.outcome  # committed and closed by now: the lock is released early
    calls = bool(outcome.message and outcome.message.get("tool_calls"))
    stop = anthropic.matched_stop(blocks.provider_stop, turn.request.body.get("stop"))
    usage = anthropic.message_usage(
        outcome.usage, outcome.cache, output_tokens=outcome.output_tokens, estimate=turn.planned_tokens
    )
    yield sse(
        anthropic.message_delta(
            anthropic.stop_reason(outcome.finish_reason, calls=calls, matched=stop), usage
        )
    )
    yield sse({"type": "message_stop"})


async def create_message(request: Request) -> Response:
    """`POST /v1/messages`: the request as a chat turn, its answer as a `message` or its events."""
    service = services_of(request).turns
    metrics = request.app.state.metrics
    started = time.perf_counter()
    body: Any = None
    try:
        try:
            _check_version(request)
            body = await read_json(request, service.settings.server.max_body_bytes)
            chat = _chat(body, request.headers.get("x-conversation-id"))
            turn = await service.prepare(chat, tenant_of(request))
        except asyncio.CancelledError as exc:
            raise shutting_down(exc) or exc from None
    except GatewayError as exc:
        refused(request, body, exc, started, event=EVENT)
        raise
    if not chat.stream:
        try:
            async with service.closing(turn):
                completion = await until_disconnect(service.complete(turn), request.receive, started=started)
        except BaseException as exc:
            return failed_response(
                turn.closed(), exc, metrics, _headers(turn), event=EVENT, render=_error_of(turn)
            )
        outcome = turn.closed()
        # The log line before the answer: whoever has the answer finds its line written.
        log_line(outcome, 200, "complete", metrics, event=EVENT)
        return JSONBody(_message(turn, outcome, completion), headers=_headers(turn))

    try:
        async with service.closing(turn, on_failure_only=True):
            chunks = await until_disconnect(service.open_chunks(turn), request.receive, started=started)
    except BaseException as exc:
        return failed_response(
            turn.closed(), exc, metrics, _headers(turn), event=EVENT, render=_error_of(turn)
        )

    async def on_close(exc: BaseException | None) -> None:
        stream_closed(await chunks.aclose(exc), exc, metrics, event=EVENT)

    return SSEResponse(message_events(turn, chunks), headers=_headers(turn), on_close=on_close)


async def count_tokens(request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: count the prompt `POST /v1/messages` with this body would send.

    Counted as `POST /v1/responses/input_tokens` counts (the window planned for the conversation
    named; nothing sent or stored), and with no conversation named, as the stateless turn sends
    it: the request whole. The answer adds the extension `gateway`: how it was counted, and the
    window."""
    services = services_of(request)
    _check_version(request)
    body = await read_json(request, services.settings.server.max_body_bytes)
    if not isinstance(body, dict):
        raise InvalidRequest(NOT_AN_OBJECT)
    validate(CountTokensRequest, body)
    chat_body: JSONObject = {
        "model": body["model"],
        "messages": anthropic.chat_messages(body.get("system"), body.get("messages")),
    }
    tools = anthropic.chat_tools(body.get("tools"))
    if tools:
        chat_body["tools"] = tools
    anthropic.chat_tool_choice(body.get("tool_choice"))  # (checked as a turn checks it)
    chat_body.update(anthropic.chat_output(body))
    chat_body.update(anthropic.chat_user(body))  # (a new conversation's recap is counted too)
    if body.get("max_tokens") is not None:  # the answer's room, as the turn keeps it
        chat_body[output_cap(body["model"])] = body["max_tokens"]
    chat_body.update({key: body[key] for key in EXTENSIONS if body.get(key) is not None})
    chat = parse_chat(chat_body, header_conversation_id=request.headers.get("x-conversation-id"))
    counted = await services.turns.count(chat, tenant_of(request))
    return JSONBody({"input_tokens": counted.input_tokens, "gateway": count_details(counted)})
