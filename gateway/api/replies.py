"""The reply bodies, described for the OpenAPI document only (`api/openapi.py`).

The handlers build plain dicts, and the schemathesis test checks that what they send matches
these.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Fields = dict[str, object]  # (as a field's type, `object` would name the field `object`)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Reply):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(_Reply):
    """OpenAI's error shape, for every error status."""

    error: ErrorDetail


class ChatCompletion(_Reply):
    id: str = Field(description="The minted response id, {model-slug}-{12 hex}")
    object: str
    created: int | None = None
    model: str | None = None
    conversation_id: str | None = None
    choices: list[Fields]
    usage: Fields | None = None
    metadata: dict[str, str] | None = Field(None, description="Stored chat completions: its metadata now")


class ModelList(_Reply):
    object: Literal["list"]
    data: list[Fields]


class Conversation(_Reply):
    id: str
    object: Literal["conversation"]
    created_at: int | None = None
    metadata: Fields | None = None
    expires_at: int | None = None  # with sessions.ttl: when it expires if nothing more is said
    state: str | None = None  # post-processing's (extension): active, processing, processed, failed
    attempts: int | None = None
    error: str | None = None


class Deleted(_Reply):
    id: str
    object: str
    deleted: Literal[True]


class Page(_Reply):
    object: Literal["list"]
    data: list[Fields]
    has_more: bool | None = None
    first_id: str | None = None
    last_id: str | None = None


class ResponseObject(_Reply):
    id: str
    object: Literal["response"]
    status: str | None = None
    output: list[Fields] | None = None


class InputTokens(_Reply):
    object: Literal["response.input_tokens"]
    input_tokens: int = Field(
        description="What the prompt would hold: the server's own count (llama.cpp, vLLM), else the "
        "gateway's through its calibration for the provider; `gateway` says which and why"
    )


class CompactedResponse(_Reply):
    """OpenAI's compacted response (`POST /v1/responses/compact`)."""

    id: str
    object: Literal["response.compaction"]
    created_at: int
    output: list[Fields] = Field(description="The user messages, as they were, then one compaction item")
    usage: Fields


class AnthropicErrorDetail(_Reply):
    type: str
    message: str


class AnthropicError(_Reply):
    """Anthropic's error shape, for every error status of the Messages API."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageObject(_Reply):
    """The Messages API's `message`."""

    id: str = Field(description="The minted response id, {model-slug}-{12 hex}")
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Fields]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Fields
    conversation_id: str | None = None


class MessageTokensCount(_Reply):
    input_tokens: int = Field(description="What the prompt would hold (as /v1/responses/input_tokens counts)")
    gateway: Fields | None = Field(None, description="Extension: how it was counted, and the window counted")
