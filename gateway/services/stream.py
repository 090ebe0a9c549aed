"""The assistant message of a turn: from a completion, or rebuilt from a chunk stream."""

from __future__ import annotations

from typing import Any

from gateway.context import (
    Message,
)
from gateway.exceptions import (
    UpstreamProtocolError,
)

_OUTPUT_FIELDS = ("role", "content", "tool_calls", "function_call", "name", "refusal")


def output_message(message: Any) -> Message:
    """The assistant message as it will be replayed: known fields, nulls dropped."""
    if not isinstance(message, dict):
        raise UpstreamProtocolError("The provider's reply has no message")
    out: Message = {"role": "assistant"}
    for key in _OUTPUT_FIELDS[1:]:
        value = message.get(key)
        if value is not None and value != []:
            out[key] = value
    if "tool_calls" in out:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": c.get("type") or "function", "function": c.get("function")}
            for c in out["tool_calls"]
            if isinstance(c, dict)
        ]
        out.setdefault("content", None)
    else:
        out.setdefault("content", "")
    return out


class StreamAccumulator:
    """Rebuilds the assistant message of choice 0 from a chunk stream."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                self.refusal.append(delta["refusal"])
            for call in delta.get("tool_calls") or ():
                slot = self.tool_calls.setdefault(
                    int(call.get("index", 0)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                if call.get("type"):
                    slot["type"] = call["type"]
                fn = call.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def message(self) -> Message:
        message: Message = {"role": "assistant", "content": "".join(self.content)}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            if not message["content"]:
                message["content"] = None
        return message

