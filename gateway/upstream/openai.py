"""The direct HTTP fast path for OpenAI-compatible providers (OpenAI, Ollama /v1, vLLM, ...).

One pooled aiohttp session per provider (measured faster than httpx here, notably under
concurrency: see bench/); the body is serialized once with orjson; aiohttp exceptions are
translated to gateway errors in exactly one place, `map_upstream_errors`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp
import orjson

from gateway.config import ProviderSettings
from gateway.exceptions import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from gateway.upstream.base import Body, Chunk, Upstream

# Every aiohttp client exception class, mapped (tests/test_upstreams.py enumerates them).
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError, aiohttp.ServerTimeoutError)
_UNREACHABLE: tuple[type[BaseException], ...] = (aiohttp.ClientConnectionError,)
_PROTOCOL: tuple[type[BaseException], ...] = (aiohttp.ClientError, ValueError)


@contextmanager
def map_upstream_errors(name: str, url: str) -> Iterator[None]:
    """Re-raise client errors as gateway upstream errors naming the provider and its URL."""
    try:
        yield
    except UpstreamError:
        raise
    except _TIMEOUTS as exc:
        raise UpstreamTimeout(f"Provider {name!r} at {url} timed out ({type(exc).__name__})") from exc
    except _UNREACHABLE as exc:
        raise UpstreamUnreachable(
            f"Provider {name!r} at {url} is unreachable: {exc or type(exc).__name__}"
        ) from exc
    except _PROTOCOL as exc:
        raise UpstreamProtocolError(
            f"Provider {name!r} at {url} failed: {exc or type(exc).__name__}"
        ) from exc


def status_error(name: str, status: int, content: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
    """An UpstreamStatusError carrying the provider's own error message when it sent one."""
    message = content.decode("utf-8", "replace")[:500].strip() or f"HTTP {status}"
    err_type = code = param = None
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            err_type = err.get("type") if isinstance(err.get("type"), str) else None
            code = err.get("code") if isinstance(err.get("code"), str) else None
            param = err.get("param") if isinstance(err.get("param"), str) else None
        elif isinstance(err, str):
            message = err
    return UpstreamStatusError(
        f"Provider {name!r} returned HTTP {status}: {message}",
        upstream_status=status,
        error_type=err_type,
        code=code,
        param=param,
        retry_after=headers.get("retry-after"),
    )


def parse_sse_line(line: str) -> Chunk | None | bool:
    """One SSE line -> a chunk dict, None (nothing to yield) or True (the [DONE] sentinel)."""
    if not line.startswith("data:"):
        return None  # comments (": ping"), "event:", "id:", blank separators
    data = line[5:].strip()
    if not data:
        return None
    if data == "[DONE]":
        return True
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError(f"invalid JSON in stream: {data[:100]!r}") from exc
    if not isinstance(chunk, dict):
        raise UpstreamProtocolError(f"stream event is not an object: {data[:100]!r}")
    return chunk


class OpenAIUpstream(Upstream):
    def __init__(self, name: str, settings: ProviderSettings) -> None:
        self.name = name
        self.url = settings.base_url.rstrip("/")
        self._headers = {"content-type": "application/json", **settings.headers}
        key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.connect_timeout or None,
            sock_connect=settings.connect_timeout or None,
            sock_read=settings.timeout or None,
        )
        self._endpoint = f"{self.url}/chat/completions"
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily: a session belongs to the event loop that first uses it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, ttl_dns_cache=300),
                timeout=self._timeout,
                headers=self._headers,
                auto_decompress=True,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def complete(self, body: Body) -> Body:
        with map_upstream_errors(self.name, self.url):
            async with self._client().post(self._endpoint, data=orjson.dumps(body)) as response:
                content = await response.read()
                status = response.status
                headers = response.headers
        if status >= 400:
            raise status_error(self.name, status, content, headers)
        try:
            result: Any = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError(
                f"Provider {self.name!r} at {self.url} returned invalid JSON"
            ) from exc
        if not isinstance(result, dict) or not isinstance(result.get("choices"), list):
            if isinstance(result, dict) and "error" in result:
                raise status_error(self.name, 502, content, headers)
            raise UpstreamProtocolError(f"Provider {self.name!r} at {self.url} returned no choices")
        return result

    async def stream(self, body: Body) -> AsyncIterator[Chunk]:
        with map_upstream_errors(self.name, self.url):
            async with self._client().post(self._endpoint, data=orjson.dumps(body)) as response:
                if response.status >= 400:
                    content = await response.read()
                    raise status_error(self.name, response.status, content, response.headers)
                buffer = b""
                async for data in response.content.iter_any():
                    buffer += data
                    while True:
                        cut = buffer.find(b"\n")
                        if cut < 0:
                            break
                        line = buffer[:cut].rstrip(b"\r").decode("utf-8", "replace")
                        buffer = buffer[cut + 1 :]
                        parsed = parse_sse_line(line)
                        if parsed is None:
                            continue
                        if parsed is True:
                            return
                        assert isinstance(parsed, dict)
                        if "error" in parsed and "choices" not in parsed:
                            raise status_error(self.name, 502, orjson.dumps(parsed), response.headers)
                        yield parsed
                if buffer.strip():
                    parsed = parse_sse_line(buffer.decode("utf-8", "replace").strip())
                    if isinstance(parsed, dict):
                        yield parsed
