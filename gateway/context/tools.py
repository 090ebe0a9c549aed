"""Tool-call rules (pure): what providers accept around assistant `tool_calls` messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import orjson

from gateway.types import Message

UNANSWERED_TOOL_RESULT = "[no result: the user continued without answering this tool call]"


def default_arguments(function: object) -> None:
    """Give a call's `function` without arguments (left out, null or "") the arguments `"{}"`.

    Every provider takes that back; as it came, a strict provider refused every later turn.
    """
    if isinstance(function, dict) and not function.get("arguments"):
        function["arguments"] = "{}"


def _is_json(text: object) -> bool:
    if not isinstance(text, str):
        return False
    if text.startswith("{") and text.endswith("}"):  # (most arguments: taken as they are)
        return True
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def with_json_arguments(message: Message) -> Message:
    """`message` as providers take it back: `"{}"` for the arguments of a call that are not JSON
    (a call cut short by the answer's token limit, stored as it was answered). Providers that
    read arguments as JSON (chat templates, Anthropic's `input`) refused every later turn."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    fixed = [_with_json_arguments(call) for call in calls]
    if all(new is old for new, old in zip(fixed, calls, strict=True)):
        return message
    return cast(Message, {**message, "tool_calls": fixed})


def _with_json_arguments(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or _is_json(function.get("arguments")):
        return call
    return {**cast(dict[str, object], call), "function": {**function, "arguments": "{}"}}


def repair_tool_calls(messages: Sequence[Message], *, goes_on: bool = False) -> list[Message]:
    """Make a message list acceptable to providers' tool-call rules without losing anything.

    An assistant `tool_calls` message whose calls were not all answered before the next
    non-tool message gets a synthetic `tool` result per missing call; a `tool` message that
    answers no pending call is dropped (providers reject orphans). `goes_on`: the turn adds no
    message after them, and the trailing calls get their synthetic results too.
    """
    out: list[Message] = []
    pending: list[str] = []

    def close_pending() -> None:
        for call_id in pending:
            out.append({"role": "tool", "tool_call_id": call_id, "content": UNANSWERED_TOOL_RESULT})
        pending.clear()

    for message in messages:
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id in pending:
                pending.remove(call_id)
                out.append(message)
            continue
        close_pending()
        out.append(message)
        if role == "assistant" and message.get("tool_calls"):
            pending = [str(c["id"]) for c in message["tool_calls"] if isinstance(c, dict) and c.get("id")]
    # A trailing call without any result is the model asking for tools now: left for the client,
    # unless the turn `goes_on` without them (a request of a system prompt alone). Calls of which
    # some were answered at the end are what the model is given now: providers refuse a call
    # without its result ("must be followed by tool messages responding to each").
    if pending and out and (goes_on or out[-1].get("role") == "tool"):
        close_pending()
    return out
