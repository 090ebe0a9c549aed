"""Read-only use cases: conversation lists, turns, response logs and context snapshots.

Conversation lists with their lifecycle state (the API, the inspector and `gateway conversations`
share one), a conversation's turns, a response's log, the latest context snapshot. No lock: reads
never write (a torn last line is left to the lock's holder); a list only hands the store the rows
it made for lack of kept ones (`services/listing.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.context import ConversationView, Turn
from gateway.context.history import text_of
from gateway.context.lifecycle import EXPIRED, State, derive_state
from gateway.context.records import latest, turn_from_records
from gateway.context.summary import applicable_versions
from gateway.exceptions import CorruptRecord, NotFound
from gateway.services.cache import ConversationCache
from gateway.services.listing import Listing, stored_tokens
from gateway.store import Store, StoreRegistry
from gateway.store.base import Listed
from gateway.types import Record, number

log = logging.getLogger("gateway.services")

# The most conversations one search request reads (the inspector then offers to go on).
SEARCH_SCAN = 500
# What a list loads of a conversation whose row it makes: its newest turns (from their checkpoint).
_ROW_TAIL = 1


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


@dataclass(frozen=True, slots=True)
class ConversationRow:
    """One conversation in a list.

    Its counts, the rest of what a list shows of it, and its lifecycle state.
    """

    summary: ConversationSummary
    listing: Listing
    state: State

    @property
    def conversation_id(self) -> str:
        return self.summary.conversation_id

    @classmethod
    def of(
        cls, listed: Listed, listing: Listing, lifecycle: list[Record], expired_before: float | None = None
    ) -> ConversationRow:
        """The row; `expired` when its last activity is before `expired_before` (`ttl` ago): the
        next use archives it, and it reads as gone until then."""
        cid = listed.conversation_id
        summary = ConversationSummary(cid, listing.turns, listing.messages, listed.changed, listing.tokens)
        state = derive_state(lifecycle, listing.last_activity)
        last = listing.last_activity
        if expired_before is not None and listing.turns and last is not None and last < expired_before:
            state = State(EXPIRED, state.attempts, last)
        return cls(summary, listing, state)


def _matches(row: ConversationRow, view: ConversationView | None, query: str) -> bool:
    if query in row.conversation_id.lower() or query in (row.listing.user or "").lower():
        return True
    return view is not None and any(query in text_of(m).lower() for m in view.transcript)


class Queries:
    def __init__(self, stores: StoreRegistry, cache: ConversationCache, ttl: float = 0.0) -> None:
        self.stores = stores
        self.cache = cache
        self.ttl = ttl  # (`sessions.ttl`: a row idle longer is `expired`, archived when next used)
        self.clock: Callable[[], float] = time.time

    async def _rows(
        self, store: Store, page: list[Listed], views: list[ConversationView | None] | None = None
    ) -> list[ConversationRow | None]:
        """The rows of a page, and their lifecycle logs, read in one go.

        Each conversation's listing as its store keeps it, else made from the conversation (from
        `views` when the caller read them whole, else from its newest turns, then kept by the store
        for the next list). None for a conversation that cannot be read (a damaged record: skipped
        with a warning, the list still answers).
        """
        listings = [Listing.from_record(listed.row) for listed in page]
        missing = [i for i, listing in enumerate(listings) if listing is None]
        if missing:
            made = (
                [Listing.of(v) if v is not None else None for v in (views[i] for i in missing)]
                if views is not None
                else await self._made(store, [page[i] for i in missing])
            )
            for i, listing in zip(missing, made, strict=True):
                listings[i] = listing
        lifecycles = await store.read_sides("lifecycle", [listed.conversation_id for listed in page])
        expired_before = self.clock() - self.ttl if self.ttl > 0 else None
        return [
            ConversationRow.of(listed, listing, records, expired_before) if listing is not None else None
            for listed, listing, records in zip(page, listings, lifecycles, strict=True)
        ]

    async def _made(self, store: Store, page: list[Listed]) -> list[Listing | None]:
        """The listings of conversations the store keeps none for (as they are now), made anew.

        They are made from their newest turns (`load_many` with a tail: one read for the page where
        the store can) and handed to the store to keep (best effort).
        """
        cids = [listed.conversation_id for listed in page]
        try:
            views: list[ConversationView | None] = list(
                await self.cache.load_many(store, cids, keep=False, tail=_ROW_TAIL)
            )
        except CorruptRecord:
            views = [await self._view_or_none(store, cid, tail=_ROW_TAIL) for cid in cids]
        made: list[Listing | None] = []
        for cid, view in zip(cids, views, strict=True):
            listing = Listing.of(view) if view is not None else None
            if view is not None and listing is None:  # checkpoints of older gateways: all of it
                whole = await self._view_or_none(store, cid)
                listing = Listing.of(whole) if whole is not None else None
            made.append(listing)
        kept = [
            (listed.conversation_id, listed.version, listing.record())
            for listed, listing in zip(page, made, strict=True)
            if listing is not None and listed.version is not None
        ]
        if kept:
            await store.keep_rows(kept)
        return made

    async def _view_or_none(self, store: Store, cid: str, *, tail: int = 0) -> ConversationView | None:
        """The conversation (from its newest turns, with `tail`), or None when it cannot be read.

        A damaged record is skipped with a warning.
        """
        try:
            return await self.cache.load(store, cid, keep=False, tail=tail)
        except CorruptRecord as exc:
            log.warning("skipping conversation %s: %s", cid, exc.message)
            return None

    async def _whole_views(self, store: Store, cids: list[str]) -> list[ConversationView | None]:
        try:
            return list(await self.cache.load_many(store, cids, keep=False))
        except CorruptRecord:
            return [await self._view_or_none(store, cid) for cid in cids]

    async def conversations(
        self, tenant: str, *, limit: int, after: str | None = None
    ) -> tuple[list[ConversationRow], bool]:
        """A page of conversation rows, most recently active first, and whether more follow.

        A page costs its own rows, not the length of their conversations: the store hands out the
        page's ids with the rows it keeps (its catalog, or one keyset query).
        """
        store = await self.stores.get(tenant)
        rows: list[ConversationRow] = []
        while True:
            page, more = await store.list_rows(limit - len(rows), after)
            rows += [row for row in await self._rows(store, page) if row is not None]
            if len(rows) == limit or not more or not page:
                return rows, more
            after = page[-1].conversation_id  # some could not be read: fill the page from the next ones

    async def search(
        self, tenant: str, query: str, *, limit: int = 200, after: str | None = None, scan: int = SEARCH_SCAN
    ) -> tuple[list[ConversationRow], str | None]:
        """Conversations whose id, user or text contains `query` (case-insensitive), most recent first.

        It looks at no more than `scan` conversations (after conversation `after`), most recently
        active first. Returns (the matches, the last conversation looked at when older ones remain:
        where the next search goes on, else None). An empty query lists the first `limit`; a query
        reads each conversation looked at (its text), whole.
        """
        store = await self.stores.get(tenant)
        query = query.strip().lower()
        out: list[ConversationRow] = []
        looked = 0
        while looked < scan:
            size = min(100 if query else limit - len(out), scan - looked)
            page, more = await store.list_rows(size, after)
            cids = [listed.conversation_id for listed in page]
            views = await self._whole_views(store, cids) if query else None
            rows = await self._rows(store, page, views)
            for n, (cid, row) in enumerate(zip(cids, rows, strict=True)):
                looked += 1
                after = cid
                if row is not None and (not query or _matches(row, views[n] if views else None, query)):
                    out.append(row)
                    if len(out) == limit:
                        return out, after if more or cid != cids[-1] else None
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

    async def prompt_cache(self, tenant: str, response_id: str) -> Record | None:
        """What the provider said its prompt cache served for a response (None: it said nothing)."""
        response = latest(await self.records(tenant, response_id), "response")
        cache = response.get("cache") if response is not None else None
        return cache if isinstance(cache, dict) else None

    async def logged_turn(self, tenant: str, cid: str, rid: str) -> list[Record] | None:
        """The log of a response the conversation's index names, for the inspector.

        None when its file is missing or empty (left out, as every reader does); a deleted or
        uncommitted one is returned, for the inspector to mark.
        """
        return await self._turn_records(await self.stores.get(tenant), cid, rid, committed=False)

    async def _turn_records(
        self, store: Store, cid: str, rid: str, *, committed: bool = True
    ) -> list[Record] | None:
        """The records of an indexed response.

        None (with one warning) when it is missing or empty, or, with `committed`, not a committed
        turn.
        """
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
        """The summary versions, oldest first, each with `applies`.

        `applies` says whether it may still be sent for `view` (not withdrawn by a deletion, not of
        an abandoned branch or reset).
        """
        records = await (await self.stores.get(tenant)).read_side("summaries", cid)
        applying = applicable_versions(records, view)
        return [
            {**r, "applies": int(number(r.get("version")) or 0) in applying}
            for r in records
            if r.get("type") == "summary"
        ]

    async def compactions(self, tenant: str, cid: str) -> list[Record]:
        """The compactions made of the conversation, oldest first.

        They are its summaries log's `compaction` lines: what each covered and why it was made.
        """
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
        """Turns as they are committed (`gateway tail`), from the first, and the index's markers.

        Each marker (a reset, a deleted item or response, new metadata) comes where it stands among
        the turns. An index that is gone, or no longer begins as the one followed did (deleted or
        expired, then started again between two looks), is a marker of its own, `{"type":
        "restarted"}`, and what it holds now follows from its first turn.
        """
        store = await self.stores.get(tenant)
        seen = 0
        last: object = None  # the entry at seen - 1: the same index still holds it there
        while True:
            try:
                entries = await store.read_index(cid)
            except NotFound:
                entries = []  # not created yet (or deleted: it may start again)
            if seen and (len(entries) < seen or entries[seen - 1] != last):
                seen = 0
                yield {"type": "restarted"}
            for entry in entries[seen:]:
                if not isinstance(entry, str):
                    yield entry
                    continue
                records = await self._turn_records(store, cid, entry)
                turn = turn_from_records(records) if records is not None else None
                if turn is not None:
                    yield turn
            seen = len(entries)
            last = entries[-1] if entries else None
            await asyncio.sleep(poll)
