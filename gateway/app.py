"""The composition root: `create_app` wires the services, the jobs and the HTTP routes into one app.

`create_app(settings, *, store=None, router=None)` wires the services, the background jobs and the
HTTP routes into one ASGI application.

Tests pass twins (MemoryStore, a Router over MockUpstream); production builds both from settings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

import gateway.metrics
from gateway.api import compaction, health, messages, ui
from gateway.api import completions as stored
from gateway.api import conversations as conv
from gateway.api import responses as resp
from gateway.api.background import BackgroundRuns
from gateway.api.chat import chat_completions
from gateway.api.direct import GatewayApp
from gateway.config import Settings, load_settings
from gateway.exceptions import GatewayError
from gateway.jobs.heap import HeapTrimmer, freeze_startup_heap
from gateway.jobs.processor import Processor
from gateway.jobs.summarizer import Summarizer
from gateway.metrics import Metrics, MetricsMiddleware, metrics_endpoint
from gateway.services import Services, StoreBackend
from gateway.services.models import litellm_windows
from gateway.tenants import LOOPBACK_HOSTS, AuthMiddleware, Tenants
from gateway.tokens import get_encoding, release_free_memory
from gateway.tracing import EXTRA_HINT, TraceContextMiddleware, Tracing, export_targets
from gateway.upstream import Router

log = logging.getLogger("gateway")


def warm_up(serving: bool = False) -> None:
    """Load what the first request would otherwise load on the event loop.

    Then, in a serving process (`serving`), freeze what is loaded out of the garbage collector.
    """
    get_encoding("cl100k_base")
    litellm_windows()
    if serving:
        freeze_startup_heap()  # its one full collection (about 20 ms, the GIL held) serves both
    release_free_memory(collect=not serving)


def tracing_for(settings: Settings, environ: Mapping[str, str] | None = None) -> Tracing:
    """The app's tracing: exporting where configured (`gateway.tracing.export_targets`), else off.

    Off, opentelemetry is not imported. Configured without the `tracing` extra: a warning, and off.
    """
    targets = export_targets(settings.tracing, os.environ if environ is None else environ)
    if targets is None:
        return Tracing()
    try:
        from gateway.otel import OtelTracing
    except ImportError as exc:
        log.warning(
            "tracing is configured (%s) but the OpenTelemetry SDK is not installed (%s): "
            "%s -m pip install %s (the `tracing` extra; an image: --build-arg EXTRAS=tracing); "
            "running without tracing",
            targets.traces,
            exc.name,
            sys.executable,
            EXTRA_HINT,
        )
        return Tracing()
    return OtelTracing(settings, targets)


def create_app(
    settings: Settings | None = None,
    *,
    store: StoreBackend | None = None,
    router: Router | None = None,
    tracing: Tracing | None = None,
    serving: bool = False,
) -> GatewayApp:
    """Wire the services, the background jobs and the HTTP routes into one ASGI application.

    `serving`: this process serves only this app (`gateway serve`): once started, its garbage
    collector is tuned (gateway.jobs.heap.freeze_startup_heap). Tests and embedders leave it off.
    `tracing`: instead of what `[tracing]` configures (tests pass one with an in-memory exporter).
    """
    settings = settings or load_settings()
    services = Services.from_settings(settings, store=store, router=router)
    stores, router, service = services.stores, services.router, services.turns
    tenants = Tenants.from_settings(settings)
    tracing = tracing or tracing_for(settings)
    if tracing.enabled:
        tracing.instrument(router)
    metrics = Metrics(active_window=settings.sessions.idle_after or 900.0, tracing=tracing)
    services.summaries.on_call = tracing.summary_call
    summarizer = Summarizer(services.summaries)
    service.schedule_summary = summarizer.schedule
    summarizer.on_outcome = lambda outcome: metrics.summaries.labels(outcome).inc()
    services.summaries.on_version = lambda: metrics.summaries.labels("ok").inc()
    services.sessions.on_failed = lambda: metrics.summaries.labels("failed").inc()
    service.on_context_refusal = lambda outcome: metrics.context_refusals.labels(outcome).inc()
    services.facts.on_rejected = lambda provider: metrics.child(metrics.calibration_rejected, provider).inc()
    gateway.metrics.refused_below_app = lambda route, status: metrics.child(
        metrics.requests, route, str(status)
    ).inc()
    processor = Processor(settings, services.sessions)
    background = BackgroundRuns(settings.server.background_responses, settings.server.background_events)
    trimmer = HeapTrimmer()

    @asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        await services.open()
        await services.warm()
        # Load the default tokenizer in the background: the first request need not pay for it.
        warm = asyncio.get_running_loop().run_in_executor(None, warm_up, serving)
        warm.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        service.warm_up = warm
        processor.start()
        trimmer.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await background.aclose()  # (each closed as cancelled: nothing half-written)
            await trimmer.stop()
            await processor.stop()
            await summarizer.aclose()
            await services.aclose()
            await asyncio.to_thread(tracing.shutdown)  # the spans still pending are exported

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions", stored.list_completions, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", stored.get_completion, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", stored.update_completion, methods=["POST"]),
        Route("/v1/chat/completions/{completion_id}", stored.delete_completion, methods=["DELETE"]),
        Route("/v1/chat/completions/{completion_id}/messages", stored.list_messages, methods=["GET"]),
        Route("/v1/models", health.models, methods=["GET"]),
        Route("/v1/models/{model:path}", health.model, methods=["GET"]),
        Route("/v1/conversations", conv.create_conversation, methods=["POST"]),
        Route("/v1/conversations", conv.list_conversations, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", conv.get_conversation, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", conv.update_conversation, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", conv.delete_conversation, methods=["DELETE"]),
        Route("/v1/conversations/{conversation_id}/reset", conv.reset_conversation, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}/context", conv.conversation_context, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items", conv.list_items, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items", conv.create_items, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", conv.get_item, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", conv.delete_item, methods=["DELETE"]),
        Route("/v1/responses", resp.create_response, methods=["POST"]),
        Route("/v1/responses/input_tokens", resp.count_input_tokens, methods=["POST"]),
        Route("/v1/responses/compact", compaction.compact_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", resp.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", resp.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", resp.cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", resp.list_input_items, methods=["GET"]),
        Route("/v1/messages", messages.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/ui", ui.page, methods=["GET"]),
        Route("/ui/", ui.page, methods=["GET"]),
        Route("/ui/static/{name}", ui.static, methods=["GET"]),
        Route("/ui/api/conversations", ui.conversations, methods=["GET"]),
        Route("/ui/api/conversations/{conversation_id}", ui.conversation, methods=["GET"]),
        Route("/openapi.json", health.openapi, methods=["GET"]),
        Route("/healthz", health.healthz, methods=["GET"]),
        Route("/readyz", health.readyz, methods=["GET"]),
    ]
    app = GatewayApp(
        # a turn's POSTs: their routes' endpoints, without the router's layers
        direct=("/v1/chat/completions", "/chat/completions", "/v1/responses", "/v1/messages"),
        routes=routes,
        lifespan=lifespan,
        middleware=[
            *([Middleware(TraceContextMiddleware, samples=tracing.samples)] if tracing.enabled else []),
            Middleware(MetricsMiddleware, metrics=metrics),
            # (`serving`: a serving process, listening where settings.server says)
            Middleware(
                AuthMiddleware, tenants=tenants, loopback=serving and settings.server.host in LOOPBACK_HOSTS
            ),
        ],
        exception_handlers={
            GatewayError: health.gateway_error,
            HTTPException: health.http_error,
            OSError: health.os_error,
            Exception: health.unexpected,
        },
    )
    app.state.settings = settings
    app.state.stores = stores
    app.state.metrics = metrics
    app.state.tracing = tracing
    app.state.processor = processor
    app.state.trimmer = trimmer
    app.state.summarizer = summarizer
    app.state.tenants = tenants
    app.state.router = router
    app.state.services = services
    app.state.service = service
    app.state.started = time.time()
    app.state.background = background
    app.state.ready = False
    return app


def app_from_env() -> GatewayApp:
    """Factory for `uvicorn --factory` (and worker processes): settings from the environment."""
    from gateway.server import configure_worker_logging, follow_supervisor, set_head_timeout

    configure_worker_logging()
    follow_supervisor()
    settings = load_settings()
    set_head_timeout(settings)
    return create_app(settings, serving=True)
