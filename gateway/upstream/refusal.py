"""Recognising a provider's "prompt too long" refusal, and the numbers it gives (pure).

Shapes seen:
- OpenAI: 400, code `context_length_exceeded`, "This model's maximum context length is 8192
  tokens. However, your messages resulted in 9000 tokens. ..."
- llama.cpp: 400, type `exceed_context_size_error`, numeric code, "request (527 tokens) exceeds
  the available context size (512 tokens)", plus `n_prompt_tokens` and `n_ctx` fields
- vLLM: 400, "This model's maximum context length is 4096 tokens. However, you requested 5000
  tokens (4900 in the messages, 100 in the completion)" or "... your request has 5000 input tokens";
  newer: "You passed 900 input tokens and requested 200 output tokens. However, the model's
  context length is only 1024 tokens, ..." (its input count is of a prompt it cut first to what
  could fit: a least figure, not read as the prompt's count)
- Ollama: "the input length exceeds the context length", "prompt too long"
"""

from __future__ import annotations

import re

from gateway.exceptions import Refusal

_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error", "context_window_exceeded"})
_PHRASES = re.compile(
    r"context length|context size|context window|maximum context|prompt is too long|prompt too long"
    r"|too many tokens|input length exceeds|exceeds the available context",
    re.IGNORECASE,
)
_WINDOW = (
    re.compile(r"maximum context length is (\d+)", re.IGNORECASE),
    re.compile(r"available context size \((\d+) tokens?\)", re.IGNORECASE),
    re.compile(r"context (?:length|size|window) (?:of|is) (\d+)", re.IGNORECASE),
    re.compile(r"\d+ tokens? > (\d+) maximum", re.IGNORECASE),  # Anthropic: "762 tokens > 600 maximum"
    re.compile(r"context length is only (\d+) tokens", re.IGNORECASE),  # vLLM, newer
)
_PROMPT = (
    re.compile(r"\((\d+) in the messages", re.IGNORECASE),
    re.compile(r"request \((\d+) tokens?\)", re.IGNORECASE),
    re.compile(r"messages resulted in (\d+) tokens", re.IGNORECASE),
    re.compile(r"request has (\d+) input tokens", re.IGNORECASE),
    re.compile(r"prompt (?:is too long|too long)[^0-9]*(\d+) tokens", re.IGNORECASE),
)


_COMPLETION = (
    re.compile(r"(\d+) in the completion", re.IGNORECASE),
    re.compile(r"requested (\d+) output tokens", re.IGNORECASE),
)


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_refusal(status: int, payload: object, text: str) -> Refusal | None:
    """The refusal in a provider's error answer, or None when the error is about something else.

    `payload`: the answer's decoded JSON, `text`: its message.
    """
    if status not in (400, 413, 422, 500):
        return None
    err = payload.get("error", payload) if isinstance(payload, dict) else None
    err = err if isinstance(err, dict) else {}
    kinds = {str(err.get("code")), str(err.get("type"))}
    if not (kinds & _CODES) and not _PHRASES.search(text):
        return None
    window = _positive_int(err.get("n_ctx")) or _first(_WINDOW, text)
    prompt = _positive_int(err.get("n_prompt_tokens")) or _first(_PROMPT, text)
    completion = _first(_COMPLETION, text)
    return Refusal(message=text, window=window, prompt_tokens=prompt, completion_tokens=completion)
