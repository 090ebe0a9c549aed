"""A fault-injecting OpenAI-compatible upstream that speaks HTTP/1.1 by hand over asyncio TCP.

Unlike a framework mock it can misbehave at the byte level: answer in 1-byte chunks, reset the
connection mid-stream, hang before or after the status line, send garbage, a huge header, or an
answer dripped a byte at a time. Each request pops the
next behaviour from a script (`server.script(b1, b2, ...)`), else runs `server.default`. Every
connection is watched, so tests can see when the gateway closed it (`FaultRequest.closed_at`).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.upstream.base import approx_tokens, chunks_from_completion, completion_from_text
from gateway.upstream.demo import demo_reply


@dataclass
class FaultRequest:
    """One request the server received, and what became of its connection."""

    n: int
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    received_at: float
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    chunked: bool = False
    closed_at: float | None = None  # when the client (the gateway) closed the connection
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(
        self, status: int = 200, headers: dict[str, str] | None = None, *, sse: bool = True
    ) -> None:
        """Status line and headers; the body that follows is chunked."""
        self.chunked = True
        lines = [f"HTTP/1.1 {status} X"]
        all_headers = {
            "content-type": "text/event-stream" if sse else "application/json",
            "transfer-encoding": "chunked",
            "connection": "close",
            **(headers or {}),
        }
        lines += [f"{k}: {v}" for k, v in all_headers.items()]
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    async def chunk(self, data: bytes) -> None:
        if data:
            await self.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def end(self) -> None:
        await self.write(b"0\r\n\r\n")

    async def respond(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        """A whole response with a Content-Length."""
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        lines = [f"HTTP/1.1 {status} X", "content-type: application/json", f"content-length: {len(data)}"]
        lines += ["connection: close"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)

    def reset(self) -> None:
        """Abort with a TCP RST (SO_LINGER 0), as a crashed provider or a middlebox would."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def wait_closed(self, timeout: float = 30.0) -> bool:
        try:
            await asyncio.wait_for(self.closed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def completion(self, text: str | None = None) -> dict[str, Any]:
        messages = self.messages
        reply = demo_reply(messages) if text is None else text
        return completion_from_text(str(self.body.get("model")), reply, prompt_tokens=approx_tokens(messages))

    def sse_events(self, text: str | None = None) -> list[bytes]:
        """The `data: {...}\\n\\n` events of a normal streamed answer, without `[DONE]`."""
        include_usage = bool((self.body.get("stream_options") or {}).get("include_usage"))
        chunks = chunks_from_completion(self.completion(text), include_usage=include_usage)
        return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks]


Behaviour = Callable[[FaultRequest], Awaitable[None]]


# -- behaviours ---------------------------------------------------------------------------------
def answer(
    *,
    text: str | None = None,
    piece: int = 0,
    pause: float = 0.0,
    ping: bool = False,
    done: bool = True,
    then: str = "close",
    delay: float = 0.0,
) -> Behaviour:
    """A correct answer (JSON or SSE, as the request asks). For streams: `piece` > 0 sends the
    bytes in pieces of that size, `pause` between events, `ping` interleaves `: ping` comments,
    `done=False` leaves out `[DONE]`, `then="hang"` keeps the connection open afterwards."""

    async def run(req: FaultRequest) -> None:
        if delay:
            await asyncio.sleep(delay)
        if not req.body.get("stream"):
            await req.respond(200, req.completion(text))
            return
        await req.head()
        events = req.sse_events(text)
        if ping:
            events = [e for ev in events for e in (b": ping\n\n", ev)] + [b": ping\n\n"]
        if done:
            events.append(b"data: [DONE]\n\n")
        for event in events:
            if piece:
                for i in range(0, len(event), piece):
                    await req.chunk(event[i : i + piece])
                    await asyncio.sleep(0.0002)  # separate TCP segments, separate reads
            else:
                await req.chunk(event)
            if pause:
                await asyncio.sleep(pause)
        if then == "hang":
            await req.wait_closed()
            return
        await req.end()

    return run


def status(
    code: int, message: str = "boom", headers: dict[str, str] | None = None, *, error_code: str | None = None
) -> Behaviour:
    async def run(req: FaultRequest) -> None:
        await req.respond(
            code, {"error": {"message": message, "type": "server_error", "code": error_code}}, headers
        )

    return run


def hang() -> Behaviour:
    """Read the request, never answer (time-to-headers)."""

    async def run(req: FaultRequest) -> None:
        await req.wait_closed()

    return run


def hang_after_head() -> Behaviour:
    """Send 200 and SSE headers, then nothing (time-to-first-token)."""

    async def run(req: FaultRequest) -> None:
        await req.head()
        await req.wait_closed()

    return run


def close_without_answer() -> Behaviour:
    async def run(req: FaultRequest) -> None:
        req.writer.close()

    return run


def reset_before_answer() -> Behaviour:
    async def run(req: FaultRequest) -> None:
        req.reset()

    return run


def stream_then(events: int, fault: str, *, text: str | None = None, pause: float = 0.0) -> Behaviour:
    """Stream the first `events` events of a normal answer, then: "reset" (TCP RST), "close"
    (clean end of body, no finish), "invalid_json", "malformed", "error_event", or "hang"."""

    async def run(req: FaultRequest) -> None:
        await req.head()
        for event in req.sse_events(text)[:events]:
            await req.chunk(event)
            if pause:
                await asyncio.sleep(pause)
        await asyncio.sleep(0.05)  # let the gateway forward them before the fault
        if fault == "reset":
            req.reset()
            return
        if fault == "invalid_json":
            await req.chunk(b'data: {"choices": [{"index": 0, "delta": {"content": "x"\n\n')
        elif fault == "malformed":  # valid JSON, wrong shape
            await req.chunk(
                b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": "x"}]}\n\n'
            )
        elif fault == "error_event":
            await req.chunk(
                b'event: error\ndata: {"error": {"message": "model overloaded", "type": "server_error"}}\n\n'
            )
        elif fault == "hang":
            await req.wait_closed()
            return
        await req.end()

    return run


def huge_head(size: int) -> Behaviour:
    """A 200 whose head carries one header of `size` bytes, then a correct whole answer (for a
    client still reading)."""

    async def run(req: FaultRequest) -> None:
        await req.write(b"HTTP/1.1 200 X\r\ncontent-type: application/json\r\nx-padding: ")
        piece = b"a" * 65536
        for _ in range(size // len(piece)):
            await req.write(piece)
        data = orjson.dumps(req.completion())
        await req.write(b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(data), data))

    return run


def drip(pause: float = 1.0) -> Behaviour:
    """A correct answer (JSON or SSE, as the request asks) whose head comes at once and whose
    body comes a byte every `pause` seconds, until the client hangs up."""

    async def run(req: FaultRequest) -> None:
        streamed = bool(req.body.get("stream"))
        if streamed:
            await req.head()
            body = b"".join(req.sse_events()) + b"data: [DONE]\n\n"
        else:
            body = orjson.dumps(req.completion())
            await req.write(
                b"HTTP/1.1 200 X\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
        for byte in body:
            if req.closed.is_set():
                return
            await (req.chunk(bytes([byte])) if streamed else req.write(bytes([byte])))
            await asyncio.sleep(pause)
        if streamed:
            await req.end()

    return run


def before(first: Behaviour, *, pause: float = 0.0) -> Behaviour:
    """Wait `pause` seconds, then behave like `first`."""

    async def run(req: FaultRequest) -> None:
        await asyncio.sleep(pause)
        await first(req)

    return run


# -- the server ---------------------------------------------------------------------------------
class FaultServer:
    def __init__(self) -> None:
        self.requests: list[FaultRequest] = []
        self.connections = 0
        self.default: Behaviour = answer()
        self._script: deque[Behaviour] = deque()
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *behaviours: Behaviour) -> None:
        with self._lock:
            self._script.extend(behaviours)

    def reset(self) -> None:
        with self._lock:
            self._script.clear()
            self.requests.clear()
        self.default = answer()

    def _next(self) -> Behaviour:
        with self._lock:
            return self._script.popleft() if self._script else self.default

    async def _watch(self, req: FaultRequest) -> None:
        try:
            while await req.reader.read(65536):
                pass
        except (ConnectionError, OSError):
            pass
        req.closed_at = time.monotonic()
        req.closed.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        watcher: asyncio.Task[None] | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {}
            for line in lines:
                if ":" in line:
                    key, value = line.split(":", 1)
                    headers[key.strip().lower()] = value.strip()
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            body = orjson.loads(raw) if raw else {}
            req = FaultRequest(
                next(self._counter), method, path, headers, body, time.monotonic(), reader, writer
            )
            with self._lock:
                self.requests.append(req)
            watcher = asyncio.create_task(self._watch(req))
            await self._next()(req)
            if not writer.is_closing():
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            if not writer.is_closing():
                writer.close()
            if watcher is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(watcher), 5)
                except (TimeoutError, asyncio.CancelledError):
                    watcher.cancel()

    # -- lifecycle in a background thread ----------------------------------------------------------
    @contextmanager
    def running(self) -> Iterator[FaultServer]:
        ready = threading.Event()
        stop: list[asyncio.Event] = []

        def main() -> None:
            async def serve() -> None:
                self.loop = asyncio.get_running_loop()
                server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512)
                self.port = server.sockets[0].getsockname()[1]
                stop.append(asyncio.Event())
                ready.set()
                async with server:
                    await stop[0].wait()

            asyncio.run(serve())

        thread = threading.Thread(target=main, daemon=True, name="fault-server")
        thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault server did not start")
        try:
            yield self
        finally:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(stop[0].set)
            thread.join(timeout=10)

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> list[FaultRequest]:
        deadline = time.monotonic() + timeout
        while len(self.requests) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"the upstream saw {len(self.requests)} requests, expected {n}")
            time.sleep(0.01)
        return self.requests


@contextmanager
def blackhole() -> Iterator[int]:
    """A loopback port whose accept queue is full: connecting to it hangs (SYN dropped), which
    is how a connect timeout looks, without any network."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fillers.append(s)
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


def closed_port() -> int:
    """A loopback port nobody listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
