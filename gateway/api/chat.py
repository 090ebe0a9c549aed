"""`POST /v1/chat/completions`: parse, hand the turn to the service, render JSON or SSE."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
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
    turn_outcome,
    until_disconnect,
)
from gateway.api.sse import chat_events
from gateway.exceptions import GatewayError
from gateway.metrics import Metrics
from gateway.services.requests import ChatRequest
from gateway.services.turn import PreparedTurn

access_log = logging.getLogger("gateway.access")


def _headers(turn: PreparedTurn) -> dict[str, str]:
    headers = {"x-response-id": turn.response_id}
    if turn.conversation_id is not None:
        headers["x-conversation-id"] = turn.conversation_id
    return headers


def _observe(metrics: Metrics, turn: PreparedTurn) -> None:
    timings, plan = turn.timings, turn.plan
    if timings is not None:
        metrics.upstream.labels(turn.route.provider).observe(timings["upstream_ms"] / 1000)
        metrics.overhead.observe(max(0.0, timings["total_ms"] - timings["upstream_ms"]) / 1000)
    usage = turn.usage or {}
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int):
        prompt = plan.window.total_tokens if plan is not None else 0
    metrics.tokens.labels("in").inc(prompt)
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        metrics.tokens.labels("out").inc(completion)
    if plan is not None and plan.window.omitted:
        metrics.truncations.inc()
        metrics.truncated_messages.inc(plan.window.omitted)
    if turn.upstream_truncated:
        metrics.upstream_truncation.inc()
    if turn.conversation_id is not None:
        metrics.conversation_touched(turn.conversation_id)


def _log_line(turn: PreparedTurn, status: int, outcome: str, metrics: Metrics | None = None) -> None:
    if metrics is not None and outcome == "complete":
        _observe(metrics, turn)
    if not access_log.isEnabledFor(logging.INFO):
        return
    line: dict[str, Any] = {
        "event": "chat.completion",
        "response_id": turn.response_id,
        "conversation_id": turn.conversation_id,
        "model": turn.request.model,
        "provider": turn.route.provider,
        "stream": turn.request.stream,
        "status": status,
        "outcome": outcome,
        "new_messages": len(turn.new),
        "sent_messages": len(turn.upstream_body["messages"]),
        "ms": round((time.perf_counter() - turn.started) * 1000, 3),
    }
    plan = turn.plan
    if plan is not None:
        line["tokens"] = plan.window.tokens
        line["budget"] = plan.window.budget
        line["truncated"] = plan.window.omitted
        line["summary_version"] = plan.summary.version if plan.summary else None
    access_log.info(orjson.dumps(line).decode())


def _failed(turn: PreparedTurn, exc: BaseException) -> Response:
    """The response for a turn that failed before any byte was sent: a 499 for a client that
    went away, else the error, naming the response whose log records the attempt."""
    if isinstance(exc, ClientDisconnected):
        _log_line(turn, 499, "disconnected")
        return Response(status_code=499)
    if not isinstance(exc, GatewayError):
        cancelled = isinstance(exc, asyncio.CancelledError)
        _log_line(turn, 499 if cancelled else 500, "cancelled" if cancelled else "error")
        raise exc
    _log_line(turn, exc.status_code, "error")
    response = error_response(exc)
    response.headers.update(_headers(turn))
    return response


def _refused_line(request: Request, body: Any, exc: GatewayError, started: float) -> None:
    """The log line of a request the gateway refused before asking any provider."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    body = body if isinstance(body, dict) else {}
    cid = body.get("conversation_id") or request.headers.get("x-conversation-id")
    line: dict[str, Any] = {
        "event": "chat.completion",
        "response_id": None,
        "conversation_id": cid if isinstance(cid, str) else None,
        "model": body.get("model") if isinstance(body.get("model"), str) else None,
        "stream": body.get("stream") is True,
        "status": exc.status_code,
        "outcome": "refused",
        "error": {"type": exc.error_type, "code": exc.code, "message": exc.message[:300]},
        "ms": round((time.perf_counter() - started) * 1000, 3),
    }
    access_log.info(orjson.dumps(line).decode())


async def chat_completions(request: Request) -> Response:
    service = services_of(request).turns
    started = time.perf_counter()
    body: Any = None
    try:
        body = await read_json(request, service.settings.server.max_body_bytes)
        chat = ChatRequest.parse(body, header_conversation_id=request.headers.get("x-conversation-id"))
        turn = await service.prepare(chat, tenant_of(request))
    except GatewayError as exc:
        _refused_line(request, body, exc, started)
        request.app.state.metrics.refusals.labels(exc.code or exc.error_type).inc()
        raise
    if not chat.stream:
        try:
            result = await until_disconnect(service.complete(turn), request.receive)
        except BaseException as exc:
            await service.close(turn, turn_outcome(exc))
            return _failed(turn, exc)
        await service.close(turn)
        _log_line(turn, 200, "complete", request.app.state.metrics)
        return JSONBody(result, headers=_headers(turn))

    try:
        chunks = await until_disconnect(service.open_chunks(turn), request.receive)
    except BaseException as exc:
        await service.close(turn, turn_outcome(exc))
        return _failed(turn, exc)

    async def on_close(exc: BaseException | None) -> None:
        await service.close(turn, None if exc is None else turn_outcome(exc))
        complete = turn.timings is not None and exc is None
        _log_line(turn, 200, "complete" if complete else "incomplete", request.app.state.metrics)

    return SSEResponse(chat_events(service, turn, chunks), headers=_headers(turn), on_close=on_close)
