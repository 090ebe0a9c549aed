"""Prompt-cache hints, as each provider receives them over HTTP: OpenAI's `prompt_cache_key`,
llama.cpp's `cache_prompt` and `id_slot`, Anthropic's `cache_control` breakpoints (through
litellm); and the pure rules that place them."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.config import ProviderSettings, Settings
from gateway.store.memory import MemoryStore
from gateway.upstream.base import chunks_from_completion, completion_from_text
from gateway.upstream.cache_hints import (
    CACHE_KEY,
    SlotTable,
    cache_key,
    count_breakpoints,
    takes_prompt_cache_key,
    with_cache_breakpoints,
)
from gateway.upstream.discovery import slots_from_llamacpp_props
from gateway.upstream.openai import OpenAIUpstream
from tests.conftest import build_client, make_settings
from tests.helpers import serving_app
from tests.mockserver import MockServer

KEYS_ENV = "CACHE_HINTS_TEST_KEYS"
EPHEMERAL = {"type": "ephemeral"}


def _settings(auth: bool = False) -> Settings:
    settings = make_settings()
    if auth:
        settings = settings.model_copy(
            update={"auth": settings.auth.model_copy(update={"keys_env": KEYS_ENV})}
        )
    return settings


@asynccontextmanager
async def _gateway(base_url: str, *, auth: bool = False, **provider: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process gateway whose provider "mock" is the fast path to `base_url`."""
    settings = ProviderSettings(kind="openai", base_url=base_url, timeout=10, **provider)
    upstream = OpenAIUpstream("mock", settings)
    try:
        async with build_client(_settings(auth), MemoryStore(), upstream) as client:  # type: ignore[arg-type]
            yield client
    finally:
        await upstream.aclose()


async def _say(
    client: httpx.AsyncClient, text: str, cid: str | None, key: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "mock/m", "messages": [{"role": "user", "content": text}], **extra}
    if cid is not None:
        body["conversation_id"] = cid
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        return {}
    answer: dict[str, Any] = r.json()
    return answer


# -- OpenAI-compatible servers: prompt_cache_key -----------------------------------------------


@pytest.fixture
def as_openai(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mock server taken for OpenAI's own API, the one provider sent `prompt_cache_key`."""
    monkeypatch.setattr("gateway.upstream.openai.takes_prompt_cache_key", lambda url: True)


def test_only_openais_own_api_takes_prompt_cache_key() -> None:
    assert takes_prompt_cache_key("https://api.openai.com/v1")
    assert takes_prompt_cache_key("https://API.OpenAI.com/v1?x=1")
    for url in (
        "https://api.groq.com/openai/v1",
        "http://127.0.0.1:11434/v1",
        "https://x.openai.azure.com/openai",
    ):
        assert not takes_prompt_cache_key(url)


async def test_a_compatible_server_is_not_sent_prompt_cache_key(upstream: MockServer) -> None:
    """It went to every OpenAI-compatible server: Groq, Cerebras and some Azure deployments refuse
    a field they do not know, and every turn of a conversation was a 400 the client never caused."""
    async with _gateway(f"{upstream.url}/v1") as client:
        await _say(client, "hi", "c")
        await _say(client, "again", "c", stream=True)
    assert len(upstream.requests) == 2
    assert all("prompt_cache_key" not in body and CACHE_KEY not in body for body in upstream.requests)


@pytest.mark.usefixtures("as_openai")
async def test_prompt_cache_key_names_the_conversation_and_tenant(
    upstream: MockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEYS_ENV, "key-one,key-two")
    async with _gateway(f"{upstream.url}/v1", auth=True) as client:
        await _say(client, "my name is Kim", "a", "key-one")
        await _say(client, "what is my name?", "a", "key-one", stream=True)
        await _say(client, "hello", "b", "key-one")
        await _say(client, "hello", "a", "key-two")  # the same id under another key
        await _say(client, "stateless", None, "key-one")
    first, second, other, other_tenant, stateless = (
        body.get("prompt_cache_key") for body in upstream.requests
    )
    assert isinstance(first, str) and len(first) == 32
    assert second == first  # stable across the conversation's turns (streamed or not)
    assert other != first and other_tenant != first and other_tenant != other
    assert stateless is None and "prompt_cache_key" not in upstream.requests[-1]
    for body in upstream.requests:  # the gateway's own field never reaches the provider
        assert CACHE_KEY not in body and "conversation_id" not in body
        assert "key-one" not in json.dumps(body) and "key-two" not in json.dumps(body)


async def test_the_clients_own_prompt_cache_key_is_kept(upstream: MockServer) -> None:
    async with _gateway(f"{upstream.url}/v1") as client:
        await _say(client, "hi", "c", prompt_cache_key="mine")
    assert upstream.requests[-1]["prompt_cache_key"] == "mine"


@pytest.mark.usefixtures("as_openai")
async def test_no_prompt_cache_key_when_the_provider_is_told_not_to(upstream: MockServer) -> None:
    async with _gateway(f"{upstream.url}/v1", cache_hints=False) as client:
        await _say(client, "hi", "c")
        await _say(client, "again", "c")
    assert upstream.requests and all("prompt_cache_key" not in body for body in upstream.requests)
    assert all(CACHE_KEY not in body for body in upstream.requests)


def test_cache_key_is_a_hash_of_tenant_and_conversation() -> None:
    key = cache_key("t0123456789abcdef", "conv-1")
    assert key == cache_key("t0123456789abcdef", "conv-1") and key is not None
    assert "conv-1" not in key and "t0123456789abcdef" not in key
    assert key != cache_key("t0123456789abcdef", "conv-2") != cache_key("", "conv-1")
    # The separator keeps ("ab", "c") and ("a", "bc") apart.
    assert cache_key("ab", "c") != cache_key("a", "bc")
    assert cache_key("t", None) is None


# -- llama.cpp: cache_prompt and one slot per conversation ---------------------------------------


def _llamacpp_app(received: list[dict[str, Any]], slots: int) -> web.Application:
    """llama-server as the gateway sees it: GET /props (window and slots) and chat completions."""
    props = {"default_generation_settings": {"n_ctx": 4096}, "total_slots": slots, "model_path": "x.gguf"}

    async def get_props(request: web.Request) -> web.Response:
        return web.json_response(props)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
        completion = completion_from_text(body["model"], f"slot {body.get('id_slot')}", prompt_tokens=20)
        if not body.get("stream"):
            return web.json_response(completion)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks_from_completion(completion, include_usage=False):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/props", get_props)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_llamacpp_gets_cache_prompt_and_a_slot_per_conversation() -> None:
    received: list[dict[str, Any]] = []
    async with serving_app(_llamacpp_app(received, slots=2)) as url, _gateway(f"{url}/v1") as client:
        for turn in range(3):  # two conversations taking turns
            await _say(client, f"A says {turn}", "conv-a")
            await _say(client, f"B says {turn}", "conv-b", stream=turn == 1)
        await _say(client, "no conversation", None)
    *turns, stateless = received
    assert all(body["cache_prompt"] is True for body in received)
    slots_a = {body["id_slot"] for body in turns[0::2]}
    slots_b = {body["id_slot"] for body in turns[1::2]}
    assert len(slots_a) == 1 and len(slots_b) == 1 and slots_a != slots_b  # never evicting each other
    assert slots_a | slots_b == {0, 1}
    assert "id_slot" not in stateless  # (as the background summarizer's requests)
    for body in received:  # llama.cpp gets its own hints, not OpenAI's
        assert "prompt_cache_key" not in body and CACHE_KEY not in body


async def test_llamacpp_the_clients_own_slot_and_cache_prompt_win() -> None:
    received: list[dict[str, Any]] = []
    async with serving_app(_llamacpp_app(received, slots=2)) as url, _gateway(f"{url}/v1") as client:
        await _say(client, "mine", "conv-a", id_slot=1, cache_prompt=False)
    assert received[-1]["id_slot"] == 1 and received[-1]["cache_prompt"] is False


async def test_llamacpp_of_one_slot_gets_cache_prompt_and_no_id_slot() -> None:
    received: list[dict[str, Any]] = []
    async with serving_app(_llamacpp_app(received, slots=1)) as url, _gateway(f"{url}/v1") as client:
        await _say(client, "hi", "conv-a")
    assert received[-1]["cache_prompt"] is True and "id_slot" not in received[-1]


async def test_llamacpp_gets_no_hints_when_the_provider_is_told_not_to() -> None:
    received: list[dict[str, Any]] = []
    async with serving_app(_llamacpp_app(received, slots=2)) as url:
        async with _gateway(f"{url}/v1", cache_hints=False) as client:
            await _say(client, "hi", "conv-a")
    (body,) = received
    assert not {"cache_prompt", "id_slot", "prompt_cache_key", CACHE_KEY} & set(body)


def test_llamacpp_props_give_the_slot_count() -> None:
    assert slots_from_llamacpp_props({"default_generation_settings": {"n_ctx": 512}, "total_slots": 4}) == 4
    for junk in (None, [], {"total_slots": "4"}, {"total_slots": True}, {"total_slots": 0}, {}):
        assert slots_from_llamacpp_props(junk) == 0


def test_slot_table_gives_a_new_conversation_the_least_recently_used_slot() -> None:
    table = SlotTable(2)
    assert [table.slot_for(c) for c in ("a", "b", "a", "b", "a")] == [0, 1, 0, 1, 0]
    assert table.slot_for("c") == 1  # b's slot was used least recently
    assert table.slot_for("a") == 0  # a keeps its own
    assert table.slot_for("b") == 1  # b lost its slot to c; c's is now the least recently used
    assert table.slot_for("c") == 0


# -- Anthropic through litellm: cache_control breakpoints -----------------------------------------


def _blocks_marked(message: dict[str, Any]) -> list[int]:
    content = message.get("content")
    return [i for i, b in enumerate(content) if b.get("cache_control")] if isinstance(content, list) else []


def test_breakpoints_end_the_stable_head_and_the_last_message() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Summary: Kim likes tea."},
        {"role": "system", "content": "[3 earlier messages omitted]"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
    ]
    before = copy.deepcopy(messages)
    out = with_cache_breakpoints(messages)
    assert messages == before  # the stored messages are not touched
    assert out[2] == {
        "role": "system",
        "content": [{"type": "text", "text": "[3 earlier messages omitted]", "cache_control": EPHEMERAL}],
    }
    assert out[5]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "x"},
        "cache_control": EPHEMERAL,
    }
    assert out[5]["content"][0] == {"type": "text", "text": "look"}
    assert [i for i, m in enumerate(out) if m != messages[i]] == [2, 5]
    assert count_breakpoints(out) == 2


def test_breakpoints_count_the_clients_own_within_four() -> None:
    def mine(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": EPHEMERAL}]}

    system = {"role": "system", "content": "S"}
    # Three of the client's: room for one, the last message's.
    three = [
        system,
        mine("1"),
        mine("2"),
        {"role": "assistant", "content": "x"},
        mine("3"),
        {"role": "user", "content": "q"},
    ]
    out = with_cache_breakpoints(three)
    assert count_breakpoints(out) == 4 and _blocks_marked(out[-1]) == [0] and out[0] == system
    # A tool's breakpoint counts as well: none left.
    tools = [{"type": "function", "function": {"name": "f"}, "cache_control": EPHEMERAL}]
    assert with_cache_breakpoints(three, tools) == three
    # The client's own on the last message is kept, not doubled nor moved back.
    out = with_cache_breakpoints([system, {"role": "user", "content": "a"}, mine("b")])
    assert (
        count_breakpoints(out) == 2
        and out[1] == {"role": "user", "content": "a"}
        and _blocks_marked(out[0]) == [0]
    )


def test_the_clients_breakpoints_that_come_back_with_the_history_stay_within_four() -> None:
    """A client marking its newest message each turn had every mark stored and replayed: five
    on the fifth turn, which Anthropic refuses, and every turn after it."""

    def mine(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": EPHEMERAL}]}

    history: list[dict[str, Any]] = [{"role": "system", "content": "S"}]
    for turn in range(6):
        history += [mine(f"q{turn}"), {"role": "assistant", "content": f"a{turn}"}]
    history.append(mine("now"))
    before = copy.deepcopy(history)
    out = with_cache_breakpoints(history)
    assert history == before  # (copies)
    assert count_breakpoints(out) == 4
    marked = [i for i, m in enumerate(out) if _blocks_marked(m)]
    assert marked == [i for i, m in enumerate(history) if _blocks_marked(m)][-4:]  # the newest four
    tools = [{"type": "function", "function": {"name": "f"}, "cache_control": EPHEMERAL}]
    assert count_breakpoints(with_cache_breakpoints(history, tools), tools) == 4


def test_breakpoints_skip_messages_that_cannot_end_with_one() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "use the tool"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    out = with_cache_breakpoints(messages)  # no system head; the bare tool call cannot hold one
    assert _blocks_marked(out[0]) == [0] and out[1] == messages[1]
    empty_last = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}]
    assert with_cache_breakpoints(empty_last) == empty_last
    tool_result = [{"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert with_cache_breakpoints(tool_result)[0]["content"] == [
        {"type": "text", "text": "42", "cache_control": EPHEMERAL}
    ]


def _anthropic_app(received: list[dict[str, Any]]) -> web.Application:
    async def messages(request: web.Request) -> web.Response:
        received.append(await request.json())
        answer = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [{"type": "text", "text": f"answer {len(received)}"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 30, "output_tokens": 3},
        }
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    return app


def _marks(value: object) -> int:
    """The `cache_control` entries anywhere in an Anthropic request body."""
    if isinstance(value, dict):
        return ("cache_control" in value) + sum(_marks(v) for v in value.values())
    if isinstance(value, list):
        return sum(_marks(v) for v in value)
    return 0


async def test_anthropic_through_litellm_receives_breakpoints_for_a_conversation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.upstream.litellm import LitellmUpstream

    monkeypatch.setenv("CACHE_HINTS_ANTHROPIC_KEY", "sk-ant-test-0123456789")
    received: list[dict[str, Any]] = []
    store = MemoryStore()
    async with serving_app(_anthropic_app(received)) as url:

        def anthropic(**extra: Any) -> LitellmUpstream:
            settings = ProviderSettings(
                kind="litellm",
                litellm_provider="anthropic",
                base_url=url,
                api_key_env="CACHE_HINTS_ANTHROPIC_KEY",
                context_window=100_000,
                **extra,
            )
            return LitellmUpstream("mock", settings)

        system = {"role": "system", "content": "You are terse."}
        body = {"model": "mock/claude-x", "max_tokens": 16}

        async def ask(client: httpx.AsyncClient, text: str, **extra: Any) -> None:
            messages = [system, {"role": "user", "content": text}]
            r = await client.post("/v1/chat/completions", json={**body, "messages": messages, **extra})
            assert r.status_code == 200, r.text

        async with build_client(make_settings(), store, anthropic()) as client:  # type: ignore[arg-type]
            await ask(client, "hello", conversation_id="cv")
            await ask(client, "and again", conversation_id="cv")
            await ask(client, "no conversation")
        async with build_client(make_settings(), MemoryStore(), anthropic(cache_hints=False)) as client:  # type: ignore[arg-type]
            await ask(client, "hints off", conversation_id="cv")
    first, second, stateless, off = received
    for sent in (first, second):
        assert sent["system"][-1] == {"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}
        assert sent["messages"][-1]["content"][-1]["cache_control"] == EPHEMERAL
        assert _marks(sent) == 2
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert _marks(stateless) == 0 and _marks(off) == 0
    # The conversation as stored carries no breakpoint (the sent copies had them).
    assert "cache_control" not in json.dumps(store.responses)
