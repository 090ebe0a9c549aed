"""Read-only use cases: conversation lists with their lifecycle state (the API, the inspector
and `gateway conversations` share one), a conversation's turns, a response's log, the latest
context snapshot. No lock: reads never write (a torn last line is left to the lock's holder)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.context import ConversationView, Turn
from gateway.context.lifecycle import State, derive_state
from gateway.exceptions import NotFound
from gateway.store import Store, StoreRegistry
from gateway.store.base import ConversationSummary
from gateway.store.records import turn_from_records

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConversationRow:
    """One conversation in a list: its counts, its assembled view and its lifecycle state."""

    summary: ConversationSummary
    view: ConversationView
    state: State

    @property
    def conversation_id(self) -> str:
        return self.summary.conversation_id


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def latest(records: list[Record], kind: str) -> Record | None:
    """The last record of a kind (a refitted turn has two `context` records: the last was sent)."""
    return next((r for r in reversed(records) if r.get("type") == kind), None)


def first(records: list[Record], kind: str) -> Record | None:
    return next((r for r in records if r.get("type") == kind), None)


class Queries:
    def __init__(self, stores: StoreRegistry) -> None:
        self.stores = stores

    async def _row(self, store: Store, summary: ConversationSummary) -> ConversationRow:
        view = await store.load(summary.conversation_id)
        state = derive_state(await store.read_side("lifecycle", summary.conversation_id), view.last_activity)
        return ConversationRow(summary, view, state)

    async def conversations(
        self, tenant: str, *, limit: int, after: str | None = None
    ) -> tuple[list[ConversationRow], bool]:
        """Most recently active first; (a page of rows, whether more follow)."""
        store = await self.stores.get(tenant)
        summaries = await store.list_conversations()
        if after:
            ids = [s.conversation_id for s in summaries]
            if after not in ids:
                raise NotFound(f"No conversation {after!r} in this list", param="after")
            summaries = summaries[ids.index(after) + 1 :]
        rows = [await self._row(store, summary) for summary in summaries[:limit]]
        return rows, len(summaries) > limit

    async def search(self, tenant: str, query: str, *, limit: int = 200) -> list[ConversationRow]:
        """Conversations whose id, user or text contains `query` (case-insensitive)."""
        store = await self.stores.get(tenant)
        query = query.strip().lower()
        out = []
        for summary in await store.list_conversations():
            view = await store.load(summary.conversation_id)
            if query:
                haystack = [summary.conversation_id.lower(), (view.user or "").lower()]
                haystack += [text_of(m).lower() for m in view.transcript]
                if not any(query in h for h in haystack):
                    continue
            state = derive_state(
                await store.read_side("lifecycle", summary.conversation_id), view.last_activity
            )
            out.append(ConversationRow(summary, view, state))
            if len(out) >= limit:
                break
        return out

    async def view(self, tenant: str, cid: str) -> ConversationView:
        return await (await self.stores.get(tenant)).load(cid)

    async def state(self, tenant: str, cid: str, view: ConversationView) -> State:
        store = await self.stores.get(tenant)
        return derive_state(await store.read_side("lifecycle", cid), view.last_activity)

    async def index(self, tenant: str, cid: str) -> list[str | Record]:
        return await (await self.stores.get(tenant)).read_index(cid)

    async def records(self, tenant: str, response_id: str) -> list[Record]:
        """A response's log, as written (empty when there is none)."""
        return await (await self.stores.get(tenant)).read_response(response_id)

    async def summaries(self, tenant: str, cid: str) -> list[Record]:
        return [
            r for r in await (await self.stores.get(tenant)).read_summaries(cid) if r.get("type") == "summary"
        ]

    async def turns(self, tenant: str, cid: str) -> list[Turn]:
        """The committed turns named by the conversation's index, oldest first."""
        store = await self.stores.get(tenant)
        turns = []
        for entry in await store.read_index(cid):
            if isinstance(entry, str):
                turn = turn_from_records(await store.read_response(entry))
                if turn is not None:
                    turns.append(turn)
        return turns

    async def latest_context(self, tenant: str, cid: str) -> tuple[str, Record]:
        """(response id, its context snapshot) of the newest turn that recorded one."""
        store = await self.stores.get(tenant)
        ids = [e for e in await store.read_index(cid) if isinstance(e, str)]
        for rid in reversed(ids):
            context = latest(await store.read_response(rid), "context")
            if context is not None:
                return rid, context
        raise NotFound(f"Conversation {cid!r} has no recorded context yet", param="conversation_id")

    async def follow(self, tenant: str, cid: str, poll: float) -> AsyncIterator[Turn]:
        store = await self.stores.get(tenant)
        async for turn in store.follow(cid, poll=poll):
            yield turn
