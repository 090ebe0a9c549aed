"""A provider's answer is bounded in its head and in time, both ways the gateway talks to an
OpenAI-compatible provider (its own HTTP/1.1 client for `http://`, aiohttp as for `https://`):
a head over 64 KiB or 100 fields is a prompt 502; `timeout` is a deadline (a whole answer in
all, a stream's first event); `stream_idle_timeout` bounds the wait between a stream's events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from gateway.config import ProviderSettings
from gateway.exceptions import UpstreamProtocolError, UpstreamTimeout
from gateway.upstream.base import chunks_from_completion, completion_from_text
from gateway.upstream.openai import OpenAIUpstream, is_retryable

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = orjson.dumps(completion_from_text("m", "Hello there, how are you today?"))
EVENTS = [
    b"data: " + orjson.dumps(c) + b"\n\n"
    for c in chunks_from_completion(orjson.loads(COMPLETION), include_usage=False)
]
PATHS = ["http1", "aiohttp"]


class Provider:
    """A loopback provider answering each request with `answer(provider, writer)`; counts the
    bytes it managed to send."""

    def __init__(self, answer: Callable[[Provider, asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.answer = answer
        self.sent = 0
        self.requests = 0
        self.streamed = False  # the last request asked for a stream
        self.port = 0
        self.handlers: set[asyncio.Task[Any]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            self.streamed = bool(orjson.loads(await reader.readexactly(length)).get("stream"))
            self.requests += 1
            await self.answer(self, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)


@pytest.fixture
async def provider() -> AsyncIterator[Callable[..., Awaitable[Provider]]]:
    servers: list[asyncio.Server] = []
    providers: list[Provider] = []

    async def start(answer: Callable[[Provider, asyncio.StreamWriter], Awaitable[None]]) -> Provider:
        provider = Provider(answer)
        server = await asyncio.start_server(provider.serve, "127.0.0.1", 0)
        provider.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        providers.append(provider)
        return provider

    yield start
    for server in servers:
        server.close()
    # A provider still dripping to a client that hung up stops at its next write.
    handlers = [task for provider in providers for task in provider.handlers]
    await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)


def upstream(provider: Provider, path: str, **settings: Any) -> OpenAIUpstream:
    up = OpenAIUpstream(
        "p",
        ProviderSettings(
            kind="openai", base_url=f"http://127.0.0.1:{provider.port}/v1", retries=0, **settings
        ),
    )
    if path == "aiohttp":
        up._pool = None  # as for an https:// provider (or one behind HTTP_PROXY)
    return up


def head(*fields: bytes, length: int | None = None) -> bytes:
    framing = [b"content-length: %d" % length] if length is not None else [b"transfer-encoding: chunked"]
    return b"\r\n".join([b"HTTP/1.1 200 OK", *fields, *framing, b"connection: close"]) + b"\r\n\r\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def collect(up: OpenAIUpstream, stream: bool) -> list[Any]:
    if not stream:
        return [await up.complete(BODY)]
    return [chunk async for chunk in up.stream({**BODY, "stream": True})]


# -- the head ---------------------------------------------------------------------------------------
def one_huge_field(size: int) -> Callable[[Provider, asyncio.StreamWriter], Awaitable[None]]:
    """A head with one field of `size` bytes, sent in 16 KiB pieces, then a correct answer."""

    async def answer(provider: Provider, writer: asyncio.StreamWriter) -> None:
        await provider.send(writer, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-padding: ")
        piece = b"a" * 16384
        for _ in range(size // len(piece)):
            await provider.send(writer, piece)
            await asyncio.sleep(0.001)  # pieces as a network delivers them
        await provider.send(writer, b"\r\n" + head(length=len(COMPLETION)).split(b"\r\n", 1)[1] + COMPLETION)

    return answer


def fields(count: int, size: int) -> Callable[[Provider, asyncio.StreamWriter], Awaitable[None]]:
    """A head of `count` fields in all, each about `size` bytes, then a correct answer."""

    async def answer(provider: Provider, writer: asyncio.StreamWriter) -> None:
        extra = [b"x-f%03d: %s" % (i, b"v" * (size - 8)) for i in range(count - 2)]
        await provider.send(writer, head(*extra, length=len(COMPLETION)) + COMPLETION)

    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS)
async def test_a_head_with_a_field_of_a_mib_is_a_502_and_the_read_stops_at_the_cap(
    provider: Callable[..., Awaitable[Provider]], path: str, stream: bool
) -> None:
    server = await provider(one_huge_field(1024 * 1024))
    up = upstream(server, path)
    try:
        with pytest.raises(UpstreamProtocolError) as info:
            await collect(up, stream)
    finally:
        await up.aclose()
    assert not is_retryable(info.value)
    # The connection was closed at the cap: the provider could not send the rest of its head.
    assert server.sent < 256 * 1024, server.sent


@pytest.mark.parametrize(
    ("count", "size"), [(101, 40), (99, 700)], ids=["101 fields", "99 fields over 64 KiB in all"]
)
@pytest.mark.parametrize("path", PATHS)
async def test_a_head_of_too_many_fields_or_too_many_bytes_is_a_502(
    provider: Callable[..., Awaitable[Provider]], path: str, count: int, size: int
) -> None:
    server = await provider(fields(count, size))
    up = upstream(server, path)
    try:
        with pytest.raises(UpstreamProtocolError) as info:
            await up.complete(BODY)
    finally:
        await up.aclose()
    assert "head" in info.value.message


@pytest.mark.parametrize("path", PATHS)
async def test_a_head_of_100_fields_within_64_kib_is_read(
    provider: Callable[..., Awaitable[Provider]], path: str
) -> None:
    server = await provider(fields(100, 600))
    up = upstream(server, path)
    try:
        result = await up.complete(BODY)
    finally:
        await up.aclose()
    assert result["choices"][0]["message"]["content"] == "Hello there, how are you today?"


# -- time -------------------------------------------------------------------------------------------
def dripped(
    *, first_events: int = 0, pause: float = 0.05
) -> Callable[[Provider, asyncio.StreamWriter], Awaitable[None]]:
    """A correct answer (JSON or, if the request streams, SSE), its body sent a byte every
    `pause` seconds after its first `first_events` events, until the gateway hangs up."""

    async def answer(provider: Provider, writer: asyncio.StreamWriter) -> None:
        sse = provider.streamed
        body = b"".join(EVENTS) + b"data: [DONE]\n\n" if sse else COMPLETION
        await provider.send(writer, head(length=None if sse else len(body)))
        whole = b"".join(EVENTS[:first_events])
        if whole:
            await provider.send(writer, chunked(whole))
        for byte in body[len(whole) :]:
            await provider.send(writer, chunked(bytes([byte])) if sse else bytes([byte]))
            await asyncio.sleep(pause)
        await provider.send(writer, b"0\r\n\r\n" if sse else b"")

    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS)
async def test_an_answer_dripped_a_byte_at_a_time_is_cut_at_its_deadline(
    provider: Callable[..., Awaitable[Provider]], path: str, stream: bool
) -> None:
    """A byte every 50 ms would take 10 s and more: the 0.5 s deadline ends it (a whole
    answer in all; a stream before its first event), a 504 that is not retried."""
    server = await provider(dripped())
    up = upstream(server, path, timeout=0.5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await collect(up, stream)
    finally:
        await up.aclose()
    assert loop.time() - start < 3
    assert "providers.p.timeout" in info.value.message and not is_retryable(info.value)
    assert server.requests == 1


@pytest.mark.parametrize("path", PATHS)
async def test_a_stream_dripping_between_events_is_cut_after_the_idle_limit(
    provider: Callable[..., Awaitable[Provider]], path: str
) -> None:
    server = await provider(dripped(first_events=2))
    up = upstream(server, path, timeout=30, stream_idle_timeout=0.3)
    chunks: list[Any] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        with pytest.raises(UpstreamTimeout) as info:
            async for chunk in up.stream({**BODY, "stream": True}):
                chunks.append(chunk)
    finally:
        await up.aclose()
    assert loop.time() - start < 3
    assert len(chunks) == 2
    assert "providers.p.stream_idle_timeout" in info.value.message


def steady(
    *, pause: float, pings_for: float = 0.0
) -> Callable[[Provider, asyncio.StreamWriter], Awaitable[None]]:
    """A stream whose events come `pause` apart; after the first, `: ping` comments for
    `pings_for` seconds."""

    async def answer(provider: Provider, writer: asyncio.StreamWriter) -> None:
        await provider.send(writer, head())
        for i, event in enumerate([*EVENTS, b"data: [DONE]\n\n"]):
            await provider.send(writer, chunked(event))
            await asyncio.sleep(pause)
            if i == 0 and pings_for:
                for _ in range(round(pings_for / pause)):
                    await provider.send(writer, chunked(b": ping\n\n"))
                    await asyncio.sleep(pause)
        await provider.send(writer, b"0\r\n\r\n")

    return answer


@pytest.mark.parametrize("path", PATHS)
async def test_a_long_steady_stream_is_never_cut_by_the_deadline(
    provider: Callable[..., Awaitable[Provider]], path: str
) -> None:
    """Events 0.1 s apart for over 1 s, and a pause of 0.6 s kept alive by pings, against a
    0.4 s `timeout` (and so a 0.4 s idle limit): the whole answer arrives."""
    server = await provider(steady(pause=0.1, pings_for=0.6))
    up = upstream(server, path, timeout=0.4)
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        chunks = await collect(up, True)
    finally:
        await up.aclose()
    assert loop.time() - start > 1.0
    assert len(chunks) == len(EVENTS)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == (
        "Hello there, how are you today?"
    )


@pytest.mark.parametrize("path", PATHS)
async def test_a_slow_reader_is_not_the_provider_going_quiet(
    provider: Callable[..., Awaitable[Provider]], path: str
) -> None:
    """The time the gateway spends handing a chunk on is not counted against the provider."""
    server = await provider(steady(pause=0.05))
    up = upstream(server, path, timeout=0.1)
    chunks: list[Any] = []
    try:
        async for chunk in up.stream({**BODY, "stream": True}):
            chunks.append(chunk)
            await asyncio.sleep(0.15)  # a slow client: 0.15 s per chunk, 1 s and more in all
    finally:
        await up.aclose()
    assert len(chunks) == len(EVENTS)
