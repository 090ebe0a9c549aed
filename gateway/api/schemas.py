"""The request bodies the gateway accepts, as pydantic models.

`api/validation.py` checks requests with them and `api/openapi.py` generates the OpenAPI document
from them.

A model checks a body, it never rewrites one: the client's own dicts are what is forwarded and
stored, unknown fields included (`extra="allow"`). Fields the gateway only passes on are
documented with OpenAI's types but not checked (`SkipValidation`): the provider checks them.
Messages are TypedDicts that leave unknown fields out of their (unused) copy: a 200-message
history is checked as fast as by hand. Each body's `error_messages` says what a 400 reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, ClassVar, Literal, NotRequired, Required, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SkipValidation,
    Tag,
    with_config,
)
from pydantic.config import JsonDict
from pydantic_core import ErrorDetails
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from gateway.ids import CONVERSATION_ID_RE
from gateway.services.requests import MAX_ANSWER_TOKENS, MESSAGE_ROLES

# What a 400 says, by field path ("messages[].role"; "" is the body): a text whose {param} is the
# field as the client wrote it, or a function of that and pydantic's error.
ErrorMessages = dict[str, str | Callable[[str, ErrorDetails], str]]

BODY = ConfigDict(extra="allow", strict=True)
# The gateway's own bodies and OpenAI's state endpoints: a field they do not know is a 400
# `unknown_parameter` (`api/validation.py`), as OpenAI answers a typo, never taken for nothing.
OWN_BODY = ConfigDict(extra="forbid", strict=True)
# For the shapes repeated in a history: unknown fields are accepted, only not copied (a third
# faster on long histories), as nobody reads the validated copy.
MESSAGE = ConfigDict(strict=True, json_schema_extra={"additionalProperties": True})
ConversationId = Annotated[str, Field(pattern=f"^{CONVERSATION_ID_RE.pattern}$")]
AnswerTokens = Annotated[int, Field(ge=1, le=MAX_ANSWER_TOKENS)]
# A model name: no control character (C0, DEL or C1). Said in the schema; checked by the content
# rules (`context.content`), which every way in applies with one error (`invalid_model`).
ModelName = Annotated[str, Field(min_length=1, json_schema_extra={"pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]+$"})]
TOKENS = f"must be an integer between 1 and {MAX_ANSWER_TOKENS}"
NOT_AN_OBJECT = "The request body must be a JSON object"


# -- chat completions ----------------------------------------------------------------------------


@with_config(MESSAGE)
class ImageURL(TypedDict, total=False):
    url: Required[str]
    detail: str


@with_config(MESSAGE)
class ContentPart(TypedDict, total=False):
    """A content part (text, image_url, ...): an object with a string `type` (required, as every
    other way into a conversation requires it).

    Its text is a string (a number, once stored, would go back to the provider on every later
    turn, and the items API refuses it); its image is checked by the content rules every way in
    shares (`context/content.py`); what else is in it is the provider's to check.
    """

    type: Required[str]
    text: str
    image_url: SkipValidation[ImageURL]


def _text_has_text(part: ContentPart) -> ContentPart:
    if part.get("type") == "text" and "text" not in part:  # (stored, it went back every turn)
        raise ValueError("a text part needs its text")
    return part


Content = str | list[Annotated[ContentPart, AfterValidator(_text_has_text)]] | None


@with_config(MESSAGE)
class FunctionCall(TypedDict):
    name: str
    arguments: NotRequired[str | None]  # (null: a provider's call without arguments, sent back)


@with_config(MESSAGE)
class ToolCall(TypedDict):
    id: Annotated[str, Field(min_length=1)]  # ("": its result named no call, and went missing)
    type: NotRequired[SkipValidation[Literal["function"]]]
    function: FunctionCall


def _said_in_schema(schema: JsonDict) -> None:
    """The schema says a message's content as its check (`_has_content`) takes it: required, a
    string or a non-empty array (so that generated requests are taken)."""
    schema["additionalProperties"] = True
    required = cast(list[str], schema.setdefault("required", []))
    if "content" not in required:
        required.append("content")
    content = cast(JsonDict, cast(JsonDict, schema["properties"])["content"])
    content["anyOf"] = [
        _non_empty(kind) for kind in cast(list[JsonDict], content["anyOf"]) if kind.get("type") != "null"
    ]


def _non_empty(kind: JsonDict) -> JsonDict:
    return {**kind, "minItems": 1} if kind.get("type") == "array" else kind


def _answer_in_schema(schema: JsonDict) -> None:
    """The schema says an assistant message as its check (`_says_something`) takes it: content,
    or tool calls."""
    schema["additionalProperties"] = True
    schema["anyOf"] = [
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
        {
            "required": ["content"],
            "properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}},
        },
    ]


@with_config(ConfigDict(strict=True, json_schema_extra=_said_in_schema))
class InputMessage(TypedDict, total=False):
    """A system, developer or user message (or a legacy `function` result)."""

    role: Required[Literal["system", "developer", "user", "function"]]
    content: Content
    name: str | None
    tool_call_id: str | None
    tool_calls: None  # only an assistant message calls tools
    is_feedback: Annotated[
        bool | None, Field(description="Gateway extension: forwarded once, never replayed")
    ]


def _ids_apart(calls: list[ToolCall]) -> list[ToolCall]:
    if len({call["id"] for call in calls}) < len(calls):  # (a result would answer both)
        raise ValueError("two tool calls with one id")
    return calls


@with_config(ConfigDict(strict=True, json_schema_extra=_answer_in_schema))
class AssistantMessage(TypedDict, total=False):
    role: Required[Literal["assistant"]]
    content: Content
    name: str | None
    tool_call_id: str | None
    tool_calls: Annotated[list[ToolCall], AfterValidator(_ids_apart)] | None
    is_feedback: bool | None
    # (kept for the check that the message says something; what they hold is the provider's)
    function_call: SkipValidation[object]
    audio: SkipValidation[object]
    refusal: SkipValidation[object]


@with_config(ConfigDict(strict=True, json_schema_extra=_said_in_schema))
class ToolMessage(TypedDict, total=False):
    role: Required[Literal["tool"]]
    content: Content
    name: str | None
    tool_call_id: Required[str]
    tool_calls: None
    is_feedback: bool | None


def _has_content(message: InputMessage | ToolMessage) -> InputMessage | ToolMessage:
    """A system, developer, user or tool message says something (the items API, Responses and
    Messages refuse one without content; stored, it went to the provider on every later turn)."""
    if message.get("role") != "function" and message.get("content") in (None, []):
        raise ValueError(f"a {message.get('role')} message needs its content: a string or a list of parts")
    return message


def _says_something(message: AssistantMessage) -> AssistantMessage:
    """An assistant message has content unless it calls tools (or is an audio answer or a
    refusal), as OpenAI requires: stored empty, it went to the provider on every later turn."""
    if message.get("content") in (None, []) and not any(
        message.get(key) not in (None, [], "") for key in ("tool_calls", "function_call", "audio", "refusal")
    ):
        raise ValueError("an assistant message needs its content unless it has tool_calls")
    return message


Message = Annotated[
    Annotated[InputMessage, AfterValidator(_has_content)]
    | Annotated[AssistantMessage, AfterValidator(_says_something)]
    | Annotated[ToolMessage, AfterValidator(_has_content)],
    Field(discriminator="role"),
]


@with_config(BODY)
class StreamOptions(TypedDict, total=False):
    include_usage: SkipValidation[bool]


def _tool_call_id(param: str, error: ErrorDetails) -> str:
    if error["type"] == "missing" or error["input"] is None:
        return f"{param} is required for a tool message"
    return f"{param} must be a string"


def _checked_or(otherwise: str) -> Callable[[str, ErrorDetails], str]:
    """What a field's own check said when it refused the value (`_has_content`, `_text_has_text`),
    else `otherwise` (its `{param}` the field)."""

    def said(param: str, error: ErrorDetails) -> str:
        if error["type"] == "value_error":
            return f"{param}: {error['msg'].removeprefix('Value error, ')}"
        return otherwise.format(param=param)

    return said


def _tool_calls(param: str, error: ErrorDetails) -> str:
    if error["type"] == "value_error":  # (two calls with one id)
        return f"{param} has two tool calls with one id"
    return f"{param} must be an array on an assistant message"


MAX_METADATA = 16
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA),
]


def _metadata(param: str, error: ErrorDetails) -> str:
    if len(error["loc"]) > 1:
        return "metadata keys are ≤64 characters and values strings ≤512"
    if error["type"] == "missing" or error["input"] is None:
        return "'metadata' is required"
    return f"'metadata' must be an object of at most {MAX_METADATA} string pairs"


class ChatCompletionRequest(BaseModel):
    model_config = BODY

    model: ModelName
    # Checked only: what is forwarded and stored is the client's own list (`body["messages"]`).
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: AnswerTokens | None = None
    max_completion_tokens: AnswerTokens | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # The gateway's own fields (never forwarded), checked in the order they are used.
    conversation_id: SkipValidation[ConversationId | None] = Field(
        None, description="Gateway extension: the conversation this turn continues (or starts)"
    )
    session_id: SkipValidation[ConversationId | None] = Field(None, description="Without conversation_id")
    agent_id: SkipValidation[ConversationId | None] = Field(None, description="Without session_id")
    user_timezone: SkipValidation[str | None] = Field(None, description="IANA zone for the recap's 'today'")
    is_feedback: bool | None = Field(None, description="Gateway extension: the last message is feedback")
    # Passed on to the provider.
    user: SkipValidation[str | None] = None
    temperature: SkipValidation[float | None] = None
    tools: SkipValidation[list[dict[str, object]] | None] = None
    tool_choice: SkipValidation[str | dict[str, object] | None] = None
    # Kept with a stored chat completion (`GET /v1/chat/completions?metadata[k]=v`), as OpenAI
    # checks it: refused here rather than stored in part.
    metadata: Metadata | None = None

    error_messages: ClassVar[ErrorMessages] = {
        "": NOT_AN_OBJECT,
        "metadata": _metadata,
        "model": "'model' is required and must be a non-empty string",
        "messages": "'messages' must be a non-empty array",
        "messages[]": _checked_or("{param} must be an object"),
        "messages[].role": "{param} must be one of " + ", ".join(sorted(MESSAGE_ROLES)),
        "messages[].content": "{param} must be a string, an array of content parts, or null",
        "messages[].content[]": _checked_or("{param} must be a content part: an object with a string 'type'"),
        "messages[].name": "{param} must be a string",
        "messages[].tool_call_id": _tool_call_id,
        "messages[].tool_calls": _tool_calls,
        "messages[].tool_calls[]": "{param} must be {{id, type: 'function', function: {{name, arguments}}}}",
        "messages[].is_feedback": "{param} must be a boolean",
        "max_tokens": f"'max_tokens' {TOKENS}",
        "max_completion_tokens": f"'max_completion_tokens' {TOKENS}",
        "stream": "'stream' must be a boolean",
        "is_feedback": "'is_feedback' must be a boolean",
        "stream_options": "'stream_options' must be an object",
    }


# -- items (Responses input, Conversations items) -------------------------------------------------


@with_config(BODY)
class ItemContentPart(TypedDict, total=False):
    type: Literal["input_text", "output_text", "text", "input_image"]
    text: str
    image_url: str | None
    file_id: str | None


@with_config(BODY)
class MessageItem(TypedDict, total=False):
    type: Literal["message"]
    role: Required[Literal["user", "assistant", "system", "developer"]]
    # Parts are checked (and named) when they become chat content: context/items.py.
    content: str | list[SkipValidation[ItemContentPart]]


def _documented_as_required(*fields: str) -> ConfigDict:
    """The config of an item whose `fields` are documented as required, as OpenAI requires them.

    `context/items.py` checks them (and takes `id` for a missing `call_id`).
    """
    return ConfigDict(extra="allow", strict=True, json_schema_extra={"required": list(fields)})


@with_config(_documented_as_required("type", "call_id", "name"))
class FunctionCallItem(TypedDict, total=False):
    type: Required[Literal["function_call"]]
    call_id: SkipValidation[Annotated[str, Field(min_length=1)]]
    name: SkipValidation[Annotated[str, Field(min_length=1)]]
    arguments: SkipValidation[str]


@with_config(_documented_as_required("type", "call_id"))
class FunctionCallOutputItem(TypedDict, total=False):
    type: Required[Literal["function_call_output"]]
    call_id: SkipValidation[Annotated[str, Field(min_length=1)]]
    output: SkipValidation[str]


_ITEM_KINDS = {"message": "message item", "function_call": "call item", "function_call_output": "output item"}


def _item_kind(item: object) -> str | None:
    if not isinstance(item, dict):
        return "message item"
    kind = item.get("type", "message")
    return _ITEM_KINDS.get(kind) if isinstance(kind, str) else None


Item = Annotated[
    Annotated[MessageItem, Tag("message item")]
    | Annotated[FunctionCallItem, Tag("call item")]
    | Annotated[FunctionCallOutputItem, Tag("output item")],
    Discriminator(_item_kind, custom_error_type="unknown_type", custom_error_message="unknown item type"),
]


@with_config(_documented_as_required("type", "encrypted_content"))
class CompactionItem(TypedDict, total=False):
    """A compaction item sent back (Responses `input`): the gateway's own reference.

    It is expanded into the summary it stands for (a 400 `invalid_encrypted_content` when it is
    not one).
    """

    type: Required[Literal["compaction"]]
    encrypted_content: SkipValidation[str]
    id: SkipValidation[str | None]


def _response_item_kind(item: object) -> str | None:
    is_compaction = isinstance(item, dict) and item.get("type") == "compaction"
    return "compaction item" if is_compaction else _item_kind(item)


ResponseItem = Annotated[
    Annotated[MessageItem, Tag("message item")]
    | Annotated[FunctionCallItem, Tag("call item")]
    | Annotated[FunctionCallOutputItem, Tag("output item")]
    | Annotated[CompactionItem, Tag("compaction item")],
    Discriminator(
        _response_item_kind, custom_error_type="unknown_type", custom_error_message="unknown item type"
    ),
]


def _unsupported_item(param: str, error: ErrorDetails) -> str:
    item = error["input"]
    kind = item.get("type") if isinstance(item, dict) else None
    return f"{param.removesuffix('.type')}: unsupported item type {kind!r}"


def item_errors(field: str) -> ErrorMessages:
    """The messages for a list of items at `field` (as `context.items.items_to_messages` words them)."""
    return {
        f"{field}[]": "{param} must be an object",
        f"{field}[].type": _unsupported_item,
        f"{field}[].role": "{param} must be user, assistant, system or developer",
        f"{field}[].content": "{param} must be a string or an array of parts",
    }


# -- the Responses API ---------------------------------------------------------------------------


@with_config(BODY)
class FunctionTool(TypedDict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: NotRequired[SkipValidation[str | None]]
    parameters: NotRequired[SkipValidation[dict[str, object] | None]]
    strict: NotRequired[SkipValidation[bool | None]]


@with_config(BODY)
class ConversationRef(TypedDict):
    id: ConversationId


def _input_kind(value: object) -> str:
    return "items" if isinstance(value, list) else "text"


ResponseInput = Annotated[
    Annotated[str, Field(min_length=1), Tag("text")]
    | Annotated[list[ResponseItem], Field(min_length=1), Tag("items")],
    Discriminator(_input_kind),
]


@with_config(BODY)
class ContextManagement(TypedDict):
    type: Literal["compaction"]
    compact_threshold: NotRequired[Annotated[int, Field(ge=1)] | None]


# At most one of the ways a Responses request names its conversation (the header aside).
_ONE_NAMING: JsonDict = {
    "not": {
        "anyOf": [
            {"required": ["conversation", "previous_response_id"]},
            {"required": ["conversation", "conversation_id"]},
            {"required": ["conversation_id", "previous_response_id"]},
        ]
    }
}


# OpenAI's Responses parameters the gateway accepts without reading them (`openai` 3.57's
# `responses.create`): any other field is a 400 `unknown_parameter`, as OpenAI answers a typo
# (taken for nothing, `previous_respons_id` would start a new conversation that knows nothing).
Accepted = Annotated[SkipValidation[object], Field(None, description="OpenAI's; accepted, not used")]


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_NAMING)

    model: ModelName
    input: ResponseInput
    instructions: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    tools: list[FunctionTool] | None = None
    stream: bool | None = None
    max_output_tokens: AnswerTokens | None = None
    # Checked where they are used: the conversation's id, the response's existence.
    conversation: SkipValidation[ConversationId | ConversationRef | None] = None
    previous_response_id: SkipValidation[str | None] = Field(None, description="404 unless a stored response")
    conversation_id: SkipValidation[ConversationId | None] = Field(
        None,
        description="Gateway extension, as on chat completions: the conversation it continues (or starts)",
    )
    store: bool | None = Field(None, description="Stored unless false (null: the default, true)")
    metadata: Metadata | None = None
    context_management: list[ContextManagement] | None = Field(
        None, description="Compaction when the conversation's prompt passes compact_threshold tokens"
    )
    # Passed on to the provider.
    temperature: SkipValidation[float | None] = None
    top_p: SkipValidation[float | None] = None
    parallel_tool_calls: SkipValidation[bool | None] = None
    tool_choice: SkipValidation[str | dict[str, object] | None] = None
    user: SkipValidation[str | None] = None
    service_tier: SkipValidation[str | None] = None
    prompt_cache_key: SkipValidation[str | None] = None
    prompt_cache_retention: SkipValidation[str | None] = None
    safety_identifier: SkipValidation[str | None] = None
    seed: SkipValidation[int | None] = Field(None, description="Passed on (local servers take it)")
    # Checked where they are used.
    background: SkipValidation[bool | None] = None
    text: SkipValidation[dict[str, object] | None] = None
    reasoning: SkipValidation[dict[str, object] | None] = None
    prompt: SkipValidation[object] = Field(None, description="Not supported: a 400 unless null")
    is_feedback: SkipValidation[bool | None] = Field(
        None, description="Gateway extension: the last input item is feedback"
    )
    include: Accepted
    stream_options: Accepted
    top_logprobs: Accepted
    max_tool_calls: Accepted
    prompt_cache_options: Accepted
    background_options: Accepted
    moderation: Accepted
    image: Accepted
    access_programs: Accepted

    error_messages: ClassVar[ErrorMessages] = {
        "": NOT_AN_OBJECT,
        "model": "'model' is required",
        "input": "'input' must be a string or an array of items",
        **item_errors("input"),
        "instructions": "'instructions' must be a string",
        "truncation": "'truncation' must be 'auto' or 'disabled'",
        "tools": "'tools' must be an array",
        "tools[]": "{param}: only function tools are supported",
        "stream": "'stream' must be a boolean",
        "max_output_tokens": f"'max_output_tokens' {TOKENS}",
        "store": "'store' must be a boolean",
        "metadata": _metadata,
        "context_management": "'context_management' must be an array of compaction entries",
        "context_management[]": "{param} must be {{type: 'compaction', compact_threshold: an integer ≥ 1}}",
    }


class ResponseCompact(BaseModel):
    """`POST /v1/responses/compact`: what to compact.

    `input`, after the history of `previous_response_id` or of the gateway's `conversation`.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"not": {"required": ["conversation", "previous_response_id"]}},
    )

    model: ModelName
    input: ResponseInput | None = None
    instructions: str | None = None
    previous_response_id: SkipValidation[str | None] = Field(None, description="404 unless a stored response")
    conversation: SkipValidation[ConversationId | ConversationRef | None] = Field(
        None, description="Gateway extension: compact this conversation's history"
    )
    prompt_cache_key: Accepted
    prompt_cache_retention: Accepted
    prompt_cache_options: Accepted
    service_tier: Accepted
    image: Accepted

    error_messages: ClassVar[ErrorMessages] = {
        "": NOT_AN_OBJECT,
        "model": "'model' is required",
        "input": "'input' must be a string or an array of items",
        **item_errors("input"),
        "instructions": "'instructions' must be a string",
    }


class InputTokensCount(ResponseCreate):
    """`POST /v1/responses/input_tokens`: a `POST /v1/responses` body, counted instead of sent.

    Without `input`, the conversation (or the response's) is counted as it stands.
    """

    input: ResponseInput | None = None  # type: ignore[assignment]  # (optional here only)
    personality: Accepted


# -- the Conversations API -----------------------------------------------------------------------


def _items(param: str, error: ErrorDetails) -> str:
    return "'items' is required" if error["type"] == "missing" else "'items' must be an array"


class ConversationCreate(BaseModel):
    model_config = OWN_BODY  # (a `metdata` typo is said, not taken for nothing)

    metadata: Metadata | None = None
    items: list[Item] | None = None
    id: SkipValidation[ConversationId | None] = Field(None, description="Gateway extension: choose the id")

    error_messages: ClassVar[ErrorMessages] = {
        "": NOT_AN_OBJECT,
        "metadata": _metadata,
        "items": _items,
        **item_errors("items"),
    }


class MetadataUpdate(BaseModel):
    """A `POST` of an object's metadata, all of it; null clears it (the SDKs' type:
    `Required[Optional[Metadata]]`)."""

    model_config = OWN_BODY

    metadata: Metadata | None

    error_messages: ClassVar[ErrorMessages] = {"": NOT_AN_OBJECT, "metadata": _metadata}


class ConversationUpdate(MetadataUpdate):
    """`POST /v1/conversations/{id}`: the conversation's metadata."""


class ItemsCreate(BaseModel):
    model_config = OWN_BODY

    items: list[Item]

    error_messages: ClassVar[ErrorMessages] = {"items": _items, **item_errors("items")}


class Reset(BaseModel):
    model_config = OWN_BODY

    keep_system_message: bool = False

    error_messages: ClassVar[ErrorMessages] = {"keep_system_message": "'{param}' must be a boolean"}


# -- stored chat completions ---------------------------------------------------------------------


class ChatCompletionUpdate(MetadataUpdate):
    """`POST /v1/chat/completions/{completion_id}`: a stored chat completion's metadata."""


# -- Anthropic's Messages API --------------------------------------------------------------------
# The blocks are documented here and checked where they become chat messages
# (`context/anthropic.py`), which names the place of a bad one as Anthropic's request has it.


@with_config(BODY)
class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


@with_config(BODY)
class Base64Source(TypedDict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


@with_config(BODY)
class URLSource(TypedDict):
    type: Literal["url"]
    url: Annotated[str, Field(pattern=r"^https?://[A-Za-z0-9]")]


@with_config(BODY)
class ImageBlock(TypedDict):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


@with_config(BODY)
class PDFSource(TypedDict):
    type: Literal["base64"]
    media_type: Literal["application/pdf"]
    data: str


@with_config(BODY)
class PlainTextSource(TypedDict):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


@with_config(BODY)
class DocumentBlock(TypedDict):
    type: Literal["document"]
    source: Annotated[PDFSource | PlainTextSource, Field(discriminator="type")]
    title: NotRequired[str | None]


@with_config(BODY)
class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, object]


@with_config(BODY)
class ToolResultBlock(TypedDict):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: NotRequired[str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]]]
    is_error: NotRequired[bool]


@with_config(BODY)
class ThinkingBlock(TypedDict):
    """Accepted in an assistant message and left out (a chat provider takes none back)."""

    type: Literal["thinking", "redacted_thinking"]


UserBlock = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]


@with_config(MESSAGE)
class UserTurn(TypedDict):
    role: Literal["user"]
    content: str | Annotated[list[SkipValidation[UserBlock]], Field(min_length=1)]


@with_config(MESSAGE)
class AssistantTurn(TypedDict):
    role: Literal["assistant"]
    content: str | list[SkipValidation[AssistantBlock]]


AnthropicMessage = Annotated[UserTurn | AssistantTurn, Field(discriminator="role")]


@with_config(BODY)
class ToolChoice(TypedDict):
    type: Literal["auto", "any", "tool", "none"]
    name: NotRequired[Annotated[str, Field(min_length=1, description="With type: tool")]]
    disable_parallel_tool_use: NotRequired[bool]


@with_config(BODY)
class AnthropicTool(TypedDict):
    name: Annotated[str, Field(min_length=1)]
    description: NotRequired[str]
    input_schema: dict[str, object]


@with_config(BODY)
class AnthropicMetadata(TypedDict, total=False):
    user_id: str | None


def _messages(param: str, error: ErrorDetails) -> str:
    return "'messages' is required" if error["type"] == "missing" else "'messages' must be a non-empty array"


ANTHROPIC_ERRORS: ErrorMessages = {
    "": NOT_AN_OBJECT,
    "model": "'model' is required and must be a non-empty string",
    "messages": _messages,
    "messages[]": "{param} must be an object with a role and content",
    "messages[].role": "{param} must be 'user' or 'assistant'",
    "messages[].content": "{param} must be a string or a non-empty array of content blocks",
    "system": "'system' must be a string or an array of text blocks",
    "tools": "'tools' must be an array",
    "tools[]": "{param} must be a client tool: {{name, description, input_schema}}",
    "metadata": "'metadata' must be an object whose user_id is a string",
}


class MessageCreate(BaseModel):
    """`POST /v1/messages` (Anthropic's Messages API); the header `anthropic-version` is required."""

    model_config = BODY

    model: ModelName
    max_tokens: AnswerTokens
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[SkipValidation[TextBlock]] | None = None
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: SkipValidation[ToolChoice | None] = None
    metadata: AnthropicMetadata | None = None
    # The gateway's own fields (the SDK's `extra_body`), as on chat completions.
    conversation_id: SkipValidation[ConversationId | None] = Field(
        None, description="Gateway extension: the conversation this turn continues (or starts)"
    )
    session_id: SkipValidation[ConversationId | None] = Field(None, description="Without conversation_id")
    agent_id: SkipValidation[ConversationId | None] = Field(None, description="Without session_id")
    # Passed on to the provider.
    temperature: SkipValidation[float | None] = None
    top_p: SkipValidation[float | None] = None

    error_messages: ClassVar[ErrorMessages] = {
        **ANTHROPIC_ERRORS,
        "max_tokens": f"'max_tokens' is required and {TOKENS}",
        "stream": "'stream' must be a boolean",
        "stop_sequences": "'stop_sequences' must be an array of strings",
    }


class CountTokensRequest(MessageCreate):
    """`POST /v1/messages/count_tokens`: a Messages request, `max_tokens` optional.

    Anthropic's takes none; given, it is the room the turn would keep for its answer, which
    decides where a conversation's window is cut, as it does on the turn. The rest is checked as
    the turn checks it: a body `POST /v1/messages` refuses is not counted."""

    max_tokens: AnswerTokens | None = None  # type: ignore[assignment]  # (optional here only)

    error_messages: ClassVar[ErrorMessages] = {
        **MessageCreate.error_messages,
        "max_tokens": f"'max_tokens' {TOKENS}",
    }
