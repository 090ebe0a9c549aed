"""A small keep-alive HTTP/1.1 client for the non-streaming calls to `http://` providers:
asyncio.Protocol + httptools (uvicorn's parser), one connection pool per provider.

It exists for speed: a call costs about 0.06 ms of CPU against 0.19 ms through aiohttp on the
same loop (docs/performance.md). Its failures are its own exception classes, which
`map_upstream_errors` translates like aiohttp's; `https://` providers and streams use aiohttp.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from gateway import __version__


class ConnectFailed(ConnectionError):
    """The connection could not be made (refused, no route, name not found)."""


class ConnectTimedOut(TimeoutError):
    """The connection was not made within the connect timeout."""


class Disconnected(ConnectionError):
    """The provider closed the connection before its whole answer was received."""


class ReadTimedOut(TimeoutError):
    """Nothing arrived from the provider for longer than the read timeout."""


class BadResponse(ValueError):
    """The provider's answer is not well-formed HTTP/1.1 (or is encoded in an unknown way)."""


class TooLarge(ValueError):
    """The answer's body is larger than the limit asked for."""


@dataclass(slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing (the reason is kept on the connection)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.waiter: asyncio.Future[Answer] | None = None
        self.last_read = 0.0
        self._reset(None, 0, 0)

    def _reset(self, waiter: asyncio.Future[Answer] | None, limit: int, error_limit: int) -> None:
        self.waiter = waiter
        self.limit = limit
        self.error_limit = error_limit
        self.status = 0
        self.headers: dict[str, str] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.truncate = False
        self.headers_done = False
        self.failure: BaseException | None = None

    # -- transport events -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is None or self.waiter.done():
            return
        if self.headers_done and self._until_close():
            self._finish()  # a body delimited by the end of the connection
        else:
            self._fail(Disconnected(f"the connection closed before the whole answer ({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        if self.waiter is None or self.waiter.done():
            self.close()  # nothing was asked on this connection: it cannot be trusted
            return
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
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        if self.status >= 400:
            self.limit, self.truncate = self.error_limit, True  # an error body is only quoted
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit and not self.truncate:
            self.failure = TooLarge(f"the answer declares {declared} bytes")
            raise _Stop

    def on_body(self, body: bytes) -> None:
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
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

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


class Pool:
    """Keep-alive connections to one `http://` origin, for POSTs of JSON bodies."""

    def __init__(
        self, url: str, headers: dict[str, str], *, connect_timeout: float | None, read_timeout: float | None
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not a plain http:// URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        given = {name.lower(): value for name, value in headers.items()}
        given.pop("content-length", None)  # ours, per request
        given.setdefault("host", parts.netloc)
        given.setdefault("user-agent", f"llm-continuity-gateway/{__version__}")
        lines = [f"POST {self.target} HTTP/1.1", *(f"{name}: {value}" for name, value in given.items())]
        self._head = ("\r\n".join(lines) + "\r\ncontent-length: ").encode("latin-1")
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

    async def post(self, body: bytes, *, limit: int, error_limit: int) -> Answer:
        """POST `body`; the answer, whose body may be at most `limit` bytes (an error status's
        body is cut to `error_limit`)."""
        loop = asyncio.get_running_loop()
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
        waiter: asyncio.Future[Answer] = loop.create_future()
        connection._reset(waiter, limit, error_limit)
        assert connection.transport is not None
        connection.transport.write(self._head + str(len(body)).encode() + b"\r\n\r\n" + body)
        timer = None
        if self.read_timeout:
            connection.last_read = loop.time()
            timer = loop.call_later(self.read_timeout, self._check_read, connection, waiter)
        try:
            answer = await waiter
        except BaseException:
            connection.close()  # cancelled or failed mid-answer: never reused
            raise
        finally:
            if timer is not None:
                timer.cancel()
            connection.waiter = None
        if not connection.closed:
            self._idle.append(connection)
        return answer

    def _check_read(self, connection: _Connection, waiter: asyncio.Future[Answer]) -> None:
        if waiter.done() or self.read_timeout is None:
            return
        quiet = connection.loop.time() - connection.last_read
        if quiet < self.read_timeout:
            connection.loop.call_later(self.read_timeout - quiet, self._check_read, connection, waiter)
            return
        connection._fail(ReadTimedOut(f"nothing received for {self.read_timeout:g} s"))

    def close(self) -> None:
        for connection in self._idle:
            if not connection.loop.is_closed():  # else its transport went with its loop
                connection.close()
        self._idle.clear()
