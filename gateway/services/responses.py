"""Stored responses (the Responses API's reads and deletes): a response's log, and deleting one.

Deleting one writes a tombstone in its log and, under the conversation's lock, a marker in the
conversation.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from dataclasses import replace

from gateway.config import Settings
from gateway.context.records import StoredResponse
from gateway.exceptions import InvalidRequest, NotFound
from gateway.services.cache import ConversationCache
from gateway.services.recap import withdraw_recaps
from gateway.services.summaries import withdraw
from gateway.store import StoreRegistry
from gateway.store.base import Store
from gateway.types import Record, as_object
from gateway.writers import gone

# How often a wait for a response running in another process looks at its log, in seconds.
ENDED_POLL = 0.2


class StoredResponses:
    def __init__(self, settings: Settings, stores: StoreRegistry, cache: ConversationCache) -> None:
        self.settings = settings
        self.stores = stores
        self.cache = cache

    async def get(self, tenant: str, rid: str) -> StoredResponse:
        """The response's log, read; NotFound when absent or deleted."""
        store = await self.stores.get(tenant)
        stored = StoredResponse.of(rid, await self._live_records(store, rid))
        cid = stored.conversation_id
        index = await self._index(store, cid) if stored.status == "in_progress" and cid is not None else []
        if rid in index:  # committed since the log was read? (its commit record precedes the index's)
            stored = StoredResponse.of(rid, await store.read_response(rid))
            index = index if stored.status == "in_progress" else []
        if rid in index:
            # An index names only committed responses: this log lost its end (a damaged file),
            # as every reader of the conversation treats it (docs/storage.md, "Damaged files").
            raise NotFound(
                f"No response found with id {rid!r}: its log is not complete (gateway fsck reports it)",
                param="response_id",
            )
        # The index grew after the attempt began: its conversation's lock, held until a turn
        # ends, was let go, so the attempt is over. Its process is gone where that cannot be
        # seen (another host's replica, on PostgreSQL): read there as in progress for ever.
        began = as_object(stored.request.get("before")).get("entries")
        moved_on = isinstance(began, int) and len(index) > began
        if stored.status == "in_progress" and (moved_on or gone(stored.request.get("writer"))):
            # Its process stopped (killed) before the attempt ended: incomplete, not in progress.
            message = "The gateway process handling this request stopped before it finished"
            error = {"message": message, "type": "server_error", "param": None, "code": "interrupted"}
            stored = replace(stored, outcome={"type": "incomplete", "reason": "interrupted", "error": error})
        return stored

    async def ask_cancel(self, tenant: str, rid: str) -> None:
        """Ask the process running background response `rid` to cancel it (it looks every
        CANCEL_POLL seconds)."""
        store = await self.stores.get(tenant)
        await store.append_side("cancels", rid, {"type": "cancel", "at": time.time()})

    async def cancel_asked(self, tenant: str, rid: str) -> bool:
        """Whether a cancel of background response `rid` was asked (by any process)."""
        store = await self.stores.get(tenant)
        return bool(await store.read_side("cancels", rid, keep=False))

    async def ended(self, tenant: str, rid: str, within: float) -> StoredResponse:
        """The response once it is no longer in progress, or as it is after `within` seconds."""
        deadline = time.monotonic() + within
        while True:
            stored = await self.get(tenant, rid)
            if stored.status != "in_progress" or time.monotonic() >= deadline:
                return stored
            await asyncio.sleep(ENDED_POLL)

    @staticmethod
    async def _index(store: Store, cid: str) -> list[str | Record]:
        try:
            return await store.read_index(cid)
        except NotFound:  # the conversation is gone: its responses are no longer indexed
            return []

    async def delete(self, tenant: str, rid: str) -> None:
        """Delete response `rid` once: of deletes racing, one is done and the others are a 404.

        Whether it is still there is asked again under a lock (its conversation's, or for a
        stateless response one named from its id), as the tombstone is written."""
        store = await self.stores.get(tenant)
        cid = (await self.get(tenant, rid)).conversation_id
        if cid is None:
            async with store.lock(_deleting(rid), self.settings.storage.lock_timeout):
                await self._live_records(store, rid)
                await store.tombstone(rid)
            return
        lock_timeout = self.settings.storage.lock_timeout
        await withdraw_recaps(store, functools.partial(self.cache.load, store, keep=False), cid, lock_timeout)
        # Branches sharing it first, each under its own lock (never two at once): its summaries
        # withdrawn, and a marker in its index, so that every process's cached view of the
        # branch leaves it out too (the response file's tombstone alone is seen only by a
        # process that reads the branch anew).
        marker = {"type": "delete_response", "response_id": rid, "at": time.time()}
        for other in await store.sharing(cid, rid):
            async with store.lock(other, self.settings.storage.lock_timeout):
                if _marked(await self._index(store, other), rid):  # (by a delete racing this one)
                    continue
                await withdraw(store, other, rid, functools.partial(self.cache.load, store, other))
                await store.append_marker(other, marker)
        async with store.lock(cid, self.settings.storage.lock_timeout):
            await self._live_records(store, rid)
            exists = await store.exists(cid)
            if exists:
                await withdraw(store, cid, rid, functools.partial(self.cache.load, store, cid))
            await store.tombstone(rid)
            if exists:
                await store.append_marker(cid, marker)

    @staticmethod
    async def _live_records(store: Store, rid: str) -> list[Record]:
        """The response's log; NotFound when absent or deleted (also: deleted meanwhile)."""
        records = await store.read_response(rid)
        if not records or records[-1].get("type") == "deleted":
            raise NotFound(f"No response found with id {rid!r}", param="response_id")
        return records

    async def named_conversation(self, tenant: str, cid: str) -> str:
        """A conversation a request names (`conversation`), which must exist, as in OpenAI's API.

        A mistyped or deleted id is a 404, not a new conversation that knows nothing. (Chat
        completions' `conversation_id` starts one instead: that is how they begin.)
        """
        store = await self.stores.get(tenant)
        if await store.exists(cid):
            return cid
        # A conversation whose first turn is running (a background response's) is there once that
        # turn ends.
        await store.settled(cid, self.settings.storage.lock_timeout)
        if await store.exists(cid):
            return cid
        raise NotFound(f"No conversation found with id {cid!r}", param="conversation")

    async def continued_conversation(self, tenant: str, previous: object) -> str:
        """The conversation a `previous_response_id` belongs to.

        Whether the turn continues on it or on a fork made at that response is decided by the
        turn, under the lock.
        """
        if not isinstance(previous, str):
            raise InvalidRequest("'previous_response_id' must be a string", param="previous_response_id")
        try:
            records = await (await self.stores.get(tenant)).read_response(previous)
        except NotFound:
            records = []
        request = next((r for r in records if r.get("type") == "request"), {})
        # One still running (a background response, a turn in flight) is waited for: the turn
        # takes its conversation's lock, which that turn holds until it ends, then finds it there.
        running = bool(request) and not any(r.get("type") in ("commit", "incomplete") for r in records)
        if not records or (records[-1].get("type") != "commit" and not running):
            raise NotFound(f"Response {previous!r} is not a completed response", param="previous_response_id")
        cid = request.get("conversation_id")
        if not isinstance(cid, str):
            raise InvalidRequest(
                f"Response {previous!r} is in no conversation (a request with store=false, or a "
                "stateless chat completion): it cannot be continued",
                param="previous_response_id",
            )
        return cid


def _deleting(rid: str) -> str:
    """The name of the lock a stateless response's delete holds (a conversation id's shape)."""
    return "deleting." + hashlib.sha256(rid.encode()).hexdigest()[:32]


def _marked(index: list[str | Record], rid: str) -> bool:
    """Does this index already hold the marker of `rid`'s delete?"""
    marker = {"type": "delete_response", "response_id": rid}
    return any(isinstance(e, dict) and marker.items() <= e.items() for e in index)
