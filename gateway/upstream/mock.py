"""Test twin of the upstream seam: `MockUpstream(handler)` records every body it is sent.

The handler gets the body and returns reply text, an assistant message dict, or a whole
completion dict; it may raise a gateway `UpstreamError` to simulate a provider fault.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable

from gateway.types import as_list, as_object, first_choice
from gateway.upstream.base import (
    Body,
    Chunk,
    ServerWindow,
    Upstream,
    approx_tokens,
    chunks_from_completion,
    completion_from_text,
    take_trace_headers,
)
from gateway.upstream.cache_hints import take_cache_key
from gateway.upstream.demo import demo_reply

# A handler answers a request body with the reply text, the assistant message, or a whole
# completion (anything else is a TypeError; raising an UpstreamError fakes a provider fault).
Handler = Callable[[Body], object]


def _demo_handler(body: Body) -> str:
    return demo_reply([as_object(m) for m in as_list(body.get("messages"))])


class MockUpstream(Upstream):
    def __init__(
        self,
        handler: Handler | None = None,
        *,
        name: str = "mock",
        delay: float = 0.0,
        window: ServerWindow | None = None,
    ) -> None:
        self.handler = handler or _demo_handler
        self.window = window  # what describe() reports
        self.name = name
        self.url = "mock://upstream"
        self.reports_real_usage = False  # tests of calibration set it
        self.delay = delay
        self.requests: list[Body] = []
        self.traceparents: list[str | None] = []  # each request's `traceparent` (tracing on)
        self.tracestates: list[str | None] = []  # and the client's `tracestate` passed on with it
        self.record = True

    def _completion(self, body: Body) -> Body:
        body, _ = take_cache_key(body)  # (as every provider: the gateway's own fields are not sent)
        body, trace = take_trace_headers(body)
        self.traceparents.append(trace.get("traceparent"))
        self.tracestates.append(trace.get("tracestate"))
        self.requests.append(copy.deepcopy(body) if self.record else body)
        reply = self.handler(body)
        model = str(body.get("model", "mock"))
        messages = body.get("messages")
        if isinstance(reply, str):
            return completion_from_text(model, reply, prompt_tokens=approx_tokens(messages))
        if isinstance(reply, dict) and "choices" in reply:
            return as_object(reply)
        if isinstance(reply, dict):
            completion = completion_from_text(model, "", prompt_tokens=approx_tokens(messages))
            choice = first_choice(completion)
            choice["message"] = reply
            if reply.get("tool_calls"):
                choice["finish_reason"] = "tool_calls"
            return completion
        raise TypeError(f"mock handler returned {type(reply).__name__}")

    async def describe(self, model: str) -> ServerWindow | None:
        return self.window

    async def complete(self, body: Body, *, waited: float = 0.0) -> Body:
        if self.delay:
            await asyncio.sleep(self.delay)
        return self._completion(body)

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        completion = await self.complete(body)
        include_usage = bool(as_object(body.get("stream_options")).get("include_usage"))
        for chunk in chunks_from_completion(completion, include_usage=include_usage):
            yield chunk
