"""The turn endpoints reached without Starlette's router: fewer layers on every turn and chunk.

A turn's POST (`/v1/chat/completions`, `/v1/responses`, `/v1/messages`) is most of what a gateway
serves. Through Starlette it passes its exception middleware, its router (a regular expression
per route until one matches) and its route's two wrappers, and every message it sends passes
three more functions. `GatewayApp` gives those exact paths their own chain: the same
middlewares (built from the same list) and the same exception handlers, with Starlette's
server-error middleware outermost as in its own stack, and an endpoint layer that calls the
handler and sends its response. Every other request, and anything under a `root_path`, goes
through Starlette as before.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


class DirectEndpoints:
    """ASGI: the endpoint for the request's path, its exceptions answered by `handlers`.

    As Starlette's route does: the scope gets its `endpoint` and (empty) `path_params`, and an
    exception the endpoint raises is answered by the handler of its nearest class (an
    `HTTPException` by its status's first). One without a handler, or raised while the response
    is sent, goes on up (to the server-error middleware: a 500 unless the answer began)."""

    def __init__(self, endpoints: Mapping[str, Endpoint], handlers: Mapping[Any, Handler]) -> None:
        self.endpoints = dict(endpoints)
        self.handlers: dict[Any, Handler] = dict(handlers)

    def handler_for(self, exc: Exception) -> Handler | None:
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints[scope["path"]]
        scope["endpoint"] = endpoint
        scope["path_params"] = {}
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = self.handler_for(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
            exc.__traceback__ = None  # (a reused exception instance would collect tracebacks)
        await response(scope, receive, send)


# Paths whose last part is an id that may hold a "/" (a model's: "ollama/phi4-mini"), which
# clients send encoded ("%2F").
SLASHED_IDS = (b"/v1/models/",)


def kept_slashes(raw_path: bytes) -> str:
    """The request's path decoded but for its encoded slashes ("%2F"), which stay as written."""
    path = raw_path.split(b"?", 1)[0].decode("latin-1")
    return "%2F".join(unquote(part) for part in re.split("%2[fF]", path))


class GatewayApp(Starlette):
    """Starlette, with the POSTs to `direct` paths served by `DirectEndpoints` behind the same middlewares.

    Each path's endpoint is its POST route's, among `routes`: one table says what a path runs."""

    def __init__(self, *, direct: Iterable[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # A path with a slash more is no route, not a redirect to the path without it: an id that
        # ends in "/" (or "%2F") named another resource, which a client following the 307 changed.
        self.router.redirect_slashes = False
        paths = set(direct)
        self.direct: dict[str, Endpoint] = {
            route.path: route.endpoint
            for route in self.routes
            if isinstance(route, Route) and route.path in paths and "POST" in (route.methods or ())
        }
        missing = paths - self.direct.keys()
        if missing:
            raise ValueError(f"no POST route for the direct paths {sorted(missing)}")
        self.direct_stack: ASGIApp | None = None

    def build_direct_stack(self) -> ASGIApp:
        """The middlewares Starlette builds, around `DirectEndpoints` instead of its router."""
        handlers = {k: v for k, v in self.exception_handlers.items() if k not in (500, Exception)}
        server_error = self.exception_handlers.get(500) or self.exception_handlers.get(Exception)
        app: ASGIApp = DirectEndpoints(self.direct, handlers)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return ServerErrorMiddleware(app, handler=server_error, debug=self.debug)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path") or b""
            if b"%2f" in raw.lower() and not raw.startswith(SLASHED_IDS):
                # An encoded "/" is part of the segment it is in, never a separator: decoded before
                # routing, "ID%2Freset" reached the reset route of conversation ID.
                scope["path"] = kept_slashes(raw)
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in self.direct
            and not scope.get("root_path")
        ):
            scope["app"] = self
            if self.direct_stack is None:
                self.direct_stack = self.build_direct_stack()
            await self.direct_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
