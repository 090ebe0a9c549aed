"""Every provider that is not OpenAI-compatible (Anthropic, Gemini, Bedrock, Ollama native, ...)
goes through `litellm.acompletion`. litellm is an optional dependency (the `litellm` extra),
imported lazily the first time it is needed, with its bundled model cost map (it would
otherwise try the network at import).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from gateway.config import ProviderSettings
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
    Upstream,
    complete_with_retries,
    stream_with_retries,
)
from gateway.upstream.refusal import parse_refusal

_litellm: Any = None
INSTALL_HINT = "pip install 'llm-continuity-gateway[litellm]'"


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
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    value = headers.get("retry-after") if headers is not None else None
    return value if isinstance(value, str) else None


@contextmanager
def map_litellm_errors(name: str, url: str) -> Iterator[None]:
    """Translate litellm's exceptions (which mirror OpenAI's) into gateway upstream errors."""
    try:
        yield
    except UpstreamError:
        raise
    except Exception as exc:
        litellm = import_litellm()
        where = f"Provider {name!r}" + (f" at {url}" if url else "")
        if isinstance(exc, litellm.exceptions.Timeout):
            raise UpstreamTimeout(f"{where} timed out") from exc
        if isinstance(exc, litellm.exceptions.APIConnectionError) or "Connection error" in str(exc):
            # (litellm may report a refused connection as a 500 "Connection error.")
            raise UpstreamUnreachable(f"{where} is unreachable: {type(exc).__name__}") from exc
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and status >= 400:
            text = str(getattr(exc, "message", exc))
            refusal = parse_refusal(status, None, text)
            if refusal is None and isinstance(exc, litellm.exceptions.ContextWindowExceededError):
                refusal = Refusal(message=text)
            kinds = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
            raise UpstreamStatusError(
                f"{where} returned HTTP {status}: {text}",
                upstream_status=status,
                error_type=kinds.get(status),
                code="context_length_exceeded" if refusal is not None else None,
                retry_after=_retry_after(exc) if status == 429 else None,
                refusal=refusal,
            ) from exc
        raise UpstreamProtocolError(f"{where} failed: {type(exc).__name__}: {exc}") from exc


def is_retryable(exc: UpstreamError) -> bool:
    """Connection failures and 502/503/504, before any answer byte; never a timeout (the
    provider already used its time) nor a 429 (passed through with Retry-After)."""
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
        kwargs = {k: v for k, v in body.items() if k in OPENAI_CHAT_PARAMS}
        kwargs["model"] = f"{self.prefix}/{body['model']}"
        if self.url:
            kwargs["api_base"] = self.url
        if self.settings.api_key_env:
            key = os.environ.get(self.settings.api_key_env, "")
            if not key:  # never litellm's fallback to the machine's own OPENAI_API_KEY & co.
                where = f"Provider {self.name!r}" + (f" at {self.url}" if self.url else "")
                raise UpstreamError(
                    f"{where} was not called: its key's environment variable "
                    f"{self.settings.api_key_env} (providers.{self.name}.api_key_env) is not set",
                    code="upstream_key_missing",
                )
            kwargs["api_key"] = key
        kwargs["timeout"] = self.settings.timeout
        # Only the gateway's retry policy applies (before the first byte, never a 429).
        kwargs["max_retries"] = 0
        kwargs["num_retries"] = 0
        if self.settings.headers:
            kwargs["extra_headers"] = dict(self.settings.headers)
        return kwargs

    async def complete(self, body: Body) -> Body:
        litellm = import_litellm(self.name)
        kwargs = self._kwargs({**body, "stream": False})

        async def once() -> Body:
            with map_litellm_errors(self.name, self.url):
                return _dump(await litellm.acompletion(**kwargs))

        return await complete_with_retries(self.name, self.settings.retries, is_retryable, once)

    def stream(self, body: Body) -> AsyncIterator[Chunk]:
        async def once() -> AsyncGenerator[Chunk, None]:
            kwargs = self._kwargs({**body, "stream": True})
            litellm = import_litellm(self.name)
            with map_litellm_errors(self.name, self.url):
                response = await litellm.acompletion(**kwargs)
                async for chunk in response:
                    yield _dump(chunk)

        return stream_with_retries(self.name, self.settings.retries, is_retryable, once)
