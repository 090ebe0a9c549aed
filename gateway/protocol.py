"""uvicorn's httptools protocol with a deadline on the request head.

uvicorn times out idle keep-alive connections, but a client that opens a connection and sends
nothing, or sends part of a header block and stalls ("slowloris"), would hold its connection
and file descriptor forever. Here the head of every request must be complete within
`server.body_timeout` of the connection opening (or of its first byte, on a kept-alive
connection); otherwise the gateway answers 408 and closes the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.exceptions import BodyTimeout

_BODY = orjson.dumps(BodyTimeout("The request head did not arrive within server.body_timeout").to_dict())
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


class HeadDeadlineProtocol(HttpToolsProtocol):
    # Set from settings in each worker (gateway.app.app_from_env); 0 disables the deadline.
    head_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

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
            self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
