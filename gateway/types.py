"""The shapes of the data the gateway passes around.

OpenAI chat messages, tool calls, usage and stream chunks, the records of a response log, and
JSON as read from a client, a provider or a file (an `object` to narrow with isinstance, never
trusted).
"""

from __future__ import annotations

import re
from typing import Literal, Required, TypeAlias, cast

from typing_extensions import TypedDict

# JSON as parsed (orjson.loads): narrow with isinstance before use.
JSON: TypeAlias = "None | bool | int | float | str | list[JSON] | dict[str, JSON]"
JSONObject: TypeAlias = "dict[str, object]"
# A record of a response log, an index marker or a side-log entry, as stored; JSON read back
# from disk is not trusted. A response log's records, in order:
#   {"type": "request", "response_id", "conversation_id", "created", "model", "stream",
#                       "params", "system", "input", ...}
#   {"type": "context", "stored_messages", "sent_messages", "messages", ...}   (the manifest)
#   {"type": "response", "message", "finish_reason", "usage", "timings"}
#   {"type": "commit", "status": "complete", "committed"} or {"type": "incomplete", "reason", "error"}
#   {"type": "deleted", "at"}                                                  (a tombstone)
Record: TypeAlias = "dict[str, object]"


class FunctionCall(TypedDict, total=False):
    name: str
    arguments: str


class ToolCall(TypedDict, total=False):
    """A tool call on an assistant message (`index` only in stream deltas)."""

    id: str
    type: str
    function: FunctionCall
    index: int


class ImageURL(TypedDict, total=False):
    url: str
    detail: str


class ContentPart(TypedDict, total=False):
    """A part of a message's content: text, an image (`image_url`), audio or a file."""

    type: Required[str]
    text: str
    image_url: ImageURL | str
    input_audio: JSONObject  # {"data", "format"}
    file: JSONObject  # {"file_id" | "file_data", "filename"}


class Message(TypedDict, total=False):
    """An OpenAI chat message.

    Clients may send more fields; they are kept and forwarded as sent (a TypedDict names the ones
    the gateway reads).
    """

    role: Required[str]
    content: str | list[ContentPart] | None
    name: str
    tool_calls: list[ToolCall]
    tool_call_id: str
    refusal: str | None
    function_call: FunctionCall  # the legacy single call (functions API)
    audio: JSONObject  # an audio answer: {"id"} (as it is replayed)
    # Anthropic's thinking through litellm (its signature included): replayed with the message,
    # as Anthropic requires of an assistant message whose tool calls are answered next.
    thinking_blocks: list[JSONObject]
    is_feedback: bool  # a gateway field: stored, never sent to a provider
    compaction: JSONObject  # a gateway field: the compaction item this summary is (stored, never sent)


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class Timings(TypedDict):
    upstream_ms: float
    total_ms: float


class Delta(TypedDict, total=False):
    role: str
    content: str | None
    tool_calls: list[ToolCall]
    refusal: str | None


class ChunkChoice(TypedDict, total=False):
    index: int
    delta: Delta
    finish_reason: str | None


class Chunk(TypedDict, total=False):
    """One `chat.completion.chunk` of a stream."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None


RecordType = Literal["request", "context", "response", "commit", "incomplete", "deleted"]

# The API a response log's request came through (`request_api`).
Api = Literal["chat", "responses", "items", "messages"]


def request_api(request: Record) -> Api:
    """Which API a request record came through.

    `items` added through the Conversations API (`"kind": "items"`), an Anthropic Messages turn
    (`"api": "messages"`), a Responses API turn (it keeps what its create returned, `responses`),
    else chat completions. (PostgreSQL's listing says the same in SQL: store/postgres/schema.py.)
    """
    if request.get("kind") == "items":
        return "items"
    if request.get("api") == "messages":
        return "messages"
    return "responses" if "responses" in request else "chat"


def as_object(value: object) -> JSONObject:
    """`value` if it is a JSON object, else an empty one (for reading untrusted JSON)."""
    return cast(JSONObject, value) if isinstance(value, dict) else {}


def as_list(value: object) -> list[object]:
    """`value` if it is a JSON array, else an empty one."""
    return cast(list[object], value) if isinstance(value, list) else []


def first_choice(completion: JSONObject) -> JSONObject:
    """Choice 0 of a completion or chunk (empty when there is none)."""
    choices = as_list(completion.get("choices"))
    return as_object(choices[0]) if choices else {}


def ascii_int(text: str, max_digits: int = 18) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits only, at most `max_digits`; else None.

    ASCII only: not `²` or `٣`, which `str.isdigit` accepts and `int` may not.
    """
    if text.isascii() and text.isdigit() and len(text) <= max_digits:
        return int(text)
    return None


# An HTTP header name (RFC 9110's token), and what ends a header line or a C string.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_LINE_ENDS = re.compile(r"[\r\n\x00]")


def header_problem(name: str, value: str) -> str | None:
    """Why HTTP/1.1 cannot carry the header `name: value` as written, or None when it can.

    Written raw, a line break in a value would end the header there and start whatever follows
    as a header or a request of its own."""
    if not _HEADER_NAME.fullmatch(name):
        return f"{name!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~)"
    if _LINE_ENDS.search(value):
        return f"the value of {name!r} holds a line break or a NUL"
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return f"the value of {name!r} holds a character HTTP/1.1 cannot carry (not latin-1)"
    return None


# Narrowing: values read from disk or from clients, typed once (None or empty when not so).


def text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def obj(value: object) -> JSONObject | None:
    return cast(JSONObject, value) if isinstance(value, dict) else None


def message(value: object) -> Message | None:
    return cast(Message, value) if isinstance(value, dict) else None


def messages(value: object) -> list[Message]:
    """A stored list of messages (anything that is not a message object left out)."""
    return [cast(Message, m) for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def ints(value: object) -> tuple[int, ...] | None:
    return tuple(v for v in value if isinstance(v, int)) if isinstance(value, list) else None
