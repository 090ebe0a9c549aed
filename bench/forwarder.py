"""A bare pass-through forwarder with no continuity (uvicorn + pooled httpx).

    python bench/forwarder.py --port 9001 --upstream http://127.0.0.1:9000 [--client aiohttp] [--workers N]

Every request is read whole, forwarded to `{upstream}{path}` with the same method, body and
content type, and the upstream's answer is returned: read whole and sent with a
content-length, or relayed chunk by chunk when it is `text/event-stream`. This is the least
any Python proxy on the same stack (uvicorn, uvloop, httptools, httpx) has to do, so
"gateway overhead / forwarder overhead" says how much the continuity work costs on top.
`--client aiohttp` swaps httpx for an aiohttp session (a reference: how much of the floor is
the HTTP client library itself); `--max-connections` sets its pool's limit (512; 0 for none).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import httpx
import uvicorn

# How every reference server of the benchmark runs (the gateway's own stack: uvloop, httptools).
SERVE_OPTIONS: dict[str, Any] = {
    "loop": "uvloop",
    "http": "httptools",
    "lifespan": "on",
    "access_log": False,
    "log_level": "warning",
}
_UPSTREAM_ENV = "BENCH_FORWARDER_UPSTREAM"
_CLIENT_ENV = "BENCH_FORWARDER_CLIENT"
_CONNECTIONS_ENV = "BENCH_FORWARDER_CONNECTIONS"
_PASS_HEADERS = (b"content-type", b"authorization")


class AiohttpForwarder:
    """The same forwarder over an aiohttp ClientSession instead of httpx."""

    def __init__(self, upstream: str, connections: int = 512) -> None:
        self.upstream = upstream.rstrip("/")
        self.connections = connections
        self.session: Any = None

    async def _lifespan(self, receive: Any, send: Any) -> None:
        import aiohttp

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self.connections),
                    timeout=aiohttp.ClientTimeout(total=600, connect=10),
                    auto_decompress=False,
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] in ("/readyz", "/healthz"):
            await _send_whole(send, 200, b"application/json", b'{"status":"ready"}')
            return
        body = await _read_body(receive)
        if body is None:
            return
        headers = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _PASS_HEADERS
        }
        url = self.upstream + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        import aiohttp

        try:
            response = await self.session.request(scope["method"], url, data=body, headers=headers)
        except aiohttp.ClientError as exc:
            await _send_whole(
                send, 502, b"application/json", b'{"error":{"message":"%b"}}' % str(exc).encode()
            )
            return
        async with response:
            ctype = response.headers.get("content-type", "application/json").encode("latin-1")
            if ctype.startswith(b"text/event-stream"):
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": [(b"content-type", ctype), (b"cache-control", b"no-cache")],
                    }
                )
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                content = await response.read()
                await _send_whole(send, response.status, ctype, content)


async def _read_body(receive: Any) -> bytes | None:
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


class Forwarder:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client: httpx.AsyncClient | None = None

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(
                    timeout=httpx.Timeout(600.0, connect=10.0),
                    limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] in ("/readyz", "/healthz"):
            await _send_whole(send, 200, b"application/json", b'{"status":"ready"}')
            return
        body = await _read_body(receive)
        if body is None:
            return
        headers = [(k, v) for k, v in scope["headers"] if k in _PASS_HEADERS]
        url = self.upstream + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        assert self.client is not None
        try:
            request = self.client.build_request(scope["method"], url, content=body, headers=headers)
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            await _send_whole(
                send, 502, b"application/json", b'{"error":{"message":"%b"}}' % str(exc).encode()
            )
            return
        try:
            ctype = response.headers.get("content-type", "application/json").encode("latin-1")
            if ctype.startswith(b"text/event-stream"):
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status_code,
                        "headers": [(b"content-type", ctype), (b"cache-control", b"no-cache")],
                    }
                )
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                content = await response.aread()
                await _send_whole(send, response.status_code, ctype, content)
        finally:
            await response.aclose()


async def _send_whole(send: Any, status: int, ctype: bytes, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def from_env() -> AiohttpForwarder | Forwarder:
    """The forwarder `main` was asked for (in a worker process: from its environment)."""
    upstream = os.environ[_UPSTREAM_ENV]
    if os.environ[_CLIENT_ENV] == "aiohttp":
        return AiohttpForwarder(upstream, int(os.environ.get(_CONNECTIONS_ENV, "512")))
    return Forwarder(upstream)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bare pass-through forwarder (benchmark floor)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9000")
    parser.add_argument("--client", choices=("httpx", "aiohttp"), default="httpx")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port (uvicorn's)")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="aiohttp client: upstream connections at most (0: no limit; the gateway's own "
        "streams have none)",
    )
    args = parser.parse_args(argv)
    os.environ[_UPSTREAM_ENV], os.environ[_CLIENT_ENV] = args.upstream, args.client
    os.environ[_CONNECTIONS_ENV] = str(args.max_connections)
    uvicorn.run(
        # Several workers take the app by name, as `gateway serve --workers N` does.
        "forwarder:from_env" if args.workers > 1 else from_env(),
        factory=args.workers > 1,
        workers=args.workers,
        app_dir=os.path.dirname(os.path.abspath(__file__)),
        host=args.host,
        port=args.port,
        **SERVE_OPTIONS,
    )


if __name__ == "__main__":
    main()
