"""The server's protocol (uvicorn's httptools protocol, ours): a request whose body came whole
says so in its scope, and `read_body` then takes it without arming the body deadline; a body
still arriving keeps the deadline."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.api.http import BODY_COMPLETE
from gateway.protocol import HeadDeadlineProtocol


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 5000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 11\r\n\r\n"


async def serve(*segments: bytes) -> tuple[list[bool], list[bytes]]:
    """Feed `segments` to a protocol; what the app saw: the flag at its start, and the body."""
    seen: list[bool] = []
    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(bool(scope.get(BODY_COMPLETE)))
        message = await receive()
        bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    config = Config(app=app, lifespan="off", log_level="warning")
    config.load()
    protocol = HeadDeadlineProtocol(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(Transport())
    for segment in segments:
        protocol.data_received(segment)
        await asyncio.sleep(0)
    for _ in range(10):
        await asyncio.sleep(0)
    protocol.connection_lost(None)
    return seen, bodies


async def test_a_request_that_came_whole_says_so() -> None:
    assert await serve(HEAD + b"hello world") == ([True], [b"hello world"])


async def test_a_body_still_arriving_does_not() -> None:
    seen, _ = await serve(HEAD, b"hello ", b"world")
    assert seen == [False]


async def test_an_answer_of_known_length_is_one_send_and_a_stream_is_not() -> None:
    sends: list[bytes] = []

    class Recording(Transport):
        def write(self, data: bytes | bytearray | memoryview) -> None:
            sends.append(bytes(data))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if scope["path"] == "/whole":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
        else:  # no length: chunked, as a stream is
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    config = Config(app=app, lifespan="off", log_level="warning")
    config.load()
    protocol = HeadDeadlineProtocol(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(Recording())
    for path in (b"/whole", b"/stream", b"/whole"):
        sends.clear()
        protocol.data_received(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(10):
            await asyncio.sleep(0)
        if path == b"/whole":
            assert (
                len(sends) == 1
                and sends[0].startswith(b"HTTP/1.1 200 OK\r\n")
                and sends[0].endswith(b"\r\n\r\nok")
            )
        else:
            assert len(sends) == 3 and sends[0].endswith(b"transfer-encoding: chunked\r\n\r\n")
    protocol.connection_lost(None)
