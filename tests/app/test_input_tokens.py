"""Counting before sending: `POST /v1/responses/input_tokens` counts the window the next turn
sends (the same planning), and `truncation: "disabled"` refuses a window that would cut."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from gateway.store.memory import MemoryStore
from gateway.upstream.base import approx_tokens, completion_from_text
from gateway.upstream.demo import demo_reply
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings

TOOLS = [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}]
LONG = "Tell me about the weather in the mountains and by the sea, in some detail. " * 6


def small_window(tokens: int = 600, **context: Any) -> Settings:
    settings = make_settings()
    update = {"max_context_tokens": tokens, "reserve_tokens": 100, **context}
    return settings.model_copy(update={"context": settings.context.model_copy(update=update)})


async def count(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/responses/input_tokens", json={"model": "mock/m", **body})


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/responses", json={"model": "mock/m", **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def context_of(client: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    return dict((await client.get(f"/v1/responses/{rid}")).json()["gateway"]["context"])


async def test_the_count_is_the_next_turns_window_nothing_stored_or_sent() -> None:
    upstream, store = MockUpstream(), MemoryStore()
    async with build_client(small_window(), store, upstream) as client:
        first = await create(client, input="Hi, I am Bob.", instructions="Be brief.")
        cid = first["conversation"]["id"]
        previous = first["id"]
        for n in range(12):  # past the window: the next turns cut, and the count with them
            kwargs: dict[str, Any] = {"input": f"{n}: {LONG}", "tools": TOOLS, "max_output_tokens": 50}
            before = (len(upstream.requests), {k: list(v) for k, v in store.indexes.items()})
            r = await count(client, **kwargs, previous_response_id=previous)
            assert r.status_code == 200, r.text
            counted = r.json()
            assert counted["object"] == "response.input_tokens"
            assert (len(upstream.requests), store.indexes) == before  # nothing sent, nothing stored
            turn = await create(client, **kwargs, previous_response_id=previous)
            context = await context_of(client, turn["id"])
            assert counted["input_tokens"] == context["tokens"]["total"], (n, counted, context["tokens"])
            assert counted["gateway"]["tokens"] == context["tokens"]
            assert counted["gateway"]["truncated"] == context["truncated"]
            assert counted["gateway"]["counted_by"] == "gateway"  # (the mock counts as the gateway does)
            previous = turn["id"]
        assert context["truncated"] > 0 and context["tokens"]["tools"] > 0
        # Named by `conversation`, and without input: the conversation as it stands.
        r = await count(client, conversation=cid, input="And now?")
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        alone = await count(client, conversation=cid)
        assert alone.status_code == 200 and 0 < alone.json()["input_tokens"] < r.json()["input_tokens"]
        # A new conversation: the input and instructions alone.
        fresh = await count(client, input="Hello", instructions="Be brief.")
        assert fresh.status_code == 200 and fresh.json()["gateway"]["sent_messages"] == 2
        assert set(store.indexes) == {cid}  # no conversation made for a count


async def test_a_count_on_an_earlier_response_is_the_branch_a_turn_would_make() -> None:
    upstream, store = MockUpstream(), MemoryStore()
    async with build_client(small_window(4000), store, upstream) as client:
        ids = []
        previous = None
        for text in ["one", "two", "three"]:
            turn = await create(client, input=text, previous_response_id=previous)
            ids.append(previous := turn["id"])
        conversations = set(store.indexes)
        counted = (await count(client, input="again", previous_response_id=ids[0])).json()
        assert set(store.indexes) == conversations  # the branch is not made by a count
        assert counted["gateway"]["sent_messages"] == 3  # one, its answer, again
        turn = await create(client, input="again", previous_response_id=ids[0])
        assert counted["input_tokens"] == (await context_of(client, turn["id"]))["tokens"]["total"]
        assert set(store.indexes) > conversations  # the turn made it


async def test_with_calibration_the_count_maps_to_the_providers_units() -> None:
    def answer(body: dict[str, Any]) -> dict[str, Any]:  # a provider counting ~2x the gateway's
        prompt = 2 * approx_tokens(body["messages"]) + 20
        return completion_from_text("m", demo_reply(body["messages"]), prompt_tokens=prompt)

    upstream = MockUpstream(answer)
    upstream.reports_real_usage = True
    async with build_client(small_window(8000), MemoryStore(), upstream) as client:
        previous = None
        for n in range(4):
            turn = await create(client, input=f"Message {n}: {LONG}", previous_response_id=previous)
            previous = turn["id"]
        state = app_of(client).state
        calibration = state.services.facts.calibration(state.router.resolve("mock/m"))
        assert calibration.samples == 4
        counted = (await count(client, input="How is it now?", previous_response_id=previous)).json()
        assert counted["gateway"]["counted_by"] == "calibration"
        turn = await create(client, input="How is it now?", previous_response_id=previous)
        total = (await context_of(client, turn["id"]))["tokens"]["total"]
        assert counted["input_tokens"] == replace(calibration, margin=0).provider_tokens(total)
        assert counted["input_tokens"] > 1.5 * total


async def test_truncation_disabled_refuses_a_window_that_would_cut_and_stores_nothing() -> None:
    upstream, store = MockUpstream(), MemoryStore()
    async with build_client(small_window(), store, upstream) as client:
        turn = await create(client, input="Hi", truncation="disabled")
        previous, cid = turn["id"], turn["conversation"]["id"]
        for n in range(12):  # under the window, disabled works as auto; until it no longer fits
            body = {"model": "mock/m", "input": f"{n}: {LONG}", "previous_response_id": previous}
            r = await client.post("/v1/responses", json={**body, "truncation": "disabled"})
            if r.status_code == 400:
                break
            assert r.json()["truncation"] == "disabled"
            assert (await context_of(client, r.json()["id"]))["truncated"] == 0
            previous = r.json()["id"]
        else:
            pytest.fail("the conversation never outgrew the window")
        assert n >= 2
        first_turns, sent = len(store.indexes[cid]), len(upstream.requests)
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
        assert error["param"] == "input"
        assert error["message"].startswith(
            "Your input exceeds the context window of this model. Please adjust your input and try again."
        )
        assert (len(store.indexes[cid]), len(upstream.requests)) == (first_turns, sent)  # nothing at all
        assert len(store.responses) == first_turns  # no response log either
        del body["model"]
        counted = await count(client, **body, truncation="disabled")
        assert counted.status_code == 400 and counted.json()["error"]["code"] == "context_length_exceeded"
        # The same turn with auto (the default) is fitted, and goes through.
        assert (await count(client, **body)).status_code == 200
        auto = await create(client, **body)
        assert auto["truncation"] == "auto" and (await context_of(client, auto["id"]))["truncated"] > 0
        # From an earlier response (its branch would be cut too): refused without making the branch.
        conversations = set(store.indexes)
        r = await client.post("/v1/responses", json={"model": "mock/m", **body, "truncation": "disabled"})
        assert r.status_code == 400 and set(store.indexes) == conversations


async def test_truncation_disabled_refuses_a_summary_in_place_of_messages() -> None:
    def model(body: dict[str, Any]) -> str:
        if str(body["messages"][0].get("content", "")).startswith("You maintain the running summary"):
            return "Bob talked about the weather."
        return "ok"

    settings = small_window(700, strategy="summarize", summary_max_tokens=60)
    async with build_client(settings, MemoryStore(), MockUpstream(model)) as client:
        previous = None
        summarized = None
        for n in range(30):
            turn = await create(client, input=f"{n}: {LONG}", previous_response_id=previous)
            previous = turn["id"]
            context = await context_of(client, previous)
            if context["summary_version"] and not context["truncated"]:
                summarized = previous
                break
            await app_of(client).state.summarizer.wait_idle()
        assert summarized is not None, "no summary entered the window"
        r = await count(client, input="next", previous_response_id=summarized, truncation="disabled")
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_an_expired_conversation_is_counted_as_the_fresh_one_it_becomes_and_kept() -> None:
    settings = make_settings()
    settings = settings.model_copy(update={"sessions": settings.sessions.model_copy(update={"ttl": 60.0})})
    store = MemoryStore()
    async with build_client(settings, store, MockUpstream()) as client:
        turn = await create(client, input=LONG, instructions="Be brief.")
        fresh = (await count(client, input="Hi")).json()["input_tokens"]  # no history, no system prompt
        continued = await count(client, input="Hi", previous_response_id=turn["id"])
        assert continued.json()["input_tokens"] > fresh
        app_of(client).state.service.clock = lambda: time.time() + 61
        expired = await count(client, input="Hi", previous_response_id=turn["id"])
        assert expired.json()["input_tokens"] == fresh
        assert store.indexes[turn["conversation"]["id"]] == [turn["id"]]  # a count archives nothing


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
@pytest.mark.parametrize("value", ["none", "AUTO", "", 1, True, ["auto"], {"type": "auto"}])
async def test_any_other_truncation_is_a_400_naming_it(path: str, value: object) -> None:
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post(path, json={"model": "mock/m", "input": "hi", "truncation": value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "truncation"
        assert "'truncation' must be 'auto' or 'disabled'" in r.json()["error"]["message"]
        assert upstream.requests == []


async def test_bad_counts_are_400_or_404() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        assert (await count(client)).json()["error"]["param"] == "input"  # nothing to count
        r = await client.post("/v1/responses/input_tokens", json={"input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        r = await count(client, input="hi", conversation="nobody-has-it")
        assert r.status_code == 404 and r.json()["error"]["param"] == "conversation"
        r = await count(client, input="hi", previous_response_id="mock-m-000000000000")
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        r = await count(client, input="hi", conversation="c", previous_response_id="mock-m-000000000000")
        assert r.status_code == 400
