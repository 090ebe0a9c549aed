"""A minimal keep-alive HTTP/1.1 client for the benchmark: asyncio.Protocol + httptools.

The same client measures every target, so its own cost cancels out of every overhead figure.
Timestamps are taken inside the protocol callbacks (request written, first body byte,
message complete), so event-loop wake-up latency is not part of a measured latency.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httptools

perf = time.perf_counter


@dataclass(slots=True)
class Response:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    t_sent: float = 0.0
    t_first_body: float = 0.0
    t_done: float = 0.0

    @property
    def latency(self) -> float:
        return self.t_done - self.t_sent

    @property
    def ttfb(self) -> float:
        """Seconds from request written to the first body byte (first SSE event)."""
        return (self.t_first_body or self.t_done) - self.t_sent


class HTTPError(Exception):
    pass


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None
        self.current = Response()
        self.parts: list[bytes] = []
        self.closed = False
        self._header_name = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HTTPError(f"connection lost: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(HTTPError(f"bad response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.parts = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.parts:
            self.current.t_first_body = perf()
        self.parts.append(body)

    def on_message_complete(self) -> None:
        response = self.current
        response.t_done = perf()
        response.body = b"".join(self.parts)
        if not self.parser.should_keep_alive() and self.transport is not None:
            self.closed = True
            self.transport.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(response)


class Connection:
    """One keep-alive connection; reconnects if the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._proto: _Protocol | None = None

    async def _ensure(self) -> _Protocol:
        if self._proto is None or self._proto.closed:
            loop = asyncio.get_running_loop()
            _, proto = await loop.create_connection(_Protocol, self.host, self.port)
            self._proto = proto
        return self._proto

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> Response:
        proto = await self._ensure()
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        if body or method in ("POST", "PUT", "PATCH"):
            head.append("Content-Type: application/json")
            head.append(f"Content-Length: {len(body)}")
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        loop = asyncio.get_running_loop()
        proto.waiter = loop.create_future()
        proto.current = Response()
        proto.current.t_sent = perf()
        assert proto.transport is not None
        proto.transport.write(data)
        try:
            return await asyncio.wait_for(proto.waiter, timeout)
        except BaseException:
            proto.closed = True
            if proto.transport is not None:
                proto.transport.close()
            raise

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
