"""Service endpoints (models, the OpenAPI document, liveness and readiness) and the error handlers.

The error handlers render every failure in the shape of the API its path belongs to (OpenAI's,
or Anthropic's under /v1/messages).
"""

from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import JSONBody, error_response_at, services_of
from gateway.api.openapi import build_schema
from gateway.exceptions import GatewayError, NotFound, StorageError

log = logging.getLogger("gateway")


async def _model_objects(request: Request) -> list[dict[str, object]]:
    """The `/v1/models` entries, in OpenAI's model object shape."""
    created = int(request.app.state.started)
    entries = await services_of(request).model_catalog.models()
    return [{"id": e.id, "object": "model", "created": created, "owned_by": e.owned_by} for e in entries]


async def models(request: Request) -> Response:
    return JSONBody({"object": "list", "data": await _model_objects(request)})


async def model(request: Request) -> Response:
    """`GET /v1/models/{model}` (the SDK's `models.retrieve`): one entry of the list, or 404."""
    wanted = request.path_params["model"]
    if not wanted:  # (`/v1/models/`: no model named, a path of its own)
        raise NotFound(f"Unknown path {request.url.path}", code="unknown_url")
    for entry in await _model_objects(request):
        if entry["id"] == wanted:
            return JSONBody(entry)
    raise NotFound(f"The model {wanted!r} does not exist", param="model", code="model_not_found")


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
    reason = await services_of(request).readiness()
    if reason is not None:
        # Out of the load balancer while the store cannot take writes.
        return JSONBody({"status": "storage_unavailable", "reason": reason}, status_code=503)
    return JSONBody({"status": "ready"})


async def gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return error_response_at(request.url.path, exc)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response_at(
            request.url.path, NotFound(f"Unknown path {request.url.path}", code="unknown_url")
        )
    err = GatewayError(str(exc.detail))
    err.status_code = exc.status_code
    err.error_type = "invalid_request_error"
    return error_response_at(request.url.path, err)


async def os_error(request: Request, exc: Exception) -> Response:
    """The OS refused something no layer mapped (files, descriptors): 503, not a crash."""
    assert isinstance(exc, OSError)
    log.error("the system refused an operation on %s: %r", request.url.path, exc)
    reason = exc.strerror or type(exc).__name__
    return error_response_at(request.url.path, StorageError(f"the system refused an operation: {reason}"))


async def unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response_at(request.url.path, GatewayError("Internal gateway error; see the gateway log"))
