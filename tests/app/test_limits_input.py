"""Bounded input and output: JSON nesting at parse time, answer sizes while reading, and the
answer budget a client may ask for. Each refusal is a clear 4xx/5xx in OpenAI's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.exceptions import UpstreamProtocolError
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from gateway.upstream.openai import OpenAIUpstream
from tests.conftest import build_client, make_settings
from tests.helpers import serving_app


class Deep:
    """`depth` levels of objects, written out by hand: JSON encoders stop before 1000 levels."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def text(self) -> str:
        return '{"a":' * (self.depth - 1) + '"x"' + "}" * (self.depth - 1)


def nested(depth: int) -> Deep:
    return Deep(depth)


def body(template: dict[str, Any], deep: Deep) -> bytes:
    """`template` as JSON with its "DEEP" string replaced by the deep value."""
    return orjson.dumps(template).replace(b'"DEEP"', deep.text().encode())


@pytest.mark.parametrize("depth, status", [(60, 200), (65, 400), (300, 400), (1000, 400)])
async def test_json_nested_deeper_than_64_levels_is_a_400_everywhere(depth: int, status: int) -> None:
    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream()) as client:
        # the body object, messages, the message, content and the part are 5 levels
        part = {"type": "text", "text": "hi", "extra": "DEEP"}
        chat = {"model": "mock/m", "messages": [{"role": "user", "content": [part]}], "conversation_id": "c"}
        headers = {"content-type": "application/json"}
        r = await client.post("/v1/chat/completions", content=body(chat, nested(depth - 4)), headers=headers)
        assert r.status_code == status, r.text
        # the body object, items, the item, content and the part are 5 levels, as above
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi", "x": "DEEP"}],
        }
        conversation = {"metadata": {"k": "v"}, "items": [item]}
        r2 = await client.post(
            "/v1/conversations", content=body(conversation, nested(depth - 4)), headers=headers
        )
        assert r2.status_code == (200 if depth <= 64 else 400)
        if status == 200:  # what was stored can be read back
            rid = r.json()["id"]
            assert (await client.get(f"/v1/responses/{rid}")).status_code == 200
            assert (await client.get("/ui/api/conversations/c")).status_code == 200
    if status == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert store.indexes.get("c") is None  # nothing stored


@pytest.mark.parametrize("value", [-1, 0, "lots", 1.5, 1e40, True, 10**18])
async def test_max_tokens_must_be_a_sensible_integer(value: Any) -> None:
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        for key in ("max_tokens", "max_completion_tokens"):
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], key: value},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == key
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
        )
        assert r.status_code == 200
    assert len(upstream.requests) == 1  # the refused ones never reached the provider


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    }


@asynccontextmanager
async def huge_provider(size: int) -> AsyncIterator[str]:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(_completion("y" * size))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        piece = {
            "id": "x",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "y" * 4096}}],
        }
        line = b"data: " + orjson.dumps(piece) + b"\n\n"
        for _ in range(size // len(line) + 1):
            await response.write(line)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    async with serving_app(app) as url:
        yield f"{url}/v1"


async def test_a_provider_answer_over_max_response_bytes_is_refused_while_read() -> None:
    async with huge_provider(3_000_000) as url:
        settings = (
            make_settings()
            .providers["mock"]
            .model_copy(update={"base_url": url, "max_response_bytes": 1_000_000, "retries": 0})
        )
        upstream = OpenAIUpstream("big", settings)
        try:
            with pytest.raises(UpstreamProtocolError, match="larger than 1000000 bytes"):
                await upstream.complete({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            received = 0
            with pytest.raises(UpstreamProtocolError, match="max_response_bytes"):
                async for chunk in upstream.stream(
                    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
                ):
                    received += len(chunk["choices"][0]["delta"]["content"])
            assert 0 < received <= 1_000_000
            # Within the limit: answered as usual.
            small = upstream.max_response_bytes = 10_000_000
            assert small and (await upstream.complete({"model": "m", "messages": []}))["choices"]
        finally:
            await upstream.aclose()


async def test_a_too_large_answer_is_a_502_and_stores_nothing() -> None:
    async with huge_provider(3_000_000) as url:
        settings = make_settings().model_copy(
            update={
                "providers": {
                    "mock": make_settings()
                    .providers["mock"]
                    .model_copy(update={"base_url": url, "max_response_bytes": 1_000_000, "retries": 0})
                }
            }
        )
        store = MemoryStore()
        from gateway.app import create_app

        app = create_app(settings, store=store)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock/m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "conversation_id": "c",
                },
            )
        await app.state.services.aclose()
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_response"
        assert "c" not in store.indexes


async def test_readyz_follows_the_stores_write_health_and_recovers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from gateway import services as services_module
    from gateway.app import create_app
    from gateway.store.jsonl import JsonlStore

    monkeypatch.setattr(services_module, "PROBE_EVERY", 0.0)
    store = JsonlStore(tmp_path / "var")
    await store.open()
    app = create_app(make_settings(tmp_path), store=store, router=None)
    app.state.ready = True
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
        assert (await client.get("/readyz")).status_code == 200
        locks = tmp_path / "var" / "locks"
        shutil.rmtree(locks)
        locks.write_text("not a folder")  # the data dir can no longer be written there
        r = await client.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "storage_unavailable"
        assert "cannot be written" in r.json()["reason"]
        locks.unlink()
        locks.mkdir()
        assert (await client.get("/readyz")).status_code == 200  # recovered by itself
    await app.state.services.aclose()


async def test_creating_a_conversation_with_items_is_all_or_nothing() -> None:
    from gateway.exceptions import StorageError
    from gateway.store.base import Appended

    class FailingItems(MemoryStore):
        def start(self, response_id: str, request: dict[str, Any]) -> Any:
            log = super().start(response_id, request)

            async def commit(conversation_id: str | None) -> Appended | None:
                raise StorageError("disk full")

            log.commit = commit  # type: ignore[method-assign]
            return log

    store = FailingItems()
    async with build_client(make_settings(), store, MockUpstream()) as client:
        items = [{"type": "message", "role": "user", "content": "hello"}]
        r = await client.post("/v1/conversations", json={"id": "half", "items": items})
        assert r.status_code == 503 and r.json()["error"]["code"] == "storage_unavailable"
        assert (await client.get("/v1/conversations/half")).status_code == 404  # not half made
        bad = await client.post("/v1/conversations", json={"id": "bad", "items": [{"type": "nonsense"}]})
        assert bad.status_code == 400
        assert (await client.get("/v1/conversations/bad")).status_code == 404  # refused before any write


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/chat/completions", "openai"), ("/v1/responses", "openai"), ("/v1/messages", "anthropic")],
)
async def test_a_compressed_request_body_is_a_415_that_says_so(path: str, shape: str) -> None:
    """A gzip body was a 400 "not valid JSON: ... surrogates not allowed", and a plain body
    labelled `br` was taken: the encoding is refused, by name."""
    import gzip

    body: dict[str, Any] = {
        "model": "mock/m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if path == "/v1/responses":
        body = {"model": "mock/m", "input": "hi"}
    raw = orjson.dumps(body)
    upstream = MockUpstream()
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        for encoding, data in (("gzip", gzip.compress(raw)), ("br", raw)):
            r = await client.post(path, content=data, headers={**headers, "content-encoding": encoding})
            assert r.status_code == 415, r.text
            error = r.json()["error"]
            assert f"Content-Encoding '{encoding}'" in error["message"]
            assert (
                r.json()["type"] == "error"
                if shape == "anthropic"
                else error["code"] == "unsupported_content_encoding"
            )
        assert (
            await client.post(path, content=raw, headers={**headers, "content-encoding": "identity"})
        ).is_success
    assert len(upstream.requests) == 1
