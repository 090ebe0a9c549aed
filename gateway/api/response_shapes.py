"""The Responses API's output shapes.

The `response` object, its output items, and the event stream a streaming `POST /v1/responses`
sends (built from the turn's chat chunks)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson

from gateway.api.background import sequence_of
from gateway.context import Message
from gateway.context.items import message_to_items
from gateway.exceptions import GatewayError
from gateway.services.turn import PreparedTurn
from gateway.services.turns import TurnStream
from gateway.types import JSONObject, Usage

# A provider's finish_reason that ends a response `incomplete`, and the reason it then gives.
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _response_tools(tools: object) -> list[JSONObject]:
    return [
        {"type": "function", "strict": None, **t["function"]}
        for t in (tools if isinstance(tools, list) else ())
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    ]


def output_items(
    message: Message | None, response_id: str, position: int, text_after: int = 0, status: str = "completed"
) -> list[JSONObject]:
    """The answer's output items: its text, then its calls; `text_after` calls first, as a
    stream that gave them before the text listed them. The last item of an answer cut short
    (`status` incomplete), its text or a call, is `incomplete`, as OpenAI's."""
    if message is None:
        return []
    items = message_to_items(message, response_id, position)
    for item in items:
        content = item.get("content")
        if item["type"] == "message" and isinstance(content, list):
            for part in content:
                part.setdefault("annotations", [])
    if text_after and items and items[0]["type"] == "message":
        text = items.pop(0)
        items.insert(min(text_after, len(items)), text)
    if status == "incomplete" and items:
        items[-1]["status"] = "incomplete"
    return items


def response_object(
    *,
    response_id: str,
    created: float,
    model: str,
    message: Message | None,
    position: int,
    finish_reason: str | None,
    usage: Usage | None,
    params: JSONObject,
    conversation_id: str | None,
    previous_response_id: str | None,
    status: str | None = None,
    error: JSONObject | None = None,
    lead: list[JSONObject] | None = None,
    completed: float | None = None,
    served: JSONObject | None = None,
    text_after: int = 0,
) -> dict[str, Any]:
    """The Responses API's `response` object.

    `lead`: output items before the answer's (the compaction item of a turn that compacted its
    conversation). `completed`: when a completed one was (`completed_at`; default: now).
    `served`: how the provider says it served it (its `service_tier`)."""
    prompt = int((usage or {}).get("prompt_tokens") or 0)
    completion = int((usage or {}).get("completion_tokens") or 0)
    prompt_details = (usage or {}).get("prompt_tokens_details")
    completion_details = (usage or {}).get("completion_tokens_details")
    if status is None:
        status = "incomplete" if finish_reason in _INCOMPLETE_REASONS else "completed"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created),
        "completed_at": int(completed if completed is not None else time.time())
        if status == "completed"
        else None,
        "status": status,
        "model": model,
        "output": [*(lead or ()), *output_items(message, response_id, position, text_after, status)],
        "error": error,
        "incomplete_details": {"reason": _INCOMPLETE_REASONS.get(finish_reason or "", "max_output_tokens")}
        if status == "incomplete" and not error
        else None,
        "instructions": params.get("instructions"),
        "metadata": params.get("metadata") or {},
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "temperature": params.get("temperature"),
        "top_p": params.get("top_p"),
        "tool_choice": params.get("tool_choice_raw", "auto"),
        "tools": _response_tools(params.get("tools")),
        "max_output_tokens": params.get("max_output_tokens"),
        "previous_response_id": previous_response_id,
        "conversation": {"id": conversation_id} if conversation_id else None,
        "store": params.get("store", True),
        "background": bool(params.get("background", False)),
        "truncation": params.get("truncation", "auto"),
        "text": params.get("text") or {"format": {"type": "text"}},
        "reasoning": params.get("reasoning") or {"effort": None, "summary": None},
        "usage": None  # (not known yet, or never: OpenAI's null, not zeros)
        if usage is None and status not in ("completed", "incomplete")
        else {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": _detail(prompt_details, "cached_tokens"),
                "cache_write_tokens": _detail(prompt_details, "cache_write_tokens"),
            },
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": _detail(completion_details, "reasoning_tokens")},
            "total_tokens": prompt + completion,
        },
        "user": params.get("user"),
        "service_tier": (served or {}).get("service_tier"),
        **{key: params.get(key) for key in ECHOED_AS_SENT},
    }


# Request fields a response object says back as the client sent them (null when it did not).
ECHOED_AS_SENT = ("prompt_cache_key", "prompt_cache_retention", "safety_identifier")


def response_error(error: JSONObject | None) -> JSONObject | None:
    """An error in the Responses API's shape (`code`, `message`), from OpenAI's error object."""
    if error is None:
        return None
    return {"code": str(error.get("code") or "server_error"), "message": str(error.get("message") or "")}


def _detail(details: object, key: str) -> int:
    """A count from the provider's usage details (`prompt_tokens_details`, ...), else 0."""
    value = details.get(key) if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def event(kind: str, seq: int, **fields: object) -> bytes:
    payload = {"type": kind, "sequence_number": seq, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def response_events(
    turn: PreparedTurn,
    chunks: TurnStream,
    common: dict[str, Any],
    lead: list[JSONObject] | None = None,
    *,
    queued: bool = False,
) -> AsyncIterator[bytes]:
    """Chat chunks as the Responses event stream.

    `lead`: items done before the answer (a compaction item), sent first. `queued`: a background
    response's, whose `response.created` and `response.queued` went out when it was made
    (`queued_events`): this goes on from `response.in_progress`."""
    created = turn.created or time.time()
    skeleton = response_object(
        created=created, message=None, finish_reason=None, usage=None, status="in_progress", **common
    )
    opening, seq = opening_events(skeleton, queued=queued)
    for frame in opening:
        yield frame
    lead = lead or []
    for index, item in enumerate(lead):
        seq += 1
        yield event("response.output_item.added", seq, output_index=index, item=item)
        seq += 1
        yield event("response.output_item.done", seq, output_index=index, item=item)
    rid, position = turn.response_id, common["position"]
    text_id = f"msg_{rid}_{position}"
    text_open = False
    calls_seen: dict[int, int] = {}  # tool call index -> output index
    # Items take their output index in the order they begin (a call may come before the text).
    output_index = next_index = len(lead)
    try:
        async for chunk in chunks:
            choices: Any = chunk.get("choices") or ()  # (a provider's chunk, checked as it goes)
            for choice in choices:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if isinstance(piece, str) and piece:
                    if not text_open:
                        text_open = True
                        output_index, next_index = next_index, next_index + 1
                        item = {
                            "type": "message",
                            "id": text_id,
                            "status": "in_progress",
                            "role": "assistant",
                            "content": [],
                        }
                        seq += 1
                        yield event("response.output_item.added", seq, output_index=output_index, item=item)
                        seq += 1
                        yield event(
                            "response.content_part.added",
                            seq,
                            item_id=text_id,
                            output_index=output_index,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                        )
                    seq += 1
                    yield event(
                        "response.output_text.delta",
                        seq,
                        item_id=text_id,
                        output_index=output_index,
                        content_index=0,
                        delta=piece,
                        logprobs=[],
                    )
                for call in delta.get("tool_calls") or ():
                    k = int(call.get("index", 0))
                    fn = call.get("function") or {}
                    if k not in calls_seen:
                        calls_seen[k], next_index = next_index, next_index + 1
                        item = {
                            "type": "function_call",
                            "id": f"fc_{rid}_{position}_{k}",
                            "call_id": call.get("id") or "",
                            "name": fn.get("name") or "",
                            "arguments": "",
                            "status": "in_progress",
                        }
                        seq += 1
                        yield event("response.output_item.added", seq, output_index=calls_seen[k], item=item)
                    if fn.get("arguments"):
                        seq += 1
                        yield event(
                            "response.function_call_arguments.delta",
                            seq,
                            item_id=f"fc_{rid}_{position}_{k}",
                            output_index=calls_seen[k],
                            delta=fn["arguments"],
                        )
    except GatewayError as exc:  # (the stream closed its turn with it)
        for frame in failure_events(created, exc, common, seq, lead):
            yield frame
        return
    outcome = chunks.outcome  # committed and closed by now: the lock is released early
    final = response_object(
        created=created,
        message=outcome.message,
        finish_reason=outcome.finish_reason,
        usage=outcome.usage,
        lead=lead,
        served=outcome.served,
        **common,
    )
    final["output"] = _in_streamed_order(
        final["output"], len(lead), output_index if text_open else None, calls_seen
    )
    announced = {*calls_seen.values(), *((output_index,) if text_open else ())}
    for frame in finishing_events(final, announced, seq, skip=len(lead)):
        yield frame


def _in_streamed_order(
    output: list[dict[str, Any]], skip: int, text_index: int | None, calls_seen: dict[int, int]
) -> list[dict[str, Any]]:
    """The answer's output items at the output indexes the stream gave them as they began (a
    call streamed before the text comes first); those it did not announce after them, in order.

    The first `skip` items were done before the answer began (a compaction item)."""
    call_indexes = iter(calls_seen[k] for k in sorted(calls_seen))
    placed: list[tuple[int, int, dict[str, Any]]] = []
    for n, item in enumerate(output[skip:]):
        at = text_index if item["type"] == "message" else next(call_indexes, None)
        placed.append((at if at is not None else len(output) + n, n, item))
    return [*output[:skip], *(item for _, _, item in sorted(placed, key=lambda p: (p[0], p[1])))]


def finishing_events(
    final: dict[str, Any], announced: set[int], seq: int, *, skip: int = 0
) -> Iterator[bytes]:
    """The events that end a response stream, numbered after `seq`.

    Each output item's done events (added first when no delta announced it: `announced` are the
    output indexes that were), then `response.completed` (`response.incomplete` for an answer cut
    short). The first `skip` items were done before
    the answer began (a compaction item)."""
    for index, item in enumerate(final["output"]):
        if index < skip:
            continue  # (done before the answer began)
        if index not in announced:
            # No delta announced it (an empty answer, a refusal): added before it is done, as
            # clients that assemble the stream (the SDK's `responses.stream`) require.
            seq += 1
            yield event("response.output_item.added", seq, output_index=index, item=_added(item))
        if item["type"] == "message":
            parts = item["content"] or [{"type": "output_text", "text": "", "annotations": []}]
            for k, part in enumerate(parts):
                if index not in announced or k > 0:
                    seq += 1
                    blank = {**part, "refusal": ""} if part["type"] == "refusal" else {**part, "text": ""}
                    yield event(
                        "response.content_part.added",
                        seq,
                        item_id=item["id"],
                        output_index=index,
                        content_index=k,
                        part=blank,
                    )
                if part["type"] == "refusal":
                    # (a refusal is known whole once the answer is: one delta, as a stream
                    # reader that builds its text from deltas expects one, then its done)
                    said: list[tuple[str, dict[str, Any]]] = [
                        ("response.refusal.delta", {"delta": part["refusal"]}),
                        ("response.refusal.done", {"refusal": part["refusal"]}),
                    ]
                else:
                    said = [("response.output_text.done", {"text": part.get("text", ""), "logprobs": []})]
                for name, fields in said:
                    seq += 1
                    yield event(name, seq, item_id=item["id"], output_index=index, content_index=k, **fields)
                seq += 1
                yield event(
                    "response.content_part.done",
                    seq,
                    item_id=item["id"],
                    output_index=index,
                    content_index=k,
                    part=part,
                )
        elif item["type"] == "function_call":
            seq += 1
            yield event(
                "response.function_call_arguments.done",
                seq,
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        seq += 1
        yield event("response.output_item.done", seq, output_index=index, item=item)
    yield from ending_events(final, seq)


def ending_events(final: dict[str, Any], seq: int) -> Iterator[bytes]:
    """A response stream's last event, numbered after `seq`, as its status says.

    As OpenAI's: `response.completed`; an answer cut short (max_output_tokens)
    `response.incomplete`; a failed one `error`, then `response.failed`. A cancelled one (OpenAI
    names no event for it) ends `response.incomplete`, its status `cancelled`, so that a follower
    waiting for an end sees one."""
    status = final.get("status")
    if status == "failed":
        err = final.get("error") or {}
        yield event("error", seq + 1, code=err.get("code"), message=err.get("message", ""), param=None)
        yield event("response.failed", seq + 2, response=final)
        return
    done = "response.incomplete" if status in ("incomplete", "cancelled") else "response.completed"
    yield event(done, seq + 1, response=final)


def _added(item: JSONObject) -> JSONObject:
    """An output item as announced before its content (a compaction item: whole)."""
    if item["type"] == "message":
        return {**item, "content": [], "status": "in_progress"}
    if item["type"] == "function_call":
        return {**item, "arguments": "", "status": "in_progress"}
    return item


def replayed_events(final: dict[str, Any], after: int = -1) -> Iterator[bytes]:
    """A stored response as the events of a whole answer, those numbered after `after`.

    For a background response whose own events are no longer kept (a restart, another worker):
    created, in progress, then every item's done events, and the end its status says. These are
    numbered afresh, fewer than the stream first had (no deltas): a client that had got further
    than they go (`after` past their last) gets the last event alone, numbered `after` + 1, so
    that it learns how the response ended."""
    skeleton = {**final, "status": "in_progress", "output": [], "error": None, "completed_at": None}
    frames, seq = opening_events(skeleton)
    frames += finishing_events(final, set(), seq)
    if after >= sequence_of(frames[-1]):
        yield from ending_events(final, after)
        return
    yield from (frame for frame in frames if sequence_of(frame) > after)


QUEUED = ("response.created", "response.queued")


def opening_events(skeleton: dict[str, Any], *, queued: bool = False) -> tuple[list[bytes], int]:
    """A response stream's first events, `response.created` then `response.in_progress`, and
    the last one's number.

    `queued`: a background response's, whose `response.created` and `response.queued` went out
    when it was made (`queued_events`): `response.in_progress` alone, numbered after them."""
    if queued:
        return [event("response.in_progress", len(QUEUED), response=skeleton)], len(QUEUED)
    created = event("response.created", 0, response=skeleton)
    return [created, event("response.in_progress", 1, response=skeleton)], 1


def queued_events(queued: dict[str, Any]) -> Iterator[bytes]:
    """A background response's first events, sent as it is made: `response.created` and
    `response.queued`, its status `queued` (as OpenAI's); the rest follow once it runs."""
    for seq, kind in enumerate(QUEUED):
        yield event(kind, seq, response=queued)


def failed_events(
    created: float, exc: GatewayError, common: dict[str, Any], *, queued: bool = False
) -> Iterator[bytes]:
    """The events of a response that failed before its provider's stream began.

    `queued`: after a background response's `queued_events`."""
    skeleton = response_object(
        created=created, message=None, finish_reason=None, usage=None, status="in_progress", **common
    )
    opening, seq = opening_events(skeleton, queued=queued)
    yield from opening
    yield from failure_events(created, exc, common, seq)


def failure_events(
    created: float, exc: GatewayError, common: dict[str, Any], seq: int, lead: list[JSONObject] | None = None
) -> Iterator[bytes]:
    """The events that end a failed response stream, numbered after `seq`.

    `error`, then `response.failed` (`lead`: items done before the answer, as in
    `response_object`)."""
    err = exc.to_dict()["error"]
    yield event("error", seq + 1, code=err.get("code"), message=err["message"], param=err.get("param"))
    failed = response_object(
        created=created,
        message=None,
        finish_reason=None,
        usage=None,
        status="failed",
        error=response_error(err),
        lead=lead,
        **common,
    )
    yield event("response.failed", seq + 2, response=failed)
