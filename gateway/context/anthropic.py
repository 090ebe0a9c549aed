"""Anthropic's Messages API <-> the gateway's chat turn (pure).

A Messages request becomes a chat-completions request, so it runs as every other turn does (the
same history, window, reconcile and tool repair); its answer, a chat message, becomes a Messages
`message`, and a chat chunk stream becomes Anthropic's content-block events.

Requests:
- `system` (a string, or text blocks joined with a blank line) is the leading system message;
- content is a string or blocks. `text` and `image` blocks become content parts (an image's
  base64 source a `data:` URL, a `url` source its URL); one text block alone is a string, as chat
  clients send it; a `document` with a base64 PDF is a `file` part, with plain text a text part;
- an assistant message's `tool_use` blocks are its `tool_calls` (the block's `id` is the call's
  id, `input` its JSON `arguments`); its `thinking` blocks are left out (an OpenAI-compatible
  provider takes none back);
- a user message's `tool_result` blocks are `tool` messages (`tool_use_id` is `tool_call_id`),
  ahead of the rest of the message: their text, joined by newlines, starting with "Error: " when
  `is_error`; the images they hold go into the user message after them (a `tool` message
  takes text only);
- `tools` (`input_schema` is `parameters`), `tool_choice` (`any` is "required", `tool` that
  function, `disable_parallel_tool_use` is `parallel_tool_calls: false`), `stop_sequences`
  (`stop`), `temperature`, `top_p` and `metadata.user_id` (`user`) are passed on; so are
  structured outputs: `output_config.format` (or the earlier `output_format`) is
  `response_format: json_schema` (strict), a tool's `strict` the function's, and
  `output_config.effort` is `reasoning_effort` (`xhigh` and `max` as `high`).

The mapping is deterministic, so a client that resends its history (as Anthropic's clients do)
resends messages equal to the stored ones: the overlap is recognised, never stored twice.

Answers: the text is a `text` block and each tool call a `tool_use` block (its arguments parsed
as `input`: `{}` when they are not a JSON object); `finish_reason` is a `stop_reason`; usage is
split as Anthropic splits it (`input_tokens` leaves out what the cache served or wrote).
"""

from __future__ import annotations

from typing import cast

import orjson

from gateway.context.content import feedback_flag, image_url
from gateway.exceptions import InvalidRequest
from gateway.types import ContentPart, JSONObject, Message, ToolCall, as_list, as_object

SYSTEM_JOINER = "\n\n"
TOOL_ERROR_PREFIX = "Error: "
DOCUMENT_NAME = "document.pdf"
_THINKING = ("thinking", "redacted_thinking")

# The HTTP statuses of Anthropic's error types; any other 4xx is an invalid request, any other
# 5xx an API error (as Anthropic documents).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # the gateway cannot take the turn now (stopping, store refusing writes)
    504: "timeout_error",
    529: "overloaded_error",
}


# -- requests ------------------------------------------------------------------------------------


def _string(value: object, at: str, param: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise InvalidRequest(f"{at} must be a{'' if empty else ' non-empty'} string", param=param)
    return value


def _kind(block: object, at: str, param: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{at} must be a content block: an object with a string type", param=param)
    return cast(str, block["type"])


def _content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Chat content for parts: one text part alone is a string, as chat clients send it."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0].get("text", "")
    return parts


# The image types Anthropic's API takes (a base64 image of another type is its 400 too).
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image(block: JSONObject, at: str, param: str) -> ContentPart:
    """An image block as an `image_url` part (checked by the content rules every way in shares)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest(f"{at}.source must be an object", param=param, code="invalid_image")
    kind = source.get("type")
    if kind == "base64":
        media = _string(source.get("media_type"), f"{at}.source.media_type", param, empty=False)
        if media not in IMAGE_TYPES:
            raise InvalidRequest(
                f"{at}.source.media_type must be one of {', '.join(IMAGE_TYPES)}",
                param=param,
                code="invalid_image",
            )
        data = _string(source.get("data"), f"{at}.source.data", param)
        url: object = f"data:{media};base64,{data}"
    elif kind == "url":
        url = source.get("url")
    else:
        raise InvalidRequest(
            f"{at}: an image source must be base64 or url (chat completions take no image by file id)",
            param=param,
            code="invalid_image",
        )
    return {"type": "image_url", "image_url": {"url": image_url(url, at, param)}}


def _document(block: JSONObject, at: str, param: str) -> ContentPart:
    """A document block: a base64 PDF as a `file` part, plain text as a text part."""
    source = as_object(block.get("source"))
    kind, media = source.get("type"), source.get("media_type")
    if kind == "base64" and media == "application/pdf":
        data = _string(source.get("data"), f"{at}.source.data", param)
        title = block.get("title")
        name = title if isinstance(title, str) and title else DOCUMENT_NAME
        return {
            "type": "file",
            "file": {"file_data": f"data:application/pdf;base64,{data}", "filename": name},
        }
    if kind == "text":
        return {"type": "text", "text": _string(source.get("data"), f"{at}.source.data", param)}
    raise InvalidRequest(
        f"{at}: a document must be a base64 PDF or plain text", param=param, code="invalid_document"
    )


def _part(block: JSONObject, kind: str, at: str, param: str) -> ContentPart:
    if kind == "text":
        return {"type": "text", "text": _string(block.get("text"), f"{at}.text", param)}
    if kind == "image":
        return _image(block, at, param)
    if kind == "document":
        return _document(block, at, param)
    raise InvalidRequest(f"{at}: unsupported content block type {kind!r}", param=param)


def _tool_result(block: JSONObject, at: str, param: str) -> tuple[Message, list[ContentPart]]:
    """A tool_result block as a `tool` message, and the images and PDFs it holds.

    Its text, a plain-text document's and a search result's (its title, source and text) are
    the message's; an image or a PDF cannot be in a `tool` message, so it goes after it."""
    call_id = _string(block.get("tool_use_id"), f"{at}.tool_use_id", param, empty=False)
    content = block.get("content")
    texts: list[str] = []
    images: list[ContentPart] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for k, inner in enumerate(content):
            where = f"{at}.content[{k}]"
            kind = _kind(inner, where, param)
            if kind == "search_result":
                texts.append(_search_result(cast(JSONObject, inner), where, param))
                continue
            if kind not in ("text", "image", "document"):
                raise InvalidRequest(
                    f"{where}: a tool result holds text, image, document and search_result blocks",
                    param=param,
                )
            part = _part(cast(JSONObject, inner), kind, where, param)
            if part["type"] == "text":
                texts.append(part.get("text", ""))
            else:
                images.append(part)
    elif content is not None:
        raise InvalidRequest(f"{at}.content must be a string or an array of blocks", param=param)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequest(f"{at}.is_error must be a boolean", param=param)
    text = "\n".join(texts)
    if is_error:
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}, images


def _search_result(block: JSONObject, at: str, param: str) -> str:
    """A search_result block as text: its title, its source, then its text blocks."""
    inner = block.get("content")
    if not isinstance(inner, list):
        raise InvalidRequest(f"{at}.content must be an array of text blocks", param=param)
    lines = [
        _string(block.get("title"), f"{at}.title", param),
        _string(block.get("source"), f"{at}.source", param),
    ]
    for k, text in enumerate(inner):
        if _kind(text, f"{at}.content[{k}]", param) != "text":
            raise InvalidRequest(f"{at}.content[{k}]: a search result holds text blocks", param=param)
        lines.append(_string(cast(JSONObject, text).get("text"), f"{at}.content[{k}].text", param))
    return "\n".join(lines)


def _user_messages(blocks: list[object], at: str) -> list[Message]:
    """A user message's blocks as chat messages: its tool results first, then the rest.

    The tool results become `tool` messages; the rest is one user message (the tool results'
    images first).
    """
    param = f"{at}.content"
    if not blocks:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    results: list[Message] = []
    parts: list[ContentPart] = []
    carried: list[ContentPart] = []
    for k, block in enumerate(blocks):
        where = f"{param}[{k}]"
        kind = _kind(block, where, param)
        if kind == "tool_result":
            message, images = _tool_result(cast(JSONObject, block), where, param)
            results.append(message)
            carried.extend(images)
        else:
            parts.append(_part(cast(JSONObject, block), kind, where, param))
    if carried or parts:
        results.append({"role": "user", "content": _content([*carried, *parts])})
    return results


def _tool_call(block: JSONObject, at: str, param: str) -> ToolCall:
    call_id = _string(block.get("id"), f"{at}.id", param, empty=False)
    name = _string(block.get("name"), f"{at}.name", param, empty=False)
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{at}.input must be an object", param=param)
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def _assistant_message(blocks: list[object], at: str) -> Message:
    param = f"{at}.content"
    parts: list[ContentPart] = []
    calls: list[ToolCall] = []
    for k, block in enumerate(blocks):
        where = f"{param}[{k}]"
        kind = _kind(block, where, param)
        if kind == "text":
            parts.append(_part(cast(JSONObject, block), kind, where, param))
        elif kind == "tool_use":
            call = _tool_call(cast(JSONObject, block), where, param)
            if any(c["id"] == call["id"] for c in calls):
                raise InvalidRequest(f"{where}: two tool_use blocks with one id", param=param)
            calls.append(call)
        elif kind not in _THINKING:
            raise InvalidRequest(
                f"{where}: an assistant message holds text, tool_use and thinking blocks, not {kind!r}",
                param=param,
            )
    message: Message = {"role": "assistant", "content": _content(parts) if parts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def system_message(system: object) -> Message | None:
    """`system` (a string or text blocks) as the leading system message; None without one."""
    if system is None:
        return None
    if isinstance(system, str):
        return {"role": "system", "content": system} if system else None
    if not isinstance(system, list):
        raise InvalidRequest("'system' must be a string or an array of text blocks", param="system")
    texts = []
    for k, block in enumerate(system):
        at = f"system[{k}]"
        if _kind(block, at, "system") != "text":
            raise InvalidRequest(f"{at}: the system prompt holds text blocks only", param="system")
        texts.append(_string(cast(JSONObject, block).get("text"), f"{at}.text", "system"))
    text = SYSTEM_JOINER.join(texts)
    return {"role": "system", "content": text} if text else None


def chat_messages(system: object, messages: object) -> list[Message]:
    """A Messages request's `system` and `messages` as chat messages."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    head = system_message(system)
    out: list[Message] = [head] if head is not None else []
    joinable = False  # the last message made is an assistant's, which a next assistant's joins
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{at}.role must be 'user' or 'assistant'", param=f"{at}.role")
        content = cast(JSONObject, message).get("content")
        if isinstance(content, str):
            made: list[Message] = [{"role": cast(str, role), "content": content}]
        elif not isinstance(content, list):
            raise InvalidRequest(
                f"{at}.content must be a string or an array of content blocks", param=f"{at}.content"
            )
        elif not content and i < len(messages) - 1:  # (as Anthropic's: but a final assistant's)
            raise InvalidRequest(
                f"{at}.content must not be empty: only the final assistant message may be",
                param=f"{at}.content",
            )
        elif role == "assistant":
            made = [_assistant_message(content, at)]
        else:
            made = _user_messages(content, at)
        flagged = feedback_flag(message, at)
        if flagged:  # (the gateway's flag, as on chat completions' messages)
            made = [{**m, "is_feedback": True} for m in made]
        elif role == "assistant" and joinable:
            # Anthropic's API makes one turn of assistant messages in a row: so does the gateway
            # (a prefill a client keeps apart from its answer is the one message stored).
            out[-1] = _one_turn(out[-1], made[0])
            continue
        joinable = role == "assistant" and not flagged
        out.extend(made)
    return out


def _one_turn(first: Message, then: Message) -> Message:
    """Two assistant messages as one: their text joined (a continuation: as it was written), then
    the second's parts and the calls of both."""
    parts = [*_parts_of(first.get("content")), *_parts_of(then.get("content"))]
    calls = [*(first.get("tool_calls") or []), *(then.get("tool_calls") or [])]
    content: str | list[ContentPart] | None
    if all(p["type"] == "text" for p in parts):
        content = "".join(p.get("text", "") for p in parts) if parts or not calls else None
    else:
        content = parts
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def _parts_of(content: object) -> list[ContentPart]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content) if isinstance(content, list) else []


def chat_tools(tools: object) -> list[JSONObject] | None:
    """Anthropic's client tools as chat-completions function tools (None without any)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    out: list[JSONObject] = []
    for k, tool in enumerate(tools):
        at = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequest(
                f"{at}: only client tools (name, description, input_schema) are supported, "
                f"not {tool.get('type')!r}",
                param=at,
            )
        function: JSONObject = {"name": _string(tool.get("name"), f"{at}.name", at, empty=False)}
        if tool.get("description") is not None:
            function["description"] = _string(tool["description"], f"{at}.description", at)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{at}.input_schema must be an object (a JSON schema)", param=at)
        function["parameters"] = schema
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"{at}.strict must be a boolean", param=f"{at}.strict")
        if strict:
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out


# Anthropic's `output_config.effort` as chat completions' `reasoning_effort` (its nearest).
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def chat_output(body: JSONObject) -> JSONObject:
    """Anthropic's structured outputs and effort as chat completions' fields (none: {}).

    `output_config.format` (or the earlier top-level `output_format`), `{"type": "json_schema",
    "schema": {...}}`, is `response_format` with that schema, strict; `output_config.effort` is
    `reasoning_effort`."""
    out: JSONObject = {}
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise InvalidRequest("'output_config' must be an object", param="output_config")
    config = config or {}
    for name, fmt in (
        ("output_config.format", config.get("format")),
        ("output_format", body.get("output_format")),
    ):
        if fmt is None:
            continue
        if (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            raise InvalidRequest(
                f'\'{name}\' must be {{"type": "json_schema", "schema": {{...}}}}', param=name
            )
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True},
        }
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise InvalidRequest(
                "'output_config.effort' must be one of " + ", ".join(EFFORTS), param="output_config.effort"
            )
        out["reasoning_effort"] = EFFORTS[effort]
    return out


def chat_tool_choice(choice: object) -> tuple[object, bool | None]:
    """(chat `tool_choice`, `parallel_tool_calls`) for Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest(
            "'tool_choice' must be {type: auto}, {type: any}, {type: tool, name} or {type: none}",
            param="tool_choice",
        )
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "tool":
        name = _string(choice.get("name"), "tool_choice.name", "tool_choice", empty=False)
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def chat_request(body: JSONObject, *, cap: str) -> JSONObject:
    """The chat-completions body of a Messages request whose fields its schema checked.

    `cap` is the chat field `max_tokens` goes in.
    """
    chat: JSONObject = {
        "model": body["model"],
        "messages": chat_messages(body.get("system"), body.get("messages")),
        cap: body["max_tokens"],
    }
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    tools = chat_tools(body.get("tools"))
    choice, parallel = chat_tool_choice(body.get("tool_choice"))
    if tools:  # (chat providers refuse a tool_choice, or parallel_tool_calls, without tools)
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    stop = body.get("stop_sequences")
    if stop:
        chat["stop"] = stop
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    chat.update(chat_output(body))
    chat.update(chat_user(body))
    return chat


def chat_user(body: JSONObject) -> JSONObject:
    """`metadata.user_id` as chat completions' `user` (the end user: a recap's key), if given."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return {"user": _string(user, "metadata.user_id", "metadata.user_id")} if user is not None else {}


# -- answers -------------------------------------------------------------------------------------


def tool_input(arguments: object) -> JSONObject:
    """A call's arguments as a tool_use block's `input`: the JSON object they hold, else `{}`."""
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return {}
        return cast(JSONObject, value) if isinstance(value, dict) else {}
    return {}


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        str(part.get("text", "")) for part in as_list(content) if isinstance(part, dict) and "text" in part
    )


def content_blocks(message: Message | None) -> list[JSONObject]:
    """An assistant chat message as content blocks: its text (or refusal), then its tool calls."""
    if message is None:
        return []
    blocks: list[JSONObject] = []
    text = _text_of(message.get("content")) or message.get("refusal") or ""
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        function = as_object(call.get("function"))
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name") or "",
                "input": tool_input(function.get("arguments")),
            }
        )
    return blocks


def matched_stop(provider_stop: object, stop_sequences: object) -> str | None:
    """The stop sequence a provider says it stopped at, if it is one of the request's.

    The provider says it in vLLM's choice `stop_reason`; OpenAI's `finish_reason` says only "stop".
    """
    if isinstance(provider_stop, str) and provider_stop in as_list(stop_sequences):
        return provider_stop
    return None


def stop_reason(finish_reason: object, *, calls: bool, matched: str | None = None) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`) for a chat answer's `finish_reason`."""
    if calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if matched is not None:
        return "stop_sequence", matched
    return "end_turn", None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def message_usage(
    usage: object, cache: object, *, output_tokens: int | None = None, estimate: int | None = None
) -> JSONObject:
    """Anthropic's usage from a chat answer's `usage` and its prompt-cache figures.

    The cache figures (`cache`) are as `context.accounting.prompt_accounting` gives them.
    `input_tokens` is the prompt less what the cache served and wrote. A figure the provider gave
    none of is the gateway's own count (`output_tokens`, `estimate`), else 0.
    """
    usage, cache = as_object(usage), as_object(cache)
    whole = _count(cache.get("prompt_tokens"))
    if whole is None:
        whole = _count(usage.get("prompt_tokens"))
    read = _count(cache.get("cached_tokens")) or 0
    written = _count(cache.get("cache_creation_tokens")) or 0
    output = _count(usage.get("completion_tokens"))
    return {
        "input_tokens": max(0, (whole if whole is not None else estimate or 0) - read - written),
        "output_tokens": output if output is not None else output_tokens or 0,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written,
    }


def message_object(
    *,
    message_id: str,
    model: str,
    message: Message | None,
    finish_reason: object,
    usage: JSONObject,
    matched: str | None = None,
) -> JSONObject:
    """The Messages API's `message` for an answer."""
    blocks = content_blocks(message)
    reason, sequence = stop_reason(
        finish_reason, calls=any(b["type"] == "tool_use" for b in blocks), matched=matched
    )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


# -- streams -------------------------------------------------------------------------------------


def message_start(
    message_id: str, model: str, input_tokens: int, conversation_id: str | None = None
) -> JSONObject:
    """The stream's first event: the message without content.

    `input_tokens` is the gateway's count of the prompt; `message_delta` gives the provider's.
    The message names its `conversation_id` (the gateway's extension), as a whole one does.
    """
    usage: JSONObject = {"input_tokens": input_tokens, "output_tokens": 0}
    usage.update(cache_read_input_tokens=0, cache_creation_input_tokens=0)
    message = message_object(
        message_id=message_id, model=model, message=None, finish_reason=None, usage=usage
    )
    message["stop_reason"] = None
    if conversation_id is not None:
        message["conversation_id"] = conversation_id
    return {"type": "message_start", "message": message}


def message_delta(stop: tuple[str, str | None], usage: JSONObject) -> JSONObject:
    """The stream's last event but `message_stop`: how it stopped, and the whole usage."""
    return {
        "type": "message_delta",
        "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
        "usage": usage,
    }


class BlockEvents:
    """A chat chunk stream as Anthropic's content-block events.

    The text, and each tool call, is a block of its own in the order they come
    (`content_block_start`, deltas, `content_block_stop` when the next begins), each block's
    deltas between its start and its stop, as Anthropic's streams have them. The chunks are the
    chat service's: each tool call piece names its call by `index`, with its id. A provider that
    interleaves parallel calls (a call begun while the one before it is still incomplete JSON)
    has the later call held back, its pieces kept, until the earlier one is complete or the
    answer ends; then it follows as a block of its own. A call's input goes whole, in one
    `input_json_delta` just before its block stops: the JSON object its arguments hold, else `{}`
    (as a whole answer's `input`; a client assembling the pieces of arguments that are not JSON,
    which small models write, raised before it had the message).
    """

    def __init__(self) -> None:
        self.blocks = 0
        self.open: int | None = None  # the block deltas go to
        self.open_call: int | None = None  # the open block's call (its index), if it is a call
        self.calls: dict[int, int] = {}  # a call's index -> its block
        self.arguments: dict[int, str] = {}  # a call's arguments so far
        self.held: dict[int, tuple[JSONObject, list[str]]] = {}  # calls held back: start, pieces
        self.provider_stop: object = None  # vLLM's stop string, from the finishing choice

    def _start(self, block: JSONObject, *, call: int | None) -> list[JSONObject]:
        events = self.close()
        return events + self._begin(block, call)

    def _begin(self, block: JSONObject, call: int | None) -> list[JSONObject]:
        self.open, self.open_call = self.blocks, call
        self.blocks += 1
        if call is not None:
            self.calls[call] = self.open
        return [{"type": "content_block_start", "index": self.open, "content_block": block}]

    def close(self) -> list[JSONObject]:
        """The stop of the open block, then the calls held back, each whole (none: nothing)."""
        return self._release(ending=True)

    def _release(self, *, ending: bool) -> list[JSONObject]:
        """The open block's stop, then the calls held back, each opened with what it has so far.

        Each is stopped for the next when the answer is `ending`; else only while it is whole
        JSON with more held behind it (the last, or one not whole yet, stays open)."""
        events = self._stop()
        while self.held:
            key = next(iter(self.held))
            block, pieces = self.held.pop(key)
            events += self._begin(block, key)
            for piece in pieces:
                self._delta(key, piece)
            if not ending and (not self.held or not self._complete(key)):
                break
            events += self._stop()
        return events

    def _stop(self) -> list[JSONObject]:
        if self.open is None:
            return []
        index, call, self.open, self.open_call = self.open, self.open_call, None, None
        events: list[JSONObject] = []
        text = self.arguments.get(call, "") if call is not None else ""
        if text.strip():
            whole = tool_input(text)
            delta = {"type": "input_json_delta", "partial_json": text if whole else "{}"}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return [*events, {"type": "content_block_stop", "index": index}]

    def _delta(self, key: int, piece: str) -> None:
        """A piece of a call's arguments, kept until its block stops (`_stop` sends them)."""
        self.arguments[key] = self.arguments.get(key, "") + piece

    def _complete(self, key: int) -> bool:
        """Are the call's arguments so far a whole JSON value? (Then a later call may begin.)

        None yet is not: they may still come (a call named first, its arguments after)."""
        text = self.arguments.get(key, "")
        if not text.strip():
            return False
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError:
            return False
        return True

    def _text(self, piece: str) -> list[JSONObject]:
        events = (
            self._start({"type": "text", "text": ""}, call=None)
            if self.open is None or self.open_call is not None
            else []
        )
        events.append(
            {
                "type": "content_block_delta",
                "index": self.open,
                "delta": {"type": "text_delta", "text": piece},
            }
        )
        return events

    def _call(self, call: JSONObject) -> list[JSONObject]:
        index = call.get("index")
        key = index if isinstance(index, int) else 0
        function = as_object(call.get("function"))
        arguments = function.get("arguments")
        piece = arguments if isinstance(arguments, str) and arguments else ""
        if key in self.held:  # (held back behind an incomplete call)
            if piece:
                self.held[key][1].append(piece)
            return []
        events: list[JSONObject] = []
        if key not in self.calls:
            start = {
                "type": "tool_use",
                "id": str(call.get("id") or ""),
                "name": str(function.get("name") or ""),
            }
            block: JSONObject = {**start, "input": {}}
            if self.open_call is not None and not self._complete(self.open_call):
                self.held[key] = (block, [piece] if piece else [])
                return []
            events = self._start(block, call=key)
        if not piece:
            return events
        if self.calls[key] != self.open and not piece.strip():
            return events  # whitespace after a call's whole JSON, its block closed: nothing to say
        self._delta(key, piece)
        if key == self.open_call and self.held and self._complete(key):
            events += self._release(ending=False)  # the calls held behind it
        return events

    def feed(self, chunk: JSONObject) -> list[JSONObject]:
        """The events for one chat chunk (choice 0; usage-only chunks give none)."""
        events: list[JSONObject] = []
        for choice in as_list(chunk.get("choices")):
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = as_object(choice.get("delta"))
            for key in ("content", "refusal"):
                piece = delta.get(key)
                if isinstance(piece, str) and piece:
                    events.extend(self._text(piece))
            for call in as_list(delta.get("tool_calls")):
                if isinstance(call, dict):
                    events.extend(self._call(call))
            if choice.get("stop_reason") is not None:
                self.provider_stop = choice["stop_reason"]
        return events


# -- errors --------------------------------------------------------------------------------------


def error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, request_id: str | None = None) -> JSONObject:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}, "request_id"}`.

    A stream's `error` event has no `request_id` (the stream's head carried it)."""
    body: JSONObject = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body
