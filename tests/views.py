"""Conversation views over a bare store, for store tests: each store instance gets its own
cache (as each process has), so revalidation against another writer is exercised too."""

from __future__ import annotations

import weakref

from gateway.context import ConversationView
from gateway.services.cache import ConversationCache
from gateway.services.queries import ConversationSummary
from gateway.store.base import Store

_CACHES: weakref.WeakKeyDictionary[Store, ConversationCache] = weakref.WeakKeyDictionary()


def cache_of(store: Store) -> ConversationCache:
    cache = _CACHES.get(store)
    if cache is None:
        cache = _CACHES[store] = ConversationCache()
    return cache


async def load(store: Store, cid: str) -> ConversationView:
    return await cache_of(store).load(store, cid)


async def list_conversations(store: Store) -> list[ConversationSummary]:
    """Every conversation, most recently active first, with its counts."""
    out = []
    for cid, changed in await store.conversation_ids():
        out.append(ConversationSummary.of(cid, await load(store, cid), changed))
    return out
