"""A chat-completions request, validated: the shapes OpenAI itself enforces, so nothing
malformed is stored and replayed later, and the gateway's own fields (never forwarded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.context import (
    ConversationView,
    Message,
)
from gateway.exceptions import (
    ConversationTooLarge,
    InvalidRequest,
)
from gateway.ids import check_conversation_id

# Consumed by the gateway, never forwarded (providers that validate arguments reject them).
GATEWAY_FIELDS = frozenset({"conversation_id", "session_id", "agent_id", "response_id", "user_timezone"})
# Never forwarded: a client must not redirect the gateway or choose its credentials.
FORBIDDEN_FIELDS = frozenset({"api_base", "base_url", "api_key", "api_version", "extra_headers"})
# Larger than any model's window: a bigger max_tokens is a mistake, not a request.
MAX_ANSWER_TOKENS = 10_000_000
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def check_size(cap: int, cid: str, view: ConversationView, adding: int) -> None:
    """A conversation past the cap gets a clear 400 instead of an ever slower load."""
    stored = len(view.transcript)
    if cap and stored + adding > cap:
        raise ConversationTooLarge(
            f"Conversation {cid!r} holds {stored} messages; this turn would take it past the cap of "
            f"{cap} (storage.max_conversation_messages). Reset it (POST /v1/conversations/{cid}/reset) "
            "or start a new conversation.",
            param="conversation_id",
        )


def _check_message_fields(m: dict[str, Any], i: int) -> None:
    """The shapes OpenAI itself enforces, so nothing malformed is stored and replayed later."""
    content = m.get("content")
    if content is not None and not isinstance(content, str):  # noqa: SIM102 - one rule, one error
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            raise InvalidRequest(
                f"messages[{i}].content must be a string, an array of content parts, or null",
                param=f"messages[{i}].content",
            )
    for key in ("name", "tool_call_id"):
        if key in m and m[key] is not None and not isinstance(m[key], str):
            raise InvalidRequest(f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidRequest(
            f"messages[{i}].tool_call_id is required for a tool message", param=f"messages[{i}].tool_call_id"
        )
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(
                f"messages[{i}].tool_calls must be an array on an assistant message",
                param=f"messages[{i}].tool_calls",
            )
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(call, dict)
                or not isinstance(call.get("id"), str)
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), str)
            ):
                raise InvalidRequest(
                    f"messages[{i}].tool_calls[{j}] must be "
                    "{id, type: 'function', function: {name, arguments}}",
                    param=f"messages[{i}].tool_calls[{j}]",
                )


@dataclass(slots=True)
class ChatRequest:
    """A validated chat-completions request."""

    body: dict[str, Any]
    model: str
    messages: list[Message]
    stream: bool
    include_usage: bool
    conversation_id: str | None
    # Continue from this response (Responses API): from the conversation's newest response, or
    # from a fork made at an older one. Decided under the conversation's lock.
    previous_response_id: str | None = None

    @classmethod
    def parse(cls, body: Any, *, header_conversation_id: str | None = None) -> ChatRequest:
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty array", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
            role = m.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role must be one of {', '.join(sorted(MESSAGE_ROLES))}",
                    param=f"messages[{i}].role",
                )
            _check_message_fields(m, i)
            if "is_feedback" in m and not isinstance(m["is_feedback"], bool):
                raise InvalidRequest(
                    f"messages[{i}].is_feedback must be a boolean", param=f"messages[{i}].is_feedback"
                )
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ANSWER_TOKENS
            ):
                raise InvalidRequest(
                    f"'{key}' must be an integer between 1 and {MAX_ANSWER_TOKENS}", param=key
                )
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a boolean", param="stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
        include_usage = bool((options or {}).get("include_usage"))
        cid: str | None = None
        if body.get("conversation_id") is not None:
            cid = check_conversation_id(body["conversation_id"], param="conversation_id")
        elif header_conversation_id is not None:
            cid = check_conversation_id(header_conversation_id, param="X-Conversation-Id")
        elif body.get("session_id") is not None:
            cid = check_conversation_id(body["session_id"], param="session_id")
        elif body.get("agent_id") is not None:
            cid = check_conversation_id(body["agent_id"], param="agent_id")
        return cls(body, model, messages, stream, include_usage, cid)
