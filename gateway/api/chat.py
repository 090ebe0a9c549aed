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
    turn_outcome,
    until_disconnect,
)
from gateway.api.observe import failed_response, log_line, refused, stream_closed
from gateway.api.sse import chat_events
from gateway.api.validation import parse_chat
from gateway.exceptions import GatewayError, shutting_down


async def chat_completions(request: Request) -> Response:
    service = services_of(request).turns
    started = time.perf_counter()
    body: Any = None
    try:
        try:
            body = await read_json(request, service.settings.server.max_body_bytes)
            chat = parse_chat(body, header_conversation_id=request.headers.get("x-conversation-id"))
            turn = await service.prepare(chat, tenant_of(request))
        except asyncio.CancelledError as exc:
            raise shutting_down(exc) or exc from None
    except GatewayError as exc:
        refused(request, body, exc, started)
        raise
    if not chat.stream:
        try:
            result = await until_disconnect(service.complete(turn), request.receive, started=started)
        except BaseException as exc:
            exc = shutting_down(exc) or exc
            outcome = await service.close(turn, turn_outcome(exc))
            return failed_response(outcome, exc, request.app.state.metrics, turn_headers(turn))
        # The log line before the answer: whoever has the answer finds its line written.
        log_line(await service.close(turn), 200, "complete", request.app.state.metrics)
        return JSONBody(result, headers=turn_headers(turn))

    try:
        chunks = await until_disconnect(service.open_chunks(turn), request.receive, started=started)
    except BaseException as exc:
        exc = shutting_down(exc) or exc
        outcome = await service.close(turn, turn_outcome(exc))
        return failed_response(outcome, exc, request.app.state.metrics, turn_headers(turn))

    async def on_close(exc: BaseException | None) -> None:
        outcome = await service.close(turn, None if exc is None else turn_outcome(exc))
        stream_closed(outcome, exc, request.app.state.metrics)

    return SSEResponse(chat_events(service, turn, chunks), headers=turn_headers(turn), on_close=on_close)
