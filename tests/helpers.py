"""Checks shared by the test tiers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def assert_openai_tool_order(messages: Sequence[Mapping[str, object]]) -> None:
    """OpenAI's rules for tool messages: each answers a call of the assistant message just
    before its block, once; every call is answered before the next non-tool message."""
    current: list[object] | None = None
    answered: set[object] = set()
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            assert current is not None, f"orphan tool message at {i}"
            call_id = message.get("tool_call_id")
            assert call_id in current, f"tool message {i} answers no call of its assistant"
            assert call_id not in answered, f"call {call_id} answered twice"
            answered.add(call_id)
            continue
        if current is not None:
            missing = [c for c in current if c not in answered]
            assert not missing, f"calls {missing} unanswered before message {i}"
        current, answered = None, set()
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and isinstance(calls, list) and calls:
            current = [c["id"] for c in calls if isinstance(c, dict)]
