"""HTTP plumbing shared by the routes.

Bounded body reading (size and time), errors in the shape of the API a path belongs to (OpenAI's;
Anthropic's under /v1/messages), disconnect watching, and a server-sent-events response that
reports how it ended."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.context.anthropic import error_body
from gateway.coroutines import resume
from gateway.exceptions import (
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    ClientGone,
    GatewayError,
    InvalidRequest,
    UnsupportedEncoding,
)
from gateway.services import Services
from gateway.services.turn import PreparedTurn
from gateway.types import ascii_int

T = TypeVar("T")

# Set in a request's scope by the server's protocol (gateway.protocol) once its whole body is in.
BODY_COMPLETE = "gateway.body_complete"
# An attribute the server's protocol gives each request cycle (the object whose method `receive`
# is): a callable set there is called when the client's connection is lost mid-request.
ON_GONE = "gateway_on_gone"


class JSONBody(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


# Anthropic's Messages API: its errors are in Anthropic's shape.
ANTHROPIC_PATHS = "/v1/messages"


def error_response(exc: GatewayError) -> Response:
    return JSONBody(exc.to_dict(), status_code=exc.status_code, headers=exc.headers())


def anthropic_error_response(exc: GatewayError, request_id: str | None = None) -> Response:
    """The error in Anthropic's shape, its `request_id` in the body and the `request-id` header.

    `request_id`: the turn's response id once there is one; else one made for this answer."""
    request_id = request_id or f"req_{secrets.token_hex(12)}"
    body = error_body(exc.status_code, exc.message, request_id)
    return JSONBody(body, status_code=exc.status_code, headers={**exc.headers(), "request-id": request_id})


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def error_response_at(path: str, exc: GatewayError) -> Response:
    """The error in the shape of the API `path` belongs to."""
    return anthropic_error_response(exc) if is_anthropic_path(path) else error_response(exc)


def tenant_of(request: Request) -> str:
    """This request's tenant (the auth middleware has resolved it from the key)."""
    return str(request.scope.get("gateway.tenant", ""))


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


async def read_json(request: Request, limit: int, *, allow_empty: bool = False) -> Any:
    """The request body decoded, refusing bodies too large or too slow to arrive.

    Too large: over `limit` bytes, refused before they are read whole. Too slow: taking longer
    than `server.body_timeout` to arrive (slow-body clients)."""
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        # (read as it is, a gzip body was "not valid JSON", and a plain one labelled `br` taken)
        raise UnsupportedEncoding(
            f"A request body with Content-Encoding {encoding!r} is not taken: send it uncompressed"
        )
    declared = request.headers.get("content-length")
    size = ascii_int(declared, 30) if declared is not None else None
    if size is not None and size > limit:
        raise BodyTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes")
    data = await read_body(request, limit)
    if not data and allow_empty:
        return {}
    if not data:
        raise InvalidRequest("The request body is empty; a JSON object is expected")
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        # Stored records wrap a message a few levels deeper, and the writer stops at 254.
        raise InvalidRequest(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes, within `server.body_timeout`.

    A body the server has already received whole (our protocol says so in the scope) is taken at
    once: no deadline to arm, no stream to iterate."""
    if request.scope.get(BODY_COMPLETE):
        message = await request.receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            data: bytes = message.get("body", b"")
            if len(data) > limit:
                raise BodyTooLarge(f"Request body exceeds the limit of {limit} bytes")
            return data
        raise ClientGone("The client closed the connection before sending the whole body")
    settings = getattr(request.app.state, "settings", None)
    timeout = settings.server.body_timeout if settings is not None else 0.0
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"Request body exceeds the limit of {limit} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise BodyTimeout(
            f"The request body did not arrive within {timeout:g} s (server.body_timeout); "
            f"received {size} bytes"
        ) from None
    except ClientDisconnect:
        raise ClientGone("The client closed the connection before sending the whole body") from None
    return b"".join(parts)


# JSON nesting accepted in a request: far below what the store's writer handles (254 levels,
# and a stored record puts a message's content a few levels deeper than the request did).
MAX_JSON_DEPTH = 64


def json_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests arrays and objects (1 for a flat one); stops past `limit`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def turn_headers(turn: PreparedTurn) -> dict[str, str]:
    """A turn's answer headers: its response id and its conversation.

    The response id goes also as the request id, which the OpenAI SDK shows as `request_id`."""
    headers = {"x-response-id": turn.response_id, "x-request-id": turn.response_id}
    if turn.conversation_id is not None:
        headers["x-conversation-id"] = turn.conversation_id
    return headers


# A turn that took longer than this to be ready (queued behind its conversation's other turns,
# say) looks whether its client is still there before the provider gets the request.
WAITED_SECONDS = 0.005


async def until_disconnect(work: Coroutine[Any, Any, T], receive: Receive, *, started: float = 0.0) -> T:
    """Run `work`, cancelling it if the client disconnects first (then ClientDisconnected).

    It runs in the calling task (no task of its own: one task less per request). On the
    gateway's own protocol (`gateway.protocol`), the request cycle's ON_GONE hook cancels that
    task when the client goes, and work for a client already gone is not begun. Elsewhere a
    watcher task does the cancelling, and a request `started` (perf_counter) more than
    WAITED_SECONDS ago is not begun at all if its client left meanwhile: a client that gave up
    while queued does not have its whole prompt sent to the provider (and billed) once the
    queue moves."""
    current = asyncio.current_task()
    assert current is not None
    cycle = getattr(receive, "__self__", None)
    if getattr(cycle, ON_GONE, False) is None:  # the protocol says when the client goes: no watcher
        return await _until_told_gone(work, cycle, current)
    state = {"gone": False, "over": False}

    def on_watcher_done(watcher: asyncio.Future[None]) -> None:
        if not state["over"] and not watcher.cancelled() and watcher.exception() is None:
            state["gone"] = True
            current.cancel()

    watcher: asyncio.Future[None] | None = None
    if started and time.perf_counter() - started > WAITED_SECONDS:
        # uvicorn's request cycle says it without a trip through the event loop (the trip, with
        # whatever else was due to run then, cost a slow request 1-2 ms)
        gone = getattr(cycle, "disconnected", None)
        if gone is None:  # another server: the watcher's first look says it
            watcher = asyncio.ensure_future(_wait_disconnect(receive))
            await asyncio.sleep(0)
            gone = watcher.done() and not watcher.cancelled() and watcher.exception() is None
        if gone:
            work.close()
            raise ClientDisconnected()
    if watcher is None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        if state["gone"] and current.uncancel() == 0:
            raise ClientDisconnected() from None
        raise
    finally:
        state["over"] = True  # a callback already scheduled must not cancel what follows
        watcher.cancel()


async def _until_told_gone(work: Coroutine[Any, Any, T], cycle: Any, current: asyncio.Task[Any]) -> T:
    """`until_disconnect` on the gateway's own protocol, which calls the cycle's ON_GONE hook.

    A client already gone (the hook, set only now, would never be called) is told at once, and
    `work` is not begun: the cycle says so without a trip through the event loop."""
    if cycle.disconnected:
        work.close()
        raise ClientDisconnected()
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        current.cancel()

    setattr(cycle, ON_GONE, on_gone)
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:
            raise ClientDisconnected() from None
        raise
    finally:
        setattr(cycle, ON_GONE, None)  # (the hook fires at most once, and never after this)


# Events held to be sent together are sent once they come to this many bytes.
_SEND_LIMIT = 65536
_READY = object()


async def _throw(step: Any, exc: BaseException) -> None:
    """Hand `exc` to `step`, stopped at a wait, and drive it to its end.

    As its task would when cancelled there; its outcome is dropped (the caller raises `exc`)."""
    try:
        await resume(step, step.throw(exc))
    except BaseException:  # noqa: BLE001, S110 - the caller raises `exc` itself
        pass


class SSEResponse(Response):
    """Streams `body` as text/event-stream.

    Stops (and cancels the producer) when the client disconnects; always calls `on_close(exc)`
    once, with None when everything was sent."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        *,
        headers: dict[str, str],
        on_close: Callable[[BaseException | None], Awaitable[None]],
    ) -> None:
        # No super().__init__: a streamed body must not get a Content-Length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **headers})
        self.body_iterator = body
        self.on_close = on_close

    async def _pump(self, send: Send) -> None:
        """Send the head, then the body's events, those ready together in one send.

        Ready together: a provider's read that brought several, a turn's last chunks and
        `[DONE]`. Each batch goes as soon as the body has to wait for more; the last with the
        end of the body."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self.body_iterator
        ready: list[bytes] = []
        size = 0
        while True:
            step = body.__anext__()
            try:
                waits_for = step.send(None)  # type: ignore[attr-defined]
            except StopIteration as at_once:
                ready.append(at_once.value)
                size += len(at_once.value)
                if size < _SEND_LIMIT:
                    continue
                waits_for = _READY  # (enough held: sent before the next)
            except StopAsyncIteration:
                break
            if ready:
                try:
                    await send({"type": "http.response.body", "body": b"".join(ready), "more_body": True})
                except BaseException as exc:
                    if waits_for is not _READY:  # the body is in the middle of a wait: it is told
                        await _throw(step, exc)
                    raise
                ready.clear()
                size = 0
            if waits_for is _READY:
                continue
            try:
                event = await resume(step, waits_for)
            except StopAsyncIteration:
                break
            ready.append(event)
            size += len(event)
        await send({"type": "http.response.body", "body": b"".join(ready), "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: BaseException | None = None
        try:
            await until_disconnect(self._pump(send), receive)
        except BaseException as exc:  # noqa: BLE001 - reported to on_close, then re-raised
            outcome = exc
            if not isinstance(exc, ClientDisconnected | OSError):
                raise
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.on_close(outcome)
