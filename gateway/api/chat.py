"""`POST /v1/chat/completions`: parse, hand the turn to the service, render JSON or SSE."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import (
    JSONBody,
    SSEResponse,
    read_json,
    services_of,
    tenant_of,
    turn_headers,
    until_disconnect,
)
from gateway.api.observe import failed_response, log_line, refused, stream_closed
from gateway.api.sse import chat_events
from gateway.api.validation import parse_chat
from gateway.exceptions import GatewayError, shutting_down
from gateway.services.requests import take_prefill


async def chat_completions(request: Request) -> Response:
    service = services_of(request).turns
    started = time.perf_counter()
    body: Any = None
    try:
        try:
            body = await read_json(request, service.settings.server.max_body_bytes)
            chat = parse_chat(body, header_conversation_id=request.headers.get("x-conversation-id"))
            take_prefill(chat)
            turn = await service.prepare(chat, tenant_of(request))
        except asyncio.CancelledError as exc:
            raise shutting_down(exc) or exc from None
    except GatewayError as exc:
        refused(request, body, exc, started)
        raise
    metrics = request.app.state.metrics
    if not chat.stream:
        try:
            async with service.closing(turn):
                result = await until_disconnect(service.complete(turn), request.receive, started=started)
        except BaseException as exc:
            return failed_response(turn.closed(), exc, metrics, turn_headers(turn))
        # The log line before the answer: whoever has the answer finds its line written.
        log_line(turn.closed(), 200, "complete", metrics)
        return JSONBody(result, headers=turn_headers(turn))

    try:
        async with service.closing(turn, on_failure_only=True):
            chunks = await until_disconnect(service.open_chunks(turn), request.receive, started=started)
    except BaseException as exc:
        return failed_response(turn.closed(), exc, metrics, turn_headers(turn))

    async def on_close(exc: BaseException | None) -> None:
        stream_closed(await chunks.aclose(exc), exc, metrics)

    return SSEResponse(chat_events(turn, chunks), headers=turn_headers(turn), on_close=on_close)
