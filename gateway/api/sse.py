"""Server-sent events for chat completions: the service's chunk stream, rendered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

import orjson

from gateway.exceptions import GatewayError, UpstreamProtocolError, shutting_down
from gateway.services.turn import PreparedTurn
from gateway.services.turns import ChatService
from gateway.types import JSONObject

log = logging.getLogger("gateway.api")

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: Mapping[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def stream_error(exc: Exception, provider: str) -> GatewayError:
    """What a stream that failed after its headers reports in-band: the gateway's own error, or
    anything else as the provider's malformed stream (logged)."""
    if isinstance(exc, GatewayError):
        return exc
    log.warning("malformed stream from %s: %r", provider, exc)
    return UpstreamProtocolError(f"Provider {provider!r} sent a malformed stream ({type(exc).__name__})")


async def chat_events(
    service: ChatService, turn: PreparedTurn, chunks: AsyncIterator[JSONObject]
) -> AsyncIterator[bytes]:
    """The chunks as `chat.completion.chunk` events, then `[DONE]`. Headers are sent by then:
    any failure becomes an in-band error event (as OpenAI does: no `[DONE]` after it)."""
    include_usage = turn.request.include_usage
    try:
        try:
            async for chunk in chunks:
                if chunk.get("choices") or include_usage:
                    yield sse(chunk)
        except asyncio.CancelledError as cancelled:  # the server's shutdown: said in-band too
            raise shutting_down(cancelled) or cancelled from None
    except Exception as exc:  # noqa: BLE001 - headers are sent: every failure is reported in-band
        error = stream_error(exc, turn.route.provider)
        await service.close(turn, error)
        yield sse(error.to_dict())
        return
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    yield SSE_DONE
