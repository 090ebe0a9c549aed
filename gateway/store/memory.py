"""In-memory store: the test twin of the JSONL store, with the same contract."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gateway.context.history import ConversationView, Turn
from gateway.exceptions import ConversationBusy, NotFound
from gateway.store.base import ConversationSummary, Record, ResponseLog, Store, now
from gateway.store.records import turn_from_records


class _MemoryLog(ResponseLog):
    def __init__(self, store: MemoryStore, response_id: str, request: Record) -> None:
        self.store = store
        self.response_id = response_id
        self.records: list[Record] = [request]
        self.closed = False
        store.responses[response_id] = self.records

    def append(self, record: Record) -> None:
        self.records.append(copy.deepcopy(record))

    async def commit(self, conversation_id: str | None, turn: Turn | None) -> None:
        self.closed = True
        if self.store.fail_commit is not None:
            raise self.store.fail_commit
        self.records.append({"type": "commit", "status": "complete", "committed": now()})
        if conversation_id is not None:
            self.store.indexes.setdefault(conversation_id, []).append(self.response_id)
            self.store.activity[conversation_id] = now()

    async def abandon(self, reason: str, error: dict[str, Any] | None = None) -> None:
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

    async def load(self, conversation_id: str) -> ConversationView:
        view = ConversationView()
        for entry in self.indexes.get(conversation_id, []):
            if isinstance(entry, dict):
                view.apply_marker(entry)
                continue
            turn = turn_from_records(self.responses.get(entry, []))
            if turn is not None:
                view.extend(turn)
        return view

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

    async def append_marker(self, conversation_id: str, marker: Record) -> None:
        if self.fail_commit is not None:
            raise self.fail_commit
        self.indexes.setdefault(conversation_id, []).append(copy.deepcopy(marker))
        self.activity[conversation_id] = now()

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        entries = self.indexes.pop(conversation_id, None)
        if entries is None:
            return False
        for entry in entries:
            if isinstance(entry, str):
                records = self.responses.pop(entry, None)
                if archive and records is not None:
                    self.archived.setdefault(conversation_id, []).append(records)
        self.summaries.pop(conversation_id, None)
        self.side.pop(("lifecycle", conversation_id), None)
        self.activity.pop(conversation_id, None)
        return True

    async def fork(self, source: str, target: str, through: str) -> None:
        entries = self.indexes.get(source, [])
        if through not in entries:
            raise NotFound(f"No response {through!r} in conversation {source!r}")
        self.indexes[target] = copy.deepcopy(entries[: entries.index(through) + 1])
        self.activity[target] = now()

    async def tombstone(self, response_id: str) -> None:
        if response_id not in self.responses:
            raise NotFound(f"No response {response_id!r}")
        self.responses[response_id].append({"type": "deleted", "at": now()})

    def index_times(self) -> list[tuple[str, float]]:
        return [(cid, self.activity.get(cid, 0.0)) for cid in self.indexes]

    async def append_side(self, kind: str, key: str, record: Record) -> None:
        if kind == "summaries":
            self.summaries.setdefault(key, []).append(copy.deepcopy(record))
        else:
            self.side.setdefault((kind, key), []).append(copy.deepcopy(record))

    async def read_side(self, kind: str, key: str) -> list[Record]:
        if kind == "summaries":
            return list(self.summaries.get(key, []))
        return list(self.side.get((kind, key), []))

    async def list_conversations(self) -> list[ConversationSummary]:
        out = []
        for cid in self.indexes:
            view = await self.load(cid)
            out.append(ConversationSummary(cid, view.turns, len(view.history), self.activity.get(cid, 0.0)))
        return sorted(out, key=lambda s: s.last_activity, reverse=True)
