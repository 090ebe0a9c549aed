"""Every provider that is not OpenAI-compatible, through `litellm.acompletion`.

Such are Anthropic, Gemini, Bedrock, Ollama native and others. litellm is an optional dependency (the
`litellm` extra), imported lazily the first time it is needed, with its bundled model cost map
(it would otherwise try the network at import).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from gateway.config import ProviderSettings, env_name_said
from gateway.exceptions import (
    Refusal,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from gateway.redact import keep_secret, keep_secret_headers, keep_url_secrets
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
from gateway.upstream.cache_hints import take_cache_key, with_cache_breakpoints
from gateway.upstream.refusal import parse_refusal

_litellm: Any = None
# litellm's prefixes for Ollama's native API, and the address litellm uses without a base_url.
OLLAMA_PREFIXES = frozenset({"ollama", "ollama_chat"})
OLLAMA_DEFAULT_URL = "http://localhost:11434"
# litellm's prefix for Anthropic's own API, whose prompt cache is asked for with breakpoints.
ANTHROPIC_PREFIX = "anthropic"


def _install_hint() -> str:
    """How to add litellm to the environment the gateway runs in.

    That is a checkout's venv, pipx's own, or the container image, which has no pip.
    """
    if "pipx" in Path(sys.prefix).parts:
        return "pipx inject llm-continuity-gateway litellm"
    if importlib.util.find_spec("pip") is None:
        return "rebuild the image with --build-arg EXTRAS=litellm (or install litellm>=1.50 here)"
    return f"{sys.executable} -m pip install 'litellm>=1.50'"


INSTALL_HINT = _install_hint()


def litellm_installed() -> bool:
    return importlib.util.find_spec("litellm") is not None


def import_litellm(provider: str = "") -> Any:
    global _litellm
    if _litellm is None:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        try:
            import litellm
        except ImportError:
            raise UpstreamError(
                f'Provider {provider!r} has kind = "litellm", which needs litellm: {INSTALL_HINT}'
            ) from None

        litellm.telemetry = False
        litellm.suppress_debug_info = True
        _litellm = litellm
    return _litellm


async def litellm_module(provider: str) -> Any:
    """litellm, imported in a thread the first time.

    The import takes seconds of CPU, and on the event loop it would hold every other request
    (health checks included) that long.
    """
    if _litellm is not None:
        return _litellm
    return await asyncio.to_thread(import_litellm, provider)


# What a litellm provider is given of the client's body: the OpenAI chat parameters, nothing else.
# litellm reads many other keys as its own options (`fallbacks` with their own `api_base`,
# `headers`, `organization`, `custom_llm_provider`, `mock_response`, `extra_body`, credentials,
# ...): a client must never choose where the provider key goes, nor what the model "answered".
OPENAI_CHAT_PARAMS = frozenset(
    {
        "model", "messages", "stream", "stream_options", "temperature", "top_p", "n", "stop",
        "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty",
        "logit_bias", "logprobs", "top_logprobs", "user", "response_format", "seed", "tools",
        "tool_choice", "parallel_tool_calls", "reasoning_effort", "modalities", "audio",
        "prediction", "service_tier", "web_search_options", "functions", "function_call",
        "top_k", "thinking",  # model parameters litellm maps for Anthropic, Gemini, ...
    }
)  # fmt: skip


def _retry_after(exc: BaseException) -> str | None:
    """The provider's Retry-After.

    litellm keeps the real headers in `litellm_response_headers` (its `response` may be one it
    made up, without them).
    """
    response = getattr(exc, "response", None)
    for headers in (getattr(exc, "litellm_response_headers", None), getattr(response, "headers", None)):
        value = headers.get("retry-after") if headers is not None else None
        if isinstance(value, str):
            return value
    return None


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception and what it wraps: litellm's `original_exception`, causes and contexts."""
    found: list[BaseException] = []
    stack: list[object] = [exc]
    while stack and len(found) < 12:
        item = stack.pop()
        if not isinstance(item, BaseException) or any(item is seen for seen in found):
            continue
        found.append(item)
        stack.extend((getattr(item, "original_exception", None), item.__cause__, item.__context__))
    return found


# How a refused or unresolvable connection reads when litellm reports it as an HTTP 500 (its
# Anthropic client says "Cannot connect to host ..."; others "Connection error.").
_CONNECT_FAILURES = ("Cannot connect to host", "Connect call failed", "Connection error")
_CONNECT_ERRORS = frozenset({"ClientConnectorError", "ClientConnectorDNSError", "ConnectError"})


def _unreachable(exc: BaseException, connection_error: type[BaseException]) -> bool:
    for item in _causes(exc):
        if isinstance(item, (connection_error, ConnectionRefusedError, socket.gaierror)):
            return True
        if type(item).__name__ in _CONNECT_ERRORS:
            return True
    return any(phrase in str(exc) for phrase in _CONNECT_FAILURES)


def _provider_error(text: str) -> tuple[str, str | None, str | None]:
    """(message, type, code) of the provider's own error object quoted in litellm's message.

    As in `AnthropicException - {"type": "error", "error": {"type": ..., "message": ...}}`.
    """
    start, end = text.find("{"), text.rfind("}")
    try:
        payload = orjson.loads(text[start : end + 1]) if 0 <= start < end else None
    except orjson.JSONDecodeError:
        payload = None
    message, kind, code, _ = error_fields(payload)
    return message or text, kind, code


@contextmanager
def map_litellm_errors(name: str, url: str) -> Iterator[None]:
    """Translate litellm's exceptions (which mirror OpenAI's) into gateway upstream errors."""
    try:
        yield
    except UpstreamError:
        raise
    except Exception as exc:
        litellm = import_litellm()
        where = provider_at(name, url)
        # (a timeout mid-stream comes wrapped: litellm's MidStreamFallbackError, "HTTP 408")
        if any(isinstance(item, litellm.exceptions.Timeout) for item in _causes(exc)):
            raise UpstreamTimeout(f"{where} timed out") from exc
        if _unreachable(exc, litellm.exceptions.APIConnectionError):
            # (litellm reports some refused connections as a 500: its text says which)
            said = str(getattr(exc, "message", exc)).strip()[:300] or type(exc).__name__
            raise UpstreamUnreachable(f"{where} is unreachable: {said}") from exc
        status = getattr(exc, "status_code", None)
        own = getattr(exc, "provider_status_code", None)  # the provider's (litellm's may be 500)
        if isinstance(own, int) and own >= 400:
            status = own
        if isinstance(status, int) and status >= 400:
            text = str(getattr(exc, "message", exc))
            refusal = parse_refusal(status, None, text)
            if refusal is None and isinstance(exc, litellm.exceptions.ContextWindowExceededError):
                refusal = Refusal(message=text)
            message, kind, code = _provider_error(text)
            kinds = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
            raise UpstreamStatusError(
                f"{where} returned HTTP {status}: {message}",
                upstream_status=status,
                error_type=kind or kinds.get(status),
                code="context_length_exceeded" if refusal is not None else code,
                retry_after=_retry_after(exc) if status == 429 else None,
                refusal=refusal,
            ) from exc
        raise UpstreamProtocolError(f"{where} failed: {type(exc).__name__}: {exc}") from exc


def is_retryable(exc: UpstreamError) -> bool:
    """Connection failures and 502/503/504, before any answer byte.

    Never a timeout (the provider already used its time) nor a 429 (passed through with
    Retry-After).
    """
    if isinstance(exc, UpstreamStatusError):
        return exc.upstream_status in RETRY_STATUSES
    return isinstance(exc, UpstreamUnreachable)


def _dump(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return obj
    dumped: dict[str, Any] = obj.model_dump(exclude_none=False)
    return dumped


class LitellmUpstream(Upstream):
    def __init__(self, name: str, settings: ProviderSettings) -> None:
        self.name = name
        self.url = settings.base_url.rstrip("/")
        self.prefix = settings.litellm_provider or name
        self.settings = settings
        if settings.api_key_env:
            keep_secret(os.environ.get(settings.api_key_env))
        keep_secret_headers(settings.headers)
        keep_url_secrets(settings.base_url)

    def _kwargs(self, body: Body) -> dict[str, Any]:
        body, conversation = take_cache_key(body)
        body, own = take_trace_headers(body)
        kwargs = {k: v for k, v in body.items() if k in OPENAI_CHAT_PARAMS}
        kwargs["model"] = f"{self.prefix}/{body['model']}"
        messages = kwargs.get("messages")
        cached = conversation is not None and self.settings.cache_hints and self.prefix == ANTHROPIC_PREFIX
        if cached and isinstance(messages, list):
            # A conversation's prompt: its next turn reads Anthropic's cache up to the breakpoints.
            kwargs["messages"] = with_cache_breakpoints(messages, kwargs.get("tools"))
        if self.url:
            kwargs["api_base"] = self.url
        if self.settings.api_key_env:
            key = os.environ.get(self.settings.api_key_env, "")
            if not key:  # never litellm's fallback to the machine's own OPENAI_API_KEY & co.
                said = env_name_said(self.settings.api_key_env)
                raise UpstreamError(
                    f"{provider_at(self.name, self.url)} was not called: its key's environment variable "
                    f"{f'{said} (' if said else '(named by '}providers.{self.name}.api_key_env) is not set",
                    code="upstream_key_missing",
                )
            kwargs["api_key"] = key
        kwargs["timeout"] = self.settings.timeout
        # Only the gateway's retry policy applies (before the first byte, never a 429).
        kwargs["max_retries"] = 0
        kwargs["num_retries"] = 0
        if self.settings.headers or own:
            kwargs["extra_headers"] = {**self.settings.headers, **own}
        options = body.get("options")
        num_ctx = options.get("num_ctx") if isinstance(options, dict) else None
        if self.prefix in OLLAMA_PREFIXES and isinstance(num_ctx, int):
            kwargs["num_ctx"] = num_ctx  # the window planned for (litellm's Ollama option)
        return kwargs

    async def describe(self, model: str) -> ServerWindow | None:
        """Ollama's native API: the running server's window (`/api/ps`, `/api/show`), as for Ollama's /v1.

        Other providers have no such question: their window is the model map's.
        """
        if self.prefix not in OLLAMA_PREFIXES:
            return None
        import aiohttp  # (here: a gateway with litellm providers need not load it at start)

        from gateway.upstream.discovery import describe_openai_compatible

        headers = dict(self.settings.headers)
        key = os.environ.get(self.settings.api_key_env, "") if self.settings.api_key_env else ""
        if key and not any(name.lower() == "authorization" for name in headers):
            headers["authorization"] = f"Bearer {key}"  # (an Ollama behind a proxy that wants it)
        async with aiohttp.ClientSession(headers=headers or None) as session:
            return await describe_openai_compatible(
                session, self.url or OLLAMA_DEFAULT_URL, model, within=self.settings.timeout or None
            )

    async def complete(self, body: Body, *, waited: float = 0.0) -> Body:
        litellm = await litellm_module(self.name)
        kwargs = self._kwargs({**body, "stream": False})

        async def once(waited: float) -> Body:
            asked = self._in_time(kwargs, waited)
            with map_litellm_errors(self.name, self.url):
                try:
                    # litellm's `timeout` holds each read, not the whole answer: the deadline does.
                    async with asyncio.timeout(asked.get("timeout") or None):
                        return _dump(await litellm.acompletion(**asked))
                except TimeoutError:
                    raise self._timed_out("no whole answer") from None

        return await complete_with_retries(self.name, self.settings.retries, is_retryable, once, waited)

    def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        async def once(waited: float) -> AsyncGenerator[Chunk, None]:
            kwargs = self._kwargs({**body, "stream": True})
            litellm = await litellm_module(self.name)
            with map_litellm_errors(self.name, self.url):
                response = await litellm.acompletion(**self._in_time(kwargs, waited))
                async for chunk in response:
                    yield _dump(chunk)

        return stream_with_retries(self.name, self.settings.retries, is_retryable, once, waited=waited)

    def _in_time(self, kwargs: dict[str, Any], waited: float) -> dict[str, Any]:
        """`kwargs` with litellm's `timeout` less the `waited` seconds of the turn's deadline.

        A deadline used up is the provider's 504 at once, nothing sent."""
        timeout = kwargs.get("timeout")
        if not waited or not timeout:
            return kwargs
        if waited >= timeout:
            raise self._timed_out("no answer")
        return {**kwargs, "timeout": timeout - waited}

    def _timed_out(self, late: str) -> UpstreamTimeout:
        """The 504 of an answer (`late`: "no answer", ...) past the provider's `timeout`."""
        return UpstreamTimeout(
            f"{provider_at(self.name, self.url)} sent {late} within {self.settings.timeout:g} s "
            f"(providers.{self.name}.timeout)"
        )
