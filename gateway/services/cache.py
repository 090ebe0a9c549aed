"""Assembled conversations, cached per process for every backend alike.

A conversation is read once, then only what was appended since (the store's `Version` says what
that is), so a turn never re-reads history, and appends by other processes or replicas are
always seen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import Settings
from gateway.context import ConversationView
from gateway.context.history import NotLoaded
from gateway.services.tail import apply_entries, tail_view
from gateway.store.base import LRU, Appended, IndexRead, Store, Version
from gateway.types import Record

log = logging.getLogger("gateway.services")

# Responses already warned about (a bounded set: damage must not grow memory either).
WARNED_LIMIT = 4096


@dataclass(slots=True)
class _Cached:
    version: Version
    view: ConversationView


def _weight(cached: _Cached) -> int:
    return len(cached.view.transcript) + len(cached.view.prefix_ids) // 8 + 1


class ConversationCache:
    """Keyed by (store, conversation): every tenant has its own store."""

    def __init__(self, size: int = 1024, messages: int = 10_000) -> None:
        """A cache of at most `size` conversations and `messages` stored messages in all.

        The conversation in use is kept even when it alone holds more: a view's memory grows with
        its turns.
        """
        self._views: LRU[tuple[int, str], _Cached] = LRU(size, weigh=_weight, budget=messages)
        self._warned: LRU[str, bool] = LRU(WARNED_LIMIT)

    @classmethod
    def of(cls, settings: Settings) -> ConversationCache:
        return cls(settings.storage.cache_conversations, settings.storage.cache_messages)

    def skipped(self, cid: str, rid: str, records: list[Record]) -> None:
        """The rule for an index entry whose response is missing, empty or not committed.

        Every reader of the conversation leaves it out, with one warning per response per process
        (a deleted response is left out silently: that is no damage).
        """
        if (records and records[-1].get("type") == "deleted") or self._warned.get(rid):
            return
        self._warned[rid] = True
        why = "its response file is missing or empty" if not records else "not a committed turn"
        log.warning("the index of %s names %s, %s: skipped (gateway fsck reports it)", cid, rid, why)

    async def load(
        self, store: Store, cid: str, *, keep: bool = True, tail: int = 0, through: str | None = None
    ) -> ConversationView:
        """The conversation as stored (empty if new); callers must not mutate it.

        Readers that go over many conversations (lists, the lifecycle pass, recaps) pass
        `keep=False`: a cached view is used and brought up to date, but none is added for them, so
        they neither grow memory nor push out the conversations that are talking.

        With `tail`, a partial view (`ConversationView.partial`) holding at least the newest
        `tail` history messages, and the turn `through` names, will do: the index is read, then
        only the responses those need (`tail_view`). Without, the view is whole.
        """
        key = (id(store), cid)
        cached = self._views.get(key)
        if cached is not None and cached.view.partial and not tail:
            cached = None  # all of it is asked for
        if cached is None and tail:
            found = await tail_view(store, cid, tail, through, self.skipped)
            if found is None:  # no such conversation: what reading all of it would find too
                return ConversationView()
            if keep:
                self._views[key] = _Cached(*found)
            return found[1]
        since = cached.version if cached is not None else None
        read = await store.read_conversation(cid, since)
        view = self._apply(key, cached, since, read, keep)
        return view if view is not None else await self.load(store, cid, keep=keep)

    async def load_many(
        self, store: Store, cids: list[str], *, keep: bool = True, tail: int = 0
    ) -> list[ConversationView]:
        """`load` of several conversations with one `read_many`.

        A page of a list is one query on PostgreSQL instead of one per row. With `tail`, each is
        loaded as `load` with it.
        """
        if tail:
            return [await self.load(store, cid, keep=keep, tail=tail) for cid in cids]
        keys = [(id(store), cid) for cid in cids]
        cached = [self._views.get(key) for key in keys]
        cached = [c if c is not None and not c.view.partial else None for c in cached]  # all of it
        since = [c.version if c else None for c in cached]
        reads = await store.read_many(list(zip(cids, since, strict=True)))
        views = [self._apply(*args, keep) for args in zip(keys, cached, since, reads, strict=True)]
        return [
            view if view is not None else await self.load(store, cid, keep=keep)
            for cid, view in zip(cids, views, strict=True)
        ]

    def _apply(
        self,
        key: tuple[int, str],
        cached: _Cached | None,
        since: Version | None,
        read: IndexRead,
        keep: bool,
    ) -> ConversationView | None:
        """A cached view (or a new one) brought up to date with what was read since `since`.

        None when the caller must load again: what changed is outside what a partial view holds,
        or the cached view moved on while the read was under way (a turn of this process, or
        another reader, applied entries the read has too: applying them again would repeat them).
        """
        cid = key[1]
        if cached is not None and (cached.version != since or self._views.get(key) is not cached):
            return None
        if read.version is None:
            self._views.pop(key, None)
            return ConversationView()
        view = cached.view if cached is not None and not read.restarted else ConversationView()
        try:
            apply_entries(view, cid, read.entries, self.skipped)
        except NotLoaded:  # a change to what a partial view does not hold: read all of it
            self._views.pop(key, None)
            return None
        if keep or cached is not None:
            self._views[key] = _Cached(read.version, view)
        return view

    def appended(
        self, store: Store, cid: str, appended: Appended | None, apply: Callable[[ConversationView], None]
    ) -> None:
        """Our own append: a cached view that was at its `before` takes it without a re-read."""
        key = (id(store), cid)
        cached = self._views.get(key)
        if cached is None:
            return
        if appended is None or cached.version != appended.before:
            self._views.pop(key, None)  # someone else appended too: read it next time
            return
        try:
            apply(cached.view)
        except NotLoaded:
            self._views.pop(key, None)
            return
        cached.version = appended.after
        self._views[key] = cached  # weighed again: it grew

    def forget(self, store: Store, cid: str) -> None:
        self._views.pop((id(store), cid), None)
