"""uvicorn's httptools protocol with a head deadline, a whole-body mark and one-piece answers.

The deadline is on the request head; the mark is on requests whose body came whole; answers of
known length are written in one piece.

uvicorn times out idle keep-alive connections, but a client that opens a connection and sends
nothing, or sends part of a header block and stalls ("slowloris"), would hold its connection
and file descriptor forever. Here the head of every request must be complete within
`server.body_timeout` of the connection opening (or of its first byte, on a kept-alive
connection); otherwise the gateway answers 408 and closes the connection.

uvicorn writes a response's head as soon as the app starts the response, then its body: two
sends, each a trip through the network stack and a wake-up of the client. An answer with a
Content-Length of at most 64 KiB (every JSON answer of a turn) goes out in one send here: its head
is held until the body part that ASGI sends next. Streams (chunked: server-sent events), HEAD
answers and larger bodies are written as uvicorn writes them.

A request httptools cannot parse (a malformed or over-64-KiB request line or header, bytes
that are not HTTP/1.1) gets a 400 in OpenAI's error shape and a JSON log line, as every other
request does, instead of uvicorn's text/plain answer and plain-text warning.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway import metrics
from gateway.api.http import BODY_COMPLETE, ON_GONE
from gateway.context.anthropic import error_body
from gateway.exceptions import BodyTimeout, GatewayError, InvalidRequest
from gateway.metrics import access_log


def _closing_answer(status: str, error: GatewayError) -> tuple[bytes, str]:
    """A whole HTTP answer in OpenAI's error shape, after which the connection is closed, and
    its status line (an answer in Anthropic's shape is made with it: `_anthropic_answer`)."""
    return _answer(status, orjson.dumps(error.to_dict())), status


def _anthropic_answer(status: str, error: GatewayError) -> bytes:
    """The answer in Anthropic's shape (for `/v1/messages`), with a `request_id` of its own."""
    request_id = f"req_{secrets.token_hex(12)}"
    body = orjson.dumps(error_body(error.status_code, error.message, request_id))
    return _answer(status, body, f"request-id: {request_id}\r\n")


def _answer(status: str, body: bytes, headers: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n{headers}".encode()
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


# Requests under this path are answered in Anthropic's error shape.
ANTHROPIC_PATH = b"/v1/messages"
_HEAD_LATE = BodyTimeout("The request head did not arrive within server.body_timeout")
TIMEOUT_RESPONSE = _closing_answer("408 Request Timeout", _HEAD_LATE)
_UNPARSABLE = InvalidRequest(
    "Invalid HTTP request: its request line or headers could not be parsed "
    "(malformed, such as a Content-Length that is not a number, or over 64 KiB)",
    code="invalid_http_request",
)
BAD_REQUEST_RESPONSE = _closing_answer("400 Bad Request", _UNPARSABLE)
# The request line and headers together: a larger head is refused before it is read whole (the
# parser would keep it all in memory, and it comes before any key is checked).
HEAD_LIMIT = 64 * 1024


class _HeadTooLarge(InvalidRequest):
    """A request head over HEAD_LIMIT (431)."""

    status_code = 431


_TOO_LARGE = _HeadTooLarge(
    f"The request line and headers are over {HEAD_LIMIT // 1024} KiB", code="request_header_too_large"
)
HEAD_TOO_LARGE_RESPONSE = _closing_answer("431 Request Header Fields Too Large", _TOO_LARGE)
_PARSER_WARNING = "Invalid HTTP request received."


def _refusal_line(error: GatewayError, route: str) -> None:
    """The JSON log line of a request refused before it was a request (nothing to route)."""
    line = {
        "event": "http.request",
        "method": None,
        "path": None,
        "route": route,
        "status": error.status_code,
        "error": {"type": error.error_type, "code": error.code, "message": error.message},
    }
    access_log.info(orjson.dumps(line).decode())
    metrics.refused_below_app(route, error.status_code)


class _NotParserWarning(logging.Filter):
    """uvicorn's own plain-text line for a request its parser refused: ours is JSON."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _PARSER_WARNING


_JOIN_LIMIT = 1 << 16


class OneSendTransport:
    """A request cycle's transport that sends a short answer's head with its body, in one piece.

    It holds the head of an answer with a Content-Length (at most _JOIN_LIMIT) and sends it with
    the body part that follows; everything else passes through.
    """

    __slots__ = ("_transport", "_cycle", "_held", "_head_seen")

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self._transport = transport
        self._cycle = cycle
        self._held: bytes | None = None
        self._head_seen = False

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
            return
        cycle = self._cycle
        # The first write once the response started is its head (attributes of uvicorn's cycle;
        # were they ever renamed, every write would simply pass through).
        if not self._head_seen and getattr(cycle, "response_started", False):
            self._head_seen = True
            # With a Content-Length a body write follows (none for HEAD).
            if (
                getattr(cycle, "chunked_encoding", None) is False
                and cycle.scope["method"] != "HEAD"
                and getattr(cycle, "expected_content_length", _JOIN_LIMIT + 1) <= _JOIN_LIMIT
            ):
                self._held = data
                return
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HeadDeadlineProtocol(HttpToolsProtocol):
    # Set from settings in each worker (gateway.app.app_from_env); 0 disables the deadline.
    head_timeout: float = 30.0

    parser_warning_filtered = False  # (once uvicorn has set up its logging: by the first connection)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # received while the head of the next request is not complete
        self._in_head = True
        self._too_large = False
        if not self.parser_warning_filtered:
            type(self).parser_warning_filtered = True
            self.logger.addFilter(_NotParserWarning())

    def _arm(self) -> None:
        if self._head_deadline is None and self.head_timeout > 0:
            self._head_deadline = self.loop.call_later(self.head_timeout, self._head_expired)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_expired(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self._refuse(TIMEOUT_RESPONSE, _HEAD_LATE, "head_timeout")
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > HEAD_LIMIT and not self.transport.is_closing():
            self._refuse(HEAD_TOO_LARGE_RESPONSE, _TOO_LARGE, "head_too_large")

    def _refuse(self, answer: tuple[bytes, str], error: GatewayError, route: str) -> None:
        """Answer a request refused before it was one, close the connection, and log and count it.

        `answer` is the whole answer in OpenAI's error shape, and its status line: a request whose
        path was read as Anthropic's Messages API gets one in Anthropic's shape instead.
        """
        self._disarm()
        url = getattr(self, "url", b"")
        anthropic = isinstance(url, bytes) and url.startswith(ANTHROPIC_PATH)
        self.transport.write(_anthropic_answer(answer[1], error) if anthropic else answer[0])
        self.transport.close()
        _refusal_line(error, route)

    def send_400_response(self, msg: str) -> None:
        """Answer a request httptools cannot parse in OpenAI's error shape, with a JSON log line.

        Not uvicorn's text/plain answer and plain warning.
        """
        if self._too_large:
            self._refuse(HEAD_TOO_LARGE_RESPONSE, _TOO_LARGE, "head_too_large")
        else:
            self._refuse(BAD_REQUEST_RESPONSE, _UNPARSABLE, "unparsable")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head = False
        if len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) > HEAD_LIMIT:
            self._too_large = True  # (a head that came in a single read)
            raise ValueError("request head too large")  # stops the parser: send_400_response
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a new request (its task has not run yet)
            cycle.transport = OneSendTransport(self.transport, cycle)  # type: ignore[assignment]
            setattr(cycle, ON_GONE, None)  # (told when the client goes: no watcher task needed)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # the next request's head, on a kept connection
        if self.cycle is not None:
            # The whole body is in: reading it cannot stall (see `gateway.api.http.read_body`).
            scope: dict[str, Any] = self.cycle.scope  # type: ignore[assignment]
            scope[BODY_COMPLETE] = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        on_gone = getattr(cycle, ON_GONE, None)
        if on_gone is not None and cycle is not None and cycle.disconnected:
            setattr(cycle, ON_GONE, None)
            on_gone()  # the request's task is cancelled (`gateway.api.http.until_disconnect`)
