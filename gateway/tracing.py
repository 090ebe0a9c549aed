"""OpenTelemetry GenAI spans and metrics of turns and summarizer calls: opt-in (`[tracing]`).

`Tracing` is the seam, and it is off by default: its methods do nothing and opentelemetry is
never imported. `gateway.app.tracing_for` gives `gateway.otel.OtelTracing` (the one module that
imports opentelemetry) when an OTLP endpoint is configured: `tracing.endpoint`, else the
standard `OTEL_EXPORTER_OTLP_*ENDPOINT` variables (`export_targets` says which wins).

The conventions followed are OpenTelemetry's GenAI semantic conventions as of semconv v1.41
(`gen_ai.provider.name`, which replaced `gen_ai.system`; content opt-in). A turn is one CLIENT
span, `chat {gen_ai.request.model}`, covering the whole turn as the gateway ran it (lock, load,
window, the provider's call, commit); the provider's own share is `gateway.upstream.duration`.
Its children are the window plan, each provider call and the commit. A turn continues its
client's W3C `traceparent` (`TraceContextMiddleware` gives each request a `TraceContext`) and
sends its trace on to the provider (`TracedUpstream`, around the router's upstreams). What a
span says is worked out here, from the turn's outcome, as plain attributes."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import urlsplit

import orjson

from gateway.config import ProviderSettings, TracingSettings
from gateway.exceptions import GatewayError, UpstreamStatusError
from gateway.types import JSONObject, Message, as_list, as_object, messages
from gateway.upstream import Router
from gateway.upstream.base import TRACEPARENT, TRACESTATE, Body, Chunk, ServerWindow, Upstream

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from gateway.services.summaries import SummaryCall
    from gateway.services.turn import TurnOutcome

AttributeValue: TypeAlias = "str | bool | int | float | list[str]"
Attributes: TypeAlias = "dict[str, AttributeValue]"

# The event that carries message contents when `capture_content` is on (GenAI conventions).
CONTENT_EVENT = "gen_ai.client.inference.operation.details"
EXTRA_HINT = "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"

# Request parameters the conventions name, by the OpenAI field that carries them.
_NUMBERS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
}
_INTEGERS = {
    "max_tokens": "gen_ai.request.max_tokens",
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
}
# What a turn that did not end in an answer or a GatewayError reports as `error.type`.
_RESULT_ERRORS = {"disconnected": "client_disconnected", "cancelled": "cancelled"}


@dataclass(frozen=True, slots=True)
class ExportTargets:
    """Where spans go (always set: tracing is on) and metrics go (None: not exported)."""

    traces: str
    metrics: str | None


def export_targets(settings: TracingSettings, environ: Mapping[str, str]) -> ExportTargets | None:
    """The OTLP/HTTP URLs to export to, or None: tracing is off.

    `tracing.endpoint` (the file, or `GATEWAY_TRACING__ENDPOINT`) wins; without it the standard
    variables apply: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `..._METRICS_ENDPOINT` (whole URLs)
    before `OTEL_EXPORTER_OTLP_ENDPOINT` (a base: `/v1/traces` is added). `OTEL_SDK_DISABLED=true`
    turns everything off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None

    def target(signal: str) -> str | None:
        if settings.endpoint:
            return f"{settings.endpoint}/v1/{signal}"
        whole = environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "").strip()
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip().rstrip("/")
        return whole or (f"{base}/v1/{signal}" if base else None)

    traces = target("traces")
    if traces is None:
        return None
    return ExportTargets(traces, target("metrics") if settings.metrics else None)


# W3C Trace Context: version-trace_id-parent_id-flags (a later version may add fields after).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


@dataclass(frozen=True, slots=True)
class RemoteParent:
    """The client's span a turn continues: what its `traceparent` said."""

    trace_id: int
    span_id: int
    sampled: bool


# Whether a turn's span in trace `trace_id` (continuing `parent`, if any) is recorded.
Samples: TypeAlias = Callable[[int, RemoteParent | None], bool]


def parent_samples(trace_id: int, parent: RemoteParent | None) -> bool:
    """Recorded unless the client's span was not (the SDK's default sampler, parent-based)."""
    return parent is None or parent.sampled


def parse_traceparent(value: str | None) -> RemoteParent | None:
    """The parent a W3C `traceparent` header names (None: absent or not valid)."""
    match = _TRACEPARENT.fullmatch(value.strip()) if value else None
    if match is None:
        return None
    version, trace, span, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or not int(trace, 16) or not int(span, 16):
        return None
    return RemoteParent(int(trace, 16), int(span, 16), bool(int(flags, 16) & 1))


@dataclass(slots=True)
class ProviderCall:
    """One call to a provider during a traced turn.

    The span id its `traceparent` named, its times (nanoseconds since the epoch) and how it ended.
    """

    span_id: int
    start_ns: int
    end_ns: int | None = None
    first_chunk_ns: int | None = None  # a stream's first chunk
    error: BaseException | None = None


@dataclass(slots=True)
class TraceContext:
    """The trace of one request's turn: the client's (its `traceparent`) or a new one.

    It holds the provider calls made in it, each told to the provider as a span of the same
    trace. Closed once its turn's span is recorded: work begun later (a summary) is not the turn's.
    """

    trace_id: int
    parent: RemoteParent | None = None
    sampled: bool = True  # its turn's span is recorded (the provider is told so)
    state: str | None = None  # the client's `tracestate`, passed on (with its `traceparent` only)
    calls: list[ProviderCall] = dataclass_field(default_factory=list)
    closed: bool = False

    @classmethod
    def of(
        cls, traceparent: str | None, samples: Samples = parent_samples, tracestate: str | None = None
    ) -> TraceContext:
        """The trace a request with these `traceparent` and `tracestate` headers is served in;
        `samples` says whether its turn's span is recorded, as the tracer's sampler will."""
        parent = parse_traceparent(traceparent)
        trace_id = parent.trace_id if parent is not None else _random_id(128)
        state = tracestate.strip() if parent is not None and tracestate is not None else ""
        return cls(trace_id, parent, samples(trace_id, parent), state or None)

    def call(self) -> ProviderCall | None:
        """A provider call begun now, in this turn (None: the turn is closed)."""
        if self.closed:
            return None
        call = ProviderCall(_random_id(64), time.time_ns())
        self.calls.append(call)
        return call

    def traceparent(self, call: ProviderCall) -> str:
        """The `traceparent` header the provider gets for `call`."""
        return f"00-{self.trace_id:032x}-{call.span_id:016x}-{'01' if self.sampled else '00'}"

    def headed(self, body: Body, call: ProviderCall) -> Body:
        """`body` with the trace headers the provider gets for `call` (taken out and sent as headers)."""
        if self.state is None:
            return {**body, TRACEPARENT: self.traceparent(call)}
        return {**body, TRACEPARENT: self.traceparent(call), TRACESTATE: self.state}


def _random_id(bits: int) -> int:
    while True:  # (all zeros is not a valid id)
        value = random.getrandbits(bits)
        if value:
            return value


# The trace of the request being served (set by `TraceContextMiddleware`, tracing on).
current_trace: ContextVar[TraceContext | None] = ContextVar("gateway_trace", default=None)


class TraceContextMiddleware:
    """Pure ASGI: each POST gets its `TraceContext`, continuing the client's `traceparent`."""

    def __init__(self, app: ASGIApp, samples: Samples = parent_samples) -> None:
        self.app = app
        self.samples = samples

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == b"traceparent"), None)
        states = [v.decode("latin-1") for k, v in scope["headers"] if k == b"tracestate"]
        trace = TraceContext.of(
            value.decode("latin-1") if value else None, self.samples, ",".join(states) if states else None
        )
        token = current_trace.set(trace)
        try:
            await self.app(scope, receive, send)
        finally:
            current_trace.reset(token)


class TracedUpstream(Upstream):
    """An upstream whose chat calls in a traced turn are noted in its `TraceContext`.

    Those calls carry its `traceparent` to the provider; anything else is the wrapped upstream's
    own.
    """

    def __init__(self, inner: Upstream) -> None:
        self.inner = inner
        self.name, self.url = inner.name, inner.url

    @property
    def reports_real_usage(self) -> bool:  # type: ignore[override]
        return self.inner.reports_real_usage

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def complete(self, body: Body, *, waited: float = 0.0) -> Body:
        trace = current_trace.get()
        call = trace.call() if trace is not None else None
        if trace is None or call is None:
            return await self.inner.complete(body, waited=waited)
        try:
            return await self.inner.complete(trace.headed(body, call), waited=waited)
        except asyncio.CancelledError:  # the turn stopped waiting (its client left): not the provider's
            raise
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            call.end_ns = time.time_ns()

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        trace = current_trace.get()
        call = trace.call() if trace is not None else None
        if trace is not None and call is not None:
            body = trace.headed(body, call)
        chunks = self.inner.stream(body, waited=waited)
        try:
            async for chunk in chunks:
                if call is not None and call.first_chunk_ns is None:
                    call.first_chunk_ns = time.time_ns()
                yield chunk
        # The turn stopped reading or waiting (its client left): not the provider's failure.
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException as exc:
            if call is not None:
                call.error = exc
            raise
        finally:
            if call is not None:
                call.end_ns = time.time_ns()
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def list_models(self) -> list[str]:
        return await self.inner.list_models()

    async def describe(self, model: str) -> ServerWindow | None:
        return await self.inner.describe(model)

    async def count_prompt(self, body: Body) -> int | None:
        return await self.inner.count_prompt(body)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Tracing:
    """Tracing off: nothing is recorded, nothing exported."""

    enabled = False  # on: requests get a `TraceContext` and provider calls are traced

    def instrument(self, router: Router) -> None:
        """Wrap `router`'s upstreams so that their calls in a turn are traced (tracing on)."""
        for name, upstream in list(router.upstreams.items()):
            if not isinstance(upstream, TracedUpstream):
                router.upstreams[name] = TracedUpstream(upstream)

    def samples(self, trace_id: int, parent: RemoteParent | None) -> bool:
        """Whether a turn's span in this trace is recorded (its provider is told so)."""
        return parent_samples(trace_id, parent)

    def turn(
        self, outcome: TurnOutcome, status: int, result: str, *, api: str, error: GatewayError | None = None
    ) -> None:
        """Record a closed turn: its span (ending now, begun `outcome.elapsed_ms` ago) and metrics."""

    def summary_call(self, call: SummaryCall) -> None:
        """Record one call to the summarizer model, as a span of its own."""

    def flush(self) -> None:
        """Export what is pending now."""

    def shutdown(self) -> None:
        """Export what is pending and stop (blocking: off the event loop)."""


def server_of(provider: ProviderSettings | None) -> tuple[str, int] | None:
    """`server.address` and `server.port` of a provider with a base URL (None: none, or in process)."""
    if provider is None or not provider.base_url:
        return None
    try:
        parts = urlsplit(provider.base_url)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def error_type(result: str, error: GatewayError | None) -> str | None:
    """`error.type` of a turn that was not answered (None: it was).

    The provider's HTTP status when it answered with an error, else the gateway's error code, else
    how the turn ended (a client that left, a cancellation).
    """
    if result == "complete":
        return None
    if isinstance(error, UpstreamStatusError) and not error.in_band:
        return str(error.upstream_status)
    if error is not None:
        return error.code or error.error_type
    return _RESULT_ERRORS.get(result, "_OTHER")


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def request_attributes(body: JSONObject) -> Attributes:
    """The request parameters the conventions name, as the provider was sent them."""
    attributes: Attributes = {}
    for field, key in _NUMBERS.items():
        value = body.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[key] = float(value)
    for field, key in _INTEGERS.items():
        value = _count(body.get(field))
        if value is not None:
            attributes[key] = value
    choices = _count(body.get("n"))
    if choices is not None and choices != 1:
        attributes["gen_ai.request.choice.count"] = choices
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in as_list(stop) if isinstance(s, str)]
    if stops:
        attributes["gen_ai.request.stop_sequences"] = stops
    return attributes


def usage_attributes(outcome: TurnOutcome) -> Attributes:
    """Token counts, as `gateway_tokens_total` takes them.

    The provider's (the whole prompt, its cached tokens included), else the gateway's own count
    (the window it planned, a stateless prompt's, the answer).
    """
    usage, cache = as_object(outcome.usage), as_object(outcome.cache)
    attributes: Attributes = {}
    prompt = _count(cache.get("prompt_tokens"))
    prompt = prompt if prompt is not None else _count(usage.get("prompt_tokens"))
    if prompt is None and outcome.committed:  # (an answer: what was sent, as we counted it)
        prompt = outcome.prompt_ours
    if prompt is not None:
        attributes["gen_ai.usage.input_tokens"] = prompt
    completion = _count(usage.get("completion_tokens"))
    completion = completion if completion is not None else outcome.output_tokens
    if completion is not None:
        attributes["gen_ai.usage.output_tokens"] = completion
    cached, written = _count(cache.get("cached_tokens")), _count(cache.get("cache_creation_tokens"))
    if cached is not None:
        attributes["gen_ai.usage.cache_read.input_tokens"] = cached
    if written is not None:
        attributes["gen_ai.usage.cache_creation.input_tokens"] = written
    return attributes


def window_attributes(outcome: TurnOutcome) -> Attributes:
    """The gateway's own facts of the turn's window, which no provider-side tracer knows."""
    attributes: Attributes = {
        "gateway.messages.new": outcome.new_messages,
        "gateway.messages.sent": outcome.sent_messages,
    }
    if outcome.window_tokens is None:  # a stateless pass-through plans no window
        return attributes
    tokens = outcome.window_tokens
    optional: dict[str, int | None] = {
        "gateway.messages.stored": outcome.stored_messages,
        "gateway.window.budget": outcome.budget,
        "gateway.window.tokens": tokens.get("total"),
        "gateway.window.truncated": outcome.truncated,
        "gateway.summary.version": outcome.summary_version,
        "gateway.summary.covers_messages": outcome.summary_covers,
        "gateway.summary.tokens": tokens.get("summary") or None,
        "gateway.recap.tokens": tokens.get("recap") or None,
    }
    attributes.update({key: value for key, value in optional.items() if value is not None})
    if outcome.cut is not None:
        attributes["gateway.window.cut"] = outcome.cut
    attributes["gateway.recap.sent"] = outcome.recap
    attributes["gateway.upstream.truncation_suspected"] = outcome.upstream_truncated
    return attributes


def plan_attributes(outcome: TurnOutcome) -> Attributes:
    """The window plan's span.

    The window facts, the window planned for and the calibration of the gateway's token count
    against the provider's it was planned with.
    """
    attributes: Attributes = {"gateway.operation": "plan", **window_attributes(outcome)}
    if outcome.context_window is not None:
        attributes["gateway.window.context_window"] = outcome.context_window
    calibration = outcome.calibration or {}
    for key in ("ratio", "overhead", "margin", "samples"):
        value = calibration.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attributes[f"gateway.calibration.{key}"] = value
    return attributes


def turn_attributes(
    outcome: TurnOutcome,
    server: tuple[str, int] | None,
    status: int,
    result: str,
    *,
    api: str,
    error: GatewayError | None = None,
) -> Attributes:
    """Every attribute of a turn's span: GenAI's, then the gateway's (`gateway.*`)."""
    body = outcome.upstream_body or {}
    model = body.get("model")
    attributes: Attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": outcome.provider,
        "gen_ai.request.model": model if isinstance(model, str) else outcome.model,
        "gen_ai.response.id": outcome.response_id,
    }
    if server is not None:
        attributes["server.address"], attributes["server.port"] = server
    if outcome.conversation_id is not None:
        attributes["gen_ai.conversation.id"] = outcome.conversation_id
        attributes["session.id"] = outcome.conversation_id
    if outcome.stream:
        attributes["gen_ai.request.stream"] = True
    attributes.update(request_attributes(body))
    if outcome.response_model is not None:
        attributes["gen_ai.response.model"] = outcome.response_model
    if outcome.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [outcome.finish_reason]
    attributes.update(usage_attributes(outcome))
    failure = error_type(result, error)
    if failure is not None:
        attributes["error.type"] = failure
    attributes.update(
        {
            "gateway.operation": "turn",
            "gateway.api": api,
            "gateway.request.model": outcome.model,
            "gateway.outcome": result,
            "gateway.status": status,
        }
    )
    if outcome.timings is not None:
        attributes["gateway.upstream.duration"] = outcome.timings["upstream_ms"] / 1000
    attributes.update(window_attributes(outcome))
    return attributes


def metric_attributes(span: Attributes) -> Attributes:
    """The attributes the GenAI metrics take, out of a span's (few values each: no ids)."""
    keys = (
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "server.address",
        "server.port",
        "error.type",
    )
    return {key: span[key] for key in keys if key in span}


def _parts(message: Message) -> list[JSONObject]:
    """A chat message's content as the conventions' message parts."""
    content = message.get("content")
    if message.get("role") == "tool":
        return [{"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content}]
    parts: list[JSONObject] = []
    if isinstance(content, str):
        parts.append({"type": "text", "content": content})
    for part in as_list(content):
        part = as_object(part)
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "content": part.get("text")})
        elif kind == "image_url":
            image = part.get("image_url")
            url = as_object(image).get("url") if isinstance(image, dict) else image
            parts.append({"type": "uri", "modality": "image", "uri": url})
        else:
            parts.append({"type": kind if isinstance(kind, str) else "unknown"})
    for call in as_list(message.get("tool_calls")):
        function = as_object(as_object(call).get("function"))
        arguments = function.get("arguments")
        try:
            arguments = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        except orjson.JSONDecodeError:
            pass
        call_id, name = as_object(call).get("id"), function.get("name")
        parts.append({"type": "tool_call", "id": call_id, "name": name, "arguments": arguments})
    return parts


def content_attributes(outcome: TurnOutcome) -> Attributes:
    """The messages sent and the answer, as `gen_ai.input.messages` and `gen_ai.output.messages`.

    Named as the conventions name them; JSON text: span events take no structured values here.
    """
    sent = messages((outcome.upstream_body or {}).get("messages"))
    inputs = [{"role": m.get("role"), "parts": _parts(m)} for m in sent]
    attributes: Attributes = {"gen_ai.input.messages": orjson.dumps(inputs).decode()}
    answer = outcome.message
    if answer is not None:
        output = {"role": "assistant", "parts": _parts(answer), "finish_reason": outcome.finish_reason}
        attributes["gen_ai.output.messages"] = orjson.dumps([output]).decode()
    return attributes
