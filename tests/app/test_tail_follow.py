"""`gateway tail`'s feed (`Queries.follow`): a conversation deleted and started again between two
looks is said, and its new history followed from the first turn."""

from __future__ import annotations

import asyncio

from gateway.context.history import Turn
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings


async def test_a_conversation_deleted_and_started_again_is_said_and_followed_whole() -> None:
    """It was taken for the same conversation grown: the new turns up to the count already seen
    were skipped, and nothing said the history had been deleted."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:

        async def turn(text: str) -> None:
            body = {
                "model": "mock/m",
                "conversation_id": "again",
                "messages": [{"role": "user", "content": text}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200

        await turn("old-1")
        await turn("old-2")
        feed = app_of(client).state.services.queries.follow("", "again", 0.01)
        seen: list[str] = []

        async def take(n: int) -> None:
            while len(seen) < n:
                entry = await anext(feed)
                seen.append(str(entry.input[0]["content"]) if isinstance(entry, Turn) else entry["type"])

        await asyncio.wait_for(take(2), 5)
        assert (await client.delete("/v1/conversations/again")).status_code == 200
        for text in ("new-1", "new-2", "new-3"):
            await turn(text)
        await asyncio.wait_for(take(6), 5)
        await feed.aclose()
    assert seen == ["old-1", "old-2", "restarted", "new-1", "new-2", "new-3"]
