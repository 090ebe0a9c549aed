"""Background responses (`background: true`): polled to completion, cancelled, and their event
stream resumed from any sequence number, byte for byte as the uncut stream."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.exceptions import UpstreamTimeout
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings


class Slow(MockUpstream):
    """A mock whose stream sends its chunks one at a time, released by the test (or at once)."""

    def __init__(self) -> None:
        super().__init__(lambda body: "one two three four five six seven eight nine ten eleven twelve")
        self.gate: asyncio.Event | None = None

    async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:  # type: ignore[override]
        completion = await self.complete(body)
        from gateway.upstream.base import chunks_from_completion

        text = completion["choices"][0]["message"]["content"]
        words = text.split(" ")
        chunks = chunks_from_completion(completion, include_usage=True)
        head, tail = chunks[0], chunks[1:]
        yield head
        for k, word in enumerate(words):
            if self.gate is not None:
                await self.gate.wait()
            yield {**head, "choices": [{"index": 0, "delta": {"content": ("" if k == 0 else " ") + word}}]}
        for chunk in tail:
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                continue
            yield chunk


def events(body: bytes) -> list[bytes]:
    return [frame + b"\n\n" for frame in body.split(b"\n\n") if frame]


async def poll(client: httpx.AsyncClient, rid: str, until: set[str]) -> dict[str, Any]:
    for _ in range(200):
        got = (await client.get(f"/v1/responses/{rid}")).json()
        if got["status"] in until:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(got)


async def test_a_background_response_is_polled_to_completed() -> None:
    async with build_client(make_settings(), None, Slow()) as client:
        r = await client.post("/v1/responses", json={"model": "mock/m", "input": "hi", "background": True})
        assert r.status_code == 200, r.text
        created = r.json()
        assert created["status"] == "queued" and created["background"] is True
        done = await poll(client, created["id"], {"completed"})
        assert done["output"][0]["content"][0]["text"].startswith("one two three")
        assert done["background"] is True


async def test_a_cancelled_background_response_frees_its_conversation() -> None:
    upstream = Slow()
    upstream.gate = asyncio.Event()  # never set: the answer hangs until cancelled
    async with build_client(make_settings(), None, upstream) as client:
        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        body = {"model": "mock/m", "input": "hi", "background": True, "conversation": conv}
        queued = (await client.post("/v1/responses", json=body)).json()
        rid = queued["id"]
        assert queued["usage"] is None  # (not known yet: it said zero tokens)
        cancelled = await client.post(f"/v1/responses/{rid}/cancel")  # (queued, maybe)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        polled = (await client.get(f"/v1/responses/{rid}")).json()
        assert polled["status"] == "cancelled"
        assert polled["error"] is None and cancelled.json()["error"] is None  # (OpenAI's: no error)
        upstream.gate = None
        after = {"model": "mock/m", "input": "again", "conversation": conv}
        r = await client.post("/v1/responses", json=after)
        assert r.status_code == 200 and r.json()["status"] == "completed"
        items = (await client.get(f"/v1/conversations/{conv}/items?order=asc")).json()["data"]
        texts = [part.get("text") for item in items for part in item.get("content", [])]
        assert "hi" not in texts and "again" in texts  # the cancelled turn added nothing


async def test_a_resumed_stream_gives_exactly_the_remaining_events() -> None:
    async with build_client(make_settings(), None, Slow()) as client:
        body = {"model": "mock/m", "input": "hi", "background": True, "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            whole = b"".join([chunk async for chunk in r.aiter_bytes()])
        frames = events(whole)
        assert len(frames) > 14 and b"response.completed" in frames[-1]
        rid = [line for line in whole.split(b"\n") if b'"response.created"' in line][0]
        rid = httpx.Response(200, content=rid.removeprefix(b"data: ")).json()["response"]["id"]
        resumed = await client.get(f"/v1/responses/{rid}?stream=true&starting_after=10")
        assert resumed.status_code == 200
        assert resumed.content == b"".join(frames[11:])  # sequence numbers 11 and on, as sent


async def test_a_stream_followed_while_it_runs_and_resumed_later() -> None:
    upstream = Slow()
    upstream.gate = asyncio.Event()
    async with build_client(make_settings(), None, upstream) as client:
        body = {"model": "mock/m", "input": "hi", "background": True}
        rid = (await client.post("/v1/responses", json=body)).json()["id"]
        await poll(client, rid, {"queued", "in_progress"})
        follow = asyncio.ensure_future(client.get(f"/v1/responses/{rid}?stream=true&starting_after=1"))
        await asyncio.sleep(0.05)
        upstream.gate.set()
        live = (await follow).content
        replay = (await client.get(f"/v1/responses/{rid}?stream=true")).content
        assert events(replay)[2:] == events(live) and b"response.completed" in live


async def test_background_limits_and_bad_values() -> None:
    settings = make_settings()
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"background_responses": 1})}
    )
    upstream = Slow()
    upstream.gate = asyncio.Event()
    async with build_client(settings, None, upstream) as client:
        first = await client.post("/v1/responses", json={"model": "mock/m", "input": "a", "background": True})
        assert first.status_code == 200
        second = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "b", "background": True}
        )
        assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_background_responses"
        bad = await client.post("/v1/responses", json={"model": "mock/m", "input": "b", "background": "yes"})
        assert bad.status_code == 400
        unstored = {"model": "mock/m", "input": "b", "background": True, "store": False}
        assert (await client.post("/v1/responses", json=unstored)).status_code == 400
        rid = first.json()["id"]
        assert (await client.get(f"/v1/responses/{rid}?stream=true&starting_after=x")).status_code == 400
        upstream.gate.set()
        await app_of(client).state.background.aclose()


async def test_a_background_response_cancelled_mid_answer_keeps_nothing() -> None:
    upstream = Slow()
    upstream.gate = asyncio.Event()
    async with build_client(make_settings(), None, upstream) as client:
        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        body = {"model": "mock/m", "input": "first", "background": True, "conversation": conv}
        rid = (await client.post("/v1/responses", json=body)).json()["id"]
        await asyncio.sleep(0.05)  # its task runs: the answer has begun
        assert (await client.get(f"/v1/responses/{rid}")).json()["status"] == "in_progress"
        assert (await client.post(f"/v1/responses/{rid}/cancel")).json()["status"] == "cancelled"
        again = await client.post(f"/v1/responses/{rid}/cancel")  # (a second cancel: as it is)
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        # Its followers see it end (they saw its last delta, then nothing).
        replay = (await client.get(f"/v1/responses/{rid}?stream=true")).content
        last = httpx.Response(200, content=events(replay)[-1].partition(b"\ndata: ")[2]).json()
        assert (last["type"], last["response"]["status"]) == ("response.incomplete", "cancelled")
        upstream.gate = None
        r = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "second", "conversation": conv}
        )
        assert r.status_code == 200
        items = (await client.get(f"/v1/conversations/{conv}/items?order=asc")).json()["data"]
        assert [p.get("text") for i in items for p in i.get("content", []) if i["role"] == "user"] == [
            "second"
        ]
        plain = (await client.post("/v1/responses", json={"model": "mock/m", "input": "x"})).json()["id"]
        refused = await client.post(f"/v1/responses/{plain}/cancel")
        assert refused.status_code == 400  # not a background response


def kinds(body: bytes) -> list[tuple[str, int]]:
    """(type, sequence_number) of each event of a stream's body."""
    found = []
    for frame in events(body):
        data = frame.partition(b"\ndata: ")[2]
        payload = httpx.Response(200, content=data).json()
        found.append((payload["type"], payload["sequence_number"]))
    return found


async def test_a_replay_rebuilt_from_the_log_ends_as_the_response_did() -> None:
    """Replayed where its own events were no longer kept (a restart, another worker), a failed
    response ended `response.completed`, and a client that had read further than the rebuilt
    events go (they have no deltas) got an empty stream, never learning it had ended."""
    store = MemoryStore()

    def fails(body: dict[str, Any]) -> str:
        raise UpstreamTimeout("Provider 'mock' did not answer within 5 s")

    async with build_client(make_settings(), store, Slow()) as client:
        body = {"model": "mock/m", "input": "hi", "background": True, "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            live = b"".join([chunk async for chunk in r.aiter_bytes()])
        done = httpx.Response(200, content=events(live)[-1].partition(b"\ndata: ")[2]).json()
        rid = done["response"]["id"]
        assert done["response"]["completed_at"] >= done["response"]["created_at"]
    async with build_client(make_settings(), store, MockUpstream(fails)) as client:
        failed = (await client.post("/v1/responses", json={**body, "stream": False})).json()["id"]
        await poll(client, failed, {"failed"})
        error = (await client.get(f"/v1/responses/{failed}")).json()["error"]
        assert set(error) == {"code", "message"}  # the Responses API's (chat's, with type and param)
    async with build_client(make_settings(), store, Slow()) as client:  # neither run kept here
        whole = (await client.get(f"/v1/responses/{rid}?stream=true")).content
        past = (await client.get(f"/v1/responses/{rid}?stream=true&starting_after=15")).content
        broken = (await client.get(f"/v1/responses/{failed}?stream=true")).content
        negative = await client.get(f"/v1/responses/{rid}?stream=true&starting_after=-1")
        # Past 64 bits: a 200 whose stream broke off (the last event's number could not be written)
        huge = await client.get(f"/v1/responses/{rid}?stream=true&starting_after={2**64 - 1}")
        odd = [await client.get(f"/v1/responses/{rid}?stream=true&starting_after={v}") for v in ("+5", "1_0")]
        got = (await client.get(f"/v1/responses/{rid}")).json()
    assert kinds(whole)[0] == ("response.created", 0) and kinds(whole)[-1][0] == "response.completed"
    assert len(kinds(whole)) < 10 and kinds(live)[-1][1] > 15  # fewer than the live stream had
    assert kinds(past) == [("response.completed", 16)]  # its end, after the client's place
    assert [kind for kind, _ in kinds(broken)][-2:] == ["error", "response.failed"]
    assert negative.status_code == huge.status_code == odd[0].status_code == odd[1].status_code == 400
    assert got["completed_at"] == done["response"]["completed_at"]


async def test_a_compaction_item_is_first_in_the_output_while_polled() -> None:
    """Queued, the response listed its compaction item; polled while in progress, not."""
    upstream = Slow()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        previous = None
        for text in ["Hi, my name is Bob.", "my city is Oslo", "I like trains a lot."]:
            body = {"model": "mock/m", "input": text, "previous_response_id": previous}
            previous = (await client.post("/v1/responses", json=body)).json()["id"]
        upstream.gate = asyncio.Event()
        manage = [{"type": "compaction", "compact_threshold": 60}]
        body = {"model": "mock/m", "input": "my dog is Rex", "previous_response_id": previous}
        queued = (
            await client.post(
                "/v1/responses", json={**body, "background": True, "context_management": manage}
            )
        ).json()
        polled = await poll(client, queued["id"], {"in_progress"})
        upstream.gate.set()
        done = await poll(client, queued["id"], {"completed"})
    assert [i["type"] for i in queued["output"]] == ["compaction"]
    assert [i["type"] for i in polled["output"]] == ["compaction"]
    assert [i["type"] for i in done["output"]] == ["compaction", "message"]


async def test_a_response_run_by_another_process_is_cancelled_and_followed_from_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another worker (or replica) answered a cancel with a 409 ("cancel it there") and a stream
    of it with a 409 ("stream it from there"): a client cannot choose its worker. A cancel is now
    asked through the store and the running process stops the response; a stream of it from
    elsewhere is its replay once it has ended."""
    from gateway.api import responses

    monkeypatch.setattr(responses, "KEEP_ALIVE", 0.05)  # (a follower elsewhere hears it is alive)
    store, upstream = MemoryStore(), Slow()
    upstream.gate = asyncio.Event()  # never set: the answer hangs until cancelled
    async with (
        build_client(make_settings(), store, upstream) as running,
        build_client(make_settings(), store, upstream) as other,
    ):
        body = {"model": "mock/m", "input": "hi", "background": True}
        rid = (await running.post("/v1/responses", json=body)).json()["id"]
        await poll(running, rid, {"in_progress"})
        assert (await other.get(f"/v1/responses/{rid}")).json()["status"] == "in_progress"
        follow = asyncio.ensure_future(other.get(f"/v1/responses/{rid}?stream=true&starting_after=1"))
        await asyncio.sleep(0.3)
        cancelled = await other.post(f"/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert (await running.get(f"/v1/responses/{rid}")).json()["status"] == "cancelled"
        followed = await follow
        assert followed.status_code == 200
        alive = b": running in another process\n\n"
        assert followed.content.startswith(alive)  # (an SSE comment, which clients skip)
        assert kinds(followed.content.replace(alive, b""))[-1][0] == "response.incomplete"


async def test_a_running_background_response_is_continued_once_it_ends() -> None:
    """`previous_response_id` naming a background response still running was a 404 "is not a
    completed response" (though a GET found it in progress), and `conversation` naming the
    conversation its first turn was making was a 404 "No conversation found". Both wait for it,
    as a turn on a busy conversation does."""
    upstream = Slow()
    upstream.gate = asyncio.Event()
    async with build_client(make_settings(), None, upstream) as client:
        first = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "hi", "background": True}
        )
        running = first.json()
        assert (await client.get(f"/v1/responses/{running['id']}")).json()["status"] in (
            "queued",
            "in_progress",
        )
        by_id = asyncio.ensure_future(
            client.post(
                "/v1/responses",
                json={"model": "mock/m", "input": "more", "previous_response_id": running["id"]},
            )
        )
        await asyncio.sleep(0.05)
        assert not by_id.done()
        upstream.gate.set()
        chained = await by_id
        named = {"model": "mock/m", "input": "again", "conversation": chained.json()["conversation"]["id"]}
        again = await client.post("/v1/responses", json=named)
    assert chained.status_code == 200, chained.text
    assert chained.json()["conversation"] == running["conversation"]
    assert again.status_code == 200, again.text
    sent = [[m["content"] for m in body["messages"] if m["role"] == "user"] for body in upstream.requests]
    assert sent == [["hi"], ["hi", "more"], ["hi", "more", "again"]]


async def test_a_conversation_whose_first_turn_runs_is_named_once_it_ends() -> None:
    upstream = Slow()
    upstream.gate = asyncio.Event()
    async with build_client(make_settings(), None, upstream) as client:
        body = {"model": "mock/m", "input": "hi", "background": True}
        running = (await client.post("/v1/responses", json=body)).json()
        cid = running["conversation"]["id"]
        named = asyncio.ensure_future(
            client.post("/v1/responses", json={"model": "mock/m", "input": "more", "conversation": cid})
        )
        await asyncio.sleep(0.05)
        assert not named.done()
        upstream.gate.set()
        r = await named
        unknown = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "x", "conversation": "nope"}
        )
    assert r.status_code == 200, r.text
    assert [m["content"] for m in upstream.requests[-1]["messages"] if m["role"] == "user"] == ["hi", "more"]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "conversation"


async def test_counting_and_compacting_on_a_running_background_response_wait_for_it() -> None:
    """`input_tokens` and `compact` with `previous_response_id` of a background response still
    running were 404s ("No conversation", "no longer part of a conversation"), where the turn
    itself waits for it."""
    upstream = Slow()
    upstream.gate = asyncio.Event()
    async with build_client(make_settings(), None, upstream) as client:
        running = (
            await client.post("/v1/responses", json={"model": "mock/m", "input": "hi", "background": True})
        ).json()
        body = {"model": "mock/m", "input": "more", "previous_response_id": running["id"]}
        counted = asyncio.ensure_future(client.post("/v1/responses/input_tokens", json=body))
        compacted = asyncio.ensure_future(client.post("/v1/responses/compact", json=body))
        await asyncio.sleep(0.05)
        assert not counted.done() and not compacted.done()
        upstream.gate.set()
        count, compact = await counted, await compacted
    assert count.status_code == 200, count.text
    assert count.json()["input_tokens"] > 0
    assert compact.status_code == 200, compact.text
