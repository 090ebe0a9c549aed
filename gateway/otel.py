"""Tracing on: GenAI spans and metrics exported over OTLP/HTTP with the OpenTelemetry SDK.

The only module that imports opentelemetry (the `tracing` extra); `gateway.app.tracing_for`
imports it only when tracing is configured. Spans are made when a turn has closed, with the
turn's own start time: nothing is traced on the request path but one span's creation, and
exporting runs in the SDK's threads. The providers are this app's own (never the global ones).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

import gateway
from gateway.config import Settings
from gateway.exceptions import GatewayError, UpstreamStatusError
from gateway.services.summaries import SummaryCall
from gateway.services.turn import TurnOutcome
from gateway.tracing import (
    CONTENT_EVENT,
    Attributes,
    ExportTargets,
    ProviderCall,
    RemoteParent,
    TraceContext,
    Tracing,
    content_attributes,
    current_trace,
    error_type,
    metric_attributes,
    parent_samples,
    plan_attributes,
    server_of,
    turn_attributes,
)
from gateway.types import as_object, first_choice

log = logging.getLogger("gateway")

SCOPE = "gateway"
# The GenAI conventions' advised bucket boundaries.
TOKEN_BUCKETS = [4.0**i for i in range(14)]  # 1, 4, 16, ... 67108864
DURATION_BUCKETS = [0.01 * 2**i for i in range(14)]  # 0.01, 0.02, 0.04, ... 81.92


class PresetIds(RandomIdGenerator):
    """Random ids, but the one set for the next span (or trace) when there is one.

    Spans made after the fact keep the ids their provider calls were already told.
    """

    def __init__(self) -> None:
        self.span_id: int | None = None
        self.trace_id: int | None = None

    def generate_span_id(self) -> int:
        preset, self.span_id = self.span_id, None
        return preset or super().generate_span_id()

    def generate_trace_id(self) -> int:
        preset, self.trace_id = self.trace_id, None
        return preset or super().generate_trace_id()


class OtelTracing(Tracing):
    """Spans and GenAI metrics for every turn and summarizer call, exported over OTLP/HTTP.

    `span_exporter`, `metric_reader`: what tests read instead.
    """

    enabled = True

    def __init__(
        self,
        settings: Settings,
        targets: ExportTargets | None = None,
        *,
        span_exporter: SpanExporter | None = None,
        metric_reader: MetricReader | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.capture_content = settings.tracing.capture_content
        self.servers = {name: server_of(provider) for name, provider in settings.providers.items()}
        resource = Resource.create(_resource_attributes(settings, os.environ if environ is None else environ))
        if span_exporter is None:
            assert targets is not None
            span_exporter = OTLPSpanExporter(endpoint=targets.traces)
        self.ids = PresetIds()
        self.tracer_provider = TracerProvider(
            resource=resource, id_generator=self.ids, shutdown_on_exit=False
        )
        self.tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        self.tracer = self.tracer_provider.get_tracer(SCOPE, gateway.__version__)
        if metric_reader is None and targets is not None and targets.metrics is not None:
            metric_reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=targets.metrics))
        readers = [metric_reader] if metric_reader is not None else []
        self.meter_provider = MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
        meter = self.meter_provider.get_meter(SCOPE, gateway.__version__)
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.first_chunk = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            unit="s",
            description="Time to receive the first chunk of a streamed answer.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self._failed = False

    def turn(
        self, outcome: TurnOutcome, status: int, result: str, *, api: str, error: GatewayError | None = None
    ) -> None:
        trace = current_trace.get()
        if trace is not None:
            trace.closed = True  # what the request does from now on is not this turn's
        try:
            server = self.servers.get(outcome.provider)
            attributes = turn_attributes(outcome, server, status, result, api=api, error=error)
            content = content_attributes(outcome) if self.capture_content else None
            message = error.message[:300] if error is not None else None
            end = time.time_ns()
            # The turn's own start (a stream's turn closes before its last events are sent and
            # its line logged: counted back from now, the start would come out late).
            start = outcome.started_ns or end - int(outcome.elapsed_ms * 1e6)
            calls = trace.calls if trace is not None else []
            first = next((c.first_chunk_ns for c in reversed(calls) if c.first_chunk_ns is not None), None)
            if outcome.stream and first is not None:
                attributes["gen_ai.response.time_to_first_chunk"] = (first - start) / 1e9
            span = self._span(attributes, start, self._parent(trace), content, message)
            self._turn_steps(span, outcome, calls, server, start, end)
            span.end(end_time=end)
            self._measure(attributes, (end - start) / 1e9)
        except Exception:  # noqa: BLE001 - tracing never fails a turn
            self._note_failure()

    def summary_call(self, call: SummaryCall) -> None:
        try:
            completion = call.completion or {}
            attributes: Attributes = {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": call.provider,
                "gen_ai.request.model": call.model,
                "gen_ai.request.max_tokens": call.max_tokens,
            }
            if call.conversation_id is not None:  # (a compaction of a request's input names none)
                attributes["gen_ai.conversation.id"] = attributes["session.id"] = call.conversation_id
            server = self.servers.get(call.provider)
            if server is not None:
                attributes["server.address"], attributes["server.port"] = server
            for field, key in (("id", "gen_ai.response.id"), ("model", "gen_ai.response.model")):
                if isinstance(completion.get(field), str):
                    attributes[key] = str(completion[field])
            finish = first_choice(completion).get("finish_reason")
            if isinstance(finish, str):
                attributes["gen_ai.response.finish_reasons"] = [finish]
            usage = as_object(completion.get("usage"))
            for field, kind in (("prompt_tokens", "input"), ("completion_tokens", "output")):
                tokens = usage.get(field)
                if isinstance(tokens, int) and not isinstance(tokens, bool):
                    attributes[f"gen_ai.usage.{kind}_tokens"] = tokens
            message = None
            if call.error is not None:
                attributes["error.type"] = _error_of(call.error)
                message = str(call.error)[:300]
            attributes["gateway.operation"] = "summary"
            end = time.time_ns()
            start = end - int(call.seconds * 1e9)
            self._span(attributes, start, Context(), None, message).end(end_time=end)
            self._measure(attributes, call.seconds)
        except Exception:  # noqa: BLE001 - tracing never fails a summary
            self._note_failure()

    def samples(self, trace_id: int, parent: RemoteParent | None) -> bool:
        """Whether a turn's span in this trace is recorded: the tracer's sampler asked now, as it
        is asked again when the span begins (`OTEL_TRACES_SAMPLER`; a provider told "sampled" of a
        trace the gateway drops would record its spans under a parent never exported)."""
        try:
            context = self._remote(trace_id, parent) if parent is not None else None
            kind = SpanKind.CLIENT
            decision = self.tracer_provider.sampler.should_sample(context, trace_id, "chat", kind)
            return bool(decision.decision == Decision.RECORD_AND_SAMPLE)  # (RECORD_ONLY: not exported)
        except Exception:  # noqa: BLE001 - tracing never fails a turn
            self._note_failure()
            return parent_samples(trace_id, parent)

    @staticmethod
    def _remote(trace_id: int, parent: RemoteParent, state: str | None = None) -> Context:
        """A context whose span is the client's (`traceparent`, `tracestate`), for a span continuing
        it."""
        flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
        trace_state = TraceState.from_header([state]) if state else None
        remote = SpanContext(
            trace_id, parent.span_id, is_remote=True, trace_flags=flags, trace_state=trace_state
        )
        return set_span_in_context(NonRecordingSpan(remote))

    def _parent(self, trace: TraceContext | None) -> Context:
        """The context a turn's span starts in: the client's span, else a new trace.

        The new trace is the one its provider calls were told.
        """
        if trace is None:
            return Context()
        if trace.parent is None:
            self.ids.trace_id = trace.trace_id
            return Context()
        return self._remote(trace.trace_id, trace.parent, trace.state)

    def _span(
        self,
        attributes: Attributes,
        start: int,
        parent: Context,
        content: Attributes | None,
        message: str | None,
    ) -> Span:
        """A CLIENT span `chat {model}` begun at `start`, its status ERROR with an `error.type`."""
        name = f"chat {attributes['gen_ai.request.model']}"
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.CLIENT, attributes=attributes, start_time=start
        )
        if content is not None:
            span.add_event(CONTENT_EVENT, attributes=content)
        if "error.type" in attributes:
            span.set_status(Status(StatusCode.ERROR, message))
        return span

    def _turn_steps(
        self,
        span: Span,
        outcome: TurnOutcome,
        calls: list[ProviderCall],
        server: tuple[str, int] | None,
        start: int,
        end: int,
    ) -> None:
        """Record the turn's steps as child spans: the window plan, each provider call, and the commit.

        The window plan spans from the turn's start to its first provider call, the commit from the
        answer to the close.
        """
        context = set_span_in_context(span)
        timings = outcome.timings
        if timings is not None:
            planned = start + int((timings["total_ms"] - timings["upstream_ms"]) * 1e6)
            planned = min(planned, calls[0].start_ns) if calls else planned  # (the clocks' skew)
            self.tracer.start_span(
                "plan window", context=context, attributes=plan_attributes(outcome), start_time=start
            ).end(end_time=planned)
        for call in calls:
            self.ids.span_id = call.span_id  # the id the provider was told
            attributes = call_attributes(outcome.provider, server, call)
            child = self.tracer.start_span(
                f"upstream {outcome.provider}",
                context=context,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                start_time=call.start_ns,
            )
            if call.error is not None:
                child.set_status(Status(StatusCode.ERROR, str(call.error)[:300]))
            child.end(end_time=call.end_ns or end)
        if timings is not None and outcome.committed:
            answered = start + int(timings["total_ms"] * 1e6)
            answered = max(answered, calls[-1].end_ns or answered) if calls else answered
            commit = self.tracer.start_span(
                "commit", context=context, attributes={"gateway.operation": "commit"}, start_time=answered
            )
            commit.end(end_time=max(answered, end))

    def _measure(self, attributes: Attributes, seconds: float) -> None:
        """The GenAI metrics of one operation `seconds` long, as its span's attributes say."""
        dimensions = metric_attributes(attributes)
        self.duration.record(seconds, dimensions)
        for kind in ("input", "output"):
            tokens = attributes.get(f"gen_ai.usage.{kind}_tokens")
            if isinstance(tokens, int):
                self.token_usage.record(tokens, {**dimensions, "gen_ai.token.type": kind})
        first = attributes.get("gen_ai.response.time_to_first_chunk")
        if isinstance(first, float):
            self.first_chunk.record(first, dimensions)

    def _note_failure(self) -> None:
        if not self._failed:  # once: a broken exporter must not flood the log
            self._failed = True
            log.exception("tracing: could not record a span (further failures are not logged)")

    def flush(self) -> None:
        self.tracer_provider.force_flush()
        self.meter_provider.force_flush()

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def call_attributes(provider: str, server: tuple[str, int] | None, call: ProviderCall) -> Attributes:
    """A provider call's span: the provider, its time to a stream's first chunk, and how it failed.

    `gateway.upstream.context_refused`: it refused the prompt as too long.
    """
    attributes: Attributes = {"gateway.operation": "upstream", "gen_ai.provider.name": provider}
    if server is not None:
        attributes["server.address"], attributes["server.port"] = server
    if call.first_chunk_ns is not None:
        attributes["gen_ai.response.time_to_first_chunk"] = (call.first_chunk_ns - call.start_ns) / 1e9
    if call.error is not None:
        attributes["error.type"] = _error_of(call.error)
        refused = isinstance(call.error, UpstreamStatusError) and call.error.refusal is not None
        attributes["gateway.upstream.context_refused"] = refused
    return attributes


def _error_of(exc: BaseException) -> str:
    """`error.type` of a failed call: the gateway's error code, else what the exception is."""
    if isinstance(exc, GatewayError):
        return error_type("error", exc) or "_OTHER"
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__


def _resource_attributes(settings: Settings, environ: Mapping[str, str]) -> Attributes:
    """`service.name` and `service.version`; `OTEL_RESOURCE_ATTRIBUTES` adds to them.

    `service.name` is the configured one; else `OTEL_SERVICE_NAME`, else the one
    `OTEL_RESOURCE_ATTRIBUTES` names, else "gateway". The additions are made by `Resource.create`.
    """
    attributes: Attributes = {"service.version": gateway.__version__}
    named = environ.get("OTEL_SERVICE_NAME") or any(
        pair.partition("=")[0].strip() == "service.name"
        for pair in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    )
    if "service_name" in settings.tracing.model_fields_set or not named:
        attributes["service.name"] = settings.tracing.service_name
    return attributes
