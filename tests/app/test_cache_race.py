"""Readers that load a conversation while a turn commits, or while another reader loads it
(a dashboard polling the Conversations API beside a talking client; on PostgreSQL every load
waits for the database): each turn is in the cached view once, and reaches the model once."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.store.base import IndexRead, Version
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

CID = "polled"


class PausingStore(MemoryStore):
    """Its next `read_conversation` waits, before reading, until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.pause_next = False
        self.paused = asyncio.Event()
        self.release = asyncio.Event()

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        if self.pause_next:
            self.pause_next = False
            self.paused.set()
            await self.release.wait()
        return await super().read_conversation(conversation_id, after)


async def say(client: Any, text: str) -> None:
    body = {"model": "mock/m", "conversation_id": CID, "messages": [{"role": "user", "content": text}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def users(upstream: MockUpstream) -> list[str]:
    return [str(m["content"]) for m in upstream.requests[-1]["messages"] if m["role"] == "user"]


async def test_a_read_overlapping_a_commit_does_not_apply_the_turn_twice() -> None:
    store, upstream = PausingStore(), MockUpstream()
    async with build_client(make_settings(), store, upstream) as client:
        await say(client, "one")
        assert (await client.get(f"/v1/conversations/{CID}")).status_code == 200  # cached
        store.pause_next = True
        reader = asyncio.create_task(client.get(f"/v1/conversations/{CID}/items", params={"limit": 100}))
        await asyncio.wait_for(store.paused.wait(), 5)
        await say(client, "two")  # commits while the reader waits for its read
        store.release.set()
        r = await reader
        assert r.status_code == 200, r.text
        items = r.json()["data"]
        assert len(items) == len({item["id"] for item in items}) == 4
        await say(client, "three")
        assert users(upstream) == ["one", "two", "three"]


async def test_two_reads_overlapping_do_not_apply_the_same_turns_twice() -> None:
    store, upstream = PausingStore(), MockUpstream()
    settings = make_settings()
    async with build_client(settings, store, upstream) as a, build_client(settings, store, upstream) as b:
        await say(a, "one")
        assert (await a.get(f"/v1/conversations/{CID}")).status_code == 200  # cached by A
        store.pause_next = True
        slow = asyncio.create_task(a.get(f"/v1/conversations/{CID}"))
        await asyncio.wait_for(store.paused.wait(), 5)
        await say(b, "two")  # another replica's turn
        fast = await a.get(f"/v1/conversations/{CID}")  # brings A's cached view up to date
        assert fast.status_code == 200
        store.release.set()
        assert (await slow).status_code == 200  # it read from the same version: must not apply it again
        await say(a, "three")
        assert users(upstream) == ["one", "two", "three"]
        r = await a.get(f"/v1/conversations/{CID}/items", params={"limit": 100})
        assert len(r.json()["data"]) == 6
