"""The direct HTTP fast path for OpenAI-compatible providers (OpenAI, Ollama /v1, vLLM, ...).

Calls to an `http://` provider go through `http1.Pool`, a small keep-alive client of our own
(measured three times cheaper in CPU than aiohttp: docs/performance.md); `https://`
providers and discovery use one pooled aiohttp session per provider
(measured faster than httpx here, notably under concurrency: see bench/). The body is
serialized once with orjson; client exceptions are translated to gateway errors in exactly
one place, `map_upstream_errors`. Both ways read at most HEAD_LIMIT bytes and HEAD_FIELDS
fields of an answer's head, and hold `timeout` as a deadline: a whole answer within it, a
stream's first event within it, then at most `stream_idle_timeout` between events (the time a
stream's reader spends handing a chunk on is not counted). A failed attempt is
retried (`retries`, default 1) only when nothing of its answer has been produced yet: after a
connection failure or a 502/503/504, never after the first chunk of a stream, never on a 429.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from typing import cast
from urllib.parse import urlsplit, urlunsplit

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
from gateway.redact import keep_secret, keep_secret_headers, keep_url_secrets
from gateway.types import as_list, as_object, first_choice
from gateway.upstream import http1
from gateway.upstream.base import (
    RETRY_STATUSES,
    Body,
    Chunk,
    ServerWindow,
    Upstream,
    complete_with_retries,
    error_fields,
    provider_at,
    stream_with_retries,
    take_trace_headers,
)
from gateway.upstream.cache_hints import (
    SlotTable,
    take_cache_key,
    takes_prompt_cache_key,
    with_llamacpp_hints,
    with_prompt_cache_key,
)
from gateway.upstream.discovery import count_prompt, describe_openai_compatible, list_openai_models, url_at
from gateway.upstream.refusal import parse_refusal

log = logging.getLogger("gateway.upstream")

# Every aiohttp and http1 exception class, mapped (tests/test_upstreams.py enumerates them).
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError, aiohttp.ServerTimeoutError)
_UNREACHABLE: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectionError,
    http1.ConnectFailed,
    http1.Disconnected,
)
_PROTOCOL: tuple[type[BaseException], ...] = (aiohttp.ClientError, ValueError)

# Provider statuses worth another attempt (a 429 is the client's to handle: passed through).
# Failures that mean "the provider never produced this answer": the connection could not be
# made or broke. A read timeout is not among them: the provider already used its time.
_RETRY_CAUSES: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
    http1.ConnectFailed,
    http1.ConnectTimedOut,
    http1.Disconnected,
    http1.BodyCut,
)
# Once every choice has its finish_reason, a provider that neither sends `[DONE]` nor ends the
# body gets this long (5x while an asked-for usage chunk is due) before the answer is taken as done.
TAIL_GRACE = 1.0
# Of an error answer, only this much is read (it is quoted in the error message, cut to 500).
_ERROR_BODY_BYTES = 65536


def is_retryable(exc: BaseException) -> bool:
    """May a request that failed with `exc`, before any answer byte, be sent again?"""
    if isinstance(exc, UpstreamStatusError):
        return exc.upstream_status in RETRY_STATUSES and not isinstance(exc, UpstreamErrorEvent)
    if isinstance(exc, UpstreamError):
        return isinstance(exc.__cause__, _RETRY_CAUSES)
    return False


@contextmanager
def map_upstream_errors(name: str, url: str) -> Iterator[None]:
    """Re-raise client errors as gateway upstream errors naming the provider and its URL."""
    try:
        yield
    except UpstreamError:
        raise
    except (aiohttp.ConnectionTimeoutError, http1.ConnectTimedOut) as exc:
        raise UpstreamTimeout(f"{provider_at(name, url)} timed out while connecting") from exc
    except aiohttp.ClientResponseError as exc:  # (raise_for_status is never called: the parser's)
        raise UpstreamProtocolError(
            f"{provider_at(name, url)} sent an answer that is not valid HTTP: {exc.message}"
        ) from exc
    except _TIMEOUTS as exc:
        raise UpstreamTimeout(f"{provider_at(name, url)} timed out ({type(exc).__name__})") from exc
    except _UNREACHABLE as exc:
        raise UpstreamUnreachable(
            f"{provider_at(name, url)} is unreachable: {exc or type(exc).__name__}"
        ) from exc
    except _PROTOCOL as exc:
        raise UpstreamProtocolError(f"{provider_at(name, url)} failed: {exc or type(exc).__name__}") from exc


def proxied(url: str) -> bool:
    """Does the environment's proxy (HTTP_PROXY / HTTPS_PROXY, less NO_PROXY) apply to `url`?"""
    parts = urlsplit(url)
    if parts.scheme not in urllib.request.getproxies():
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


class UpstreamErrorEvent(UpstreamStatusError):
    """The provider reported an error inside a 200 answer (a stream's error event): never retried."""

    in_band = True


def status_error(
    name: str,
    status: int,
    content: bytes,
    headers: Mapping[str, str],
    cls: type[UpstreamStatusError] = UpstreamStatusError,
) -> UpstreamStatusError:
    """An UpstreamStatusError carrying the provider's own error message when it sent one."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        payload = None
    said, err_type, code, param = error_fields(payload)
    message = said or content.decode("utf-8", "replace")[:500].strip() or f"HTTP {status}"
    refusal = parse_refusal(status, payload, message)
    if refusal is not None and code is None:
        code = "context_length_exceeded"  # llama.cpp's code is numeric: say what it means
    said = "reported an error" if issubclass(cls, UpstreamErrorEvent) else f"returned HTTP {status}"
    return cls(
        f"Provider {name!r} {said}: {message}",
        upstream_status=status,
        error_type=err_type,
        code=code,
        param=param,
        retry_after=headers.get("retry-after"),
        refusal=refusal,
    )


async def _read_cut(read: Callable[[], Awaitable[bytes]], limit: int) -> bytes:
    """At most `limit` bytes of a body (an error body is only quoted)."""
    parts: list[bytes] = []
    size = 0
    while size < limit and (piece := await read()):
        parts.append(piece)
        size += len(piece)
    return b"".join(parts)[:limit]


def completion_chunks(completion: Body, wants_usage: bool) -> list[Chunk]:
    """A whole chat completion as the chunks a stream of it would have been.

    One chunk holds each choice's whole message as its delta (tool calls numbered, as deltas
    number them) and its finish_reason; the usage follows in a chunk of its own when asked for."""
    head: dict[str, object] = {
        key: completion[key] for key in ("id", "created", "model") if key in completion
    }
    choices = []
    for n, choice in enumerate(as_list(completion.get("choices"))):
        choice = as_object(choice)
        delta = dict(as_object(choice.get("message")))
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            delta["tool_calls"] = [{**as_object(call), "index": k} for k, call in enumerate(calls)]
        index = choice.get("index", n)
        choices.append(
            {"index": index, "delta": delta, "finish_reason": choice.get("finish_reason") or "stop"}
        )
    chunks: list[Chunk] = [{**head, "object": "chat.completion.chunk", "choices": choices}]
    if wants_usage and isinstance(completion.get("usage"), dict):
        chunks.append(
            {**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]}
        )
    return chunks


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


def check_chunk(chunk: Chunk) -> Chunk:
    """Refuse a chunk whose shape the gateway would trip over (decoded here, at the edge)."""
    choices = chunk.get("choices")
    problem = None
    if choices is not None and not isinstance(choices, list):
        problem = "'choices' is not a list"
    for choice in as_list(choices):
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(choice, dict):
            problem = "a choice is not an object"
        elif delta is not None and not isinstance(delta, dict):
            problem = "'delta' is not an object"
        elif delta:
            for key in ("content", "refusal"):
                if delta.get(key) is not None and not isinstance(delta[key], str):
                    problem = f"'delta.{key}' is not a string"
            calls = delta.get("tool_calls")
            if calls is not None and not (
                isinstance(calls, list) and all(_is_tool_call_delta(c) for c in calls)
            ):
                problem = "'delta.tool_calls' is malformed"
    if chunk.get("usage") is not None and not isinstance(chunk["usage"], dict):
        problem = "'usage' is not an object"
    if problem:
        raise UpstreamProtocolError(f"a malformed stream chunk: {problem}")
    return chunk


def _is_tool_call_delta(call: object) -> bool:
    if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
        return False
    fn = call.get("function")
    if fn is None:
        return True
    return isinstance(fn, dict) and all(
        fn.get(k) is None or isinstance(fn[k], str) for k in ("name", "arguments")
    )


def without_thinking(body: Body) -> Body:
    """The body without its messages' `thinking_blocks`.

    litellm's field for Anthropic's thinking, stored with an answer so that Anthropic gets it
    back; an OpenAI-compatible server has no use for it, and a strict one refuses a message
    field it does not know (a 400 on every later turn of a conversation that moved providers)."""
    messages = [
        {k: v for k, v in m.items() if k != "thinking_blocks"} if isinstance(m, dict) else m
        for m in as_list(body.get("messages"))
    ]
    return {**body, "messages": messages}


class _TimedContent:
    """An aiohttp body read against a deadline its reader moves, as `http1.Streamed`'s is."""

    def __init__(self, content: aiohttp.StreamReader, deadline: float | None) -> None:
        self._content = content
        self.deadline = deadline

    async def read(self) -> bytes:
        if self.deadline is None:
            return await self._content.readany()
        async with asyncio.timeout_at(self.deadline):
            return await self._content.readany()

    def expire_at(self, when: float | None) -> None:
        self.deadline = when


def without_userinfo(url: str) -> str:
    """`url` without its `user:password@`, if it has one."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class OpenAIUpstream(Upstream):
    def __init__(self, name: str, settings: ProviderSettings) -> None:
        self.name = name
        self.url = settings.base_url.rstrip("/")
        self._headers = {"content-type": "application/json", **settings.headers}
        key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        keep_secret(key)
        keep_secret_headers(settings.headers)
        keep_url_secrets(settings.base_url)
        if key:
            self._headers["authorization"] = f"Bearer {key}"
            # The key is the provider's authorization: a `user:password@` in the URL too is left
            # out (aiohttp refuses the two together: the model list and the window questions
            # failed without a word).
            self.url = without_userinfo(self.url)
        # The deadlines are the gateway's own (aiohttp's socket timeouts would be idle timers).
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=settings.connect_timeout or None,
            sock_connect=settings.connect_timeout or None,
        )
        self.deadline = settings.timeout or None  # seconds
        idle = settings.timeout if settings.stream_idle_timeout is None else settings.stream_idle_timeout
        self.stream_idle = idle or None  # seconds
        self._endpoint = url_at(self.url, "/chat/completions")
        self.max_response_bytes = settings.max_response_bytes
        self._session: aiohttp.ClientSession | None = None
        self._prompt_counter = ""  # how the server counts a prompt (from `describe`), if it can
        self._cache_hints = settings.cache_hints
        # `prompt_cache_key` goes to OpenAI's own API only: servers that check the fields they
        # get (Groq, Cerebras, some Azure deployments) refuse it, and the others ignore it.
        self._takes_cache_key = takes_prompt_cache_key(self.url)
        self._llamacpp = False  # known to be llama.cpp (from `describe`): its own cache hints
        self._slots: SlotTable | None = None  # a llama.cpp server's slots, when it has several
        self.retries = settings.retries
        self._pool: http1.Pool | None = None
        # Plain HTTP goes through the gateway's own client, unless the environment's proxy
        # applies (HTTP_PROXY, NO_PROXY): then, as HTTPS, through aiohttp, which honours it.
        if self._endpoint.startswith("http://") and not proxied(self._endpoint):
            self._pool = http1.Pool(
                self._endpoint,
                self._headers,
                connect_timeout=settings.connect_timeout or None,
                timeout=self.deadline,
            )

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily: a session belongs to the event loop that first uses it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, ttl_dns_cache=300),
                timeout=self._timeout,
                headers=self._headers,
                auto_decompress=True,
                trust_env=True,  # HTTP(S)_PROXY and NO_PROXY, as the OpenAI SDK and litellm
                # An answer's head, as http1's: each line at most 8 KiB (aiohttp's default),
                # HEAD_FIELDS fields; `_check_head` holds the whole to HEAD_LIMIT.
                max_line_size=8190,
                max_field_size=8190,
                max_headers=http1.HEAD_FIELDS,
            )
        return self._session

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def list_models(self) -> list[str]:
        return await list_openai_models(self._client(), self.url)

    async def describe(self, model: str) -> ServerWindow | None:
        # Never longer than the provider's own deadline: the turn asking waits for it, and it
        # counts against that turn's `timeout` (`waited`).
        window = await describe_openai_compatible(self._client(), self.url, model, within=self.deadline)
        if window is not None and window.prompt_counter:
            self._prompt_counter = window.prompt_counter  # (one server behind one base_url)
        if window is not None:
            self._llamacpp = window.is_llamacpp
            if window.total_slots < 2:
                self._slots = None
            elif self._slots is None or self._slots.total != window.total_slots:
                self._slots = SlotTable(window.total_slots)
        return window

    def _outgoing(self, body: Body) -> bytes:
        """The body as the provider gets it: the gateway's cache key out, its cache hints in.

        The cache hints the key stands for are llama.cpp's own, or OpenAI's `prompt_cache_key`."""
        body, key = take_cache_key(body)
        if self._cache_hints and self._llamacpp:
            body = with_llamacpp_hints(body, key, self._slots)
        elif self._cache_hints and self._takes_cache_key:
            body = with_prompt_cache_key(body, key)
        data = orjson.dumps(body)
        if b'"thinking_blocks"' in data:  # (rare: looked for in the bytes, at C speed)
            data = orjson.dumps(without_thinking(body))
        return data

    async def count_prompt(self, body: Body) -> int | None:
        return await count_prompt(self._client(), self.url, self._prompt_counter, body)

    async def complete(self, body: Body, *, waited: float = 0.0) -> Body:
        body, own = take_trace_headers(body)  # (the headers of this request alone)
        data = self._outgoing(body)
        return await complete_with_retries(
            self.name,
            self.retries,
            is_retryable,
            lambda waited: self._complete_once(data, own, waited),
            waited,
        )

    async def _complete_once(self, data: bytes, own: dict[str, str], waited: float) -> Body:
        late = "no whole answer within"
        self._check_time_left(waited, late)
        with map_upstream_errors(self.name, self.url), self._in_time(late):
            if self._pool is not None:
                try:
                    answer = await self._pool.post(
                        data,
                        limit=self.max_response_bytes,
                        error_limit=_ERROR_BODY_BYTES,
                        headers=own,
                        waited=waited,
                    )
                except http1.TooLarge:
                    raise self._too_large() from None
                status, content = answer.status, answer.body
                headers: Mapping[str, str] = answer.headers
            else:
                async with (
                    asyncio.timeout(self.deadline - waited if self.deadline else None),
                    self._client().post(self._endpoint, data=data, headers=own) as response,
                ):
                    self._check_head(response)
                    status = response.status
                    headers = response.headers
                    # An error body is only quoted: its start is enough.
                    limit = self.max_response_bytes if status < 400 else _ERROR_BODY_BYTES
                    content = await self._read_limited(response, limit, truncate=status >= 400)
        if status >= 400:
            raise status_error(self.name, status, content, headers)
        return self._whole_answer(content, headers)

    def _whole_answer(self, content: bytes, headers: Mapping[str, str]) -> Body:
        """A whole answer's completion: an error object in it is the provider's error (a 502)."""
        try:
            result: object = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError(f"{provider_at(self.name, self.url)} returned invalid JSON") from exc
        if not isinstance(result, dict) or not isinstance(result.get("choices"), list):
            if isinstance(result, dict) and ("error" in result or isinstance(result.get("detail"), str)):
                raise status_error(self.name, 502, content, headers, UpstreamErrorEvent)
            raise UpstreamProtocolError(f"{provider_at(self.name, self.url)} returned no choices")
        return result

    def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        body, own = take_trace_headers(body)  # (the headers of this request alone)
        data = self._outgoing(body)
        wants_usage = bool(as_object(body.get("stream_options")).get("include_usage"))
        return stream_with_retries(
            self.name,
            self.retries,
            is_retryable,
            lambda waited: self._stream_once(data, wants_usage, own, waited),
            # Still before the first byte: a proper HTTP error, not a 200.
            empty=lambda: UpstreamProtocolError(
                f"{provider_at(self.name, self.url)} ended the stream without an answer"
            ),
            waited=waited,
        )

    async def _stream_once(
        self, data: bytes, wants_usage: bool, own: dict[str, str], waited: float
    ) -> AsyncGenerator[Chunk, None]:
        late = "no stream event within"
        self._check_time_left(waited, late)
        with map_upstream_errors(self.name, self.url):
            async with AsyncExitStack() as stack:
                with self._in_time(late):
                    answer = await self._open_stream(stack, data, own, waited)
                    if answer.status >= 400:
                        content = await _read_cut(answer.read, _ERROR_BODY_BYTES)
                        raise status_error(self.name, answer.status, content, answer.headers)
                    if answer.headers.get("content-type", "").startswith("application/json"):
                        # A JSON body, not events: the provider's error said in a 200, or a
                        # whole answer from a server that does not stream.
                        content = await _read_cut(answer.read, self.max_response_bytes + 1)
                        if len(content) > self.max_response_bytes:
                            raise self._too_large()
                        whole = self._whole_answer(content, answer.headers)
                        if not isinstance(first_choice(whole).get("message"), dict):
                            # (still before the first byte: an HTTP error, as for a whole answer)
                            raise UpstreamProtocolError(
                                f"{provider_at(self.name, self.url)} returned no message"
                            )
                        for chunk in completion_chunks(whole, wants_usage):
                            yield check_chunk(chunk)  # (as a stream's: nothing unfit is stored)
                        return
                async for chunk in self._events(answer, wants_usage):
                    yield chunk

    async def _open_stream(
        self, stack: AsyncExitStack, data: bytes, own: dict[str, str], waited: float
    ) -> http1.Streamed:
        """The stream's status and headers, once they came (within the deadline), and its body.

        The body is closed with `stack`. `own`: this request's headers, besides the provider's;
        `waited`: seconds already gone from the deadline."""
        if self._pool is not None:
            return await stack.enter_async_context(self._pool.stream(data, own, waited=waited))
        deadline = asyncio.get_running_loop().time() + self.deadline - waited if self.deadline else None
        async with asyncio.timeout_at(deadline):
            post = self._client().post(self._endpoint, data=data, headers=own)
            response = await stack.enter_async_context(post)
        self._check_head(response)
        body = _TimedContent(response.content, deadline)
        headers = {name.lower(): value for name, value in response.headers.items()}
        return http1.Streamed(response.status, headers, body.read, body.expire_at)

    async def _events(self, answer: http1.Streamed, wants_usage: bool) -> AsyncGenerator[Chunk, None]:
        """The checked chunks of an SSE body (`answer.read` gives b"" at its end).

        The answer's deadline, its first event's until then, moves with each read that brought
        a complete line after it; the time the chunks of a read spend being handed on is not
        counted."""
        read, expire_at, headers = answer.read, answer.expire_at, answer.headers
        loop = asyncio.get_running_loop()
        idle = self.stream_idle
        started = False  # a chunk was yielded: the idle limit applies
        buffer = b""
        received_bytes = 0
        unfinished: set[object] = set()  # choice indexes still without a finish_reason
        seen_usage = False
        finished = False
        ended = False
        while not ended:
            if finished and not unfinished:
                # Waiting for a usage chunk that was asked for gets longer.
                grace = TAIL_GRACE if seen_usage or not wants_usage else 5 * TAIL_GRACE
                try:
                    async with asyncio.timeout(grace):
                        received = await read()
                except TimeoutError:
                    return  # a complete answer without `[DONE]` (or one gone quiet after it)
            else:
                try:
                    received = await read()
                except TimeoutError as exc:
                    raise self._late(started) from exc
            received_bytes += len(received)
            if received_bytes > self.max_response_bytes:
                raise self._too_large()
            if not received:
                ended = True
                received = b"\n"  # a last event without its line end still counts
            buffer += received
            start = 0  # the first line of `buffer` not read yet
            alive = False  # a line came after the first chunk: the provider is still there
            lifted = False  # the deadline is off while this read's chunks are handed on
            while (cut := buffer.find(b"\n", start)) >= 0:
                line = buffer[start:cut]
                start = cut + 1
                if line.startswith(b"data:"):
                    chunk = self._data(line, headers)
                elif not line or not _text(line):  # the blank line that ends an event
                    continue
                else:  # a comment (`: ping`) or a field of its own
                    chunk = None
                if chunk is True:
                    return
                if not isinstance(chunk, dict):
                    alive = alive or started
                    continue
                finished, seen_usage = _track(chunk, unfinished, finished, seen_usage)
                if not lifted:
                    expire_at(None)
                    lifted = True
                yield chunk
                started = alive = True
            buffer = buffer[start:]
            if alive:
                expire_at(loop.time() + idle if idle else None)

    def _check_time_left(self, waited: float, late: str) -> None:
        """A 504 at once, nothing sent, when the turn's wait on this provider used up its deadline.

        (Its window asked of a server that left the question unanswered: see `describe`.)"""
        if self.deadline is not None and waited >= self.deadline:
            raise self._timed_out(late, self.deadline, "timeout")

    @contextmanager
    def _in_time(self, late: str) -> Iterator[None]:
        """Say `late` ("no whole answer within", ...) in the 504 of an answer past its deadline.

        A connect timeout is `map_upstream_errors`'s to say."""
        try:
            yield
        except (aiohttp.ConnectionTimeoutError, http1.ConnectTimedOut):
            raise
        except TimeoutError as exc:
            if self.deadline is None:
                raise  # not the answer's deadline: there is none
            raise self._timed_out(late, self.deadline, "timeout") from exc

    def _late(self, started: bool) -> UpstreamTimeout:
        """The 504 of a stream whose next event did not come in time."""
        if started:
            return self._timed_out("no stream event for", self.stream_idle, "stream_idle_timeout")
        return self._timed_out("no stream event within", self.deadline, "timeout")

    def _timed_out(self, late: str, seconds: float | None, key: str) -> UpstreamTimeout:
        return UpstreamTimeout(
            f"{provider_at(self.name, self.url)} sent {late} {seconds or 0:g} s (providers.{self.name}.{key})"
        )

    def _check_head(self, response: aiohttp.ClientResponse) -> None:
        """Refuse a head larger than http1.HEAD_LIMIT in all.

        aiohttp itself holds each line and the number of fields in bounds."""
        size = sum(len(name) + len(value) + 4 for name, value in response.raw_headers)
        if size + len(response.reason or "") + 15 > http1.HEAD_LIMIT:
            raise UpstreamProtocolError(
                f"{provider_at(self.name, self.url)} failed: the answer's head is larger than "
                f"{http1.HEAD_LIMIT} bytes"
            )

    def _too_large(self) -> UpstreamProtocolError:
        return UpstreamProtocolError(
            f"{provider_at(self.name, self.url)} sent an answer larger than "
            f"{self.max_response_bytes} bytes (providers.{self.name}.max_response_bytes)"
        )

    async def _read_limited(self, response: aiohttp.ClientResponse, limit: int, *, truncate: bool) -> bytes:
        """The body, read to at most `limit` bytes, past which it is refused.

        An error body that is only quoted is cut there instead."""
        declared = response.content_length
        if declared is not None and declared > limit and not truncate:
            raise self._too_large()
        parts: list[bytes] = []
        size = 0
        async for piece in response.content.iter_chunked(65536):
            size += len(piece)
            if size > limit:
                if truncate:
                    parts.append(piece[: len(piece) - (size - limit)])
                    break
                raise self._too_large()
            parts.append(piece)
        return b"".join(parts)

    def _data(self, line: bytes, headers: Mapping[str, str]) -> Chunk | None | bool:
        """A `data:` line -> a checked chunk, None (nothing to yield) or True (`[DONE]`).

        A JSON object is read from the bytes as they came; anything else takes `_decode`'s way."""
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if type(chunk) is not dict or ("error" in chunk and "choices" not in chunk):
            return self._decode(_text(line), headers)  # (its errors, or a blank line's None)
        if _is_text(chunk):
            return chunk
        try:
            return check_chunk(chunk)
        except UpstreamProtocolError as exc:
            raise UpstreamProtocolError(f"{provider_at(self.name, self.url)} sent {exc.message}") from exc

    def _decode(self, line: str, headers: Mapping[str, str]) -> Chunk | None | bool:
        """One SSE line -> a checked chunk, None (nothing to yield) or True (`[DONE]`)."""
        try:
            parsed = parse_sse_line(line)
            if isinstance(parsed, dict) and not ("error" in parsed and "choices" not in parsed):
                check_chunk(parsed)
        except UpstreamProtocolError as exc:
            raise UpstreamProtocolError(f"{provider_at(self.name, self.url)} sent {exc.message}") from exc
        if isinstance(parsed, dict) and "error" in parsed and "choices" not in parsed:
            raise status_error(self.name, 502, orjson.dumps(parsed), headers, UpstreamErrorEvent)
        return parsed


def _text(line: bytes) -> str:
    """A stream line as text, without its `\\r`.

    A line is whole here: a character split across reads is joined again."""
    try:
        return line.rstrip(b"\r").decode("utf-8")
    except UnicodeDecodeError:  # as a whole answer's: its bad bytes were stored as U+FFFD
        raise UpstreamProtocolError("a stream line that is not UTF-8") from None


# A delta with only these fields, `content` a string or null, is a piece of text (or nothing).
_TEXT_KEYS = frozenset(("role", "content"))


def _is_text(chunk: Chunk) -> bool:
    """Is `chunk` the common one: a single choice whose delta is text alone, without usage?

    Such a chunk needs no more of `check_chunk`'s checks."""
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1 or chunk.get("usage") is not None:
        return False
    choice = choices[0]
    delta = choice.get("delta") if type(choice) is dict else None
    if type(delta) is not dict or not delta.keys() <= _TEXT_KEYS:
        return False
    content = delta.get("content")
    return content is None or type(content) is str


def _track(chunk: Chunk, unfinished: set[object], finished: bool, seen_usage: bool) -> tuple[bool, bool]:
    """(finished, seen_usage) after a checked `chunk`.

    A choice's finish_reason takes its index out of `unfinished`, any other choice puts it in."""
    for choice in cast(list[Chunk], chunk.get("choices") or ()):  # (checked: a list of objects)
        index = choice.get("index", 0)
        if choice.get("finish_reason"):
            unfinished.discard(index)
            finished = True
        else:
            unfinished.add(index)
    if chunk.get("usage") is not None:  # (checked: an object)
        seen_usage = True
    return finished, seen_usage
