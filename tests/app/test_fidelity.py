"""The gateway as a drop-in for OpenAI's APIs, seen through the official SDK: what an answer
holds (a refusal, an audio answer, a legacy function call) is stored and replayed as it came,
and the Responses bridge streams, echoes and maps what OpenAI's does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI, NotFoundError
from pydantic import BaseModel

from gateway.exceptions import UpstreamUnreachable
from gateway.store.memory import MemoryStore
from gateway.upstream.base import completion_from_text
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

REFUSAL = "I'm sorry, I cannot help with that."


def answer(body: dict[str, Any]) -> Any:
    """By the newest user message: a refusal, an audio answer, a legacy call, no text, or text."""
    last = str(body["messages"][-1].get("content"))
    if "[refuse]" in last:
        return {"role": "assistant", "content": None, "refusal": REFUSAL}
    if "[audio]" in last:
        return {
            "role": "assistant",
            "content": None,
            "audio": {"id": "audio_1", "data": "UklG", "transcript": "hi"},
        }
    if "[legacy]" in last:
        return {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"q": 1}'}}
    if "[empty]" in last:
        return {"role": "assistant", "content": ""}
    if "[json]" in last:
        return '{"name": "Bob"}'
    completion = completion_from_text(str(body["model"]), f"said: {last}", prompt_tokens=11)
    completion["usage"]["prompt_tokens_details"] = {"cached_tokens": 3}
    completion["usage"]["completion_tokens_details"] = {"reasoning_tokens": 2}
    return completion


@pytest.fixture
async def upstream() -> MockUpstream:
    return MockUpstream(answer)


@pytest.fixture
async def sdk(upstream: MockUpstream) -> AsyncIterator[AsyncOpenAI]:
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        yield AsyncOpenAI(base_url=f"{client.base_url}/v1", api_key="x", http_client=client, max_retries=0)


@pytest.mark.parametrize("text", ["[empty]", "[refuse]"])
async def test_a_responses_stream_without_text_announces_what_it_finishes(
    sdk: AsyncOpenAI, text: str
) -> None:
    """The SDK's stream helper once raised "a content event for output index 0 before
    receiving its output item" on an empty answer or a refusal."""
    async with sdk.responses.stream(model="mock/m", input=text) as stream:
        types = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.status == "completed"
    if text == "[refuse]":
        assert [p.type for p in final.output[0].content] == ["refusal"]
        # (a reader that builds the refusal from deltas, as streaming UIs do, gets it too)
        at = types.index("response.refusal.delta")
        assert types[at + 1] == "response.refusal.done"


async def test_a_refusal_is_a_refusal_part_everywhere(sdk: AsyncOpenAI) -> None:
    await sdk.conversations.create(extra_body={"id": "ref"})
    created = await sdk.responses.create(model="mock/m", input="[refuse] do it", conversation="ref")
    retrieved = await sdk.responses.retrieve(created.id)
    items = await sdk.conversations.items.list("ref")
    for parts in (created.output[0].content, retrieved.output[0].content, items.data[0].content):
        assert [(p.type, getattr(p, "refusal", None)) for p in parts] == [("refusal", REFUSAL)]


async def test_retrieve_returns_what_create_returned(sdk: AsyncOpenAI) -> None:
    first = await sdk.responses.create(
        model="mock/m",
        input="Hi",
        instructions="Be brief.",
        metadata={"a": "b"},
        max_output_tokens=50,
        user="u1",
    )
    second = await sdk.responses.create(model="mock/m", input="Again", previous_response_id=first.id)
    for made in (first, second):
        got = (await sdk.responses.retrieve(made.id)).model_dump()
        assert {k: v for k, v in got.items() if k != "gateway"} == made.model_dump()
    assert second.previous_response_id == first.id and first.instructions == "Be brief."
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 3
    assert first.usage.output_tokens_details.reasoning_tokens == 2


async def test_text_format_reasoning_and_image_detail_reach_the_provider(
    sdk: AsyncOpenAI, upstream: MockUpstream
) -> None:
    class Person(BaseModel):
        name: str

    parsed = await sdk.responses.parse(model="mock/m", input="[json] who?", text_format=Person)
    assert parsed.output_parsed == Person(name="Bob")
    assert upstream.requests[-1]["response_format"]["json_schema"]["name"] == "Person"
    await sdk.responses.create(model="mock/m", input="think", reasoning={"effort": "high"})
    assert upstream.requests[-1]["reasoning_effort"] == "high"
    image = {"type": "input_image", "image_url": "https://x/y.png", "detail": "high"}
    await sdk.responses.create(model="mock/m", input=[{"role": "user", "content": [image]}])
    assert upstream.requests[-1]["messages"][-1]["content"][0]["image_url"] == {
        "url": "https://x/y.png",
        "detail": "high",
    }
    with pytest.raises(Exception) as refused:  # (a background response must be stored)
        await sdk.responses.create(model="mock/m", input="later", background=True, store=False)
    assert getattr(refused.value, "status_code", None) == 400
    with pytest.raises(NotFoundError) as unknown:
        await sdk.responses.create(model="mock/m", input="x", previous_response_id="resp_nope")
    assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_verbosity_allowed_tools_and_cache_fields_reach_the_provider_in_chat_shape(
    sdk: AsyncOpenAI, upstream: MockUpstream
) -> None:
    """`text` with a verbosity and no format is plain text (it was a 400 "'text.format' must
    be..."); an `allowed_tools` choice nests as chat completions nest it; the client's
    `prompt_cache_key` and `safety_identifier` are passed on, not replaced or dropped."""
    made = await sdk.responses.create(model="mock/m", input="hi", text={"verbosity": "low"})
    assert made.text is not None and made.text.verbosity == "low" and made.text.format.type == "text"
    assert upstream.requests[-1]["verbosity"] == "low" and "response_format" not in upstream.requests[-1]
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    made = await sdk.responses.create(
        model="mock/m",
        input="weather?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
        prompt_cache_key="mine",
        safety_identifier="user-7",
    )
    sent = upstream.requests[-1]
    assert sent["tool_choice"] == {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        },
    }
    assert sent["prompt_cache_key"] == "mine" and sent["safety_identifier"] == "user-7"
    for said in (made, await sdk.responses.retrieve(made.id)):  # (said back, as OpenAI's are)
        assert (said.prompt_cache_key, said.safety_identifier) == ("mine", "user-7")
    with pytest.raises(Exception) as refused:
        await sdk.responses.create(model="mock/m", input="hi", text={"verbosity": "loud"})  # type: ignore[typeddict-item]
    assert getattr(refused.value, "status_code", None) == 400


@pytest.mark.parametrize("stream", [False, True])
async def test_audio_answers_and_legacy_calls_are_replayed_as_they_came(
    sdk: AsyncOpenAI, upstream: MockUpstream, stream: bool
) -> None:
    for text in ("[audio] speak", "[legacy] call"):
        cid = f"{text[1:6]}-{stream}"
        extra = {"conversation_id": cid}
        made = await sdk.chat.completions.create(
            model="mock/m", messages=[{"role": "user", "content": text}], stream=stream, extra_body=extra
        )
        if stream:
            async for _ in made:  # type: ignore[union-attr]
                pass
        await sdk.chat.completions.create(
            model="mock/m", messages=[{"role": "user", "content": "and?"}], extra_body=extra
        )
        replayed = upstream.requests[-1]["messages"][1]
        if text.startswith("[audio]"):
            assert replayed["audio"] == {"id": "audio_1"}  # by its id, as OpenAI documents
        else:
            assert replayed["function_call"] == {"name": "f", "arguments": '{"q": 1}'}
    # A client resending the documented audio reference keeps it (it was swapped for the stored one)
    history = [
        {"role": "user", "content": "[audio] speak"},
        {"role": "assistant", "audio": {"id": "audio_1"}},
        {"role": "user", "content": "again"},
    ]
    await sdk.chat.completions.create(
        model="mock/m", messages=history, extra_body={"conversation_id": f"audio-{stream}"}
    )  # type: ignore[arg-type]
    assert upstream.requests[-1]["messages"][1]["audio"] == {"id": "audio_1"}


async def test_the_request_id_is_the_response_id(sdk: AsyncOpenAI) -> None:
    raw = await sdk.chat.completions.with_raw_response.create(
        model="mock/m", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.request_id == raw.parse().id == raw.headers["x-response-id"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_responses_turn_names_its_logged_attempt(stream: bool) -> None:
    """Chat completions and Messages answer a failure with `X-Response-Id` naming the response
    log that records the attempt; the Responses API answered with no id at all."""

    def down(body: dict[str, Any]) -> Any:
        raise UpstreamUnreachable("Provider 'mock' at http://mock.invalid/v1 is unreachable")

    async with build_client(make_settings(), MemoryStore(), MockUpstream(down)) as client:
        body = {"model": "mock/m", "input": "hi", "conversation_id": "down", "stream": stream}
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable", r.text
        rid = r.headers["x-response-id"]
        assert r.headers["x-conversation-id"] == "down" and r.headers["x-request-id"] == rid
        logged = await client.get(f"/v1/responses/{rid}")
    assert logged.status_code == 200 and logged.json()["status"] == "failed", logged.text
