"""Stored chat completions (OpenAI's read API for them) over the chat-completion turns the gateway logs.

One, a page of them (by model, by metadata), their metadata set anew, their deletion.

Metadata set after the turn goes to the `metadata` side log keyed by the response id (the last
record holds), not to the response log: a response log ends with its commit, which every reader
of history relies on. A deletion is the Responses API's (`StoredResponses.delete`): a tombstone in
the response log and a marker in its conversation, so the turn leaves the history as well.
"""

from __future__ import annotations

import time
from dataclasses import replace

from gateway.context.records import StoredCompletion
from gateway.exceptions import NotFound
from gateway.ids import is_valid_response_id
from gateway.services.responses import StoredResponses
from gateway.store import StoreRegistry
from gateway.store.base import Store

# With a metadata filter a page reads the completions it walks this many at a time.
FILTERED_BATCH = 100


class StoredCompletions:
    def __init__(self, stores: StoreRegistry, responses: StoredResponses) -> None:
        self.stores = stores
        self.responses = responses

    async def get(self, tenant: str, completion_id: str) -> StoredCompletion:
        """The stored chat completion `completion_id`.

        NotFound unless it is a committed, undeleted chat-completion turn of this tenant.
        """
        store = await self.stores.get(tenant)
        found = await _read(store, [completion_id]) if is_valid_response_id(completion_id) else [None]
        if found[0] is None:
            raise NotFound(f"No chat completion found with id {completion_id!r}", param="completion_id")
        return found[0]

    async def page(
        self,
        tenant: str,
        *,
        limit: int,
        after: str | None = None,
        descending: bool = False,
        model: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> tuple[list[StoredCompletion], bool]:
        """Up to `limit` stored chat completions in the order of their requests, and whether more follow.

        They come after completion `after`, of `model` and holding every pair of `metadata`. The
        store pages by API and model; a metadata filter is checked here, on the completions walked
        until the page is full (or none are left).
        """
        store = await self.stores.get(tenant)
        batch = max(limit + 1, FILTERED_BATCH) if metadata else limit + 1
        found: list[StoredCompletion] = []
        cursor = after
        while True:
            ids, more = await store.list_responses(
                batch, api="chat", model=model, after=cursor, descending=descending
            )
            for completion in await _read(store, ids):
                if completion is not None and _holds(completion, metadata):
                    found.append(completion)
            if len(found) > limit or not more or not ids:
                return found[:limit], len(found) > limit
            cursor = ids[-1]

    async def update(
        self, tenant: str, completion_id: str, metadata: dict[str, str] | None
    ) -> StoredCompletion:
        """Set the completion's metadata (all of it: None clears it)."""
        completion = await self.get(tenant, completion_id)
        pairs = dict(metadata or {})
        store = await self.stores.get(tenant)
        await store.append_side("metadata", completion_id, {"metadata": pairs, "at": time.time()})
        return replace(completion, metadata=pairs)

    async def delete(self, tenant: str, completion_id: str) -> None:
        """Delete the turn as the Responses API's delete does: it leaves its conversation's history too.

        A 404 unless it is a stored chat completion.
        """
        await self.get(tenant, completion_id)
        await self.responses.delete(tenant, completion_id)


async def _read(store: Store, ids: list[str]) -> list[StoredCompletion | None]:
    """The stored chat completions these responses are (None for those that are not)."""
    if not ids:
        return []
    records = await store.read_turns(ids)
    updates = await store.read_sides("metadata", ids)
    return [StoredCompletion.of(rid, r, u) for rid, r, u in zip(ids, records, updates, strict=True)]


def _holds(completion: StoredCompletion, metadata: dict[str, str] | None) -> bool:
    return not metadata or all(completion.metadata.get(k) == v for k, v in metadata.items())
