"""Stored chat completions, in OpenAI's shapes, over the logged chat-completion turns.

`GET /v1/chat/completions`, `GET|POST|DELETE /v1/chat/completions/{completion_id}` and
`GET .../messages` (the SDK's `client.chat.completions.retrieve`, `list`, `update`, `delete` and
`messages.list`); the turns are read through `services/completions.py`.
"""

from __future__ import annotations

import re

from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import JSONBody, read_json, services_of, tenant_of
from gateway.api.pages import list_params, page, paginate
from gateway.api.schemas import MAX_METADATA, ChatCompletionUpdate
from gateway.api.validation import validate
from gateway.context.records import StoredCompletion
from gateway.exceptions import InvalidRequest
from gateway.types import JSONObject, Message

_FILTER = re.compile(r"metadata\[(.*)\]", re.DOTALL)


def completion_object(completion: StoredCompletion) -> JSONObject:
    """A `chat.completion` as it was answered, with its metadata now and its conversation.

    As answered: the reply as the client got it, the usage; the conversation it belongs to is its
    `conversation_id`, as answered.
    """
    stored = completion.stored
    obj: JSONObject = {
        "id": stored.response_id,
        "object": "chat.completion",
        "created": int(stored.created),
        "model": stored.model,
        "choices": [
            {
                "index": 0,
                "message": stored.answered,
                "finish_reason": stored.finish_reason or "stop",
                "logprobs": None,
            }
        ],
        "usage": stored.usage,
        "metadata": completion.metadata,
        **stored.served,  # (`system_fingerprint`, `service_tier`, as the provider said them)
    }
    if stored.conversation_id is not None:
        obj["conversation_id"] = stored.conversation_id
    return obj


def store_message(completion_id: str, position: int, message: Message) -> JSONObject:
    """A request message as OpenAI lists it (`{completion_id}-{position}`).

    Its text as `content`, and its parts as `content_parts` when it had parts (images, files).
    """
    content = message.get("content")
    parts = content if isinstance(content, list) else None
    if parts is not None:
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = "".join(texts) if texts else None
    return {
        "id": f"{completion_id}-{position}",
        **message,
        "content": content,
        "name": message.get("name"),
        "content_parts": parts,
    }


def metadata_filter(query: QueryParams) -> dict[str, str]:
    """The `metadata[key]=value` pairs of a list's query (as the SDK writes a `metadata` dict)."""
    pairs: dict[str, str] = {}
    for key, value in query.multi_items():
        if key == "metadata":
            raise InvalidRequest("Filter by metadata as metadata[key]=value", param="metadata")
        match = _FILTER.fullmatch(key)
        if match is not None:
            pairs[match.group(1)] = value
    if len(pairs) > MAX_METADATA:
        raise InvalidRequest(f"At most {MAX_METADATA} metadata filters", param="metadata")
    return pairs


# -- routes -------------------------------------------------------------------------------------


async def list_completions(request: Request) -> Response:
    query = request.query_params
    params = list_params(query, default_order="asc")
    completions, has_more = await services_of(request).completions.page(
        tenant_of(request),
        limit=params.limit,
        after=params.after,
        descending=params.order == "desc",
        model=query.get("model") or None,
        metadata=metadata_filter(query),
    )
    return JSONBody(page([completion_object(c) for c in completions], has_more))


async def get_completion(request: Request) -> Response:
    cid = request.path_params["completion_id"]
    completion = await services_of(request).completions.get(tenant_of(request), cid)
    return JSONBody(completion_object(completion))


async def update_completion(request: Request) -> Response:
    services = services_of(request)
    body = await read_json(request, services.settings.server.max_body_bytes)
    update = validate(ChatCompletionUpdate, body)
    cid = request.path_params["completion_id"]
    completion = await services.completions.update(tenant_of(request), cid, update.metadata)
    return JSONBody(completion_object(completion))


async def delete_completion(request: Request) -> Response:
    cid = request.path_params["completion_id"]
    await services_of(request).completions.delete(tenant_of(request), cid)
    return JSONBody({"id": cid, "object": "chat.completion.deleted", "deleted": True})


async def list_messages(request: Request) -> Response:
    cid = request.path_params["completion_id"]
    params = list_params(request.query_params, default_order="asc")
    completion = await services_of(request).completions.get(tenant_of(request), cid)
    messages = [store_message(cid, k, m) for k, m in enumerate(completion.messages)]
    return JSONBody(paginate(messages, params))
