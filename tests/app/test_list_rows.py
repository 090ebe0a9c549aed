"""A page of the conversation list costs its rows, not the length of their conversations: a
turn brings its conversation's list row with it, the store keeps it (the JSONL catalog, a
column in PostgreSQL, the memory twin), and a list started cold reads no index and no response
log for it. A row the store lacks (a catalog rebuilt from the folder, a data dir or database
older than rows) is made from the conversation's newest turns (a bounded read) and kept, so the
next list reads nothing. Each field shows what a load of the whole conversation shows, whichever
way the conversation was changed (the API, items, edits, deletions, resets).

Reads are counted by wrapping the store's read methods: index entries and response logs."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from gateway.context.history import PREVIEW_CHARS, text_of
from gateway.services.cache import ConversationCache
from gateway.services.queries import ConversationSummary
from gateway.store.base import IndexList, IndexRead, Store
from gateway.store.jsonl import JsonlStore
from gateway.store.memory import MemoryStore
from gateway.store.postgres import PostgresStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings
from tests.helpers import say_each
from tests.postgres.cluster import postgres_cluster  # noqa: F401 - the session's PostgreSQL

LONG = 80  # turns of the long conversation (160 messages): more than any bound below
SHORT = 24  # other conversations, one turn each


class Reads:
    """What a store was asked to read: index entries and response logs (by its callers: a
    read method that calls another is counted once)."""

    def __init__(self, store: Store) -> None:
        self.entries = 0
        self.responses = 0
        self._depth = 0
        self._wrap(store, "read_conversation", self._index_read)
        self._wrap(store, "read_many", lambda reads: [self._index_read(r) for r in reads])
        self._wrap(store, "read_entries", self._index_list)
        self._wrap(store, "read_index", self._entries)
        self._wrap(store, "read_turns", self._responses)
        self._wrap(store, "read_response", lambda records: self._responses([records]))

    def _wrap(self, store: Store, name: str, note: Callable[[Any], object]) -> None:
        real = getattr(store, name)

        @functools.wraps(real)
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            try:
                result = await real(*args, **kwargs)
            finally:
                self._depth -= 1
            if not self._depth:
                note(result)
            return result

        setattr(store, name, counted)

    def _index_read(self, read: IndexRead) -> None:
        self.entries += len(read.entries)
        self.responses += sum(1 for e in read.entries if e.records)

    def _index_list(self, index: IndexList) -> None:
        self.entries += len(index.entries)

    def _entries(self, entries: list[Any]) -> None:
        self.entries += len(entries)

    def _responses(self, responses: list[Any]) -> None:
        self.responses += len(responses)


class Backend:
    """One backend's data, opened as a process (or replica) opens it, again and again."""

    def __init__(self, kind: str, root: Path, dsn: str = "") -> None:
        self.kind, self.root, self.dsn = kind, root, dsn
        self.memory = MemoryStore()
        self.opened: list[Store] = []

    async def open(self) -> Store:
        """A new store on the same data: nothing of it cached (the memory twin has one
        instance; a new app over it has a cold cache all the same)."""
        if self.kind == "memory":
            return self.memory
        jsonl = self.kind == "jsonl"
        store: Store = JsonlStore(self.root, durability="none") if jsonl else PostgresStore(self.dsn)
        await store.open()
        self.opened.append(store)
        return store

    async def forget_rows(self) -> None:
        """As data kept before list rows existed (or a JSONL catalog rebuilt from the folder)."""
        if self.kind == "memory":
            self.memory.rows.clear()
        elif self.kind == "jsonl":
            for name in ("conversations.jsonl", "rows.jsonl"):
                (self.root / "catalog" / name).unlink(missing_ok=True)
        else:
            conn = await asyncpg.connect(self.dsn)
            try:
                await conn.execute("UPDATE gateway_conversations SET listing = NULL")
            finally:
                await conn.close()

    async def close(self) -> None:
        for store in self.opened:
            await store.close()


@pytest.fixture(params=["memory", "jsonl", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    dsn = request.getfixturevalue("postgres_cluster").create_database() if request.param == "postgres" else ""
    data = Backend(request.param, tmp_path / "var", dsn)
    yield data
    await data.close()


@asynccontextmanager
async def client_of(store: Store) -> AsyncIterator[httpx.AsyncClient]:
    async with build_client(make_settings(), store, MockUpstream()) as client:
        yield client


async def first_page(store: Store) -> list[dict[str, Any]]:
    async with client_of(store) as client:
        r = await client.get("/v1/conversations?limit=20")
        assert r.status_code == 200, r.text
        return list(r.json()["data"])


async def grow(backend: Backend) -> None:
    """A long conversation, then short ones, then the long one again: the newest. (A JSONL data
    dir gets its catalog from the first list that finds a conversation; from then on each
    change brings its row.)"""
    async with client_of(await backend.open()) as client:
        await say_each(client, "long", ["question 0"])
        assert (await client.get("/v1/conversations")).status_code == 200
        await say_each(client, "long", [f"question {i}" for i in range(1, LONG)])
        for i in range(SHORT):
            await say_each(client, f"short-{i:02d}", [f"hello {i}"])
        await asyncio.sleep(0.05)  # (a catalog rebuilt from the folder orders by file times: a coarse clock)
        await say_each(client, "long", ["and the last one"])


def check_long(page: list[dict[str, Any]]) -> None:
    assert len(page) == 20 and page[0]["id"] == "long"
    assert page[0]["turns"] == LONG + 1 and page[0]["messages"] == 2 * (LONG + 1)
    assert [row["id"] for row in page[1:]] == [f"short-{i:02d}" for i in range(SHORT - 1, SHORT - 20, -1)]


async def test_a_list_page_reads_nothing_of_its_conversations(backend: Backend) -> None:
    await grow(backend)
    store = await backend.open()  # another process: nothing cached
    reads = Reads(store)
    page = await first_page(store)
    check_long(page)
    assert (reads.entries, reads.responses) == (0, 0)


async def test_a_missing_row_is_made_from_the_newest_turns_then_kept(backend: Backend) -> None:
    await grow(backend)
    before = await first_page(await backend.open())
    await backend.forget_rows()
    store = await backend.open()
    reads = Reads(store)
    page = await first_page(store)
    check_long(page)
    # A JSONL catalog rebuilt from the folder has each conversation's last change from its index
    # file's time, which the kernel's coarse clock set up to a tick before the catalog's own
    # clock read it: across a second's turn, a second apart.
    pairs = list(zip(page, before, strict=True))
    assert all(abs(made["last_activity_at"] - kept["last_activity_at"]) <= 1 for made, kept in pairs)
    assert [{**made, "last_activity_at": kept["last_activity_at"]} for made, kept in pairs] == before
    before = page  # (what the rows now kept say)
    # The long conversation's newest turns (a checkpoint's worth), and each short one's turn:
    # not the long conversation's LONG + 1 responses.
    assert reads.responses <= 8 + 19 + 2 < LONG
    reads.entries = reads.responses = 0
    assert await first_page(store) == before  # kept by the first list
    assert (reads.entries, reads.responses) == (0, 0)
    again = await backend.open()  # and by the store: another process reads none either
    reads = Reads(again)
    assert await first_page(again) == before
    assert (reads.entries, reads.responses) == (0, 0)


async def whole_row(store: Store, cid: str) -> dict[str, Any]:
    """What the list showed before rows were kept: each field from the whole conversation,
    loaded afresh."""
    view = await ConversationCache().load(store, cid)
    summary = ConversationSummary.of(cid, view, 0.0)
    users = (m for m in reversed(view.history) if m.get("role") == "user")
    preview = next((text_of(m)[:PREVIEW_CHARS] for m in users), "")
    return {
        "turns": summary.turns,
        "messages": summary.messages,
        "tokens": summary.tokens,
        "created_at": int(view.created_at or 0),
        "metadata": view.metadata,
        "last_activity": view.last_activity,
        "user": view.user,
        "preview": preview,
    }


async def listed_row(client: httpx.AsyncClient, cid: str) -> dict[str, Any]:
    api = next(r for r in (await client.get("/v1/conversations?limit=100")).json()["data"] if r["id"] == cid)
    ui = next(r for r in (await client.get("/ui/api/conversations")).json()["data"] if r["id"] == cid)
    assert (api["turns"], api["messages"]) == (ui["turns"], ui["messages"])
    return {
        "turns": api["turns"],
        "messages": api["messages"],
        "tokens": ui["tokens"],
        "created_at": api["created_at"],
        "metadata": api["metadata"],
        "last_activity": ui["last_activity"],
        "user": ui["user"],
        "preview": ui["preview"],
    }


async def test_every_field_is_what_the_whole_conversation_shows(backend: Backend) -> None:
    """After each way of changing a conversation, in the process that changed it and in a new
    one, with the row as its store keeps it or made again for lack of one."""
    store = await backend.open()
    cid = "fields"
    chat = functools.partial(_chat, cid=cid)
    steps: list[Callable[[httpx.AsyncClient], Awaitable[Any]]] = [
        lambda c: c.post("/v1/conversations", json={"id": cid, "metadata": {"topic": "lists"}}),
        lambda c: c.post(f"/v1/conversations/{cid}/items", json={"items": [_user("from items " * 30)]}),
        lambda c: chat(c, [{"role": "system", "content": "be brief"}, _user("first question")], user="ann"),
        lambda c: chat(c, [{**_user("thumbs up"), "is_feedback": True}]),
        lambda c: chat(c, [_user("second question")]),
        lambda c: chat(c, [_user("from items " * 30), _user("first question, edited")]),  # a branch
        lambda c: c.post(f"/v1/conversations/{cid}", json={"metadata": {"topic": "rows"}}),
        functools.partial(_delete_first_item, cid=cid),
        lambda c: chat(c, [_user("after the deletion")]),
        lambda c: c.post(f"/v1/conversations/{cid}/reset", json={"keep_system_message": True}),
        lambda c: chat(c, [_user("after the reset")], user="bob"),
    ]
    for n, step in enumerate(steps):
        async with client_of(store) as client:
            r = await step(client)
            assert r.status_code == 200, (n, r.text)
            assert await listed_row(client, cid) == await whole_row(store, cid), n
        async with client_of(await backend.open()) as client:
            assert await listed_row(client, cid) == await whole_row(store, cid), n
    await backend.forget_rows()
    async with client_of(await backend.open()) as client:
        assert await listed_row(client, cid) == await whole_row(store, cid)


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def _chat(client: httpx.AsyncClient, messages: list[Any], *, cid: str, **extra: Any) -> httpx.Response:
    body = {"model": "mock/m", "conversation_id": cid, "messages": messages, **extra}
    return await client.post("/v1/chat/completions", json=body)


async def _delete_first_item(client: httpx.AsyncClient, *, cid: str) -> httpx.Response:
    items = (await client.get(f"/v1/conversations/{cid}/items?order=asc")).json()["data"]
    first = next(item for item in items if item.get("role") == "user")
    return await client.delete(f"/v1/conversations/{cid}/items/{first['id']}")
