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

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

import gateway
from gateway.config import Settings
from gateway.exceptions import GatewayError
from gateway.services.summaries import SummaryCall
from gateway.services.turn import TurnOutcome
from gateway.tracing import (
    CONTENT_EVENT,
    Attributes,
    ExportTargets,
    Tracing,
    content_attributes,
    error_type,
    metric_attributes,
    server_of,
    turn_attributes,
)
from gateway.types import as_object, first_choice

log = logging.getLogger("gateway")

SCOPE = "gateway"
# The GenAI conventions' advised bucket boundaries.
TOKEN_BUCKETS = [4.0**i for i in range(14)]  # 1, 4, 16, ... 67108864
DURATION_BUCKETS = [0.01 * 2**i for i in range(14)]  # 0.01, 0.02, 0.04, ... 81.92


class OtelTracing(Tracing):
    """Spans and GenAI metrics for every turn and summarizer call, exported over OTLP/HTTP
    (`span_exporter`, `metric_reader`: what tests read instead)."""

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
        self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
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
        self._failed = False

    def turn(
        self, outcome: TurnOutcome, status: int, result: str, *, api: str, error: GatewayError | None = None
    ) -> None:
        try:
            server = self.servers.get(outcome.provider)
            attributes = turn_attributes(outcome, server, status, result, api=api, error=error)
            content = content_attributes(outcome) if self.capture_content else None
            message = error.message[:300] if error is not None else None
            self._record(attributes, outcome.elapsed_ms / 1000, content, message)
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
                "gen_ai.conversation.id": call.conversation_id,
            }
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
            self._record(attributes, call.seconds, None, message)
        except Exception:  # noqa: BLE001 - tracing never fails a summary
            self._note_failure()

    def _record(
        self, attributes: Attributes, seconds: float, content: Attributes | None, message: str | None
    ) -> None:
        """One CLIENT span that ended now, `seconds` long, and its GenAI metrics."""
        end = time.time_ns()
        name = f"chat {attributes['gen_ai.request.model']}"
        span = self.tracer.start_span(
            name, kind=SpanKind.CLIENT, attributes=attributes, start_time=end - int(seconds * 1e9)
        )
        if content is not None:
            span.add_event(CONTENT_EVENT, attributes=content, timestamp=end)
        if "error.type" in attributes:
            span.set_status(Status(StatusCode.ERROR, message))
        span.end(end_time=end)
        dimensions = metric_attributes(attributes)
        self.duration.record(seconds, dimensions)
        for kind in ("input", "output"):
            tokens = attributes.get(f"gen_ai.usage.{kind}_tokens")
            if isinstance(tokens, int):
                self.token_usage.record(tokens, {**dimensions, "gen_ai.token.type": kind})

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


def _error_of(exc: BaseException) -> str:
    """`error.type` of a failed call: the gateway's error code, else what the exception is."""
    if isinstance(exc, GatewayError):
        return error_type("error", exc) or "_OTHER"
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__


def _resource_attributes(settings: Settings, environ: Mapping[str, str]) -> Attributes:
    """`service.name` (the configured one; else `OTEL_SERVICE_NAME`, else "gateway") and
    `service.version`; `OTEL_RESOURCE_ATTRIBUTES` adds to them (`Resource.create`)."""
    attributes: Attributes = {"service.version": gateway.__version__}
    if "service_name" in settings.tracing.model_fields_set or not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = settings.tracing.service_name
    return attributes
