"""A small keep-alive HTTP/1.1 client for the calls to `http://` providers.

asyncio.Protocol + httptools (uvicorn's parser), one connection pool per provider; whole answers
and streams.

It exists for speed: a call costs about 0.06 ms of CPU against 0.19 ms through aiohttp on the
same loop (docs/performance.md). Its failures are its own exception classes, which
`map_upstream_errors` translates like aiohttp's; `https://` providers use aiohttp.
"""

from __future__ import annotations

import asyncio
import base64
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httptools

from gateway import __version__
from gateway.types import ascii_int, header_problem

_NONE: Mapping[str, str] = {}  # a request with no headers of its own


class ConnectFailed(ConnectionError):
    """The connection could not be made (refused, no route, name not found)."""


class ConnectTimedOut(TimeoutError):
    """The connection was not made within the connect timeout."""


class Disconnected(ConnectionError):
    """The provider closed the connection before its whole answer was received."""


class ReadTimedOut(TimeoutError):
    """The answer was not received by its deadline."""


class BadResponse(ValueError):
    """The provider's answer is not well-formed HTTP/1.1 (or is encoded in an unknown way)."""


class HeadTooLarge(BadResponse):
    """The answer's head is larger than HEAD_LIMIT bytes or has more than HEAD_FIELDS fields."""


class BodyCut(BadResponse):
    """The connection closed in the middle of the answer's body."""


class TooLarge(ValueError):
    """The answer's body is larger than the limit asked for."""


@dataclass(slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


@dataclass(slots=True)
class Streamed:
    status: int
    headers: dict[str, str]  # names in lower case
    read: Callable[[], Awaitable[bytes]]  # the body's next bytes; b"" at its end
    # Moves the answer's deadline (loop time; None: none): a reader that knows where the
    # provider is in its answer (a stream's events) gives it more time as it goes.
    expire_at: Callable[[float | None], None]


# A stream's bytes buffered unread past this pause the connection until they are read.
_STREAM_BUFFER = 262144
# An answer's head (status line and header fields) is read up to this size and field count, as
# a client's head is: past either the connection is closed (httptools keeps a field whole in
# memory, however long, and copies it as it grows).
HEAD_LIMIT = 65536
HEAD_FIELDS = 100


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing (the reason is kept on the connection)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one request at a time.

    The request is answered whole (`waiter` has the body) or streamed (`waiter` has the head;
    `read` gives the body as it comes), failed with ReadTimedOut if it is not done by its
    `deadline`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.deadline: float | None = None  # loop time
        self.timer: asyncio.TimerHandle | None = None
        self.reset(None, 0, 0, streaming=False)

    def reset(
        self, waiter: asyncio.Future[Answer] | None, limit: int, error_limit: int, *, streaming: bool
    ) -> None:
        self.waiter = waiter
        self.active = waiter is not None  # a request is waiting for (more of) its answer
        self.streaming = streaming
        self.limit = limit
        self.error_limit = error_limit
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_size = 0  # bytes received before the head was complete
        self.fields = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.truncate = False
        self.headers_done = False
        self.ended = False  # the whole answer was received
        self.failure: BaseException | None = None
        self.wakeup: asyncio.Future[None] | None = None
        self.paused = False

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.active:
            return
        if self.headers_done and self._until_close():
            self._finish()  # a body delimited by the end of the connection
        elif self.headers_done:
            self._fail(BodyCut(f"the connection closed in the middle of the answer ({exc or 'EOF'})"))
        else:
            self._fail(Disconnected(f"the connection closed before the answer ({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        if not self.active:
            self.close()  # nothing was asked on this connection: it cannot be trusted
            return
        if self.headers_done:
            self._feed(data)
            return
        room = HEAD_LIMIT - self.head_size
        self.head_size += len(data)
        if len(data) <= room:
            self._feed(data)
            return
        self._feed(data[:room])  # the head must end within its limit
        if not self.active:
            self.close()  # (answered, with bytes after the answer: the connection is not reused)
        elif self.headers_done:
            self._feed(data[room:])
        else:
            self._fail(HeadTooLarge(f"the answer's head is larger than {HEAD_LIMIT} bytes"))

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserCallbackError, _Stop):
            self._fail(self.failure or BadResponse("the answer could not be read"))
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"malformed HTTP answer: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost decides

    # -- parser callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields += 1
        if self.fields > HEAD_FIELDS:
            self.failure = HeadTooLarge(f"the answer's head has more than {HEAD_FIELDS} fields")
            raise _Stop
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        if self.streaming:
            encoding = self.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                self.failure = BadResponse(f"the streamed answer is encoded as {encoding!r}")
                raise _Stop
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(Answer(self.status, self.headers, b""))
            return
        if self.status >= 400:
            self.limit, self.truncate = self.error_limit, True  # an error body is only quoted
        declared = self.headers.get("content-length", "")
        size = ascii_int(declared, 30)
        if size is not None and size > self.limit and not self.truncate:
            self.failure = TooLarge(f"the answer declares {declared} bytes")
            raise _Stop

    def on_body(self, body: bytes) -> None:
        if self.streaming:
            self.parts.append(body)
            self.size += len(body)
            if self.size > _STREAM_BUFFER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            self._wake()
            return
        self.size += len(body)
        if self.size <= self.limit:
            self.parts.append(body)
            return
        if not self.truncate:
            self.failure = TooLarge(f"the answer is larger than {self.limit} bytes")
            raise _Stop
        self.parts.append(body[: len(body) - (self.size - self.limit)])
        self.close()  # the rest is not read: the connection cannot be used again
        self._finish()
        raise _Stop

    def on_message_complete(self) -> None:
        if not self.parser.should_keep_alive():
            self.close()
        self._finish()

    # -- ending a request -------------------------------------------------------------------
    def _until_close(self) -> bool:
        return "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", ""
        )

    def _finish(self) -> None:
        if not self.active:
            return
        self.active = False
        self.ended = True
        self.stop_timer()
        if self.streaming:
            self._wake()
            return
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        body = b"".join(self.parts)
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            try:
                body = _decode(body, encoding, self.limit)
            except BadResponse as exc:
                self._fail(exc)
                return
            except TooLarge as exc:
                if not self.truncate:
                    self._fail(exc)
                    return
                body = b""
        waiter.set_result(Answer(self.status, self.headers, body))

    def _fail(self, exc: BaseException) -> None:
        self.close()
        self.active = False
        self.stop_timer()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        else:
            self.failure = exc  # for a stream's reader
        self._wake()

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expire_at(self, when: float | None) -> None:
        """Fail the request in progress if it is not done by `when` (loop time; None: never).

        Moving the deadline later costs no timer: the one set goes off and looks again."""
        self.deadline = when
        if when is None or not self.active:
            return
        if self.timer is not None:
            if self.timer.when() <= when:
                return
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._check_deadline)

    def _check_deadline(self) -> None:
        self.timer = None
        if not self.active or self.deadline is None:
            return
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)
            return
        self._fail(ReadTimedOut("the answer did not arrive by its deadline"))

    async def read(self) -> bytes:
        """A stream's next bytes (all that arrived since the last call); b"" at its end."""
        while not self.parts:
            if self.failure is not None:
                raise self.failure
            if self.ended:
                return b""
            self.wakeup = self.loop.create_future()
            try:
                await self.wakeup
            finally:
                self.wakeup = None
        data = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
        self.parts.clear()
        self.size = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _decode(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip- or deflate-encoded body, decoded (never past `limit` bytes)."""
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise BadResponse(f"the answer is encoded as {encoding!r}")
    wbits = 16 + zlib.MAX_WBITS if encoding != "deflate" else zlib.MAX_WBITS
    try:
        decoder = zlib.decompressobj(wbits)
        out = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadResponse(f"the {encoding} answer cannot be decoded: {exc}") from None
    if len(out) > limit:
        raise TooLarge(f"the answer is larger than {limit} bytes")
    return out


def head_lines(headers: Mapping[str, str]) -> bytes:
    """Header lines, each `name: value\\r\\n`; ValueError for one HTTP/1.1 cannot carry
    (`header_problem`): written raw on a kept connection, a line break in a value would start a
    request of its own."""
    for name, value in headers.items():
        problem = header_problem(name, value)
        if problem is not None:
            raise ValueError(f"{problem}: not sent")
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1")


class Pool:
    """Keep-alive connections to one `http://` origin, for POSTs of JSON bodies."""

    def __init__(
        self, url: str, headers: dict[str, str], *, connect_timeout: float | None, timeout: float | None
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not a plain http:// URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.connect_timeout = connect_timeout
        # An answer's deadline, counted from when it is asked for (its connection included).
        self.timeout = timeout
        given = {name.lower(): value for name, value in headers.items()}
        given.pop("content-length", None)  # ours, per request
        given.setdefault("host", parts.netloc.rpartition("@")[2])  # (never the URL's credentials)
        if parts.username is not None:  # http://user:password@host/...: Basic auth, as aiohttp sends it
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            given.setdefault("authorization", "Basic " + base64.b64encode(pair).decode("ascii"))
        given.setdefault("user-agent", f"llm-continuity-gateway/{__version__}")
        # Without it a provider may compress (RFC 9110 12.5.3), and a stream must not be.
        given.setdefault("accept-encoding", "identity")
        self._head = f"POST {self.target} HTTP/1.1\r\n".encode("latin-1") + head_lines(given)
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(lambda: _Connection(loop), self.host, self.port)
        except TimeoutError:
            raise ConnectTimedOut(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc)) from exc
        return connection

    async def _send(
        self,
        body: bytes,
        limit: int,
        error_limit: int,
        *,
        streaming: bool,
        headers: Mapping[str, str],
        waited: float,
    ) -> _Connection:
        """Write the request on an idle connection (or a new one); its `waiter` has the answer.

        `headers`: this request's own, besides the pool's; `waited`: seconds already gone from
        its deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout - waited if self.timeout else None
        connection = None
        while self._idle:
            candidate = self._idle.pop()
            if not candidate.closed and candidate.loop is loop:
                connection = candidate
                break
            # Else closed by the provider, or left by another event loop: dropped (a transport
            # belongs to its own loop, which may be gone).
        if connection is None:
            connection = await self._connect()
        connection.reset(loop.create_future(), limit, error_limit, streaming=streaming)
        assert connection.transport is not None
        own = head_lines(headers)
        length = b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        connection.transport.write(self._head + own + length + body)
        connection.expire_at(deadline)
        return connection

    def _release(self, connection: _Connection) -> None:
        connection.waiter = None
        if connection.ended and not connection.closed:
            self._idle.append(connection)
        else:
            connection.stop_timer()
            connection.close()  # cancelled, failed or left mid-answer: never reused

    async def post(
        self,
        body: bytes,
        *,
        limit: int,
        error_limit: int,
        headers: Mapping[str, str] = _NONE,
        waited: float = 0.0,
    ) -> Answer:
        """POST `body`; the answer, whole within the pool's `timeout` (less `waited` seconds).

        Its body may be at most `limit` bytes (an error status's body is cut to `error_limit`)."""
        connection = await self._send(
            body, limit, error_limit, streaming=False, headers=headers, waited=waited
        )
        assert connection.waiter is not None
        try:
            return await connection.waiter
        finally:
            self._release(connection)

    @asynccontextmanager
    async def stream(
        self, body: bytes, headers: Mapping[str, str] = _NONE, *, waited: float = 0.0
    ) -> AsyncIterator[Streamed]:
        """POST `body`; the answer's status and headers, and its body as it arrives.

        Its head is due within the pool's `timeout` less `waited` seconds. Sizes are the
        caller's to check; its deadline is the caller's to move. Leaving early closes the
        connection."""
        connection = await self._send(body, 0, 0, streaming=True, headers=headers, waited=waited)
        assert connection.waiter is not None
        try:
            head = await connection.waiter
            yield Streamed(head.status, head.headers, connection.read, connection.expire_at)
        finally:
            self._release(connection)

    def close(self) -> None:
        for connection in self._idle:
            if not connection.loop.is_closed():  # else its transport went with its loop
                connection.close()
        self._idle.clear()
