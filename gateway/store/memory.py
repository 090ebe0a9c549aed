"""In-memory store: the test twin of the JSONL store, with the same contract."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.exceptions import ConversationBusy, NotFound
from gateway.store.base import (
    Appended,
    IndexEntry,
    IndexList,
    IndexRead,
    Listed,
    ResponseLog,
    SideLog,
    Store,
    Version,
    now,
)
from gateway.types import Api, JSONObject, Record, request_api


class _MemoryLog(ResponseLog):
    def __init__(self, store: MemoryStore, response_id: str, request: Record) -> None:
        self.store = store
        self.response_id = response_id
        self.records: list[Record] = [request]
        self.closed = False
        store.responses[response_id] = self.records

    @property
    def commit_waits(self) -> bool:
        return False

    def append(self, record: Record) -> None:
        self.records.append(copy.deepcopy(record))

    async def commit(self, conversation_id: str | None) -> Appended | None:
        self.closed = True
        if self.store.fail_commit is not None:
            raise self.store.fail_commit
        self.records.append({"type": "commit", "status": "complete", "committed": now()})
        if conversation_id is None:
            return None
        return self.store.append_entry(conversation_id, self.response_id, self.row)

    async def abandon(self, reason: str, error: JSONObject | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.records.append({"type": "incomplete", "reason": reason, "error": error})


class MemoryStore(Store):
    """Keeps everything in dicts; `fail_commit` injects a storage failure for tests."""

    def __init__(self) -> None:
        self.responses: dict[str, list[Record]] = {}
        self.indexes: dict[str, list[str | Record]] = {}
        self.activity: dict[str, float] = {}
        self.summaries: dict[str, list[Record]] = {}
        self.archived: dict[str, list[list[Record]]] = {}
        self.side: dict[tuple[str, str], list[Record]] = {}
        self.fail_commit: Exception | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._generations: dict[str, int] = {}  # a new one each time an index is (re)created
        self._next_generation = 0
        self.rows: dict[str, tuple[Version, JSONObject]] = {}  # the list's rows, by the version they describe

    def _version(self, cid: str) -> Version:
        return Version(self._generations.get(cid, -1), len(self.indexes.get(cid, [])))

    def append_entry(self, cid: str, entry: str | Record, row: JSONObject | None) -> Appended:
        """Add a line to a conversation's index (a response id or a marker), and its list row."""
        if cid not in self.indexes:
            self._next_generation += 1
            self._generations[cid] = self._next_generation
        before = self._version(cid)
        self.indexes.setdefault(cid, []).append(entry)
        self.activity[cid] = now()
        after = self._version(cid)
        if row is not None:
            self.rows[cid] = (after, copy.deepcopy(row))
        return Appended(before, after)

    @asynccontextmanager
    async def lock(self, conversation_id: str, timeout: float) -> AsyncIterator[None]:
        lock = self._locks.setdefault(conversation_id, asyncio.Lock())
        try:
            async with asyncio.timeout(timeout):
                await lock.acquire()
        except TimeoutError:
            raise ConversationBusy(
                f"Conversation {conversation_id!r} is busy with another request; retry later"
            ) from None
        try:
            yield
        finally:
            lock.release()

    async def read_entries(self, conversation_id: str) -> IndexList:
        if conversation_id not in self.indexes:
            return IndexList([], None)
        return IndexList(copy.deepcopy(self.indexes[conversation_id]), self._version(conversation_id))

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        if conversation_id not in self.indexes:
            return IndexRead([], None, True)
        version = self._version(conversation_id)
        restarted = after is None or after.generation != version.generation
        restarted = restarted or (after is not None and after.position > version.position)
        start = 0 if restarted or after is None else after.position
        entries = []
        for entry in self.indexes[conversation_id][start:]:
            if isinstance(entry, dict):
                entries.append(IndexEntry(None, copy.deepcopy(entry), []))
            else:
                records = [r for r in self.responses.get(entry, []) if r.get("type") != "context"]
                entries.append(IndexEntry(entry, None, records))
        return IndexRead(entries, version, restarted)

    def start(self, response_id: str, request: Record) -> ResponseLog:
        return _MemoryLog(self, response_id, copy.deepcopy(request))

    async def read_response(self, response_id: str) -> list[Record]:
        if response_id not in self.responses:
            raise NotFound(f"No response {response_id!r}")
        return list(self.responses[response_id])

    async def read_index(self, conversation_id: str) -> list[str | Record]:
        if conversation_id not in self.indexes:
            raise NotFound(f"No conversation {conversation_id!r}")
        return list(self.indexes[conversation_id])

    async def append_marker(
        self, conversation_id: str, marker: Record, row: JSONObject | None = None
    ) -> Appended:
        if self.fail_commit is not None:
            raise self.fail_commit
        return self.append_entry(conversation_id, copy.deepcopy(marker), row)

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        entries = self.indexes.pop(conversation_id, None)
        if entries is None:
            return False
        shared = {e for index in self.indexes.values() for e in index if isinstance(e, str)}
        for entry in entries:
            if isinstance(entry, str):
                # A fork shares its prefix's responses: those stay while an index names them.
                records = self.responses.get(entry) if entry in shared else self.responses.pop(entry, None)
                if entry not in shared:
                    self.side.pop(("metadata", entry), None)
                if archive and records is not None:
                    self.archived.setdefault(conversation_id, []).append(copy.deepcopy(records))
        self.summaries.pop(conversation_id, None)
        self.side.pop(("lifecycle", conversation_id), None)
        self.activity.pop(conversation_id, None)
        self.rows.pop(conversation_id, None)
        return True

    async def fork(self, source: str, target: str, through: str) -> None:
        entries = self.indexes.get(source, [])
        if through not in entries:
            raise NotFound(f"No response {through!r} in conversation {source!r}")
        self._next_generation += 1
        self._generations[target] = self._next_generation
        self.indexes[target] = copy.deepcopy(entries[: entries.index(through) + 1])
        self.activity[target] = now()

    async def sharing(self, conversation_id: str, response_id: str) -> list[str]:
        named = (c for c, entries in self.indexes.items() if response_id in entries)
        return sorted(c for c in named if c != conversation_id)

    async def tombstone(self, response_id: str) -> None:
        if response_id not in self.responses:
            raise NotFound(f"No response {response_id!r}")
        self.responses[response_id].append({"type": "deleted", "at": now()})

    async def list_responses(
        self,
        limit: int,
        *,
        api: Api,
        model: str | None = None,
        after: str | None = None,
        descending: bool = False,
    ) -> tuple[list[str], bool]:
        """A sort of every response (a test twin holds few)."""
        keys: dict[str, tuple[float, str]] = {}
        for rid, records in self.responses.items():
            request = records[0] if records and records[0].get("type") == "request" else None
            created = request.get("created") if request is not None else None
            if isinstance(created, int | float) and not isinstance(created, bool):
                keys[rid] = (float(created), rid)
        order = sorted(keys.values(), reverse=descending)
        if after is not None:
            if after not in keys:
                raise NotFound(f"No response {after!r} in this list", param="after")
            cursor = keys[after]
            order = [k for k in order if (k < cursor if descending else k > cursor)]
        out = []
        for _, rid in order:
            records = self.responses[rid]
            request = records[0]
            if records[-1].get("type") != "commit" or request_api(request) != api:
                continue
            if model is not None and request.get("model") != model:
                continue
            out.append(rid)
            if len(out) > limit:
                break
        return out[:limit], len(out) > limit

    def _index_times(self) -> list[tuple[str, float]]:
        return [(cid, self.activity.get(cid, 0.0)) for cid in self.indexes]

    async def append_side(self, kind: SideLog, key: str, record: Record) -> None:
        if kind == "summaries":
            self.summaries.setdefault(key, []).append(copy.deepcopy(record))
        else:
            self.side.setdefault((kind, key), []).append(copy.deepcopy(record))

    async def read_side(self, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
        if kind == "summaries":
            return list(self.summaries.get(key, []))
        return list(self.side.get((kind, key), []))

    async def conversation_ids(self) -> list[tuple[str, float]]:
        return sorted(self._index_times(), key=lambda pair: pair[1], reverse=True)

    async def list_rows(self, limit: int, after: str | None = None) -> tuple[list[Listed], bool]:
        page, more = await self.list_conversations(limit, after)
        out = []
        for cid, changed in page:
            version = self._version(cid)
            kept = self.rows.get(cid)
            row = copy.deepcopy(kept[1]) if kept is not None and kept[0] == version else None
            out.append(Listed(cid, changed, version, row))
        return out, more

    async def keep_rows(self, rows: list[tuple[str, Version, JSONObject]]) -> None:
        for cid, version, row in rows:
            if cid in self.indexes and self._version(cid) == version:
                self.rows[cid] = (version, copy.deepcopy(row))
