"""Conversation read endpoints: the latest context snapshot (what the model was last given)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import JSONBody
from gateway.exceptions import NotFound
from gateway.ids import check_conversation_id
from gateway.store import Store


async def conversation_context(request: Request) -> Response:
    store: Store = request.app.state.store
    cid = check_conversation_id(request.path_params["conversation_id"], param="conversation_id")
    entries = await store.read_index(cid)
    ids = [e for e in entries if isinstance(e, str)]
    for rid in reversed(ids):
        records = await store.read_response(rid)
        context = next((r for r in records if r.get("type") == "context"), None)
        if context is not None:
            body = {k: v for k, v in context.items() if k != "type"}
            return JSONBody(
                {"object": "conversation.context", "conversation_id": cid, "response_id": rid, **body}
            )
    raise NotFound(f"Conversation {cid!r} has no recorded context yet", param="conversation_id")
