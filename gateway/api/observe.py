"""What every turn leaves behind, whichever API carried it: one JSON log line (`gateway.access`)
and the same metrics; also for requests refused before any provider was asked."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from starlette.requests import Request

from gateway.api.http import ClientDisconnected
from gateway.exceptions import GatewayError
from gateway.metrics import Metrics
from gateway.services.turn import PreparedTurn

access_log = logging.getLogger("gateway.access")


def observe(metrics: Metrics, turn: PreparedTurn) -> None:
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


def log_line(
    turn: PreparedTurn,
    status: int,
    outcome: str,
    metrics: Metrics | None = None,
    *,
    event: str = "chat.completion",
) -> None:
    if metrics is not None and outcome == "complete":
        observe(metrics, turn)
    if not access_log.isEnabledFor(logging.INFO):
        return
    line: dict[str, Any] = {
        "event": event,
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


def refused(
    request: Request, body: Any, exc: GatewayError, started: float, *, event: str = "chat.completion"
) -> None:
    """The log line and metric of a request the gateway refused before asking any provider."""
    request.app.state.metrics.refusals.labels(exc.code or exc.error_type).inc()
    if not access_log.isEnabledFor(logging.INFO):
        return
    body = body if isinstance(body, dict) else {}
    cid = body.get("conversation_id") or request.headers.get("x-conversation-id")
    line: dict[str, Any] = {
        "event": event,
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


def log_failure(turn: PreparedTurn, exc: BaseException, *, event: str = "chat.completion") -> None:
    """The log line of a turn that failed before any byte of its answer was sent."""
    if isinstance(exc, ClientDisconnected):
        log_line(turn, 499, "disconnected", event=event)
    elif isinstance(exc, GatewayError):
        log_line(turn, exc.status_code, "error", event=event)
    else:
        cancelled = isinstance(exc, asyncio.CancelledError)
        log_line(turn, 499 if cancelled else 500, "cancelled" if cancelled else "error", event=event)
