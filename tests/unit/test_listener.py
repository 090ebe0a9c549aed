"""The serving event loop takes a burst of waiting connections in a few passes, not one a pass."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
import uvloop
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from gateway import listener, server
from gateway.listener import AcceptingLoop, AcceptingServer
from tests.conftest import make_settings


class Echo(asyncio.Protocol):
    made: list[Echo] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        Echo.made.append(self)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data.upper())


def run(loop_class: Callable[[], asyncio.AbstractEventLoop], main: Callable[[], object]) -> object:
    loop = loop_class()
    try:
        return loop.run_until_complete(main())  # type: ignore[arg-type]
    finally:
        loop.close()


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    return sock


def connect_many(port: int, n: int) -> list[socket.socket]:
    """n connections the kernel completes at once (they wait in the accept queue)."""
    clients = []
    for _ in range(n):
        client = socket.socket()
        client.connect(("127.0.0.1", port))
        clients.append(client)
    return clients


def passes_to_take(loop_class: Callable[[], asyncio.AbstractEventLoop], n: int) -> int:
    """Passes of the event loop until `n` connections waiting at once are all made."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        sock = listening()
        clients = connect_many(sock.getsockname()[1], n)
        Echo.made = []
        passes = 0
        done = loop.create_future()

        def tick() -> None:  # runs once per pass
            nonlocal passes
            passes += 1
            if len(Echo.made) >= n:
                done.set_result(passes)
            else:
                loop.call_soon(tick)

        srv = await loop.create_server(Echo, sock=sock, backlog=512)
        loop.call_soon(tick)
        try:
            return await asyncio.wait_for(done, 10)
        finally:
            srv.close()
            for client in clients:
                client.close()

    return run(loop_class, main)  # type: ignore[return-value]


def test_a_burst_of_connections_is_taken_in_a_few_passes() -> None:
    # uvloop's own servers take one connection per pass: the reason for AcceptingLoop
    assert passes_to_take(uvloop.Loop, 100) >= 90
    assert passes_to_take(AcceptingLoop, 100) <= 100 // listener.BATCH + 3


def test_serve_runs_on_the_accepting_loop() -> None:
    assert server.loop_and_http()["loop"] == "gateway.listener:AcceptingLoop"


def test_connections_carry_data_and_close_stops_accepting() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = listening()
        port = sock.getsockname()[1]
        srv = await loop.create_server(Echo, sock=sock, backlog=16)
        assert isinstance(srv, AcceptingServer) and srv.is_serving() and srv.sockets == (sock,)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"HELLO"
        peer = Echo.made[-1].transport.get_extra_info("socket")
        assert peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        srv.close()
        await srv.wait_closed()
        assert not srv.is_serving() and srv.sockets == ()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(AcceptingLoop, main)


def test_host_and_port_servers_are_uvloops_own() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Echo, "127.0.0.1", 0)
        assert not isinstance(srv, AcceptingServer)
        srv.close()

    run(AcceptingLoop, main)


class RunsOutOfFiles(socket.socket):
    """A listening socket whose first accept finds no file descriptor left."""

    failed = 0

    def accept(self) -> tuple[socket.socket, object]:
        if not RunsOutOfFiles.failed:
            RunsOutOfFiles.failed += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_out_of_files_pauses_accepting_then_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "RETRY_SECONDS", 0.05)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = RunsOutOfFiles()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        srv = await loop.create_server(Echo, sock=sock, backlog=16)
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        writer.write(b"still served")
        assert await asyncio.wait_for(reader.readexactly(12), 5) == b"STILL SERVED"
        assert RunsOutOfFiles.failed == 1
        writer.close()
        srv.close()

    run(AcceptingLoop, main)


def test_serve_reads_no_forwarded_headers() -> None:
    """Nothing the gateway does depends on the client's address: no proxy-headers layer per request."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    options = {k: v for k, v in server.uvicorn_options(make_settings()).items() if k != "factory"}
    config = uvicorn.Config(app, **options)
    config.load()
    assert options["proxy_headers"] is False
    assert not isinstance(config.loaded_app, ProxyHeadersMiddleware)


@pytest.mark.parametrize("access_log", [True, False])
def test_server_access_log_turns_uvicorns_access_lines_on(access_log: bool) -> None:
    """With `server.access_log = true` uvicorn wrote no access line: its `log_level` of "warning"
    set the access logger's level too. Its own lines stay at warnings and up either way."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    settings = make_settings()
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"access_log": access_log})}
    )
    options = {k: v for k, v in server.uvicorn_options(settings).items() if k != "factory"}
    uvicorn.Config(app, **options)  # (configures uvicorn's loggers, as `serve` does)
    assert logging.getLogger("uvicorn.access").isEnabledFor(logging.INFO) is access_log
    assert not logging.getLogger("uvicorn.error").isEnabledFor(logging.INFO)
