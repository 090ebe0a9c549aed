"""A deleted item or response leaves the model's view for good, rolling summary included: the
summary versions that folded it in are withdrawn, the summarizer starts again from a clean
version, and a fold that was under way while the deletion happened is not kept."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings

CID = "sumdel"


def summarizing(body: dict[str, Any]) -> bool:
    return str(body["messages"][0].get("content", "")).startswith("You maintain the running summary")


class Model(MockUpstream):
    """Answers "noted." to turns; as the summarizer, lists every secret it was shown (in the
    current summary and the new messages), so a summary's text tells what it drew on."""

    def __init__(self) -> None:
        super().__init__(self.reply)
        self.turns: list[dict[str, Any]] = []  # the bodies of the turns (not the summarizer's)
        self.hold: asyncio.Event | None = None  # set: the summarizer waits for it
        self.holding = asyncio.Event()

    def reply(self, body: dict[str, Any]) -> str:
        if summarizing(body):
            shown = str(body["messages"][1]["content"])
            return "facts: " + " ".join(sorted(set(re.findall(r"secret-\d+", shown))))
        self.turns.append(body)
        return "noted."

    async def complete(self, body: dict[str, Any], *, waited: float = 0.0) -> dict[str, Any]:
        if summarizing(body) and self.hold is not None:
            self.holding.set()
            await self.hold.wait()
        return await super().complete(body)


def settings(tmp_path: Path | None = None) -> Any:
    base = make_settings(tmp_path)
    context = base.context.model_copy(
        update={"strategy": "summarize", "max_history_messages": 4, "keep_recent_messages": 2}
    )
    return base.model_copy(update={"context": context})


async def turn(client: httpx.AsyncClient, text: str) -> str:
    body = {"model": "mock/m", "conversation_id": CID, "messages": [{"role": "user", "content": text}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def sent_text(body: dict[str, Any]) -> str:
    return " ".join(str(m.get("content")) for m in body["messages"])


async def grown(client: httpx.AsyncClient, model: Model, n: int = 8) -> list[str]:
    """`n` turns, each telling a secret, with the summarizer done after each."""
    ids = []
    for i in range(n):
        ids.append(await turn(client, f"remember secret-{i}"))
        await app_of(client).state.summarizer.wait_idle()
    return ids


async def summary_of_next_turn(client: httpx.AsyncClient, model: Model, text: str) -> str:
    await turn(client, text)
    system = [m for m in model.turns[-1]["messages"] if m["role"] == "system"]
    return " ".join(str(m["content"]) for m in system)


async def items_saying(client: httpx.AsyncClient, needle: str) -> list[str]:
    r = await client.get(f"/v1/conversations/{CID}/items", params={"limit": 100, "order": "asc"})
    assert r.status_code == 200, r.text
    found = []
    for item in r.json()["data"]:
        text = " ".join(str(part.get("text", "")) for part in item.get("content") or [])
        if needle in text:
            found.append(item["id"])
    return found


@pytest.mark.parametrize("backend", ["memory", "jsonl"])
async def test_a_deleted_item_leaves_the_summary_and_later_summaries(backend: str, tmp_path: Path) -> None:
    model = Model()
    memory = MemoryStore() if backend == "memory" else None
    async with build_client(settings(None if memory else tmp_path), memory, model) as client:
        store = app_of(client).state.services.stores
        store = memory or await store.get("")
        await grown(client, model)
        assert "secret-0" in await summary_of_next_turn(client, model, "probe-1")  # summarized

        (item,) = await items_saying(client, "secret-0")
        r = await client.delete(f"/v1/conversations/{CID}/items/{item}")
        assert r.status_code == 200, r.text

        await turn(client, "probe-2")
        assert "secret-0" not in sent_text(model.turns[-1])
        inspector = (await client.get(f"/ui/api/conversations/{CID}")).json()["summaries"]
        assert inspector and not any(s["applies"] for s in inspector)  # all folded secret-0 in
        # The summarizer starts again from what is left, and its summaries are used again.
        for i in range(3):
            await turn(client, f"more secret-{100 + i}")
            await app_of(client).state.summarizer.wait_idle()
        summary = await summary_of_next_turn(client, model, "probe-3")
        assert "secret-1" in summary and "secret-0" not in summary
        assert "secret-0" not in sent_text(model.turns[-1])
        versions = [r["version"] for r in await store.read_side("summaries", CID) if r["type"] == "summary"]
        assert len(versions) == len(set(versions))  # numbering goes on, never repeats


async def test_a_deleted_response_leaves_the_summary() -> None:
    model = Model()
    async with build_client(settings(), MemoryStore(), model) as client:
        ids = await grown(client, model)
        assert "secret-0" in await summary_of_next_turn(client, model, "probe-1")
        r = await client.delete(f"/v1/responses/{ids[0]}")
        assert r.status_code == 200, r.text
        await turn(client, "probe-2")
        assert "secret-0" not in sent_text(model.turns[-1])


async def test_a_summary_that_does_not_cover_the_deleted_item_is_still_used() -> None:
    model = Model()
    async with build_client(settings(), MemoryStore(), model) as client:
        await grown(client, model)
        (item,) = await items_saying(client, "secret-7")  # the newest: in the window, not summarized
        assert (await client.delete(f"/v1/conversations/{CID}/items/{item}")).status_code == 200
        summary = await summary_of_next_turn(client, model, "probe")
        assert "secret-0" in summary  # the summary of the older turns still applies
        assert "secret-7" not in sent_text(model.turns[-1])


@pytest.mark.parametrize("what", ["item", "response"])
async def test_a_fold_under_way_during_a_deletion_is_not_kept(what: str) -> None:
    model = Model()
    async with build_client(settings(), MemoryStore(), model) as client:
        ids = await grown(client, model, 3)  # nothing summarized yet
        model.hold = asyncio.Event()
        await turn(client, "remember secret-3")  # the window cuts: the first fold starts
        await asyncio.wait_for(model.holding.wait(), 5)
        if what == "item":
            (item,) = await items_saying(client, "secret-0")
            r = await client.delete(f"/v1/conversations/{CID}/items/{item}")
        else:
            r = await client.delete(f"/v1/responses/{ids[0]}")
        assert r.status_code == 200, r.text
        model.hold.set()
        await app_of(client).state.summarizer.wait_idle()
        for i in range(4, 8):
            await turn(client, f"remember secret-{i}")
            await app_of(client).state.summarizer.wait_idle()
        await turn(client, "probe")
        assert "secret-0" not in sent_text(model.turns[-1])
        assert "secret-1" in sent_text(model.turns[-1])  # summarized again, without it


@pytest.mark.parametrize("what", ["delete", "reset"])
async def test_a_fold_under_way_when_the_conversation_is_deleted_or_reset_is_not_kept(what: str) -> None:
    """The fold's text came back after the DELETE (or reset): it was written to the summaries
    log of the conversation that no longer held those turns, and a new conversation with the
    same id found it there."""
    model = Model()
    store = MemoryStore()
    async with build_client(settings(), store, model) as client:
        await grown(client, model, 3)
        await app_of(client).state.summarizer.wait_idle()
        # (a summary for the next cut may be written already: it is asked for ahead of the cut)
        before = [r for r in store.summaries.get(CID, []) if r.get("type") == "summary"]
        model.hold = asyncio.Event()
        await turn(client, "remember secret-3")  # the window cuts: a fold starts
        await asyncio.wait_for(model.holding.wait(), 5)
        if what == "delete":
            r = await client.delete(f"/v1/conversations/{CID}")
        else:
            r = await client.post(f"/v1/conversations/{CID}/reset", json={})
        assert r.status_code == 200, r.text
        model.hold.set()
        await app_of(client).state.summarizer.wait_idle()
        after = [r for r in store.summaries.get(CID, []) if r.get("type") == "summary"]
        assert after == (before if what == "reset" else [])  # (a reset keeps the log, unused)
        await turn(client, "hello again")
        assert "secret" not in sent_text(model.turns[-1])


async def test_a_turn_larger_than_a_summarizer_call_is_folded_whole() -> None:
    """A chat moved in with one request is one stored turn; when it falls out of the window,
    all of it reaches the summary (in several summarizer calls), not just its beginning:
    a turn is either in the window or in a summary, never lost in between."""
    import gateway.context.summary as summary_module

    model = Model()
    base = settings()
    context = base.context.model_copy(update={"max_history_messages": 4, "keep_recent_messages": 2})
    async with build_client(base.model_copy(update={"context": context}), MemoryStore(), model) as client:
        moved = []
        for i in range(30):
            moved += [
                {"role": "user", "content": f"remember secret-{i} " + "filler words " * 20},
                {"role": "assistant", "content": f"noted {i}."},
            ]
        messages = [*moved, {"role": "user", "content": "hi"}]
        body = {"model": "mock/m", "conversation_id": CID, "messages": messages}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        original = summary_module.CHUNK_TOKENS
        summary_module.CHUNK_TOKENS = 400  # a summarizer call takes far less than the moved chat
        try:
            for i in range(3):
                await turn(client, f"after {i}")
                await app_of(client).state.summarizer.wait_idle()
            summary = await summary_of_next_turn(client, model, "probe")
        finally:
            summary_module.CHUNK_TOKENS = original
        assert all(f"secret-{i}" in summary for i in range(30)), summary


@pytest.mark.parametrize("backend", ["memory", "jsonl"])
async def test_a_fork_made_after_a_deletion_keeps_the_deletion(backend: str, tmp_path: Path) -> None:
    """Items deleted after the response a fork is made at (`previous_response_id` of an older
    response) stay deleted in the fork: the deletion marker comes after that response in the
    source's index, and the fork takes it along."""
    model = Model()
    memory = MemoryStore() if backend == "memory" else None
    async with build_client(make_settings(None if memory else tmp_path), memory, model) as client:
        ids = []
        previous = None
        for i in range(4):
            body = {"model": "mock/m", "input": f"remember secret-{i}"}
            if previous:
                body["previous_response_id"] = previous
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
            ids.append(previous)
        cid = r.headers["x-conversation-id"]
        r = await client.get(f"/v1/conversations/{cid}/items", params={"limit": 100, "order": "asc"})
        deleted = [i["id"] for i in r.json()["data"] if ids[1] in i["id"]]
        assert len(deleted) == 2
        for item in deleted:
            assert (await client.delete(f"/v1/conversations/{cid}/items/{item}")).status_code == 200
        r = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "a fork", "previous_response_id": ids[2]}
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-conversation-id"] != cid  # a fork
        sent = sent_text(model.turns[-1])
        assert "secret-0" in sent and "secret-2" in sent and "secret-1" not in sent


async def branch_summary_deletion(client: httpx.AsyncClient, model: Model) -> list[str]:
    """A source of four responses and a branch at the fourth, with its own summary of the shared
    ones; then the second response deleted. The response ids of the source."""

    async def respond(text: str, previous: str | None) -> str:
        body = {"model": "mock/m", "input": text}
        if previous:
            body["previous_response_id"] = previous
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        await app_of(client).state.summarizer.wait_idle()
        return str(r.json()["id"])

    ids: list[str] = []
    for i in range(4):
        ids.append(await respond(f"remember secret-{i}", ids[-1] if ids else None))
    await respond("the source goes on", ids[-1])
    branch = ids[-1]  # the branch starts at the 4th response, sharing the first four
    for i in range(4, 9):
        branch = await respond(f"remember secret-{i}", branch)
    last = await respond("probe-1", branch)
    assert "secret-1" in sent_text(model.turns[-1])  # summarized in the branch
    assert (await client.delete(f"/v1/responses/{ids[1]}")).status_code == 200
    await respond("probe-2", last)
    assert "secret-1" not in sent_text(model.turns[-1])
    return ids


@pytest.mark.parametrize("backend", ["memory", "jsonl"])
async def test_a_deleted_response_leaves_the_summaries_of_branches_that_share_it(
    backend: str, tmp_path: Path
) -> None:
    """A branch (`previous_response_id` of an older response) shares its prefix's responses;
    its own rolling summary may have folded one in. Deleting that response withdraws it there
    too, not only in the conversation the deletion names."""
    model = Model()
    memory = MemoryStore() if backend == "memory" else None
    async with build_client(settings(None if memory else tmp_path), memory, model) as client:
        await branch_summary_deletion(client, model)


@pytest.mark.parametrize("backend", ["memory", "jsonl"])
async def test_a_deleted_response_leaves_a_branch_this_process_has_loaded(
    backend: str, tmp_path: Path
) -> None:
    """The branch's view is cached (it was just talked on): the deletion reaches it too."""
    model = Model()
    memory = MemoryStore() if backend == "memory" else None
    async with build_client(make_settings(None if memory else tmp_path), memory, model) as client:

        async def respond(text: str, previous: str | None = None) -> Any:
            body = {"model": "mock/m", "input": text}
            if previous:
                body["previous_response_id"] = previous
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            return r

        r1 = (await respond("remember secret-1")).json()["id"]
        r2 = (await respond("remember secret-2", r1)).json()["id"]
        fork = await respond("a branch", r1)
        branch, f1 = fork.headers["x-conversation-id"], fork.json()["id"]
        assert (await client.delete(f"/v1/responses/{r1}")).status_code == 200
        await respond("the source goes on", r2)
        assert "secret-1" not in sent_text(model.turns[-1])
        await respond("the branch goes on", f1)
        assert "secret-1" not in sent_text(model.turns[-1]) and "a branch" in sent_text(model.turns[-1])
        items = (await client.get(f"/v1/conversations/{branch}/items", params={"limit": 100})).json()["data"]
        assert not any(r1 in item["id"] for item in items)


class ToolModel(Model):
    """Asks for a tool when a user message mentions the weather; reports the tool's result."""

    def reply(self, body: dict[str, Any]) -> Any:
        if summarizing(body):
            shown = str(body["messages"][1]["content"])
            return "facts: " + " ".join(sorted(set(re.findall(r"(?:secret|result)-\d+", shown))))
        self.turns.append(body)
        last = body["messages"][-1]
        if last["role"] == "user" and "weather" in str(last["content"]):
            n = len(self.turns)
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{n}",
                        "type": "function",
                        "function": {"name": "weather", "arguments": "{}"},
                    }
                ],
            }
        return "noted."


async def test_a_summary_never_ends_between_a_tool_call_and_its_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tool results come in the turn after the one whose answer called the tool: a summary
    version may not cover the call and leave the results out (they would be orphans, dropped
    from the window without a marker), however small the summarizer's calls."""
    import gateway.context.summary as summary_module

    monkeypatch.setattr(summary_module, "CHUNK_TOKENS", 40)  # a version per turn or so
    model = ToolModel()
    store = MemoryStore()
    async with build_client(settings(), store, model) as client:

        async def say(message: dict[str, Any]) -> Any:
            body = {"model": "mock/m", "conversation_id": CID, "messages": [message]}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            await app_of(client).state.summarizer.wait_idle()
            return r.json()["choices"][0]["message"]

        for i in range(8):
            call = (await say({"role": "user", "content": f"weather secret-{i}?"}))["tool_calls"][0]
            await say({"role": "tool", "tool_call_id": call["id"], "content": f"sunny result-{i}"})
            sent = model.turns[-1]["messages"]
            marker = next((m for m in sent if str(m.get("content", "")).endswith("messages omitted]")), None)
            summary = " ".join(str(m["content"]) for m in sent if m["role"] == "system")
            if marker is None:  # nothing cut: every result sent or summarized
                for k in range(i + 1):
                    assert f"result-{k}" in sent_text(model.turns[-1]) or f"result-{k}" in summary, (k, sent)
        view = await app_of(client).state.services.cache.load(store, CID)
        versions = [r for r in await store.read_side("summaries", CID) if r["type"] == "summary"]
        assert len(versions) > 2
        for version in versions:
            last = view.history[view.history_end[version["covers_through"]] - 1]
            assert not last.get("tool_calls"), version  # a call covered without its result
