"""Token counting: a message costs its fields' tokens plus framing, whatever the cache holds."""

from __future__ import annotations

import orjson

from gateway.tokens import TOKENS_PER_MESSAGE, count_message, counter_for, get_encoding


def expected(message: dict[str, object], encoding: str) -> int:
    enc = get_encoding(encoding)
    total = TOKENS_PER_MESSAGE
    for key, value in message.items():
        if key == "is_feedback" or value is None:
            continue
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        total += len(enc.encode(text, disallowed_special=())) + (key == "name")
    return total


MESSAGES: list[dict[str, object]] = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Nice to meet you, Bob! " * 20},
    {"role": "user", "content": "<|endoftext|> is only text here <|im_start|>"},
    {"role": "user", "name": "kim", "content": [{"type": "text", "text": "a part"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
    {"role": "user", "content": "<|endoftext|>", "is_feedback": True},
]


def test_counts_match_the_encoding_for_every_field_kind() -> None:
    for model, encoding in (("llama3", "cl100k_base"), ("gpt-4o-mini", "o200k_base")):
        name, count = counter_for(model)
        assert name == encoding
        for message in MESSAGES * 2:  # the second pass reads short strings from the cache
            assert count(message) == count_message(message, model) == expected(message, encoding)
