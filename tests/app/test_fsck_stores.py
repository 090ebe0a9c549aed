"""`Store.check` on each backend: what it finds, what a repair moves and where, the lock it
takes, and that readers (also one with a warm cache) see the repaired conversation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.services.cache import ConversationCache
from gateway.store.jsonl import JsonlStore
from gateway.store.postgres import PostgresStore
from tests.helpers import commit_turn
from tests.postgres.cluster import PostgresCluster, postgres_cluster

__all__ = ["postgres_cluster"]


@pytest.fixture
async def jsonl(tmp_path: Path) -> JsonlStore:
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    return store


@pytest.fixture
async def pg(postgres_cluster: PostgresCluster) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(postgres_cluster.create_database())
    await store.open()
    yield store
    await store.close()


async def test_jsonl_repair_waits_for_the_conversation_lock(jsonl: JsonlStore) -> None:
    rid = await commit_turn(jsonl, "c", "one")
    await commit_turn(jsonl, "c", "two")
    jsonl.data_dir.response_path(rid).unlink()
    async with jsonl.lock("c", 5):
        busy = await jsonl.check(repair=True, lock_timeout=0.2)
    assert [(d.where, d.repaired) for d in busy] == [("logs/conversations/c.jsonl:1", False)]
    done = await jsonl.check(repair=True, lock_timeout=2)
    assert [(d.where, d.repaired) for d in done] == [("logs/conversations/c.jsonl:1", True)]
    assert await jsonl.check() == []


async def test_jsonl_a_file_with_nothing_readable_is_moved_whole_and_a_warm_cache_reloads(
    jsonl: JsonlStore,
) -> None:
    cache = ConversationCache()
    first = await commit_turn(jsonl, "c", "one")
    second = await commit_turn(jsonl, "c", "two")
    assert len((await cache.load(jsonl, "c")).history) == 4  # cached, at the index's version
    jsonl.data_dir.response_path(first).write_bytes(b"{torn beyond repair\n")
    found = await jsonl.check()
    assert [(d.where, d.problem.split(":")[0]) for d in found] == [
        ("logs/conversations/c.jsonl:1", f"names a response file with no readable record ({first})"),
        (f"logs/responses/{first}.jsonl:1", "undecodable record"),
    ]
    done = await jsonl.check(repair=True)
    assert {d.where for d in done if d.repaired} == {
        f"logs/responses/{first}.jsonl",  # moved whole: nothing readable left
        "logs/conversations/c.jsonl:1",  # then the index line naming it
    }
    assert not jsonl.data_dir.response_path(first).exists()
    assert await jsonl.check() == []
    view = await cache.load(jsonl, "c")  # the index is a new file: read again from the start
    assert view.response_ids == [second]


async def test_postgres_index_rows_naming_unusable_responses_move_to_the_archive(pg: PostgresStore) -> None:
    cache = ConversationCache()
    first = await commit_turn(pg, "c", "one")
    second = await commit_turn(pg, "c", "two")
    third = await commit_turn(pg, "c", "three")
    assert len((await cache.load(pg, "c")).history) == 6
    await pg.db.fetch("damage", "DELETE FROM gateway_responses WHERE response_id = $1", first)
    await pg.db.fetch(
        "damage", "DELETE FROM gateway_responses WHERE response_id = $1 AND kind = 'commit'", third
    )
    found = await pg.check()
    assert [(d.where, d.problem) for d in found] == [
        ("gateway_index/c:1", f"names a response that is missing ({first})"),
        ("gateway_index/c:3", f"names a response that is not committed ({third})"),
    ]
    done = await pg.check(repair=True, lock_timeout=2)
    assert [d.where for d in done if d.repaired] == ["gateway_index/c:1", "gateway_index/c:3"]
    assert await pg.check() == []
    rows = await pg.db.fetch("read", "SELECT path, content FROM gateway_archive ORDER BY path")
    assert [row["path"] for row in rows] == ["conversations/c.jsonl.line-1", "conversations/c.jsonl.line-3"]
    assert first in rows[0]["content"]
    assert (await cache.load(pg, "c")).response_ids == [second]  # a new incarnation: loaded again
    fourth = await commit_turn(pg, "c", "four")
    assert await pg.read_index("c") == [second, fourth]


async def test_postgres_repair_waits_for_the_conversation_lock(pg: PostgresStore) -> None:
    rid = await commit_turn(pg, "c", "one")
    await pg.db.fetch("damage", "DELETE FROM gateway_responses WHERE response_id = $1", rid)
    async with pg.lock("c", 5):
        task = asyncio.create_task(pg.check(repair=True, lock_timeout=0.2))
        busy = await task
    assert [(d.where, d.repaired) for d in busy] == [("gateway_index/c:1", False)]
