"""A chat-completions request as the services take it, the gateway's own fields and the size cap.

The request is checked at the edge by `gateway/api/validation.py`; the gateway's own fields are
never forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.context import ConversationView, Message
from gateway.context.records import end_user
from gateway.exceptions import ConversationTooLarge

# Consumed by the gateway, never forwarded (providers that validate arguments reject them);
# `previous_response_id` is the Responses API's: a chat completion names its conversation instead.
GATEWAY_FIELDS = frozenset(
    {
        "conversation_id", "session_id", "agent_id", "response_id", "user_timezone", "is_feedback",
        "previous_response_id",
    }
)  # fmt: skip
# The prefix of the fields the gateway itself adds to a provider's body (`gateway.cache_key`,
# `gateway.traceparent`), taken out before it is sent: a client's own such field is never passed on.
OWN = "gateway."
# Never forwarded: a client must not redirect the gateway or choose its credentials. Beside
# OpenAI's, the credentials and routing litellm takes as arguments.
FORBIDDEN_FIELDS = frozenset(
    {
        "api_base",
        "base_url",
        "api_key",
        "api_version",
        "api_type",
        "extra_headers",
        "headers",
        "organization",
        "custom_llm_provider",
        "azure_ad_token",
        "azure_ad_token_provider",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "aws_region_name",
        "aws_profile_name",
        "aws_role_name",
        "aws_web_identity_token",
        "vertex_credentials",
        "vertex_project",
        "vertex_location",
    }
)
# Larger than any model's window: a bigger max_tokens is a mistake, not a request.
MAX_ANSWER_TOKENS = 10_000_000
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def take_prefill(request: ChatRequest) -> None:
    """A request that ends with an assistant message of text asks the answer to go on from it
    (a prefill: Anthropic's, llama.cpp's, vLLM's, Ollama's; a client going on from an answer cut
    short): `request.prefill`, stored with the answer as one assistant message. An empty one is
    no prefill: left out (stored, it was an empty message sent on every later turn)."""
    last = request.messages[-1] if request.messages else None
    if last is None or last.get("role") != "assistant" or last.get("tool_calls"):
        return
    text = last.get("content")
    parts = text if isinstance(text, list) else None
    if parts and all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        # Text given as parts (OpenAI's array form): the same prefill, as the string it joins to.
        text = "".join(str(p.get("text", "")) for p in parts)
        request.messages[-1] = {**last, "content": text}
    if isinstance(text, str) and text:
        request.prefill = text
    elif text == "" and len(request.messages) > 1:
        request.messages.pop()


def check_size(cap: int, cid: str, view: ConversationView, adding: int) -> None:
    """A conversation past the cap gets a clear 400 instead of an ever slower load."""
    stored = view.transcript_count
    if cap and stored + adding > cap:
        raise ConversationTooLarge(
            f"Conversation {cid!r} holds {stored} messages; this turn would take it past the cap of "
            f"{cap} (storage.max_conversation_messages). Reset it (POST /v1/conversations/{cid}/reset) "
            "or start a new conversation.",
            param="conversation_id",
        )


@dataclass(slots=True)
class ChatRequest:
    """A validated chat-completions request: the client's body and messages, as sent."""

    body: dict[str, Any]
    model: str
    messages: list[Message]
    stream: bool
    include_usage: bool
    conversation_id: str | None
    # Continue from this response (Responses API): from the conversation's newest response, or
    # from a fork made at an older one. Decided under the conversation's lock.
    previous_response_id: str | None = None
    # The Responses API's own parameters (instructions, metadata, ...): recorded, never sent.
    echo: dict[str, Any] | None = None
    # Anthropic's Messages API: a turn translated into this request, recorded so (`"api"`), so
    # that lists of one API's turns tell it apart (`gateway.types.request_api`).
    from_messages_api: bool = False
    # The Responses API's `truncation`: "auto", the gateway's window; "disabled", a window
    # that would leave out any of the conversation is refused instead (`planning.refuse_cut`).
    truncation: str = "auto"
    # The summary version a compaction made for this turn (Responses `context_management`):
    # the window is cut to start with it, whatever the previous turn's head was.
    compaction_version: int | None = None
    # A Responses turn naming OpenAI's `conversation` or `previous_response_id`: how many of the
    # leading messages are the system prompt (its `instructions`: 0 or 1). The input's own
    # system/developer items after them are items in line once the conversation holds anything,
    # as OpenAI appends every input item (and as `items.create` does). None: every leading
    # system message is the system prompt (chat completions, which resend it).
    system_prompt_count: int | None = None
    # A prefill (`take_prefill`): the request ends with this assistant text, which the answer goes
    # on from. Sent as it is; stored as the beginning of the answer, not as a message of its own.
    prefill: str | None = None

    @property
    def end_user(self) -> str | None:
        """The end user: `user`, else `safety_identifier` (OpenAI's newer name for it)."""
        return end_user(self.body) or None
