"""A real HTTP, OpenAI-compatible mock upstream for end-to-end tests.

It records every request body, answers with the demo model's logic (so recall is visible),
rejects what OpenAI rejects (an argument or a message field it does not know: 400
"Unrecognized request argument supplied"), lists its models at `/v1/models`, and can be told
to misbehave: `server.mode = "error500" | "error503_once" | "error429" | "hang"
| "stall" | "tool_call"` ("stall": a whole answer hangs; a stream sends its first chunk, then hangs).
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

# What OpenAI's chat completions accept; anything else is a 400, as OpenAI answers it.
KNOWN_ARGUMENTS = frozenset(
    {
        "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
        "logprobs", "top_logprobs", "user", "tools", "tool_choice", "parallel_tool_calls",
        "response_format", "seed", "metadata", "store", "reasoning_effort", "modalities", "audio",
        "prediction", "service_tier", "web_search_options", "functions", "function_call",
        "prompt_cache_key",
    }
)  # fmt: skip
KNOWN_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "function_call", "audio"}
)
MODELS = ["tiny", "m", "big"]


def unknown_fields(body: dict[str, Any]) -> list[str]:
    unknown = [k for k in body if k not in KNOWN_ARGUMENTS]
    for i, message in enumerate(body.get("messages") or []):
        unknown += [f"messages[{i}].{k}" for k in message if k not in KNOWN_MESSAGE_FIELDS]
    return unknown


class MockServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, lower-case names
        self.mode = "normal"
        self.hang_seconds = 30.0
        self.url = ""
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.headers.clear()
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
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        unknown = unknown_fields(body)
        if unknown:
            message = f"Unrecognized request argument supplied: {', '.join(unknown)}"
            error = {
                "error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}
            }
            return Response(orjson.dumps(error), status_code=400, media_type="application/json")
        if self.mode == "error503_once":
            self.mode = "normal"
            return Response(b'{"error": {"message": "warming up", "type": "server_error"}}', status_code=503)
        if self.mode == "echo_key":  # as some servers do: the key it was sent, quoted back
            sent = request.headers.get("authorization", "")
            message = f"Incorrect API key provided: {sent}"
            error = {
                "error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}
            }
            status = 500 if "[500]" in str(body.get("messages")) else 401
            return Response(orjson.dumps(error), status_code=status, media_type="application/json")
        if self.mode == "error500":
            return Response(b'{"error": {"message": "boom", "type": "server_error"}}', status_code=500)
        if self.mode == "error429":
            return Response(
                b'{"error": {"message": "slow down", "type": "rate_limit_error"}}',
                status_code=429,
                headers={"retry-after": "7"},
            )
        if self.mode == "error_in_200":  # (a provider's error said in a 200, streamed or not)
            return Response(
                b'{"error": {"message": "model overloaded, try later"}}', media_type="application/json"
            )
        if self.mode == "detail_in_200":  # (a web framework's error object, in a 200)
            return Response(b'{"detail": "model is still loading"}', media_type="application/json")
        if self.mode == "hang" or (self.mode == "stall" and not body.get("stream")):
            await asyncio.sleep(self.hang_seconds)
        completion = self.completion(body)
        if not body.get("stream") or self.mode == "no_stream":  # (a server that does not stream)
            return Response(orjson.dumps(completion), media_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = chunks_from_completion(completion, include_usage=include_usage)

        async def events() -> Any:
            for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if self.mode == "stall":
                    await asyncio.sleep(self.hang_seconds)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "mock"} for m in MODELS]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    def user_contents(self, index: int = -1) -> list[Any]:
        return [m.get("content") for m in self.requests[index]["messages"]]


@contextmanager
def mock_server() -> Iterator[MockServer]:
    server = MockServer()
    with running_in_thread(server.app()) as url:
        server.url = url
        yield server
