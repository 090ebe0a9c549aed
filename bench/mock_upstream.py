"""A fast OpenAI-compatible mock upstream for the benchmark (single process, loopback only).

    python bench/mock_upstream.py --port 9000

`POST /v1/chat/completions` (also `/chat/completions`) answers at once with a fixed short
reply, as JSON or, with `"stream": true`, as SSE `chat.completion.chunk` events (plus a usage
chunk when `stream_options.include_usage` is set). No sleeps: a raw `asyncio.Protocol` HTTP/1.1
server over uvloop with the httptools parser, so the mock is never the bottleneck.

Paced mode (`--stream-chunks 100 --stream-interval-ms 20`, the streaming scenario of
bench/streams.py): every streamed answer sends its head at once, then that many
`chat.completion.chunk` events of a few tokens each, one every interval (the first at once,
each on its own schedule from the request's arrival, so a late timer does not shift the rest),
then, one interval after the last, the finish chunk, the usage chunk when asked for and
`[DONE]`. Non-streaming answers stay immediate.

Bench-only endpoints:
    GET /_bench/last    the raw body of the last chat request received (byte for byte)
    GET /_bench/stats   {"requests": N, "open_streams": M}
    GET /healthz        {"status": "ok"}
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

import httptools
import orjson

REPLY_PARTS = ("Hello", "! This is", " the mock", " upstream.")
REPLY = "".join(REPLY_PARTS)
_CHAT_PATHS = frozenset({b"/v1/chat/completions", b"/chat/completions"})


class _State:
    __slots__ = ("last_body", "requests", "seq", "chunks", "interval", "open_streams")

    def __init__(self) -> None:
        self.last_body = b"{}"
        self.requests = 0
        self.seq = 0
        self.chunks = 0  # paced mode: content chunks per stream (0: the fixed short reply)
        self.interval = 0.0  # paced mode: seconds between two chunks
        self.open_streams = 0


STATE = _State()


def _head(status: bytes, ctype: bytes, length: int | None, keep_alive: bool) -> bytes:
    parts = [b"HTTP/1.1 ", status, b"\r\ncontent-type: ", ctype, b"\r\n"]
    if length is None:
        parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts += [b"content-length: ", str(length).encode(), b"\r\n"]
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _json_response(status: bytes, payload: Any, keep_alive: bool) -> bytes:
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return _head(status, b"application/json", len(body), keep_alive) + body


def _error(status: bytes, message: str, keep_alive: bool) -> bytes:
    err = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return _json_response(status, err, keep_alive)


def _usage(body_bytes: int) -> dict[str, int]:
    # About 4 bytes of JSON per token: never far below a real count, so a gateway that checks
    # reported prompt tokens against its own count sees no (false) upstream truncation.
    prompt = max(1, body_bytes // 4)
    completion = len(REPLY_PARTS) + 1
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(frame: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(frame), frame)


def _parse_chat(body: bytes, keep_alive: bool) -> dict[str, Any] | bytes:
    """The request, or the error response to send."""
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _error(b"400 Bad Request", "body is not valid JSON", keep_alive)
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
        return _error(b"400 Bad Request", "'messages' must be a non-empty array", keep_alive)
    return req


def chat_response(body: bytes, keep_alive: bool) -> bytes:
    req = _parse_chat(body, keep_alive)
    if isinstance(req, bytes):
        return req
    STATE.seq += 1
    cid = f"chatcmpl-mock{STATE.seq:012d}"
    model = req.get("model") or "mock"
    created = int(time.time())
    usage = _usage(len(body))
    if req.get("stream") is not True:
        completion = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}
            ],
            "usage": usage,
        }
        return _json_response(b"200 OK", completion, keep_alive)
    options = req.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    events: list[dict[str, Any]] = [
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    for part in REPLY_PARTS:
        events.append({**base, "choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if include_usage:
        events.append({**base, "choices": [], "usage": usage})
    out = [_head(b"200 OK", b"text/event-stream", None, keep_alive)]
    for event in events:
        out.append(_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
    out.append(_chunk(b"data: [DONE]\n\n"))
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def _paced_word(k: int) -> str:
    return f" token {k} of the"  # a few tokens per chunk


class PacedStream:
    """One paced SSE answer (paced mode): chunk k is written at start + k * interval."""

    __slots__ = ("transport", "keep_alive", "frames", "start", "k", "loop", "handle")

    def __init__(
        self, transport: asyncio.Transport, req: dict[str, Any], body_bytes: int, keep_alive: bool
    ) -> None:
        STATE.seq += 1
        base = {
            "id": f"chatcmpl-mock{STATE.seq:012d}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.get("model") or "mock",
        }
        frames: list[bytes] = []
        for k in range(STATE.chunks):
            delta: dict[str, str] = {"role": "assistant"} if k == 0 else {}
            delta["content"] = _paced_word(k)
            event = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            frames.append(_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
        tail = [{**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        options = req.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            prompt = max(1, body_bytes // 4)
            completion = 4 * STATE.chunks
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            tail.append({**base, "choices": [], "usage": usage})
        last = b"".join(_chunk(b"data: " + orjson.dumps(e) + b"\n\n") for e in tail)
        frames.append(last + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self.transport = transport
        self.keep_alive = keep_alive
        self.frames = frames
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.k = 0
        self.handle: asyncio.TimerHandle | None = None
        STATE.open_streams += 1
        transport.write(_head(b"200 OK", b"text/event-stream", None, keep_alive))
        self._tick()

    def _tick(self) -> None:
        transport = self.transport
        if transport.is_closing():
            self.stop()
            return
        transport.write(self.frames[self.k])
        self.k += 1
        if self.k < len(self.frames):
            self.handle = self.loop.call_at(self.start + self.k * STATE.interval, self._tick)
            return
        self.handle = None
        STATE.open_streams -= 1
        if not self.keep_alive:
            transport.close()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if self.k < len(self.frames):
            self.k = len(self.frames)
            STATE.open_streams -= 1


class MockProtocol(asyncio.Protocol):
    __slots__ = ("transport", "parser", "url", "body", "paced")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.paced: PacedStream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.paced is not None:
            self.paced.stop()
            self.paced = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_error(b"400 Bad Request", "malformed HTTP request", False))
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"POST" and path in _CHAT_PATHS:
            body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            STATE.last_body = body
            STATE.requests += 1
            req = _parse_chat(body, keep_alive) if STATE.chunks else None
            if isinstance(req, dict) and req.get("stream") is True:
                self.paced = PacedStream(transport, req, len(body), keep_alive)
            else:
                transport.write(chat_response(body, keep_alive))
        elif method == b"GET" and path == b"/_bench/last":
            transport.write(_json_response(b"200 OK", STATE.last_body, keep_alive))
        elif method == b"GET" and path == b"/_bench/stats":
            stats = {"requests": STATE.requests, "open_streams": STATE.open_streams}
            transport.write(_json_response(b"200 OK", stats, keep_alive))
        elif method == b"GET" and path in (b"/healthz", b"/readyz", b"/health"):
            transport.write(_json_response(b"200 OK", {"status": "ok"}, keep_alive))
        elif method == b"GET" and path in (b"/v1/models", b"/models"):
            models = {
                "object": "list",
                "data": [{"id": "bench-model", "object": "model", "owned_by": "mock"}],
            }
            transport.write(_json_response(b"200 OK", models, keep_alive))
        else:
            transport.write(
                _error(b"404 Not Found", f"unknown path {path.decode(errors='replace')}", keep_alive)
            )
        self.body = []
        if not keep_alive:
            transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(MockProtocol, host, port, backlog=1024, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"mock upstream listening on http://{host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--stream-chunks", type=int, default=0, help="paced mode: content chunks per streamed answer"
    )
    parser.add_argument(
        "--stream-interval-ms", type=float, default=20.0, help="paced mode: ms between two chunks"
    )
    args = parser.parse_args(argv)
    STATE.chunks = max(0, args.stream_chunks)
    STATE.interval = args.stream_interval_ms / 1000
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port))
    except ImportError:
        asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
