"""The ASGI application: `create_app(settings, *, store=None, router=None)`.

Tests pass twins (MemoryStore, a Router over MockUpstream); production builds both from settings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api import conversations as conv
from gateway.api import responses as resp
from gateway.api import ui
from gateway.api.chat import chat_completions
from gateway.api.http import JSONBody, error_response
from gateway.api.openapi import build_schema
from gateway.config import Settings, load_settings
from gateway.exceptions import GatewayError, NotFound
from gateway.lifecycle import Processor
from gateway.metrics import Metrics, MetricsMiddleware, metrics_endpoint
from gateway.services.models import _litellm_windows
from gateway.services.turns import ChatService
from gateway.store import Store, StoreRegistry
from gateway.tenants import DEFAULT_TENANT, AuthMiddleware, Tenants
from gateway.tokens import get_encoding, release_free_memory
from gateway.upstream import Router

log = logging.getLogger("gateway")


def warm_up() -> None:
    """Load what the first request would otherwise load on the event loop."""
    get_encoding("cl100k_base")
    _litellm_windows()
    release_free_memory()


async def models(request: Request) -> Response:
    settings: Settings = request.app.state.settings
    created = int(request.app.state.started)
    data: list[dict[str, Any]] = []
    for name in settings.models:
        provider = name.partition("/")[0] if "/" in name else settings.default_provider
        data.append({"id": name, "object": "model", "created": created, "owned_by": provider})
    for name, provider_settings in settings.providers.items():
        if provider_settings.kind == "demo":
            data.append({"id": name, "object": "model", "created": created, "owned_by": "gateway"})
    return JSONBody({"object": "list", "data": data})


async def openapi(request: Request) -> Response:
    schema = getattr(request.app.state, "openapi", None)
    if schema is None:
        schema = request.app.state.openapi = orjson.dumps(build_schema())
    return Response(schema, media_type="application/json")


async def healthz(request: Request) -> Response:
    return JSONBody({"status": "ok"})


async def readyz(request: Request) -> Response:
    if not getattr(request.app.state, "ready", False):
        return JSONBody({"status": "starting"}, status_code=503)
    reason = request.app.state.stores.refusing_writes()
    if reason is not None:
        # Out of the load balancer: this process acknowledges no writes until restarted.
        return JSONBody({"status": "storage_unavailable", "reason": reason}, status_code=503)
    return JSONBody({"status": "ready"})


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFound(f"Unknown path {request.url.path}", code="unknown_url"))
    err = GatewayError(str(exc.detail))
    err.status_code = exc.status_code
    err.error_type = "invalid_request_error"
    return error_response(err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(GatewayError("Internal gateway error; see the gateway log"))


def create_app(
    settings: Settings | None = None,
    *,
    store: Store | None = None,
    router: Router | None = None,
) -> Starlette:
    settings = settings or load_settings()
    stores = StoreRegistry(settings, default=store)
    router = router or Router.from_settings(settings)
    tenants = Tenants.from_settings(settings)
    service = ChatService(settings, router)
    metrics = Metrics(active_window=settings.sessions.idle_after or 900.0)
    service.summarizer.on_outcome = lambda outcome: metrics.summaries.labels(outcome).inc()
    service.on_context_refusal = lambda outcome: metrics.context_refusals.labels(outcome).inc()
    processor = Processor(settings, stores, service.summarizer)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await stores.get(DEFAULT_TENANT)
        # Load the default tokenizer in the background: the first request need not pay for it.
        warm = asyncio.get_running_loop().run_in_executor(None, warm_up)
        warm.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        service.warm_up = warm
        processor.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await processor.stop()
            await service.summarizer.aclose()
            await router.aclose()
            await stores.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
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
        Route("/v1/responses/{response_id}", resp.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", resp.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", resp.list_input_items, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/ui", ui.page, methods=["GET"]),
        Route("/ui/", ui.page, methods=["GET"]),
        Route("/ui/static/{name}", ui.static, methods=["GET"]),
        Route("/ui/api/conversations", ui.conversations, methods=["GET"]),
        Route("/ui/api/conversations/{conversation_id}", ui.conversation, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(MetricsMiddleware, metrics=metrics),
            Middleware(AuthMiddleware, tenants=tenants),
        ],
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.settings = settings
    app.state.stores = stores
    app.state.metrics = metrics
    app.state.processor = processor
    app.state.tenants = tenants
    app.state.router = router
    app.state.service = service
    app.state.started = time.time()
    app.state.ready = False
    return app


def app_from_env() -> Starlette:
    """Factory for `uvicorn --factory` (and worker processes): settings from the environment."""
    from gateway.server import set_head_timeout

    settings = load_settings()
    set_head_timeout(settings)
    return create_app(settings)
