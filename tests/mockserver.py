"""A real HTTP, OpenAI-compatible mock upstream for end-to-end tests.

It records every request body, answers with the demo model's logic (so recall is visible),
and can be told to misbehave: `server.mode = "error500" | "error503_once" | "error429" | "hang"
| "tool_call"`.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.server import running_in_thread
from gateway.upstream.base import approx_tokens, chunks_from_completion, completion_from_text
from gateway.upstream.demo import demo_reply


class MockServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.mode = "normal"
        self.hang_seconds = 30.0
        self.url = ""
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
        self.mode = "normal"

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        completion = completion_from_text(
            str(body.get("model")), demo_reply(messages), prompt_tokens=approx_tokens(messages)
        )
        last = messages[-1] if messages else {}
        if self.mode == "tool_call" and last.get("role") == "user":
            completion["choices"][0]["message"] = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{len(self.requests)}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            }
            completion["choices"][0]["finish_reason"] = "tool_calls"
        elif last.get("role") == "tool":
            completion["choices"][0]["message"]["content"] = f"The tool said: {last.get('content')}"
        return completion

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        with self._lock:
            self.requests.append(copy.deepcopy(body))
        if self.mode == "error503_once":
            self.mode = "normal"
            return Response(b'{"error": {"message": "warming up", "type": "server_error"}}', status_code=503)
        if self.mode == "error500":
            return Response(b'{"error": {"message": "boom", "type": "server_error"}}', status_code=500)
        if self.mode == "error429":
            return Response(
                b'{"error": {"message": "slow down", "type": "rate_limit_error"}}',
                status_code=429,
                headers={"retry-after": "7"},
            )
        if self.mode == "hang":
            await asyncio.sleep(self.hang_seconds)
        completion = self.completion(body)
        if not body.get("stream"):
            return Response(orjson.dumps(completion), media_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = chunks_from_completion(completion, include_usage=include_usage)

        async def events() -> Any:
            for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    def user_contents(self, index: int = -1) -> list[Any]:
        return [m.get("content") for m in self.requests[index]["messages"]]


@contextmanager
def mock_server() -> Iterator[MockServer]:
    server = MockServer()
    with running_in_thread(server.app()) as url:
        server.url = url
        yield server
