"""The OpenAI Conversations API, plus gateway extensions (list, reset, context).

Parse, call the conversation use cases (`services/conversations.py`, `services/queries.py`),
render.
"""

from __future__ import annotations

from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import JSONBody, read_json, services_of, tenant_of
from gateway.api.pages import NEWEST_FIRST, list_params, page, paginate
from gateway.api.schemas import ConversationCreate, ConversationUpdate, ItemsCreate, Reset
from gateway.api.validation import validate
from gateway.context.lifecycle import State
from gateway.exceptions import InvalidRequest
from gateway.ids import check_conversation_id
from gateway.services.conversations import find_item, item_place, view_items
from gateway.types import JSONObject


def _cid(request: Request) -> str:
    return check_conversation_id(request.path_params["conversation_id"], param="conversation_id")


class Described(Protocol):
    """What a conversation object says of a conversation (a view, or a list's listing)."""

    @property
    def created_at(self) -> float | None: ...
    @property
    def metadata(self) -> dict[str, str]: ...
    @property
    def last_activity(self) -> float | None: ...


def conversation_object(cid: str, view: Described, ttl: float = 0.0, **extra: object) -> JSONObject:
    """OpenAI's conversation object, plus `expires_at` when `sessions.ttl` is set.

    `expires_at`: when it expires if nothing more is said (null: it never does, or nothing was
    said yet).
    """
    expires = view.last_activity + ttl if ttl > 0 and view.last_activity is not None else None
    return {
        "id": cid,
        "object": "conversation",
        "created_at": int(view.created_at or 0),
        "metadata": view.metadata,
        "expires_at": int(expires) if expires is not None else None,
        **extra,
    }


def _ttl(request: Request) -> float:
    return float(request.app.state.settings.sessions.ttl)


# -- routes -------------------------------------------------------------------------------------


async def create_conversation(request: Request) -> Response:
    services = services_of(request)
    body = await read_json(request, services.settings.server.max_body_bytes, allow_empty=True)
    create = validate(ConversationCreate, body)
    cid, view = await services.conversations.create(
        tenant_of(request),
        requested_id=body.get("id") or body.get("conversation_id"),
        metadata=create.metadata or {},
        items=body.get("items"),
    )
    return JSONBody(conversation_object(cid, view, _ttl(request)))


def lifecycle(state: State) -> dict[str, object]:
    """Where post-processing has the conversation (SPEC 8), its attempts and last error."""
    return {"state": state.state, "attempts": state.attempts, "error": state.error}


async def get_conversation(request: Request) -> Response:
    cid = _cid(request)
    services = services_of(request)
    view = await services.conversations.get(tenant_of(request), cid)
    state = await services.queries.state(tenant_of(request), cid, view)
    return JSONBody(conversation_object(cid, view, _ttl(request), **lifecycle(state)))


async def update_conversation(request: Request) -> Response:
    services = services_of(request)
    cid = _cid(request)
    body = await read_json(request, services.settings.server.max_body_bytes)
    update = validate(ConversationUpdate, body)
    view = await services.conversations.update_metadata(tenant_of(request), cid, update.metadata or {})
    return JSONBody(conversation_object(cid, view, _ttl(request)))


async def delete_conversation(request: Request) -> Response:
    cid = _cid(request)
    await services_of(request).conversations.delete(tenant_of(request), cid)
    return JSONBody({"id": cid, "object": "conversation.deleted", "deleted": True})


async def list_conversations(request: Request) -> Response:
    params = list_params(request.query_params, orders=NEWEST_FIRST)
    rows, has_more = await services_of(request).queries.conversations(
        tenant_of(request), limit=params.limit, after=params.after
    )
    data = [
        conversation_object(
            row.conversation_id,
            row.listing,
            _ttl(request),
            turns=row.summary.turns,
            messages=row.summary.messages,
            last_activity_at=int(row.summary.last_activity),
            **lifecycle(row.state),
        )
        for row in rows
    ]
    return JSONBody(page(data, has_more))


async def reset_conversation(request: Request) -> Response:
    services = services_of(request)
    cid = _cid(request)
    body = await read_json(request, services.settings.server.max_body_bytes, allow_empty=True)
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    # (a `keep_system_messages` typo is said: taken for nothing, it resets the system prompt too)
    keep = validate(Reset, body).keep_system_message
    view = await services.conversations.reset(tenant_of(request), cid, keep_system_message=keep)
    return JSONBody(conversation_object(cid, view, _ttl(request), reset=True, keep_system_message=keep))


async def list_items(request: Request) -> Response:
    view = await services_of(request).conversations.get(tenant_of(request), _cid(request))
    params = list_params(request.query_params)
    return JSONBody(paginate(view_items(view), params, place=item_place(view)))


async def create_items(request: Request) -> Response:
    services = services_of(request)
    cid = _cid(request)
    body = await read_json(request, services.settings.server.max_body_bytes)
    if not isinstance(body, dict):
        raise InvalidRequest("'items' is required", param="items")
    validate(ItemsCreate, body)  # then turned into messages (and checked again) by the service
    created = await services.conversations.add_items(tenant_of(request), cid, body["items"])
    return JSONBody(page(created, False))


async def get_item(request: Request) -> Response:
    view = await services_of(request).conversations.get(tenant_of(request), _cid(request))
    return JSONBody(find_item(view, request.path_params["item_id"]))


async def delete_item(request: Request) -> Response:
    cid = _cid(request)
    view = await services_of(request).conversations.delete_item(
        tenant_of(request), cid, request.path_params["item_id"]
    )
    return JSONBody(conversation_object(cid, view, _ttl(request)))


async def conversation_context(request: Request) -> Response:
    cid = _cid(request)
    await services_of(request).conversations.get(tenant_of(request), cid)  # (gone once expired)
    queries = services_of(request).queries
    rid, context = await queries.latest_context(tenant_of(request), cid)
    body = {k: v for k, v in context.items() if k != "type"}
    cache = await queries.prompt_cache(tenant_of(request), rid)  # (the provider's figures, once answered)
    if cache is not None:
        body["cache"] = cache
    return JSONBody({"object": "conversation.context", "conversation_id": cid, "response_id": rid, **body})
