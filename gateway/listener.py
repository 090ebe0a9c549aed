"""uvloop's event loop with TCP servers that take a burst of connections in a few passes.

uvloop (libuv) accepts one connection per pass of its event loop. A pass that runs a burst of
requests takes tens to hundreds of milliseconds, so once a burst of clients connects, the
others wait in the kernel's accept queue, a pass each: in `bench/streams.py` (300 clients
connecting at once) the last connections were taken 2-3 s after the first, and their first
chunk came that much later. asyncio's own loop accepts up to the listen backlog at once; this
loop does much the same: a listening socket handed to `create_server` is read by a callback that
accepts up to BATCH connections each pass, and each becomes a uvloop transport
(`connect_accepted_socket`) as before.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvloop

log = logging.getLogger("gateway")

# Connections taken per pass at most: a burst is taken in a few passes, and the workers of one
# `serve --workers N`, all woken by the same connections, each take a share of a burst.
BATCH = 32
# A listening socket that cannot accept (out of file descriptors) is left alone this long.
RETRY_SECONDS = 1.0
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class AcceptingServer:
    """A TCP server on a listening socket, taking up to BATCH waiting connections each pass.

    What uvicorn needs of `asyncio.Server`: `close`, `wait_closed`, `sockets`, `is_serving`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        backlog: int,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._factory = protocol_factory
        self._serving = False
        self._opening: set[asyncio.Future[Any]] = set()  # (a task nobody holds may be collected)
        sock.setblocking(False)
        sock.listen(max(1, backlog))
        self._start()

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening socket (none once closed)."""
        return (self._sock,) if self._serving else ()

    def is_serving(self) -> bool:
        """Is the socket still accepting?"""
        return self._serving

    def _start(self) -> None:
        self._serving = True
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        """Take the connections waiting (at most BATCH, the rest at the next pass)."""
        for _ in range(BATCH):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _OUT_OF_FILES:
                    raise
                log.warning("cannot accept connections (%s): retrying in %.0f s", exc.strerror, RETRY_SECONDS)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(RETRY_SECONDS, self._resume)
                return
            opening = asyncio.ensure_future(self._loop.connect_accepted_socket(self._factory, conn))
            self._opening.add(opening)
            opening.add_done_callback(self._opened)

    def _opened(self, opening: asyncio.Future[Any]) -> None:
        self._opening.discard(opening)
        if not opening.cancelled() and opening.exception() is not None:
            log.debug("an accepted connection could not be opened: %r", opening.exception())

    def _resume(self) -> None:
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket; open connections are left to their owner."""
        if not self._serving:
            return
        self._serving = False
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    async def wait_closed(self) -> None:
        """Closed at once: nothing to wait for."""


class AcceptingLoop(uvloop.Loop):
    """uvloop's loop; a plain TCP listening socket given to `create_server` accepts in bulk.

    uvicorn's `loop` setting names it (`loop="gateway.listener:AcceptingLoop"`): uvicorn calls
    a custom loop setting to make each event loop."""

    async def create_server(
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: Any = None,
        port: Any = None,
        *,
        sock: socket.socket | None = None,
        backlog: int = 100,
        ssl: Any = None,
        **kwargs: Any,
    ) -> Any:
        plain_tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        if plain_tcp and ssl is None and not kwargs:
            assert sock is not None
            return AcceptingServer(self, sock, protocol_factory, backlog)
        return await super().create_server(
            protocol_factory, host, port, sock=sock, backlog=backlog, ssl=ssl, **kwargs
        )
