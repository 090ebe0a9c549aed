"""What every turn leaves behind, whichever API carried it: a log line, metrics and a span.

One JSON log line (`gateway.access`) and the same metrics, and with tracing configured its
GenAI span; also for requests refused before any provider was asked (a line and a metric: no
provider call, no span). Requests that are not turns get the metrics middleware's line
(`http.request`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import error_response
from gateway.exceptions import ClientDisconnected, GatewayError, ShuttingDown
from gateway.metrics import Metrics, access_log, access_logged
from gateway.services.turn import TurnOutcome
from gateway.types import JSONObject


def _mark_logged() -> None:
    """This request has its line: the middleware does not add a generic one."""
    flag = access_logged.get()
    if flag is not None:
        flag[0] = True


def observe(metrics: Metrics, outcome: TurnOutcome) -> None:
    timings = outcome.timings
    if timings is not None:
        # The turn's whole time (preparing, the commit and closing included) less the provider's.
        metrics.overhead.observe(max(0.0, outcome.elapsed_ms - timings["upstream_ms"]) / 1000)
    usage = outcome.usage or {}
    cache = outcome.cache or {}  # the whole prompt (Anthropic's input_tokens leaves its cache out)
    whole, cached = cache.get("prompt_tokens"), cache.get("cached_tokens")
    prompt = whole if isinstance(whole, int) else outcome.prompt_ours or 0
    metrics.child(metrics.tokens, "in").inc(prompt)
    if isinstance(whole, int) and isinstance(cached, int):
        metrics.child(metrics.prompt_tokens, outcome.provider, "cached").inc(cached)
        metrics.child(metrics.prompt_tokens, outcome.provider, "uncached").inc(max(0, whole - cached))
    completion = usage.get("completion_tokens")
    if not isinstance(completion, int):
        completion = outcome.output_tokens
    if isinstance(completion, int):
        metrics.child(metrics.tokens, "out").inc(completion)
    if outcome.truncated:
        metrics.truncations.inc()
        metrics.truncated_messages.inc(outcome.truncated)
    if outcome.upstream_truncated:
        metrics.upstream_truncation.inc()
    if outcome.conversation_id is not None:
        metrics.conversation_touched(outcome.conversation_id)


def log_line(
    outcome: TurnOutcome,
    status: int,
    result: str,
    metrics: Metrics | None = None,
    *,
    event: str = "chat.completion",
    error: GatewayError | None = None,
) -> None:
    if metrics is not None:
        if outcome.timings is not None:  # the provider's time, a failed call's too
            metrics.child(metrics.upstream, outcome.provider).observe(outcome.timings["upstream_ms"] / 1000)
        if result == "complete":
            observe(metrics, outcome)
        else:
            metrics.child(metrics.failed_turns, result).inc()
        metrics.tracing.turn(outcome, status, result, api=event, error=error)
    _mark_logged()
    if not access_log.isEnabledFor(logging.INFO):
        return
    line: JSONObject = {
        "event": event,
        "response_id": outcome.response_id,
        "conversation_id": outcome.conversation_id,
        "model": outcome.model,
        "provider": outcome.provider,
        "stream": outcome.stream,
        "status": status,
        "outcome": result,
        "new_messages": outcome.new_messages,
        "sent_messages": outcome.sent_messages,
        "ms": outcome.elapsed_ms,
    }
    if outcome.window_tokens is not None:
        line["tokens"] = outcome.window_tokens
        line["budget"] = outcome.budget
        line["truncated"] = outcome.truncated
        line["summary_version"] = outcome.summary_version
        line["stored_messages"] = outcome.stored_messages
        line["included_response_ids"] = outcome.included_response_ids
    if outcome.cache is not None:
        line["cache"] = outcome.cache
    if error is not None:
        line["error"] = {"type": error.error_type, "code": error.code, "message": error.message[:300]}
    access_log.info(orjson.dumps(line).decode())


def refused(
    request: Request,
    body: object,
    exc: GatewayError,
    started: float,
    *,
    event: str = "chat.completion",
    conversation_id: str | None = None,
) -> None:
    """The log line and metric of a request the gateway refused before asking any provider.

    `conversation_id`: the one the request named, when it was known by other means than the
    body's `conversation_id` or the header (the Responses API's `conversation`, or the
    conversation of its `previous_response_id`)."""
    request.app.state.metrics.refusals.labels(exc.code or exc.error_type).inc()
    _mark_logged()
    if not access_log.isEnabledFor(logging.INFO):
        return
    body = body if isinstance(body, dict) else {}
    cid = conversation_id or body.get("conversation_id") or request.headers.get("x-conversation-id")
    line: JSONObject = {
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


def log_failure(
    outcome: TurnOutcome,
    exc: BaseException,
    metrics: Metrics | None = None,
    *,
    event: str = "chat.completion",
    streaming: bool = False,
) -> None:
    """The log line (and metrics) of a turn that failed, before or (`streaming`) after its answer began.

    Before any byte of its answer was sent, or, `streaming`, after its 200 and first chunks (the
    error went in-band: the line keeps the 200 the client got, and says what happened).
    """
    if isinstance(exc, ClientDisconnected):
        log_line(outcome, 499, "disconnected", metrics, event=event)
    elif isinstance(exc, GatewayError):
        status = 200 if streaming else exc.status_code
        log_line(outcome, status, _failed(exc), metrics, event=event, error=exc)
    else:
        cancelled = isinstance(exc, asyncio.CancelledError)
        status = 499 if cancelled else 200 if streaming else 500
        log_line(outcome, status, "cancelled" if cancelled else "error", metrics, event=event)


def _failed(error: GatewayError | None) -> str:
    """How a turn that failed with `error` ended: `cancelled` by the server's stop, else `error`."""
    return "cancelled" if isinstance(error, ShuttingDown) else "error"


def stream_closed(
    outcome: TurnOutcome, exc: BaseException | None, metrics: Metrics, *, event: str = "chat.completion"
) -> None:
    """The log line of a stream once it ended: complete (stored), or how it failed."""
    if exc is None and outcome.committed:
        log_line(outcome, 200, "complete", metrics, event=event)
    elif exc is None:  # ended in an in-band error: the provider's, the store's, or the server's stop
        log_line(outcome, 200, _failed(outcome.error), metrics, event=event, error=outcome.error)
    else:
        log_failure(outcome, exc, metrics, event=event, streaming=True)


def failed_response(
    outcome: TurnOutcome,
    exc: BaseException,
    metrics: Metrics,
    headers: dict[str, str],
    *,
    event: str = "chat.completion",
    render: Callable[[GatewayError], Response] = error_response,
) -> Response:
    """The response for a turn that failed before any byte was sent, its line logged.

    A 499 for a client that went away, else the error (`render`: in the API's own shape) with the
    turn's `headers`, which name the response whose log records the attempt.
    """
    log_failure(outcome, exc, metrics, event=event)
    if isinstance(exc, ClientDisconnected):
        return Response(status_code=499)
    if not isinstance(exc, GatewayError):
        raise exc
    response = render(exc)
    response.headers.update(headers)
    return response
