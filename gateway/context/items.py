"""Conversations API items <-> chat messages (pure).

A stored message is named by its response and its position there, so an item id is
`msg_{response_id}_{position}` (function calls: `fc_..._{k}`, tool outputs: `fco_...`, system
prompt messages: `sys_{response_id}_{k}`).
"""

from __future__ import annotations

from gateway.exceptions import InvalidRequest
from gateway.types import ContentPart, JSONObject, Message, ToolCall

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


def _chat_content(content: object, where: str) -> str | list[ContentPart]:
    """Responses content (string or parts) as chat content (string, or parts for images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content must be a string or an array of parts", param=f"{where}.content"
        )
    parts: list[ContentPart] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if _is_text_part(kind):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and (part.get("image_url") or part.get("file_id")):
            parts.append(
                {"type": "image_url", "image_url": {"url": part.get("image_url") or part.get("file_id")}}
            )
        else:
            raise InvalidRequest(
                f"{where}.content[{k}]: unsupported content part {kind!r}", param=f"{where}.content"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p.get("text", "") for p in parts)
    return parts


def items_to_messages(items: object, *, param: str = "items") -> list[Message]:
    """Responses-style input items as chat messages (consecutive function calls merge into one
    assistant message with several tool_calls)."""
    if not isinstance(items, list):
        raise InvalidRequest(f"'{param}' must be an array", param=param)
    out: list[Message] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(
                    f"{where}.role must be user, assistant, system or developer", param=f"{where}.role"
                )
            content = _chat_content(item.get("content", ""), where)
            if role == "assistant" and not isinstance(content, str):
                content = _text_of(item.get("content"))
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id = str(item.get("call_id") or item.get("id") or "")
            name = str(item.get("name", ""))
            call: ToolCall = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": str(item.get("arguments", ""))},
            }
            if not call_id or not name:
                raise InvalidRequest(f"{where}: a function_call needs call_id and name", param=where)
            calls = out[-1].get("tool_calls") if out and out[-1]["role"] == "assistant" else None
            if calls and not out[-1].get("content"):
                calls.append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise InvalidRequest(f"{where}: a function_call_output needs call_id", param=where)
            output = item.get("output", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item["call_id"]),
                    "content": output if isinstance(output, str) else _text_of(output),
                }
            )
        else:
            raise InvalidRequest(f"{where}: unsupported item type {kind!r}", param=f"{where}.type")
    return out


def _content_parts(message: Message, role: str) -> list[JSONObject]:
    content = message.get("content")
    if role == "assistant":
        text = _text_of(content) if not isinstance(content, str) else content
        return (
            [{"type": "output_text", "text": text or "", "annotations": [], "logprobs": []}]
            if text or not message.get("tool_calls")
            else []
        )
    if isinstance(content, list):
        parts: list[JSONObject] = []
        for p in content:
            if not isinstance(p, dict):
                continue
            if p.get("type") == "image_url":
                image = p.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                parts.append({"type": "input_image", "image_url": url, "detail": "auto", "file_id": None})
            else:
                parts.append({"type": "input_text", "text": str(p.get("text", ""))})
        return parts
    return [{"type": "input_text", "text": content if isinstance(content, str) else ""}]


def message_to_items(message: Message, response_id: str, position: int) -> list[Item]:
    """One stored chat message as Conversations API items (as OpenAI returns them)."""
    role = message.get("role")
    base = f"{response_id}_{position}"
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
        prefix = "sys" if position < 0 else "msg"
        items.append(
            {
                "type": "message",
                "id": f"{prefix}_{base}" if position >= 0 else f"sys_{response_id}_{-position}",
                "role": role if role in ("user", "assistant", "system", "developer", "tool") else "unknown",
                "status": "completed",
                "content": parts,
            }
        )
        del prefix
    for k, call in enumerate(message.get("tool_calls") or []):
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
    if prefix not in ("msg", "fc", "fco", "sys") or not rest:
        return None
    if prefix == "fc":
        rest = rest.rsplit("_", 1)[0]
    rid, _, pos = rest.rpartition("_")
    if not rid or not pos.isdigit():
        return None
    return (rid, -int(pos)) if prefix == "sys" else (rid, int(pos))
