"""Compaction over HTTP, in OpenAI's shapes.

`POST /v1/responses/compact`, the compaction items a Responses `input` brings back, and
`context_management` on `POST /v1/responses` (the Responses handlers call the last two;
`gateway/services/compaction.py` does the work).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.http import JSONBody, read_json, services_of, tenant_of
from gateway.api.schemas import ResponseCompact
from gateway.api.validation import validate
from gateway.context import split_system
from gateway.context.compaction import compaction_refs
from gateway.context.content import check_model
from gateway.context.items import items_to_messages
from gateway.exceptions import InvalidRequest
from gateway.ids import check_conversation_id
from gateway.services import Services
from gateway.services.compaction import Compacted
from gateway.services.requests import ChatRequest
from gateway.types import JSONObject, Message


async def input_compactions(services: Services, tenant: str, raw_input: object) -> dict[str, Message]:
    """The summary message each compaction item of a Responses `input` stands for.

    Keyed by its `encrypted_content` (for `items_to_messages`); a 400 for one that does not
    resolve.
    """
    return await services.compactions.resolve(tenant, compaction_refs(raw_input, "input"))


async def compact_before_turn(
    services: Services, tenant: str, body: dict[str, Any], chat: ChatRequest, previous: str | None
) -> list[JSONObject]:
    """Compact the turn's conversation first when its prompt passes N tokens, as the body asks.

    `context_management: [{"type": "compaction", "compact_threshold": N}]` asks for it. Returns
    the output items to put before the answer (the compaction item, or none). The turn then starts
    its window at the new summary (`chat.compaction_version`) and its record keeps the item
    (`echo`).
    """
    entries = body.get("context_management") or []
    cid = chat.conversation_id
    if not entries or cid is None:
        return []
    threshold = entries[0].get("compact_threshold")
    _, new = split_system(chat.messages)
    compaction = await services.compactions.compact_if_due(tenant, cid, previous, chat.model, threshold, new)
    if compaction is None:
        return []
    chat.compaction_version = compaction.version
    if chat.echo is not None:
        chat.echo["compaction"] = compaction.item
    return [compaction.item]


def lead_items(echo: object) -> list[JSONObject]:
    """The items a stored Responses turn put before its answer (its compaction item)."""
    item = echo.get("compaction") if isinstance(echo, dict) else None
    return [item] if isinstance(item, dict) else []


def compacted_response(compacted: Compacted) -> JSONObject:
    """OpenAI's `response.compaction` object."""
    prompt, answer = compacted.usage["prompt_tokens"], compacted.usage["completion_tokens"]
    return {
        "id": compacted.response_id,
        "object": "response.compaction",
        "created_at": int(compacted.created),
        "output": [*compacted.kept, compacted.item],
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + answer,
        },
    }


async def compact_response(request: Request) -> Response:
    """`POST /v1/responses/compact`: the history and the `input` after it, folded by the summarizer.

    The history is that of `previous_response_id`, or of the gateway's `conversation`; the
    summarizer is the gateway's.
    """
    services = services_of(request)
    tenant = tenant_of(request)
    body = await read_json(request, services.settings.server.max_body_bytes)
    parsed = validate(ResponseCompact, body)
    check_model(parsed.model)
    raw_input = body.get("input")
    compactions = await input_compactions(services, tenant, raw_input)
    messages: list[Message] = []
    if isinstance(raw_input, str):
        messages = [{"role": "user", "content": raw_input}]
    elif raw_input is not None:
        messages = items_to_messages(raw_input, param="input", compactions=compactions)
    conversation, previous = body.get("conversation"), body.get("previous_response_id")
    if conversation is not None and previous is not None:
        raise InvalidRequest(
            "Use 'conversation' or 'previous_response_id', not both", param="previous_response_id"
        )
    cid: str | None = None
    if conversation is not None:
        raw = conversation.get("id") if isinstance(conversation, dict) else conversation
        cid = await services.responses.named_conversation(
            tenant, check_conversation_id(raw, param="conversation")
        )
    elif previous is not None:
        cid = await services.responses.continued_conversation(tenant, previous)
    compacted = await services.compactions.compact(
        tenant, parsed.model, messages, conversation=cid, previous=previous
    )
    return JSONBody(compacted_response(compacted))
