"""Read-only use cases: conversation lists with their lifecycle state (the API, the inspector
and `gateway conversations` share one), a conversation's turns, a response's log, the latest
context snapshot. No lock: reads never write (a torn last line is left to the lock's holder)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from gateway.context import ConversationView, Turn
from gateway.context.lifecycle import State, derive_state
from gateway.context.records import latest, number, turn_from_records
from gateway.context.summary import applicable_versions
from gateway.exceptions import CorruptRecord, NotFound
from gateway.services.cache import ConversationCache
from gateway.store import Store, StoreRegistry
from gateway.tokens import count_message
from gateway.types import Record

log = logging.getLogger("gateway.services")

# The most conversations one search request reads (the inspector then offers to go on).
SEARCH_SCAN = 500


@dataclass(frozen=True, slots=True)
class ConversationSummary:
    conversation_id: str
    turns: int
    messages: int
    last_activity: float
    tokens: int = 0

    @classmethod
    def of(cls, cid: str, view: ConversationView, changed: float) -> ConversationSummary:
        return cls(cid, view.turns, len(view.history), changed, tokens=sum(stored_tokens(view)))


def stored_tokens(view: ConversationView) -> list[int]:
    """Each message's tokens, system prompt first then history: as counted for its turn, or
    (a message added through the Conversations API, or counted for another encoding) by
    cl100k_base now."""
    system = view.system or []
    system_counts = view.system_tokens or [None] * len(system)
    pairs = [*zip(system, system_counts, strict=False), *zip(view.history, view.history_tokens, strict=True)]
    return [n if n is not None else count_message(m) for m, n in pairs]


@dataclass(frozen=True, slots=True)
class ConversationRow:
    """One conversation in a list: its counts, its assembled view and its lifecycle state."""

    summary: ConversationSummary
    view: ConversationView
    state: State

    @property
    def conversation_id(self) -> str:
        return self.summary.conversation_id


def text_of(message: Mapping[str, object]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _matches(row: ConversationRow, query: str) -> bool:
    if query in row.conversation_id.lower() or query in (row.view.user or "").lower():
        return True
    return any(query in text_of(m).lower() for m in row.view.transcript)


class Queries:
    def __init__(self, stores: StoreRegistry, cache: ConversationCache) -> None:
        self.stores = stores
        self.cache = cache

    async def _row(self, store: Store, cid: str, changed: float) -> ConversationRow | None:
        """The row of one conversation; None when it cannot be read (a damaged record: skipped
        with a warning, the list still answers)."""
        try:
            view = await self.cache.load(store, cid, keep=False)
        except CorruptRecord as exc:
            log.warning("skipping conversation %s: %s", cid, exc.message)
            return None
        state = derive_state(await store.read_side("lifecycle", cid, keep=False), view.last_activity)
        return ConversationRow(ConversationSummary.of(cid, view, changed), view, state)

    async def _rows(self, store: Store, page: list[tuple[str, float]]) -> list[ConversationRow | None]:
        """The rows of a page: its conversations and lifecycle logs read in one go each
        (`read_many`, `read_sides`); row by row when one cannot be read (then skipped)."""
        cids = [cid for cid, _ in page]
        try:
            views = await self.cache.load_many(store, cids, keep=False)
        except CorruptRecord:
            return [await self._row(store, cid, changed) for cid, changed in page]
        lifecycles = await store.read_sides("lifecycle", cids)
        return [
            ConversationRow(
                ConversationSummary.of(cid, view, changed), view, derive_state(records, view.last_activity)
            )
            for (cid, changed), view, records in zip(page, views, lifecycles, strict=True)
        ]

    async def conversations(
        self, tenant: str, *, limit: int, after: str | None = None
    ) -> tuple[list[ConversationRow], bool]:
        """Most recently active first; (a page of rows, whether more follow). A page costs its
        own rows: the store hands out the page's ids (its catalog, or one keyset query)."""
        store = await self.stores.get(tenant)
        rows: list[ConversationRow] = []
        while True:
            page, more = await store.list_conversations(limit - len(rows), after)
            rows += [row for row in await self._rows(store, page) if row is not None]
            if len(rows) == limit or not more or not page:
                return rows, more
            after = page[-1][0]  # some could not be read: fill the page from the next ones

    async def search(
        self, tenant: str, query: str, *, limit: int = 200, after: str | None = None, scan: int = SEARCH_SCAN
    ) -> tuple[list[ConversationRow], str | None]:
        """Conversations whose id, user or text contains `query` (case-insensitive), most
        recently active first, looking at no more than `scan` conversations (after conversation
        `after`); (the matches, the last conversation looked at when older ones remain: where
        the next search goes on, else None). An empty query lists the first `limit`."""
        store = await self.stores.get(tenant)
        query = query.strip().lower()
        out: list[ConversationRow] = []
        looked = 0
        while looked < scan:
            size = min(100 if query else limit - len(out), scan - looked)
            page, more = await store.list_conversations(size, after)
            for (cid, _), row in zip(page, await self._rows(store, page), strict=True):
                looked += 1
                after = cid
                if row is not None and (not query or _matches(row, query)):
                    out.append(row)
                    if len(out) == limit:
                        return out, after if more or cid != page[-1][0] else None
            if not more or not page:
                return out, None
        return out, after

    async def view(self, tenant: str, cid: str) -> ConversationView:
        return await self.cache.load(await self.stores.get(tenant), cid)

    async def state(self, tenant: str, cid: str, view: ConversationView) -> State:
        store = await self.stores.get(tenant)
        return derive_state(await store.read_side("lifecycle", cid), view.last_activity)

    async def index(self, tenant: str, cid: str) -> list[str | Record]:
        return await (await self.stores.get(tenant)).read_index(cid)

    async def records(self, tenant: str, response_id: str) -> list[Record]:
        """A response's log, as written; NotFound when its file is missing or empty."""
        records = await (await self.stores.get(tenant)).read_response(response_id)
        if not records:
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return records

    async def logged_turn(self, tenant: str, cid: str, rid: str) -> list[Record] | None:
        """The log of a response the conversation's index names, for the inspector: None when
        its file is missing or empty (left out, as every reader does); a deleted or uncommitted
        one is returned, for the inspector to mark."""
        return await self._turn_records(await self.stores.get(tenant), cid, rid, committed=False)

    async def _turn_records(
        self, store: Store, cid: str, rid: str, *, committed: bool = True
    ) -> list[Record] | None:
        """The records of an indexed response; None (with one warning) when it is missing or
        empty, or, with `committed`, not a committed turn."""
        try:
            records = await store.read_response(rid)
        except NotFound:
            records = []
        if turn_from_records(records) is None:
            self.cache.skipped(cid, rid, records)
            if committed or not records:
                return None
        return records

    async def summaries(self, tenant: str, cid: str, view: ConversationView) -> list[Record]:
        """The summary versions, oldest first, each with `applies`: whether it may still be
        sent for `view` (not withdrawn by a deletion, not of an abandoned branch or reset)."""
        records = await (await self.stores.get(tenant)).read_side("summaries", cid)
        applying = applicable_versions(records, view)
        return [
            {**r, "applies": int(number(r.get("version")) or 0) in applying}
            for r in records
            if r.get("type") == "summary"
        ]

    async def compactions(self, tenant: str, cid: str) -> list[Record]:
        """The compactions made of the conversation (its summaries log's `compaction` lines),
        oldest first: what each covered and why it was made."""
        records = await (await self.stores.get(tenant)).read_side("summaries", cid)
        return [r for r in records if r.get("type") == "compaction"]

    async def turns(self, tenant: str, cid: str) -> list[Turn]:
        """The committed turns named by the conversation's index, oldest first."""
        store = await self.stores.get(tenant)
        turns = []
        for entry in await store.read_index(cid):
            if isinstance(entry, str):
                records = await self._turn_records(store, cid, entry)
                turn = turn_from_records(records) if records is not None else None
                if turn is not None:
                    turns.append(turn)
        return turns

    async def latest_context(self, tenant: str, cid: str) -> tuple[str, Record]:
        """(response id, its context snapshot) of the newest turn that recorded one."""
        store = await self.stores.get(tenant)
        ids = [e for e in await store.read_index(cid) if isinstance(e, str)]
        for rid in reversed(ids):
            records = await self._turn_records(store, cid, rid)
            context = latest(records, "context") if records is not None else None
            if context is not None:
                return rid, context
        raise NotFound(f"Conversation {cid!r} has no recorded context yet", param="conversation_id")

    async def follow(self, tenant: str, cid: str, poll: float) -> AsyncIterator[Turn | Record]:
        """Turns as they are committed (`gateway tail`), from the first, and the index's markers
        (a reset, a deleted item or response, new metadata) where they come."""
        store = await self.stores.get(tenant)
        seen = 0
        while True:
            try:
                entries = await store.read_index(cid)
            except NotFound:
                entries = []  # not created yet (or deleted: it may start again)
            if len(entries) < seen:
                seen = 0
            for entry in entries[seen:]:
                if not isinstance(entry, str):
                    yield entry
                    continue
                records = await self._turn_records(store, cid, entry)
                turn = turn_from_records(records) if records is not None else None
                if turn is not None:
                    yield turn
            seen = len(entries)
            await asyncio.sleep(poll)
