"""Prometheus metrics, one registry per app (per worker process).

Requests, gateway overhead vs upstream latency, tokens, truncations, summaries and active
conversations. Beside the registry, the app's OpenTelemetry tracing (`tracing`, off unless
configured), told of the same turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.exceptions import shutting_down
from gateway.tracing import Tracing

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# The active-conversations gauge remembers at most this many (a busy gateway's new conversations
# must not grow memory): past it, it reads ACTIVE_LIMIT.
ACTIVE_LIMIT = 16_384
# One JSON line per HTTP request (`gateway.access`): a turn writes its own, richer line and marks
# this request's flag; every other request gets the middleware's line.
access_log = logging.getLogger("gateway.access")


def _uncounted(route: str, status: int) -> None:
    """Until an app of this process counts them: requests refused below the app."""


# Requests refused below the app (the HTTP parser, the head deadline: gateway.protocol), counted
# in gateway_requests_total by the app serving this process (`create_app` sets it).
refused_below_app: Callable[[str, int], None] = _uncounted
access_logged: ContextVar[list[bool] | None] = ContextVar("gateway_access_logged", default=None)

_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, active_window: float = 900.0, tracing: Tracing | None = None) -> None:
        self.tracing = tracing or Tracing()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.overhead = Histogram(
            "gateway_overhead_seconds",
            "Time spent in the gateway itself (total minus upstream)",
            buckets=_FAST,
            registry=r,
        )
        self.upstream = Histogram(
            "gateway_upstream_seconds", "Upstream provider latency", ["provider"], buckets=_SLOW, registry=r
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens sent to (in) and received from (out) providers",
            ["direction"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens",
            "Prompt tokens of answered turns as their provider counted them, by provider and by kind: "
            "cached (served from the provider's prompt cache) or uncached (counted where the provider "
            "reports its cached tokens)",
            ["provider", "kind"],
            registry=r,
        )
        self.calibration_rejected = Counter(
            "gateway_calibration_rejected",
            "Provider prompt counts not learned from: outside what real tokenizers do (under 0.5x or "
            "over 3x the gateway's own count of that prompt)",
            ["provider"],
            registry=r,
        )
        self.truncations = Counter(
            "gateway_truncations", "Requests whose history was truncated to fit the window", registry=r
        )
        self.truncated_messages = Counter(
            "gateway_truncated_messages", "History messages left out of windows", registry=r
        )
        self.summaries = Counter(
            "gateway_summaries",
            "Summary versions written (ok) and attempts that failed (failed), rolling or post-processing",
            ["outcome"],
            registry=r,
        )
        self.refusals = Counter(
            "gateway_refusals",
            "Chat requests the gateway refused before asking a provider, by error code",
            ["code"],
            registry=r,
        )
        self.failed_turns = Counter(
            "gateway_failed_turns",
            "Turns that ended without being stored, by outcome (disconnected, error, cancelled), "
            "streams that failed after their first byte included (their HTTP status was 200)",
            ["outcome"],
            registry=r,
        )
        self.context_refusals = Counter(
            "gateway_context_refusals",
            "Prompts a provider refused as too long, by outcome (retried: refitted and sent again)",
            ["outcome"],
            registry=r,
        )
        self.upstream_truncation = Counter(
            "gateway_upstream_truncation_suspected",
            "Responses whose provider seems to have cut the prompt",
            registry=r,
        )
        self.active = Gauge(
            "gateway_conversations_active",
            f"Conversations with a turn in the last sessions.idle_after (counted up to {ACTIVE_LIMIT})",
            registry=r,
        )
        self.active.set_function(self._count_active)
        # Keyed by the id's hash (an int, not the id): bounded by ACTIVE_LIMIT and the window.
        self._last_turn: dict[int, float] = {}
        self._touches = 0
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.active_window = active_window

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once instead of validated and locked on every request.

        Label sets here are few: routes, statuses, providers.
        """
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = metric.labels(*values)
            if len(self._children) < 4096:
                self._children[key] = found
        return found

    def conversation_touched(self, key: str) -> None:
        hashed = hash(key)
        self._last_turn.pop(hashed, None)  # re-inserted last: the dict stays ordered by recency
        self._last_turn[hashed] = time.monotonic()
        while len(self._last_turn) > ACTIVE_LIMIT:
            del self._last_turn[next(iter(self._last_turn))]  # the least recent
        self._touches += 1
        if self._touches % 1024 == 0:
            self._count_active()

    def _count_active(self) -> float:
        # Oldest first (insertion order is recency order): stop at the first recent one.
        cutoff = time.monotonic() - self.active_window
        for key in list(self._last_turn):
            if self._last_turn[key] >= cutoff:
                break
            del self._last_turn[key]
        return float(len(self._last_turn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_UNROUTED = {401: "unauthenticated", 403: "cross_origin"}


class MetricsMiddleware:
    """Counts every HTTP request by route (the endpoint's name) and status.

    It also logs one JSON line for each request that did not log its own (every request but a
    turn's).
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]
        logged = [False]
        token = access_logged.set(logged)
        started = time.perf_counter()
        answered = [False]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                answered[0] = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError as exc:
            error = shutting_down(exc)
            if error is None or answered[0]:
                raise
            # Stopped by the server's shutdown before it answered: OpenAI's shape, not a bare 500.
            body = orjson.dumps(error.to_dict())
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send_wrapper(
                {"type": "http.response.start", "status": error.status_code, "headers": headers}
            )
            await send_wrapper({"type": "http.response.body", "body": body})
        finally:
            access_logged.reset(token)
            endpoint: Any = scope.get("endpoint")
            # A request refused before routing (a missing or wrong key, a page of another
            # origin) has no endpoint.
            route = getattr(endpoint, "__name__", None) or _UNROUTED.get(status[0], "unmatched")
            self.metrics.child(self.metrics.requests, route, str(status[0])).inc()
            if not logged[0] and access_log.isEnabledFor(logging.INFO):
                access_log.info(request_line(scope, route, status[0], started))


# What a request's path names, as its log line says it (a stored chat completion is a response).
_NAMED_IN_PATH = (
    ("conversation_id", "conversation_id"),
    ("response_id", "response_id"),
    ("completion_id", "response_id"),
    ("item_id", "item_id"),
)


def request_line(scope: Scope, route: str, status: int, started: float) -> str:
    """The JSON log line of a request that is not a turn (a turn logs `chat.completion`)."""
    line: dict[str, Any] = {
        "event": "http.request",
        "method": scope.get("method"),
        "path": scope.get("path"),
        "route": route,
        "status": status,
        "ms": round((time.perf_counter() - started) * 1000, 3),
    }
    params = scope.get("path_params") or {}
    for key, said_as in _NAMED_IN_PATH:
        if isinstance(params.get(key), str):
            line[said_as] = params[key]
    return orjson.dumps(line).decode()


async def metrics_endpoint(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
