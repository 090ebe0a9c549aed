"""`POST /v1/chat/completions`: parse, hand the turn to the service, render JSON or SSE."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import (
    ClientDisconnected,
    JSONBody,
    SSEResponse,
    error_response,
    read_json,
    services_of,
    tenant_of,
    turn_headers,
    turn_outcome,
    until_disconnect,
)
from gateway.api.observe import log_failure, log_line, refused, stream_closed
from gateway.api.sse import chat_events
from gateway.api.validation import parse_chat
from gateway.exceptions import GatewayError, shutting_down
from gateway.metrics import Metrics
from gateway.services.turn import PreparedTurn, TurnOutcome


def _failed(turn: PreparedTurn, outcome: TurnOutcome, exc: BaseException, metrics: Metrics) -> Response:
    """The response for a turn that failed before any byte was sent: a 499 for a client that
    went away, else the error, naming the response whose log records the attempt."""
    log_failure(outcome, exc, metrics)
    if isinstance(exc, ClientDisconnected):
        return Response(status_code=499)
    if not isinstance(exc, GatewayError):
        raise exc
    response = error_response(exc)
    response.headers.update(turn_headers(turn))
    return response


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
            return _failed(turn, await service.close(turn, turn_outcome(exc)), exc, request.app.state.metrics)
        # The log line before the answer: whoever has the answer finds its line written.
        log_line(await service.close(turn), 200, "complete", request.app.state.metrics)
        return JSONBody(result, headers=turn_headers(turn))

    try:
        chunks = await until_disconnect(service.open_chunks(turn), request.receive, started=started)
    except BaseException as exc:
        exc = shutting_down(exc) or exc
        return _failed(turn, await service.close(turn, turn_outcome(exc)), exc, request.app.state.metrics)

    async def on_close(exc: BaseException | None) -> None:
        outcome = await service.close(turn, None if exc is None else turn_outcome(exc))
        stream_closed(outcome, exc, request.app.state.metrics)

    return SSEResponse(chat_events(service, turn, chunks), headers=turn_headers(turn), on_close=on_close)
