"""Store backends, chosen by name; an optional backend's dependencies load only when chosen."""

from __future__ import annotations

from gateway.config import Settings
from gateway.exceptions import ConfigError
from gateway.store.base import ConversationSummary, ResponseLog, Store

__all__ = ["ConversationSummary", "ResponseLog", "Store", "create_store"]


def create_store(settings: Settings) -> Store:
    backend = settings.storage.backend
    if backend == "jsonl":
        from gateway.store.jsonl import JsonlStore

        return JsonlStore(
            settings.storage.data_dir,
            durability=settings.storage.durability,
            cache_size=settings.storage.cache_conversations,
        )
    if backend == "memory":
        from gateway.store.memory import MemoryStore

        return MemoryStore()
    raise ConfigError(f"config error: storage.backend: {backend!r} is not available in this build")
