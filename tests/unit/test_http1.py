"""The keep-alive HTTP/1.1 client for `http://` providers, against a scripted loopback server:
framing (length, chunked, until close, gzip), limits, reuse, and every failure it maps."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.config import ProviderSettings
from gateway.exceptions import UpstreamProtocolError, UpstreamTimeout, UpstreamUnreachable
from gateway.upstream import http1
from gateway.upstream.openai import OpenAIUpstream, is_retryable, map_upstream_errors
from tests.conftest import free_port

# Written after an answer: the server then closes the connection (not said in the answer).
CLOSE_AFTER = b"<close>"
# Answers the script writes back for a request: raw bytes, or None to close without answering.
# A list of parts is written part by part, PAUSE apart (a stream).
Script = Callable[[int, bytes], Awaitable[bytes | list[bytes] | None]]
PAUSE = 0.02


def ok(body: bytes, *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", "content-type: application/json", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Scripted:
    """A loopback HTTP server answering each request with `script(n, request)`; counts the
    connections it accepted and keeps the raw requests."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.readers: list[asyncio.StreamReader] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.readers.append(reader)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                answer = await self.script(len(self.requests), request)
                if answer is None:
                    break
                parts = answer if isinstance(answer, list) else [answer]
                for i, part in enumerate(parts):
                    if i:
                        await asyncio.sleep(PAUSE)
                    writer.write(part.removesuffix(CLOSE_AFTER))
                    await writer.drain()
                if parts[-1].endswith(CLOSE_AFTER):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[Scripted]]]:
    servers: list[Scripted] = []

    async def start(script: Script) -> Scripted:
        scripted = Scripted(script)
        scripted.server = await asyncio.start_server(scripted._serve, "127.0.0.1", 0)
        scripted.port = scripted.server.sockets[0].getsockname()[1]
        servers.append(scripted)
        return scripted

    yield start
    for scripted in servers:
        assert scripted.server is not None
        scripted.server.close()


def pool(url: str, *, timeout: float | None = 5.0) -> http1.Pool:
    return http1.Pool(
        url,
        {"content-type": "application/json", "authorization": "Bearer k"},
        connect_timeout=2.0,
        timeout=timeout,
    )


async def test_one_connection_carries_many_requests(serve: Callable[[Script], Awaitable[Scripted]]) -> None:
    async def script(n: int, request: bytes) -> bytes:
        return ok(b'{"n": %d}' % n)

    server = await serve(script)
    client = pool(server.url)
    answers = [await client.post(b'{"q": 1}', limit=1000, error_limit=100) for _ in range(3)]
    client.close()
    assert [a.body for a in answers] == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']
    assert answers[0].status == 200 and answers[0].headers["content-type"] == "application/json"
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nauthorization: Bearer k\r\n" in first and first.endswith(b'\r\n\r\n{"q": 1}')
    assert f"\r\nhost: 127.0.0.1:{server.port}\r\n".encode() in first
    assert b"\r\nuser-agent: llm-continuity-gateway/" in first
    # No Accept-Encoding would let a provider compress (RFC 9110 12.5.3); streams must not be.
    assert b"\r\naccept-encoding: identity\r\n" in first


async def test_configured_headers_replace_the_defaults(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    async def script(n: int, request: bytes) -> bytes:
        return ok(b"{}")

    server = await serve(script)
    client = http1.Pool(
        server.url,
        {"Host": "models.internal", "User-Agent": "mine/1", "Content-Length": "999"},
        connect_timeout=2.0,
        timeout=5.0,
    )
    await client.post(b'{"q": 1}', limit=100, error_limit=100)
    client.close()
    head = server.requests[0].lower()
    assert head.count(b"\r\nhost: ") == 1 and b"\r\nhost: models.internal\r\n" in head
    assert head.count(b"user-agent: ") == 1 and b"user-agent: mine/1" in head
    assert head.count(b"content-length: ") == 1 and b"content-length: 8\r\n" in head


async def test_a_base_url_with_credentials_and_a_query_is_asked_as_meant(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    """`http://user:pass@host/v1?api-version=...`: the path went after the query
    (`/v1?api-version=x/chat/completions`) and the password into the Host header."""
    import base64

    async def script(n: int, request: bytes) -> bytes:
        answer = b'{"id": "x", "object": "chat.completion", "choices": [{"index": 0, '
        answer += b'"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}'
        return ok(answer)

    server = await serve(script)
    base_url = f"http://us%40er:pa%3Ass@127.0.0.1:{server.port}/v1?api-version=2024-10-21"
    upstream = OpenAIUpstream("p", ProviderSettings(kind="openai", base_url=base_url))
    try:
        await upstream.complete({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        await upstream.aclose()
    head = server.requests[0].split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith("POST /v1/chat/completions?api-version=2024-10-21 HTTP/1.1\r\n"), head
    assert f"\r\nhost: 127.0.0.1:{server.port}\r\n" in head and "pa:ss" not in head
    assert f"\r\nauthorization: Basic {base64.b64encode(b'us@er:pa:ss').decode()}" in head


async def test_chunked_until_close_and_gzip_bodies_are_read_whole(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    packed = gzip.compress(b'{"zipped": true}')
    answers = {
        1: b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{"a":\r\n3\r\n 1}\r\n0\r\n\r\n',
        2: ok(packed, "content-encoding: gzip"),
        3: b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"until": "close"}' + CLOSE_AFTER,
    }

    async def script(n: int, request: bytes) -> bytes:
        return answers[n]

    server = await serve(script)
    client = pool(server.url)
    bodies = [(await client.post(b"{}", limit=1000, error_limit=100)).body for _ in range(3)]
    # After a `connection: close` answer, the next request opens a new connection.
    answers[4] = ok(b"{}")
    await client.post(b"{}", limit=1000, error_limit=100)
    client.close()
    assert bodies == [b'{"a": 1}', b'{"zipped": true}', b'{"until": "close"}']
    assert server.connections == 2


async def test_bodies_over_the_limit_are_refused_and_error_bodies_cut(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    big = b"x" * 5000
    answers = {
        1: ok(big),  # declared too large
        2: b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1388\r\n" + big + b"\r\n0\r\n\r\n",
        3: ok(gzip.compress(big), "content-encoding: gzip"),  # small on the wire, large decoded
        4: b"HTTP/1.1 500 Oops\r\ncontent-length: 5000\r\nretry-after: 3\r\n\r\n" + big,
    }

    async def script(n: int, request: bytes) -> bytes:
        return answers[n]

    server = await serve(script)
    client = pool(server.url)
    for _ in range(3):
        with pytest.raises(http1.TooLarge):
            await client.post(b"{}", limit=1000, error_limit=100)
    error = await client.post(b"{}", limit=1000, error_limit=100)
    client.close()
    assert error.status == 500 and error.body == b"x" * 100 and error.headers["retry-after"] == "3"


async def test_a_connection_closed_while_idle_is_not_reused(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    async def script(n: int, request: bytes) -> bytes | None:
        return ok(b'{"n": %d}' % n) + CLOSE_AFTER

    server = await serve(script)
    client = pool(server.url)
    await client.post(b"{}", limit=100, error_limit=100)
    await asyncio.sleep(0.1)  # the server's close (a keep-alive timeout) reaches the client
    answer = await client.post(b"{}", limit=100, error_limit=100)
    client.close()
    assert answer.body == b'{"n": 2}' and server.connections == 2


async def test_failures_map_to_gateway_errors_and_say_whether_to_retry(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    async def script(n: int, request: bytes) -> bytes | None:
        if n == 1:
            return None  # closes without answering
        if n == 2:
            return b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"cut'  # then hangs
        return b"NOT HTTP AT ALL\r\n\r\n"

    server = await serve(script)
    client = pool(server.url, timeout=0.3)
    raised: list[BaseException] = []
    for _ in range(3):
        with pytest.raises(Exception) as info, map_upstream_errors("p", server.url):
            await client.post(b"{}", limit=1000, error_limit=100)
        raised.append(info.value)
    refused = pool(f"http://127.0.0.1:{free_port()}/v1/chat/completions")
    with pytest.raises(UpstreamUnreachable) as unreachable, map_upstream_errors("p", "u"):
        await refused.post(b"{}", limit=1000, error_limit=100)
    client.close()
    disconnected, timed_out, malformed = raised
    assert isinstance(disconnected, UpstreamUnreachable) and is_retryable(disconnected)
    assert isinstance(timed_out, UpstreamTimeout) and not is_retryable(timed_out)
    assert isinstance(timed_out.__cause__, http1.ReadTimedOut)
    assert isinstance(malformed, UpstreamProtocolError) and not is_retryable(malformed)
    assert is_retryable(unreachable.value)


async def test_a_cancelled_call_closes_its_connection(serve: Callable[[Script], Awaitable[Scripted]]) -> None:
    release = asyncio.Event()

    async def script(n: int, request: bytes) -> bytes:
        if n == 1:
            await release.wait()
        return ok(b'{"n": %d}' % n)

    server = await serve(script)
    client = pool(server.url)
    call = asyncio.ensure_future(client.post(b"{}", limit=100, error_limit=100))
    while not server.requests:
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The provider sees the connection close at once (llama.cpp, for one, stops generating).
    assert await asyncio.wait_for(server.readers[0].read(), 2) == b""
    release.set()
    # The late answer to the cancelled call must not be read as the next call's answer.
    answer = await client.post(b"{}", limit=100, error_limit=100)
    client.close()
    assert answer.body == b'{"n": 2}' and server.connections == 2


async def test_plain_http_providers_use_the_pool_and_https_ones_do_not() -> None:
    plain = OpenAIUpstream("a", ProviderSettings(kind="openai", base_url="http://127.0.0.1:9/v1"))
    secure = OpenAIUpstream("b", ProviderSettings(kind="openai", base_url="https://example.invalid/v1"))
    assert plain._pool is not None and plain._pool.target == "/v1/chat/completions"
    assert secure._pool is None


def test_a_pool_used_from_a_new_event_loop_opens_its_own_connection() -> None:
    """An app started twice in one process (tests, `gateway demo`) runs on a new loop each time;
    a keep-alive connection of the first loop is not used from the second."""
    connections: list[object] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the server holds the connection open

        def setup(self) -> None:
            super().setup()
            connections.append(self.connection)

        def do_POST(self) -> None:  # noqa: N802 - the standard library's name
            self.rfile.read(int(self.headers["content-length"]))
            body = b'{"n": %d}' % len(connections)
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = pool(f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions")
    try:
        first = asyncio.run(asyncio.wait_for(client.post(b"{}", limit=100, error_limit=100), 5))
        second = asyncio.run(asyncio.wait_for(client.post(b"{}", limit=100, error_limit=100), 5))
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    assert (first.body, second.body) == (b'{"n": 1}', b'{"n": 2}')


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def two_events(n: int, request: bytes) -> list[bytes]:
    """A chunked stream of two events, PAUSE apart."""
    return [STREAM_HEAD + chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n"), chunk(b"") + b"\r\n"]


async def test_a_stream_arrives_as_it_is_sent_and_frees_its_connection(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    server = await serve(two_events)
    client = pool(server.url)
    loop = asyncio.get_running_loop()
    for _ in range(2):
        pieces: list[tuple[bytes, float]] = []
        async with client.stream(b"{}") as answer:
            assert answer.status == 200 and answer.headers["content-type"] == "text/event-stream"
            while piece := await answer.read():
                pieces.append((piece, loop.time()))
        assert [p for p, _ in pieces] == [b"data: 1\n\n", b"data: 2\n\n"]
        assert pieces[1][1] - pieces[0][1] >= PAUSE / 2  # handed over when it came, not at the end
    client.close()
    assert server.connections == 1


async def test_leaving_a_stream_early_closes_its_connection(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    server = await serve(two_events)
    client = pool(server.url)
    async with client.stream(b"{}") as answer:
        assert await answer.read() == b"data: 1\n\n"
    assert not client._idle
    async with client.stream(b"{}") as answer:
        assert await answer.read() == b"data: 1\n\n"
    client.close()
    assert server.connections == 2


async def test_a_stream_cut_short_or_gone_quiet_fails_its_reader(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    async def script(n: int, request: bytes) -> list[bytes]:
        if n == 1:
            return [STREAM_HEAD + chunk(b"data: 1\n\n") + CLOSE_AFTER]
        return [STREAM_HEAD + chunk(b"data: 1\n\n")]  # then nothing

    server = await serve(script)
    client = pool(server.url, timeout=1.0)  # (a deadline a loaded machine meets for the first event)
    for expected in (http1.BodyCut, http1.ReadTimedOut):
        async with client.stream(b"{}") as answer:
            assert await answer.read() == b"data: 1\n\n"
            with pytest.raises(expected):
                await answer.read()
    client.close()


async def test_a_stream_read_slowly_is_paused_and_arrives_whole(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    events = [b"data: " + bytes([65 + i % 26]) * 1000 + b"\n\n" for i in range(1000)]

    async def script(n: int, request: bytes) -> bytes:
        return STREAM_HEAD + b"".join(chunk(e) for e in events) + chunk(b"") + b"\r\n"

    server = await serve(script)
    client = pool(server.url)
    received: list[bytes] = []
    async with client.stream(b"{}") as answer:
        await asyncio.sleep(0.2)  # the provider writes ~1 MB meanwhile: reading stops past 256 KiB
        while piece := await answer.read():
            received.append(piece)
    client.close()
    whole = b"".join(events)
    assert 262144 <= len(received[0]) < len(whole) / 2  # buffered up to the bound, then paused
    assert b"".join(received) == whole


async def test_an_answer_cut_mid_body_is_a_bad_response_worth_retrying(
    serve: Callable[[Script], Awaitable[Scripted]],
) -> None:
    async def script(n: int, request: bytes) -> bytes:
        return b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"cut' + CLOSE_AFTER

    server = await serve(script)
    client = pool(server.url)
    with pytest.raises(UpstreamProtocolError) as info, map_upstream_errors("p", server.url):
        await client.post(b"{}", limit=1000, error_limit=100)
    client.close()
    assert isinstance(info.value.__cause__, http1.BodyCut) and is_retryable(info.value)
