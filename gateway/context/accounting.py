"""What a provider said of a prompt (pure): its whole size, and how much its prompt cache served.

Providers say it in three shapes:

- OpenAI (and vLLM, llama.cpp's newer servers): `usage.prompt_tokens` is the whole prompt, of
  which `usage.prompt_tokens_details.cached_tokens` came from the cache;
- llama.cpp: its `timings` (in a whole answer, and in a stream's last chunk, asked for usage or
  not): `cache_n` tokens reused from the cache, `prompt_n` evaluated; the whole is their sum;
- Anthropic: `input_tokens` leaves out `cache_read_input_tokens` and
  `cache_creation_input_tokens`; the whole is the three together. litellm translates that into
  `prompt_tokens` and keeps both cache fields beside it; recent litellm counts both in
  `prompt_tokens` (and says `prompt_tokens_details.cache_creation_tokens`), some earlier
  versions counted the cache reads only.

A figure the provider did not give is left out, never guessed.
"""

from __future__ import annotations

from gateway.types import JSONObject, as_object


def _count(value: object) -> int | None:
    """A token count, or None for anything else (a bool, a negative number, a string)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def prompt_accounting(usage: object, timings: object = None) -> JSONObject | None:
    """The prompt's figures from a completion's `usage` (and llama.cpp's `timings`).

    None when neither says anything. Each figure only when known: `prompt_tokens` (the whole
    prompt, cached tokens included), `cached_tokens` (served from the provider's cache),
    `cache_creation_tokens` (written to it: Anthropic), and `source` (where the cache figures
    came from).
    """
    usage, timings = as_object(usage), as_object(timings)
    details = as_object(usage.get("prompt_tokens_details"))
    read = _count(usage.get("cache_read_input_tokens"))
    written = _count(usage.get("cache_creation_input_tokens"))
    if read is not None or written is not None:
        whole, cached, source = _anthropic_whole(usage, details, read or 0, written or 0), read, "anthropic"
    else:
        whole, source = _count(usage.get("prompt_tokens")), "usage"
        cached = _count(details.get("cached_tokens"))
    reused, evaluated = _count(timings.get("cache_n")), _count(timings.get("prompt_n"))
    out: JSONObject = {}
    if cached is None and reused is not None:
        cached, source = reused, "llama.cpp timings"
    if whole is None and reused is not None and evaluated is not None:
        whole = reused + evaluated
    if whole is not None:
        out["prompt_tokens"] = whole
    if cached is not None:
        out["cached_tokens"] = cached
    if written is not None:
        out["cache_creation_tokens"] = written
    if cached is not None or written is not None:
        out["source"] = source
    return out or None


def _anthropic_whole(usage: JSONObject, details: JSONObject, read: int, written: int) -> int | None:
    """The whole prompt of an answer that reports Anthropic's cache fields (None: cannot tell)."""
    if "prompt_tokens" not in usage:  # Anthropic's own shape
        uncached = _count(usage.get("input_tokens"))
        return uncached + read + written if uncached is not None else None
    prompt = _count(usage.get("prompt_tokens"))
    if prompt is None or written == 0 or _count(details.get("cache_creation_tokens")) is not None:
        return prompt  # (every litellm version counts the cache reads in prompt_tokens)
    text = _count(details.get("text_tokens"))
    # A cache write, from a litellm that may or may not have counted it in prompt_tokens.
    return text + read + written if text is not None else None
