"""Stored chat completions over the logged turns (memory and JSONL stores, in process): what is
listed (chat completions only, committed, not deleted), filters, the messages of a request, the
metadata rules, and deletion."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.exceptions import UpstreamUnreachable
from gateway.types import as_list, as_object
from gateway.upstream.base import Body, completion_from_text
from gateway.upstream.demo import demo_reply
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

Client = httpx.AsyncClient


class Switch:
    """The mock provider's answers, failing while `down`."""

    def __init__(self) -> None:
        self.down = False

    def __call__(self, body: Body) -> object:
        if self.down:
            raise UpstreamUnreachable("the provider is down")
        return demo_reply([as_object(m) for m in as_list(body.get("messages"))])


@pytest.fixture
def switch() -> Switch:
    return Switch()


@pytest.fixture(params=["memory", "jsonl"])
async def client(request: pytest.FixtureRequest, tmp_path: Path, switch: Switch) -> AsyncIterator[Client]:
    settings = make_settings(tmp_path) if request.param == "jsonl" else make_settings()
    async with build_client(settings, None, MockUpstream(switch)) as c:
        yield c


async def chat(client: Client, text: str, **extra: Any) -> str:
    body = {"model": "mock/m", "messages": [{"role": "user", "content": text}], **extra}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def listed(client: Client, **params: str) -> list[str]:
    r = await client.get("/v1/chat/completions", params=params)
    assert r.status_code == 200, r.text
    return [c["id"] for c in r.json()["data"]]


async def test_only_completed_chat_completion_turns_are_listed(client: Client, switch: Switch) -> None:
    first = await chat(client, "my name is Ann", conversation_id="c1")
    response = (await client.post("/v1/responses", json={"model": "mock/m", "input": "hi"})).json()["id"]
    r = await client.post(
        "/v1/conversations/c1/items", json={"items": [{"type": "message", "role": "user", "content": "x"}]}
    )
    assert r.status_code == 200, r.text
    switch.down = True
    r = await client.post(
        "/v1/chat/completions", json={"model": "mock/m", "messages": [{"role": "user", "content": "?"}]}
    )
    failed = r.headers["x-response-id"]
    switch.down = False
    stateless = await chat(client, "no conversation")
    assert await listed(client) == [first, stateless]
    for other in (response, failed, "no-such-completion", "mock-m-000000000000"):
        r = await client.get(f"/v1/chat/completions/{other}")
        assert r.status_code == 404 and r.json()["error"]["param"] == "completion_id", r.text
        assert (await client.get(f"/v1/chat/completions/{other}/messages")).status_code == 404
        assert (await client.post(f"/v1/chat/completions/{other}", json={"metadata": {}})).status_code == 404
        assert (await client.delete(f"/v1/chat/completions/{other}")).status_code == 404
    got = (await client.get(f"/v1/chat/completions/{first}")).json()
    assert got["object"] == "chat.completion" and got["model"] == "mock/m" and got["conversation_id"] == "c1"
    assert got["choices"][0]["message"]["content"] == "Nice to meet you, Ann! (turn 1)"
    assert got["metadata"] == {} and got["usage"]["total_tokens"] > 0
    assert "conversation_id" not in (await client.get(f"/v1/chat/completions/{stateless}")).json()


async def test_pages_both_ways_and_filters_by_model_and_metadata(client: Client) -> None:
    ids = [
        await chat(client, "a", metadata={"team": "red", "run": "1"}),
        await chat(client, "b", model="mock/other"),
        await chat(client, "c", metadata={"team": "blue"}),
        await chat(client, "d", metadata={"team": "red", "run": "2"}),
    ]
    assert await listed(client) == ids
    assert await listed(client, order="desc") == ids[::-1]
    page = (await client.get("/v1/chat/completions", params={"limit": "2"})).json()
    assert [c["id"] for c in page["data"]] == ids[:2] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == (ids[0], ids[1])
    page = (await client.get("/v1/chat/completions", params={"limit": "2", "after": ids[1]})).json()
    assert [c["id"] for c in page["data"]] == ids[2:] and not page["has_more"]
    assert await listed(client, model="mock/other") == [ids[1]]
    assert await listed(client, **{"metadata[team]": "red"}) == [ids[0], ids[3]]
    assert await listed(client, **{"metadata[team]": "red", "metadata[run]": "2"}) == [ids[3]]
    assert await listed(client, **{"metadata[team]": "red", "order": "desc", "limit": "1"}) == [ids[3]]
    page = (await client.get("/v1/chat/completions", params={"metadata[team]": "red", "limit": "1"})).json()
    assert [c["id"] for c in page["data"]] == [ids[0]] and page["has_more"]
    assert await listed(client, **{"metadata[team]": "green"}) == []
    for query in ({"metadata": "team"}, {f"metadata[k{n}]": "v" for n in range(17)}):
        r = await client.get("/v1/chat/completions", params=query)
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    r = await client.get("/v1/chat/completions", params={"after": "mock-m-000000000000"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "after", r.text


async def test_metadata_is_set_whole_within_openais_limits(client: Client) -> None:
    rid = await chat(client, "hello", metadata={"team": "red"})
    r = await client.post(f"/v1/chat/completions/{rid}", json={"metadata": {"team": "blue", "x": "1"}})
    assert r.status_code == 200 and r.json()["metadata"] == {"team": "blue", "x": "1"}, r.text
    assert r.json()["id"] == rid and r.json()["object"] == "chat.completion"
    assert (await client.get(f"/v1/chat/completions/{rid}")).json()["metadata"] == {"team": "blue", "x": "1"}
    assert await listed(client, **{"metadata[team]": "red"}) == []
    assert await listed(client, **{"metadata[team]": "blue"}) == [rid]
    for bad in (
        {"metadata": {f"k{n}": "v" for n in range(17)}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k": 1}},
        {"metadata": "team"},
        {},
        [],
    ):
        r = await client.post(f"/v1/chat/completions/{rid}", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = {"metadata": {f"k{n}": "v" * 512 for n in range(15)} | {"k" * 64: ""}}
    assert (await client.post(f"/v1/chat/completions/{rid}", json=ok)).status_code == 200
    r = await client.post(f"/v1/chat/completions/{rid}", json={"metadata": None})
    assert r.status_code == 200 and r.json()["metadata"] == {}
    assert (await client.get(f"/v1/chat/completions/{rid}")).json()["metadata"] == {}


async def test_metadata_is_checked_on_create_as_on_update(client: Client) -> None:
    """A create kept 20 pairs, and dropped a pair whose value was not a string, with a 200."""
    listed_before = await listed(client)
    for bad in (
        {f"k{n}": "v" for n in range(17)},
        {"a": 1, "b": "x"},
        {"k" * 65: "v"},
        "team",
    ):
        body = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], "metadata": bad}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "metadata" or r.json()["error"]["param"].startswith("metadata")
    assert await listed(client) == listed_before  # nothing stored


async def test_the_messages_are_what_the_request_added(client: Client) -> None:
    """The system message when the request set the system prompt, then its new messages; a
    history the client resends is not repeated; parts are `content_parts`."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"type": "text", "text": "what is "}, {"type": "text", "text": "this?"}, image]
    system = {"role": "system", "content": "Be brief."}
    first = await chat(
        client, "my name is Ann", conversation_id="m1", messages=[system, {"role": "user", "content": parts}]
    )
    r = await client.get(f"/v1/chat/completions/{first}/messages")
    assert r.status_code == 200, r.text
    page = r.json()
    assert [(m["id"], m["role"], m["content"]) for m in page["data"]] == [
        (f"{first}-0", "system", "Be brief."),
        (f"{first}-1", "user", "what is this?"),
    ]
    assert page["data"][1]["content_parts"] == parts and page["data"][0]["content_parts"] is None
    assert (page["first_id"], page["last_id"], page["has_more"]) == (f"{first}-0", f"{first}-1", False)
    reply = (await client.get(f"/v1/chat/completions/{first}")).json()["choices"][0]["message"]
    resent = [system, {"role": "user", "content": parts}, reply, {"role": "user", "content": "and you?"}]
    second = await chat(client, "", conversation_id="m1", messages=resent)
    data = (await client.get(f"/v1/chat/completions/{second}/messages")).json()["data"]
    assert [(m["id"], m["role"], m["content"]) for m in data] == [(f"{second}-0", "user", "and you?")]
    # Pages of one message, both ways.
    r = await client.get(f"/v1/chat/completions/{first}/messages", params={"limit": "1", "order": "desc"})
    assert [m["id"] for m in r.json()["data"]] == [f"{first}-1"] and r.json()["has_more"]
    r = await client.get(
        f"/v1/chat/completions/{first}/messages", params={"limit": "1", "after": f"{first}-0"}
    )
    assert [m["id"] for m in r.json()["data"]] == [f"{first}-1"] and not r.json()["has_more"]
    r = await client.get(f"/v1/chat/completions/{first}/messages", params={"after": f"{first}-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"


async def test_a_deleted_completion_is_gone_from_the_list_and_the_history(client: Client) -> None:
    ids = [await chat(client, text, conversation_id="d1") for text in ("my name is Ann", "I like tea", "x")]
    r = await client.delete(f"/v1/chat/completions/{ids[0]}")
    assert r.json() == {"id": ids[0], "object": "chat.completion.deleted", "deleted": True}
    assert (await client.get(f"/v1/chat/completions/{ids[0]}")).status_code == 404
    assert (await client.delete(f"/v1/chat/completions/{ids[0]}")).status_code == 404
    assert await listed(client) == ids[1:]
    assert await listed(client, after=ids[0]) == ids[1:]  # a cursor deleted since keeps its place
    answer = (
        await client.get(
            f"/v1/chat/completions/{await chat(client, 'what is my name?', conversation_id='d1')}"
        )
    ).json()
    assert "Ann" not in answer["choices"][0]["message"]["content"]  # the turn left the history
    # The SDK's loop: list a page, delete each, list after the last one.
    after: str | None = None
    while True:
        page = (
            await client.get(
                "/v1/chat/completions", params={"limit": "1", **({"after": after} if after else {})}
            )
        ).json()
        for c in page["data"]:
            assert (await client.delete(f"/v1/chat/completions/{c['id']}")).status_code == 200
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert await listed(client) == []


@pytest.mark.parametrize("conversation", [{"conversation_id": "race"}, {}], ids=["conversation", "stateless"])
async def test_of_deletes_racing_one_deletes_and_the_others_are_404(
    client: Client, conversation: dict[str, str]
) -> None:
    """Several deletes of one turn at once were each told 200, and each wrote its own marker and
    tombstone: whether it was still there was asked before the lock."""
    ids = [await chat(client, text, **conversation) for text in ("one", "two")]
    completions = [client.delete(f"/v1/chat/completions/{ids[0]}") for _ in range(4)]
    responses = [client.delete(f"/v1/responses/{ids[1]}") for _ in range(4)]
    answers = await asyncio.gather(*completions, *responses)
    assert sorted(r.status_code for r in answers[:4]) == [200, 404, 404, 404]
    assert sorted(r.status_code for r in answers[4:]) == [200, 404, 404, 404]
    if conversation:
        index = (await client.get("/v1/conversations/race/items")).json()["data"]
        assert index == []


async def test_metadata_reaches_the_provider_only_with_store() -> None:
    """The tag went to the provider without `store: true`, which OpenAI refuses (400 "The
    'metadata' parameter is only allowed when 'store' is enabled"): the documented example
    failed on OpenAI's models. The gateway keeps it either way."""
    upstream = MockUpstream()
    async with build_client(make_settings(), None, upstream) as client:
        plain = await chat(client, "one", metadata={"run": "7"})
        stored = await chat(client, "two", metadata={"run": "7"}, store=True)
        assert await listed(client, **{"metadata[run]": "7"}) == [plain, stored]
    sent = [(body.get("metadata"), body.get("store")) for body in upstream.requests]
    assert sent == [(None, None), ({"run": "7"}, True)]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stored_completion_says_how_it_was_served(tmp_path: Path, stream: bool) -> None:
    """`system_fingerprint` and `service_tier` were dropped: retrieve and list said None where
    the create had said `fp_mock` and `default`."""

    def served(body: Body) -> object:
        completion = completion_from_text("m", "hello")
        return {**completion, "system_fingerprint": "fp_mock", "service_tier": "default"}

    async with build_client(make_settings(tmp_path), None, MockUpstream(served)) as client:
        body = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        made = await client.post("/v1/chat/completions", json=body)
        rid = made.headers["x-response-id"] if stream else made.json()["id"]
        got = (await client.get(f"/v1/chat/completions/{rid}")).json()
        page = (await client.get("/v1/chat/completions")).json()["data"]
    assert (got["system_fingerprint"], got["service_tier"]) == ("fp_mock", "default")
    assert (page[0]["system_fingerprint"], page[0]["service_tier"]) == ("fp_mock", "default")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_and_the_stored_completion_say_the_same_created(stream: bool) -> None:
    """The client got the provider's `created` (its clock, or a mock's 1700000000) and the
    stored completion the request's time: a completion that was two times at once."""

    def answer(body: Body) -> object:
        completion = completion_from_text("m", "hello")
        completion["created"] = 1_700_000_000
        return completion

    async with build_client(make_settings(), None, MockUpstream(answer)) as client:
        body = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], "store": True}
        if stream:
            r = await client.post("/v1/chat/completions", json={**body, "stream": True})
            chunks = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            rid, said = chunks[0]["id"], {c["created"] for c in chunks}
        else:
            answered = (await client.post("/v1/chat/completions", json=body)).json()
            rid, said = answered["id"], {answered["created"]}
        stored = (await client.get(f"/v1/chat/completions/{rid}")).json()
    assert said == {stored["created"]} and stored["created"] > 1_700_000_000
