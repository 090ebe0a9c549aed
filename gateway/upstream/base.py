"""The upstream seam: send an OpenAI chat-completions body, get a completion or a chunk stream.

Implementations: `openai.py` (direct HTTP fast path), `litellm.py` (every other provider),
`demo.py` (built-in deterministic model) and `mock.py` (test twin with a handler).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

import orjson

from gateway.exceptions import UpstreamError
from gateway.types import JSONObject, as_list, as_object, first_choice

Body = JSONObject  # an OpenAI chat-completions request body
Chunk = JSONObject  # a completion, or one chunk of a stream, as the provider sent it

log = logging.getLogger("gateway.upstream")

# Provider statuses worth another attempt (never 429: that is passed through with Retry-After).
RETRY_STATUSES = frozenset({502, 503, 504, 529})  # (529: Anthropic's `overloaded_error`)
_BACKOFF = (0.2, 0.5, 1.0, 2.0)
# A traced turn's W3C `traceparent` for the provider, carried in the body (as `CACHE_KEY` is):
# an implementation takes it out and sends it as the request's header.
TRACEPARENT = "gateway.traceparent"
TRACESTATE = "gateway.tracestate"  # the client's W3C `tracestate`, passed on with it
_W3C_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
# A `tracestate` list member (W3C Trace Context): a key (`vendor` or `tenant@vendor`) = a value.
_KEY_CHARS = r"[a-z0-9_\-*/]"
_W3C_MEMBER = re.compile(
    rf"(?:[a-z]{_KEY_CHARS}{{0,255}}|[a-z0-9]{_KEY_CHARS}{{0,240}}@[a-z]{_KEY_CHARS}{{0,13}})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


def take_field(body: Body, field: str) -> tuple[Body, str | None]:
    """The body without one of the gateway's own `field`s, and the text it held (None: none).

    The body itself when it has no such field; a copy otherwise (the caller's body stays whole).
    """
    if field not in body:
        return body, None
    value = body[field]
    rest = {k: v for k, v in body.items() if k != field}
    return rest, value if isinstance(value, str) and value else None


def take_traceparent(body: Body) -> tuple[Body, str | None]:
    """The body without the gateway's `TRACEPARENT`, and the header value it held when that is a
    W3C `traceparent` (anything else is no header: never a client's text written as one)."""
    body, value = take_field(body, TRACEPARENT)
    return body, value if value is not None and _W3C_TRACEPARENT.fullmatch(value) else None


def take_trace_headers(body: Body) -> tuple[Body, dict[str, str]]:
    """The body without the gateway's `TRACEPARENT` and `TRACESTATE`, and the W3C headers they
    hold: `traceparent`, and with it the client's `tracestate`."""
    body, traceparent = take_traceparent(body)
    body, state = take_field(body, TRACESTATE)
    if traceparent is None:
        return body, {}
    if state is not None and well_formed_tracestate(state):
        return body, {"traceparent": traceparent, "tracestate": state}
    return body, {"traceparent": traceparent}


def well_formed_tracestate(value: str) -> bool:
    """Is `value` a W3C `tracestate`: at most 32 list members, at most 512 characters? (One that
    is not is dropped, as OpenTelemetry drops it from the span: the provider and the trace agree.)"""
    if len(value) > 512:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    named = [m for m in members if m]
    return 0 < len(named) <= 32 and all(_W3C_MEMBER.fullmatch(m) for m in named)


def backoff(attempt: int) -> float:
    return _BACKOFF[min(attempt, len(_BACKOFF) - 1)]


async def retry_or_raise(
    provider: str, exc: UpstreamError, attempt: int, retries: int, retryable: bool
) -> None:
    """Return after the backoff if another attempt is allowed, else re-raise `exc`.

    Callers only ask while nothing of the answer has been produced."""
    if attempt >= retries or not retryable:
        raise exc
    delay = backoff(attempt)
    log.warning(
        orjson.dumps(
            {
                "event": "upstream_retry",
                "provider": provider,
                "attempt": attempt + 1,
                "error": exc.message,
                "delay_s": delay,
            }
        ).decode()
    )
    await asyncio.sleep(delay)


async def complete_with_retries(
    provider: str,
    retries: int,
    retryable: Callable[[UpstreamError], bool],
    once: Callable[[float], Awaitable[Body]],
    waited: float = 0.0,
) -> Body:
    """`once(waited)`, attempted again (up to `retries` times) while its failure is retryable.

    The first attempt is given `waited` (seconds already spent on the turn's deadline), the
    others 0: each retry has its own deadline."""
    attempt = 0
    while True:
        try:
            return await once(waited if attempt == 0 else 0.0)
        except UpstreamError as exc:
            await retry_or_raise(provider, exc, attempt, retries, retryable(exc))
        attempt += 1


async def stream_with_retries(
    provider: str,
    retries: int,
    retryable: Callable[[UpstreamError], bool],
    once: Callable[[float], AsyncGenerator[Chunk, None]],
    empty: Callable[[], UpstreamError] | None = None,
    waited: float = 0.0,
) -> AsyncGenerator[Chunk, None]:
    """The chunks of `once(waited)`, started again while a retryable failure comes before the first chunk.

    Never after it: part of the answer is already on its way. `empty()`, if given, is the error
    for a stream that ended without any chunk. `waited` as in `complete_with_retries`."""
    attempt = 0
    while True:
        started = False
        try:
            async with aclosing(once(waited if attempt == 0 else 0.0)) as chunks:
                async for chunk in chunks:
                    started = True
                    yield chunk
            if not started and empty is not None:
                raise empty()
            return
        except UpstreamError as exc:
            if started:
                raise
            await retry_or_raise(provider, exc, attempt, retries, retryable(exc))
        attempt += 1


@dataclass(frozen=True, slots=True)
class ServerWindow:
    """The context window a running server says it gives a model, and where it said so."""

    tokens: int
    source: str  # e.g. "llama.cpp GET /props"
    num_ctx_option: bool = False  # Ollama: send the decided window as `options.num_ctx`
    # llama.cpp and vLLM refuse a prompt over their window (a 400): they never cut one silently,
    # so a count lower than expected is their template's (tools it does not render), not a cut.
    refuses_overlong: bool = False
    # How the server counts a prompt itself on request, "" if it cannot: "llama.cpp" (POST
    # /apply-template, then POST /tokenize) or "vllm" (POST /tokenize with the messages). The
    # window is then checked with its exact count (`Upstream.count_prompt`).
    prompt_counter: str = ""
    # llama.cpp: its slots (`total_slots` of GET /props), each keeping one prompt cached; 0 elsewhere.
    total_slots: int = 0
    # A guess the server will soon replace (an Ollama model not loaded yet: its window comes with
    # its first load): asked again a little later.
    provisional: bool = False

    @property
    def is_llamacpp(self) -> bool:
        return self.prompt_counter == "llama.cpp"


def provider_at(name: str, url: str) -> str:
    """How errors name a provider: "Provider 'NAME'", and "at URL" when it has one."""
    return f"Provider {name!r}" + (f" at {url}" if url else "")


def error_fields(payload: object) -> tuple[str | None, str | None, str | None, str | None]:
    """(message, type, code, param) of a provider's error object; None for what it does not say.

    The object comes as `{"error": {...}}`, as itself, as `{"error": "text"}`, or as a web
    framework's `{"detail": "text"}` (FastAPI's, which some servers answer with)."""
    err = payload.get("error", payload) if isinstance(payload, dict) else None
    if isinstance(err, str):
        return err or None, None, None, None
    if not isinstance(err, dict):
        return None, None, None, None

    def text(key: str) -> str | None:
        value = err.get(key)
        return value if isinstance(value, str) else None

    message = err.get("message") or text("detail")
    return (str(message) if message else None), text("type"), text("code"), text("param")


class Upstream(ABC):
    """One configured provider.

    `body["model"]` is already the provider's own model name; a conversation's body also carries
    `cache_hints.CACHE_KEY`, which an implementation takes out (and turns into the provider's own
    prompt-cache hints, if it has any), and a traced turn's `TRACEPARENT`, which it sends as the
    `traceparent` header where it can."""

    name: str = "upstream"
    url: str = ""
    # Does the provider's `usage.prompt_tokens` come from the model's real tokenizer? (The demo
    # model and the test twin only estimate it: nothing to calibrate against.)
    reports_real_usage: bool = True

    @abstractmethod
    async def complete(self, body: Body, *, waited: float = 0.0) -> Body:
        """A whole `chat.completion` object.

        `waited`: seconds the turn already waited on this provider for it (asking its window),
        taken off the first attempt's `timeout`: the provider's deadline counts from the turn's
        first question to it."""

    @abstractmethod
    def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        """`chat.completion.chunk` objects, in order; ends when the provider is done.

        `waited` as for `complete`: off the first attempt's deadline for the first event."""

    async def list_models(self) -> list[str]:
        """The model names the provider itself lists (empty when it lists none)."""
        return []

    async def describe(self, model: str) -> ServerWindow | None:
        """The runtime context window the server reports for `model`, if it reports one."""
        return None

    async def count_prompt(self, body: Body) -> int | None:
        """The server's own count of the prompt `body` (a chat request) makes, when it has a way to say.

        Its way is `ServerWindow.prompt_counter`; None otherwise or when asking failed."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def completion_from_text(model: str, text: str, *, prompt_tokens: int = 0) -> Body:
    """A minimal, valid `chat.completion` carrying one assistant text reply."""
    completion_tokens = max(1, len(text) // 4)
    return {
        "id": "chatcmpl-local",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chunks_from_completion(completion: Body, *, include_usage: bool) -> list[Chunk]:
    """Split a completion into the chunk sequence an OpenAI-compatible server would stream."""
    created = completion.get("created", int(time.time()))
    model = completion.get("model", "")
    base: Chunk = {
        "id": completion.get("id", "chatcmpl-local"),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        # (on every chunk, as OpenAI streams them)
        **{key: completion[key] for key in ("system_fingerprint", "service_tier") if key in completion},
    }
    choice = first_choice(completion)
    message = as_object(choice.get("message"))
    out: list[Chunk] = [
        {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    content = message.get("content")
    words = (content if isinstance(content, str) else "").split(" ")
    for i, word in enumerate(words):
        piece = word if i == len(words) - 1 else word + " "
        if piece:
            out.append(
                {**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            )
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        out.append({**base, "choices": [{"index": 0, "delta": {"refusal": refusal}, "finish_reason": None}]})
    audio = message.get("audio")
    if isinstance(audio, dict):
        out.append({**base, "choices": [{"index": 0, "delta": {"audio": audio}, "finish_reason": None}]})
    legacy = as_object(message.get("function_call"))
    if legacy:  # the legacy single call: its name, then its arguments
        pieces: tuple[JSONObject, ...] = (
            {"name": legacy.get("name", ""), "arguments": ""},
            {"arguments": legacy.get("arguments", "")},
        )
        for part in pieces:
            out.append(
                {**base, "choices": [{"index": 0, "delta": {"function_call": part}, "finish_reason": None}]}
            )
    for i, call in enumerate(as_object(c) for c in as_list(message.get("tool_calls"))):
        out.append(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": i, **call}]}, "finish_reason": None}
                ],
            }
        )
    out.append(
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason", "stop")}]}
    )
    if include_usage and completion.get("usage"):
        out.append({**base, "choices": [], "usage": completion["usage"]})
    if completion.get("timings"):  # llama.cpp's: in the last chunk, usage asked for or not
        out[-1]["timings"] = completion["timings"]
    return out


def approx_tokens(messages: object) -> int:
    """A cheap token estimate for local models (4 characters a token, 4 per message)."""
    total = 0
    for m in as_list(messages):
        content = as_object(m).get("content")
        total += 4 + (len(content) // 4 if isinstance(content, str) else 8)
    return total
