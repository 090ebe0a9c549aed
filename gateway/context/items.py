"""Conversations API items <-> chat messages (pure).

A stored message is named by its response and its position there, so an item id is
`msg_{response_id}_{position}` (function calls: `fc_..._{k}`, tool outputs: `fco_...`, system
prompt messages: `sys_{response_id}_{k}`, the summary a compaction item stood for: `cmp_...`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from gateway.context.content import feedback_flag, image_detail, image_url
from gateway.context.tools import default_arguments
from gateway.exceptions import InvalidRequest
from gateway.types import ContentPart, ImageURL, JSONObject, Message, ToolCall, ascii_int

Item = JSONObject
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _is_text_part(kind: object) -> bool:
    """A part's type is client JSON: it may be any value, hashable or not."""
    return isinstance(kind, str) and kind in _TEXT_PARTS


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and (p.get("type") is None or _is_text_part(p.get("type")))
        )
    return ""


def _string(value: object, what: str, param: str) -> str:
    """A field that must be a string (a 400 naming it otherwise: never a repr stored instead)."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string", param=param)
    return value


def _chat_content(content: object, where: str, where_role: str = "user") -> str | list[ContentPart]:
    """Responses content (string or parts) as chat content (string, or parts for images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content must be a string or an array of parts", param=f"{where}.content"
        )
    if not content:  # (stored, an empty message went to the provider on every later turn)
        raise InvalidRequest(f"{where}.content must not be an empty array", param=f"{where}.content")
    parts: list[ContentPart] = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, dict) and _is_text_part(kind):
            parts.append(
                {"type": "text", "text": _string(part.get("text"), f"{at}.text", f"{where}.content")}
            )
        elif isinstance(part, dict) and kind == "input_image":
            parts.append({"type": "image_url", "image_url": _image(part, at, f"{where}.content")})
        elif isinstance(part, dict) and kind == "input_audio" and isinstance(part.get("input_audio"), dict):
            parts.append({"type": "input_audio", "input_audio": part["input_audio"]})
        elif isinstance(part, dict) and kind == "refusal" and where_role == "assistant":
            parts.append(
                {"type": "refusal", "text": _string(part.get("refusal"), f"{at}.refusal", f"{where}.content")}
            )
        elif isinstance(part, dict) and kind == "input_file":
            file = {k: part[k] for k in ("file_id", "file_data", "filename") if isinstance(part.get(k), str)}
            if not file.get("file_id") and not file.get("file_data"):
                raise InvalidRequest(
                    f"{at}: an input_file needs file_id or file_data (a string)", param=f"{where}.content"
                )
            parts.append({"type": "file", "file": file})
        else:
            said = f"of type {kind!r}" if isinstance(kind, str) else "without a string 'type'"
            raise InvalidRequest(f"{at}: unsupported content part {said}", param=f"{where}.content")
    if all(p["type"] == "text" for p in parts):
        return "".join(p.get("text", "") for p in parts)
    return parts


def _image(part: JSONObject, at: str, param: str) -> ImageURL:
    """An input_image as chat completions take it: by URL or data URL, with a detail they know.

    The content rules are `context/content.py`. A file id is a 400: sent as an image URL, it made
    every later turn of its conversation a provider's 400.
    """
    url = part.get("image_url")
    if url is None and isinstance(part.get("file_id"), str):
        raise InvalidRequest(
            f"{at}: an input_image by file_id cannot be sent: chat completions take an image by "
            "URL or data URL (give image_url)",
            param=param,
            code="invalid_image",
        )
    image: ImageURL = {"url": image_url(url, at, param)}
    detail = image_detail(part.get("detail"), at, param)
    if detail is not None and detail != "auto":
        image["detail"] = detail
    return image


def _tool_output(output: object, where: str) -> str:
    """A function_call_output's output: a string, or text parts (joined)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(p, dict) and _is_text_part(p.get("type")) and isinstance(p.get("text"), str)
        for p in output
    ):
        return _text_of(output)
    raise InvalidRequest(
        f"{where}.output must be a string or an array of text parts", param=f"{where}.output"
    )


def items_to_messages(
    items: object, *, param: str = "items", compactions: Mapping[str, Message] | None = None
) -> list[Message]:
    """Responses-style input items as chat messages.

    An assistant message and the function calls next to it are one assistant message with its
    tool_calls, as the answer was made (a response's `output` sent back as input). A field
    of the wrong type is a 400: what is stored is replayed on every later turn, so it must be what
    a provider accepts. A `compaction` item becomes the message `compactions` resolved its
    `encrypted_content` to (`context.compaction`); where none is given, it is an unsupported item.
    """
    if not isinstance(items, list):
        raise InvalidRequest(f"'{param}' must be an array", param=param)
    out: list[Message] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            message = _item_message(item, where)
            last = out[-1] if out else None
            if (
                last is not None
                and message["role"] == last["role"] == "assistant"
                and last.get("tool_calls")
                and last.get("content") is None
            ):
                last["content"] = message.get("content")  # (its calls came first: one answer)
            else:
                out.append(message)
        elif kind == "function_call":
            call = _item_call(item, where)
            if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
                # The answer's calls after its text (a response's `output` sent back, as
                # OpenAI's function-calling guide does): one assistant message, as it was made.
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(
                    f"{where}: a function_call_output needs call_id (a non-empty string)", param=where
                )
            output = _tool_output(item.get("output", ""), where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "compaction" and isinstance(item.get("encrypted_content"), str) and compactions:
            resolved = compactions.get(str(item["encrypted_content"]))
            if resolved is None:
                raise InvalidRequest(f"{where}: the compaction item was not resolved", param=where)
            out.append(cast(Message, dict(resolved)))
        else:
            raise InvalidRequest(f"{where}: unsupported item type {kind!r}", param=f"{where}.type")
    return out


def _item_message(item: JSONObject, where: str) -> Message:
    """A `message` item as a chat message (an assistant's refusal parts as its `refusal`)."""
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequest(
            f"{where}.role must be user, assistant, system or developer", param=f"{where}.role"
        )
    if "content" not in item:
        raise InvalidRequest(f"{where}.content is required", param=f"{where}.content")
    content = _chat_content(item["content"], where, str(role))
    message: Message = {"role": str(role), "content": content}
    if role == "assistant" and not isinstance(content, str):
        refusal = "".join(str(p.get("text", "")) for p in content if p["type"] == "refusal")
        message["content"] = _text_of(item.get("content"))
        if refusal:
            message["refusal"] = refusal
    if feedback_flag(item, where):
        message["is_feedback"] = True
    return message


def _item_call(item: JSONObject, where: str) -> ToolCall:
    """A `function_call` item as a chat tool call (its arguments settled as stored ones are)."""
    call_id = item.get("call_id") or item.get("id")
    name = item.get("name")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise InvalidRequest(
            f"{where}: a function_call needs call_id and name (non-empty strings)", param=where
        )
    arguments = _string(item.get("arguments", ""), f"{where}.arguments", f"{where}.arguments")
    call: ToolCall = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    default_arguments(call["function"])
    return call


def _content_parts(message: Message, role: str) -> list[JSONObject]:
    content = message.get("content")
    if role == "assistant":
        text = _text_of(content) if not isinstance(content, str) else content
        refusal = message.get("refusal")
        parts: list[JSONObject] = []
        if text or not (message.get("tool_calls") or refusal):
            parts.append({"type": "output_text", "text": text or "", "annotations": [], "logprobs": []})
        if isinstance(refusal, str) and refusal:
            parts.append({"type": "refusal", "refusal": refusal})
        return parts
    if isinstance(content, list):
        return [_item_part(cast(JSONObject, p)) for p in content if isinstance(p, dict)]
    return [{"type": "input_text", "text": content if isinstance(content, str) else ""}]


def _item_part(part: JSONObject) -> JSONObject:
    """A chat content part as the Conversations API shows it.

    A kind it has no name for is shown as stored, never as made-up text.
    """
    kind = part.get("type")
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        detail = image.get("detail") if isinstance(image, dict) else None
        return {"type": "input_image", "image_url": url, "detail": detail or "auto", "file_id": None}
    file = part.get("file")
    if kind == "file" and isinstance(file, dict):
        return {"type": "input_file", **file}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    if kind in (None, "text", "input_text"):
        text = part.get("text")
        return {"type": "input_text", "text": text if isinstance(text, str) else ""}
    return dict(part)


def message_to_items(
    message: Message, response_id: str, position: int, call_numbers: list[int] | None = None
) -> list[Item]:
    """One stored chat message as Conversations API items (as OpenAI returns them).

    `call_numbers`: the numbers its calls had at first, when some were deleted (item ids keep them).
    """
    role = message.get("role")
    base = f"{response_id}_{position}"
    mark = message.get("compaction")
    if isinstance(mark, dict):  # the summary of a compaction item: listed as that item again
        content = mark.get("encrypted_content")
        return [{"type": "compaction", "id": f"cmp_{base}", "encrypted_content": content}]
    if role == "tool":
        return [
            {
                "type": "function_call_output",
                "id": f"fco_{base}",
                "call_id": message.get("tool_call_id", ""),
                "output": _text_of(message.get("content"))
                if not isinstance(message.get("content"), str)
                else message["content"],
                "status": "completed",
            }
        ]
    items: list[Item] = []
    parts = _content_parts(message, str(role))
    if parts:
        items.append(
            {
                "type": "message",
                "id": f"msg_{base}" if position >= 0 else f"sys_{response_id}_{-position}",
                "role": role if role in ("user", "assistant", "system", "developer", "tool") else "unknown",
                "status": "completed",
                "content": parts,
            }
        )
    calls = message.get("tool_calls") or []
    for k, call in zip(call_numbers or range(len(calls)), calls, strict=False):
        fn = call.get("function") or {}
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{base}_{k}",
                "call_id": call.get("id", ""),
                "name": fn.get("name", ""),
                "arguments": fn.get("arguments", ""),
                "status": "completed",
            }
        )
    return items


def parse_item_id(item_id: str) -> tuple[str, int] | None:
    """(response_id, position) a stored item id names, or None if it is not one of ours."""
    prefix, _, rest = item_id.partition("_")
    if prefix not in ("msg", "fc", "fco", "sys", "cmp") or not rest:
        return None
    if prefix == "fc":
        rest = rest.rsplit("_", 1)[0]
    rid, _, raw = rest.rpartition("_")
    pos = ascii_int(raw)
    if not rid or pos is None:
        return None
    return (rid, -pos) if prefix == "sys" else (rid, pos)
