"""Server-sent events for chat completions: the service's chunk stream, rendered."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import orjson

from gateway.exceptions import GatewayError
from gateway.services.turn import PreparedTurn
from gateway.services.turns import TurnStream

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: Mapping[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def chat_events(turn: PreparedTurn, chunks: TurnStream) -> AsyncIterator[bytes]:
    """The chunks as `chat.completion.chunk` events, then `[DONE]`.

    Headers are sent by then: a failure of the stream is an in-band error event (as OpenAI does:
    no `[DONE]` after it)."""
    include_usage = turn.request.include_usage
    try:
        async for chunk in chunks:
            if chunk.get("choices") or include_usage:
                yield sse(chunk)
    except GatewayError as error:  # (the stream closed its turn with it)
        yield sse(error.to_dict())
        return
    yield SSE_DONE
