"""Anthropic's thinking through litellm: an answer's `thinking_blocks` (their signature included)
are stored with it and replayed, as Anthropic requires of an assistant message whose tool calls
are answered in the next request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.store.memory import MemoryStore
from gateway.upstream.base import Body, Chunk
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

CALL = {
    "id": "toolu_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
THOUGHT = {"type": "thinking", "thinking": "I should ask the tool.", "signature": "sig-abc"}


class Thinking(MockUpstream):
    """Answers the first turn with a thought and a tool call, as litellm gives Anthropic's."""

    def __init__(self) -> None:
        super().__init__(self.answer)

    def answer(self, body: Body) -> Any:
        if body["messages"][-1]["role"] == "tool":
            return "It is sunny."
        message = {"role": "assistant", "content": None, "tool_calls": [CALL], "thinking_blocks": [THOUGHT]}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        completion = await self.complete(body)
        message = completion["choices"][0]["message"]
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        if not message.get("tool_calls"):
            yield {
                **head,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": message["content"]}}],
            }
            yield {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            return
        for piece in (
            {"thinking": "I should ", "signature": None},
            {"thinking": "ask the tool."},
            {"signature": "sig-abc"},
        ):
            yield {
                **head,
                "choices": [{"index": 0, "delta": {"thinking_blocks": [{"type": "thinking", **piece}]}}],
            }
        yield {**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **CALL}]}}]}
        yield {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answers_thinking_is_replayed_with_its_tool_calls(stream: bool) -> None:
    """It was stored without them: the tool result's turn sent the call alone, which Anthropic
    refuses ("Expected `thinking` ... but found `tool_use`"), on every retry."""
    upstream = Thinking()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        first = {"model": "mock/m", "conversation_id": "t", "stream": stream}
        r = await client.post(
            "/v1/chat/completions", json={**first, "messages": [{"role": "user", "content": "weather?"}]}
        )
        assert r.status_code == 200
        result = {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
        r = await client.post("/v1/chat/completions", json={**first, "messages": [result]})
        assert r.status_code == 200
    replayed = upstream.requests[-1]["messages"][-2]
    assert replayed["tool_calls"][0]["id"] == "toolu_1"
    assert replayed["thinking_blocks"] == [THOUGHT]
