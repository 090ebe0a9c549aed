"""The OpenAI Conversations API over our store, plus gateway extensions (list, reset, context).

Every change is an append to the conversation's index (a marker) or a new response log for
created items; nothing is rewritten in place, except deletion, which removes the files.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import JSONBody, read_json, store_for
from gateway.context import ConversationView, Turn, split_system
from gateway.context.items import Item, items_to_messages, message_to_items, parse_item_id
from gateway.exceptions import InvalidRequest, NotFound
from gateway.ids import check_conversation_id, mint_response_id
from gateway.lifecycle import derive_state
from gateway.services.requests import check_size
from gateway.store import Store
from gateway.store.base import now

MAX_METADATA = 16


def _cid(request: Request) -> str:
    return check_conversation_id(request.path_params["conversation_id"], param="conversation_id")


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        raise InvalidRequest("'metadata' must be an object of at most 16 string pairs", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise InvalidRequest("metadata keys are ≤64 characters and values strings ≤512", param="metadata")
    return dict(metadata)


def conversation_object(cid: str, view: ConversationView, **extra: Any) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "conversation",
        "created_at": int(view.created_at or 0),
        "metadata": view.metadata,
        **extra,
    }


async def _existing(store: Store, cid: str) -> ConversationView:
    if not await store.exists(cid):
        raise NotFound(f"No conversation found with id {cid!r}", param="conversation_id")
    return await store.load(cid)


def view_items(view: ConversationView) -> list[Item]:
    """The conversation as items, oldest first: system prompt, then what the model sees."""
    items: list[Item] = []
    if view.system and view.system_owner:
        for k, message in enumerate(view.system):
            items.extend(message_to_items(message, view.system_owner, -(k + 1)))
    for message, owner, pos in zip(view.history, view.history_owner, view.history_pos, strict=True):
        items.extend(message_to_items(message, owner, pos))
    return items


async def _add_items(
    store: Store, cid: str, raw_items: Any, lock_timeout: float, max_messages: int
) -> list[Item]:
    messages = items_to_messages(raw_items)
    if len(messages) > 100:
        raise InvalidRequest("At most 100 items can be added at a time", param="items")
    system, rest = split_system(messages)
    rid = mint_response_id("items")
    created_at = now()
    record: dict[str, Any] = {
        "type": "request",
        "kind": "items",
        "response_id": rid,
        "conversation_id": cid,
        "created": created_at,
        "system": system or None,
        "input": rest,
    }
    async with store.lock(cid, lock_timeout):
        check_size(max_messages, cid, await store.load(cid), len(messages))
        log = store.start(rid, record)
        turn = Turn(rid, tuple(rest), None, tuple(system) if system else None, created=created_at)
        try:
            await log.commit(cid, turn)
        except BaseException:
            await log.abandon("error")
            raise
    created: list[Item] = []
    for k, message in enumerate(system):
        created.extend(message_to_items(message, rid, -(k + 1)))
    for pos, message in enumerate(rest):
        created.extend(message_to_items(message, rid, pos))
    return created


def _page(items: list[Item], *, first: bool = True) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise InvalidRequest("'limit' must be an integer between 1 and 100", param="limit")
    return int(raw)


def paginate(items: list[Item], request: Request, *, default_order: str) -> dict[str, Any]:
    order = request.query_params.get("order", default_order)
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'", param="order")
    limit = _limit(request)
    ordered = items if order == "asc" else list(reversed(items))
    after = request.query_params.get("after")
    if after:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise NotFound(f"No item {after!r} in this list", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    result = _page(page)
    result["has_more"] = len(ordered) > limit
    return result


# -- routes -------------------------------------------------------------------------------------


async def create_conversation(request: Request) -> Response:
    settings = request.app.state.settings
    store = await store_for(request)
    body = await read_json(request, settings.server.max_body_bytes, allow_empty=True)
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    metadata = _metadata(body) or {}
    # Extension: a client may choose the id (as it does with chat completions).
    requested = body.get("id") or body.get("conversation_id")
    cid = check_conversation_id(requested, param="id") if requested else f"conv_{secrets.token_hex(16)}"
    async with store.lock(cid, settings.storage.lock_timeout):
        if await store.exists(cid):
            raise InvalidRequest(
                f"Conversation {cid!r} already exists", param="id", code="conversation_exists"
            )
        await store.append_marker(
            cid, {"type": "conversation", "created_at": int(time.time()), "metadata": metadata}
        )
    if body.get("items"):
        await _add_items(
            store,
            cid,
            body["items"],
            settings.storage.lock_timeout,
            settings.storage.max_conversation_messages,
        )
    view = await store.load(cid)
    return JSONBody(conversation_object(cid, view))


async def get_conversation(request: Request) -> Response:
    store = await store_for(request)
    cid = _cid(request)
    view = await _existing(store, cid)
    return JSONBody(conversation_object(cid, view))


async def update_conversation(request: Request) -> Response:
    settings = request.app.state.settings
    store = await store_for(request)
    cid = _cid(request)
    body = await read_json(request, settings.server.max_body_bytes)
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    metadata = _metadata(body)
    if metadata is None:
        raise InvalidRequest("'metadata' is required", param="metadata")
    async with store.lock(cid, settings.storage.lock_timeout):
        await _existing(store, cid)
        await store.append_marker(cid, {"type": "metadata", "metadata": metadata, "at": now()})
        view = await store.load(cid)
    return JSONBody(conversation_object(cid, view))


async def delete_conversation(request: Request) -> Response:
    settings = request.app.state.settings
    store = await store_for(request)
    cid = _cid(request)
    async with store.lock(cid, settings.storage.lock_timeout):
        deleted = await store.delete_conversation(cid, archive=settings.storage.archive_deleted)
    if not deleted:
        raise NotFound(f"No conversation found with id {cid!r}", param="conversation_id")
    return JSONBody({"id": cid, "object": "conversation.deleted", "deleted": True})


async def list_conversations(request: Request) -> Response:
    store = await store_for(request)
    summaries = await store.list_conversations()
    limit = _limit(request)
    after = request.query_params.get("after")
    if after:
        ids = [s.conversation_id for s in summaries]
        if after not in ids:
            raise NotFound(f"No conversation {after!r} in this list", param="after")
        summaries = summaries[ids.index(after) + 1 :]
    data = []
    for summary in summaries[:limit]:
        view = await store.load(summary.conversation_id)
        data.append(
            conversation_object(
                summary.conversation_id,
                view,
                turns=summary.turns,
                messages=summary.messages,
                last_activity_at=int(summary.last_activity),
                state=derive_state(
                    await store.read_side("lifecycle", summary.conversation_id), view.last_activity
                ).state,
            )
        )
    result = _page(data)
    result["has_more"] = len(summaries) > limit
    return JSONBody(result)


async def reset_conversation(request: Request) -> Response:
    settings = request.app.state.settings
    store = await store_for(request)
    cid = _cid(request)
    body = await read_json(request, settings.server.max_body_bytes, allow_empty=True)
    keep = bool(body.get("keep_system_message", False)) if isinstance(body, dict) else False
    async with store.lock(cid, settings.storage.lock_timeout):
        await _existing(store, cid)
        await store.append_marker(cid, {"type": "reset", "keep_system_message": keep, "at": now()})
        view = await store.load(cid)
    return JSONBody(conversation_object(cid, view, reset=True, keep_system_message=keep))


async def list_items(request: Request) -> Response:
    store = await store_for(request)
    cid = _cid(request)
    view = await _existing(store, cid)
    return JSONBody(paginate(view_items(view), request, default_order="desc"))


async def create_items(request: Request) -> Response:
    settings = request.app.state.settings
    store = await store_for(request)
    cid = _cid(request)
    body = await read_json(request, settings.server.max_body_bytes)
    if not isinstance(body, dict) or "items" not in body:
        raise InvalidRequest("'items' is required", param="items")
    await _existing(store, cid)
    created = await _add_items(
        store, cid, body["items"], settings.storage.lock_timeout, settings.storage.max_conversation_messages
    )
    return JSONBody(_page(created))


def _find(view: ConversationView, item_id: str) -> Item:
    for item in view_items(view):
        if item["id"] == item_id:
            return item
    raise NotFound(f"No item {item_id!r} in this conversation", param="item_id")


async def get_item(request: Request) -> Response:
    store = await store_for(request)
    cid = _cid(request)
    view = await _existing(store, cid)
    return JSONBody(_find(view, request.path_params["item_id"]))


async def delete_item(request: Request) -> Response:
    settings = request.app.state.settings
    store = await store_for(request)
    cid = _cid(request)
    item_id = request.path_params["item_id"]
    async with store.lock(cid, settings.storage.lock_timeout):
        view = await _existing(store, cid)
        _find(view, item_id)
        named = parse_item_id(item_id)
        assert named is not None  # _find only finds ids we made
        rid, position = named
        await store.append_marker(
            cid, {"type": "delete_item", "response_id": rid, "position": position, "at": now()}
        )
        view = await store.load(cid)
    return JSONBody(conversation_object(cid, view))


async def conversation_context(request: Request) -> Response:
    store = await store_for(request)
    cid = _cid(request)
    entries = await store.read_index(cid)
    ids = [e for e in entries if isinstance(e, str)]
    for rid in reversed(ids):
        records = await store.read_response(rid)
        context = next((r for r in reversed(records) if r.get("type") == "context"), None)
        if context is not None:
            body = {k: v for k, v in context.items() if k != "type"}
            return JSONBody(
                {"object": "conversation.context", "conversation_id": cid, "response_id": rid, **body}
            )
    raise NotFound(f"Conversation {cid!r} has no recorded context yet", param="conversation_id")


async def get_response(request: Request) -> Response:
    """The logged request/response of one response id (this tenant's only)."""
    store = await store_for(request)
    rid = request.path_params["response_id"]
    records = await store.read_response(rid)
    request_record = next((r for r in records if r.get("type") == "request"), {})
    response_record = next((r for r in records if r.get("type") == "response"), None)
    context = next((r for r in reversed(records) if r.get("type") == "context"), None)
    outcome = records[-1] if records else {}
    status = (
        "completed"
        if outcome.get("type") == "commit"
        else ("incomplete" if outcome.get("type") == "incomplete" else "in_progress")
    )
    return JSONBody(
        {
            "id": rid,
            "object": "gateway.response",
            "created_at": int(request_record.get("created") or 0),
            "conversation_id": request_record.get("conversation_id"),
            "model": request_record.get("model"),
            "status": status,
            "request": {k: v for k, v in request_record.items() if k != "type"},
            "context": {k: v for k, v in context.items() if k != "type"} if context else None,
            "response": {k: v for k, v in response_record.items() if k != "type"}
            if response_record
            else None,
            "error": outcome.get("error") if status == "incomplete" else None,
        }
    )
