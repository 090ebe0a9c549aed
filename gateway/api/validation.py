"""Request bodies checked against their models (`api/schemas.py`), the first error in OpenAI's shape.

pydantic's first error is turned into OpenAI's: a 400 `invalid_request_error` whose `param` names
the field as the client wrote it (`messages[2].tool_calls[0]`) and whose message says what that
field must be.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from gateway.api.schemas import NOT_AN_OBJECT, ChatCompletionRequest, ErrorMessages
from gateway.context.content import check_messages, check_model
from gateway.context.tools import default_arguments
from gateway.exceptions import InvalidRequest
from gateway.ids import check_conversation_id
from gateway.services.requests import ChatRequest

B = TypeVar("B", bound=BaseModel)


def _path(error: ErrorDetails, body: object) -> list[str | int]:
    """The error's place in the body.

    pydantic's `loc` also holds the tags of the union members it tried (a message's role, "str"):
    following the body leaves them out.
    """
    path: list[str | int] = []
    node = body
    last = len(error["loc"]) - 1
    for k, step in enumerate(error["loc"]):
        after_index = k > 0 and isinstance(error["loc"][k - 1], int)
        if isinstance(step, int) and isinstance(node, list) and 0 <= step < len(node):
            path.append(step)
            node = node[step]
        elif after_index and isinstance(node, dict) and step == node.get("role"):
            continue  # the tag of a message's member: its role
        elif isinstance(step, str) and isinstance(node, dict) and step in node:
            path.append(step)
            node = node[step]
        elif k == last and error["type"] == "missing":
            path.append(step)
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):  # no member for the role
        path.append(str(error.get("ctx", {}).get("discriminator", "")).strip("'"))
    elif error["type"] == "unknown_type":  # no member for an item's type
        path.append("type")
    return path


def _render(path: list[str | int], *, indexes: bool = True) -> str:
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]" if indexes else "[]"
        else:
            out += f".{step}" if out else step
    return out


def invalid_request(error: ErrorDetails, body: object, messages: ErrorMessages) -> InvalidRequest:
    """The 400 for pydantic's `error`, reported at the deepest field `messages` has words for."""
    path = _path(error, body)
    for end in range(len(path), -1, -1):
        message = messages.get(_render(path[:end], indexes=False))
        if message is not None:
            param = _render(path[:end])
            text = message.format(param=param) if isinstance(message, str) else message(param, error)
            return InvalidRequest(text, param=param or None)
    param = _render(path)
    return InvalidRequest(f"{param or 'The request body'}: {error['msg']}", param=param or None)


def validate(model: type[B], body: object) -> B:
    """`body` as a `model`, or the 400 for its first error (the model's fields in order)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # A field the API does not take is named first: its typo is why another is missing.
        error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        # A value no member of a union took (a message's content): the member that got furthest
        # says most (a part without its type, rather than "must be a string").
        parent = error["loc"][:-1]
        deeper = [
            e for e in errors if e["loc"][: len(parent)] == parent and len(e["loc"]) > len(error["loc"])
        ]
        if deeper:
            error = max(deeper, key=lambda e: len(e["loc"]))
        if error["type"] == "extra_forbidden":  # (as OpenAI says it)
            name = _render([*error["loc"]])
            raise InvalidRequest(
                f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter"
            ) from None
        messages: ErrorMessages = getattr(model, "error_messages", {})
        raise invalid_request(error, body, messages) from None


def parse_chat(body: object, *, header_conversation_id: str | None = None) -> ChatRequest:
    """A chat-completions request, checked; the services get the client's own dicts."""
    if not isinstance(body, dict):
        raise InvalidRequest(NOT_AN_OBJECT)
    request = validate(ChatCompletionRequest, body)
    check_model(request.model)
    check_messages(body["messages"])
    cid: str | None = None
    # The first id present names the conversation; ids after it are not looked at.
    if request.conversation_id is not None:
        cid = check_conversation_id(request.conversation_id, param="conversation_id")
    elif header_conversation_id is not None:
        cid = check_conversation_id(header_conversation_id, param="X-Conversation-Id")
    elif request.session_id is not None:
        cid = check_conversation_id(request.session_id, param="session_id")
    elif request.agent_id is not None:
        cid = check_conversation_id(request.agent_id, param="agent_id")
    if request.is_feedback:
        # `extra_body={"is_feedback": True}`: the SDK's way to flag a turn; it marks the
        # request's last message (the new input of a resending client as of one sending only it).
        body["messages"][-1] = {**body["messages"][-1], "is_feedback": True}
    _default_arguments(body["messages"])
    include_usage = bool((request.stream_options or {}).get("include_usage"))
    return ChatRequest(body, request.model, body["messages"], bool(request.stream), include_usage, cid)


def _default_arguments(messages: list[Any]) -> None:
    """Give each call the client sends without arguments the arguments "{}".

    The gateway stores a provider's such call the same way (`default_arguments`).
    """
    for message in messages:
        for call in message.get("tool_calls") or () if message.get("role") == "assistant" else ():
            default_arguments(call.get("function"))
