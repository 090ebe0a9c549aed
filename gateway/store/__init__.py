"""Store backends, chosen by name; an optional backend's dependencies load only when chosen.
One store per tenant (`StoreRegistry`), each rooted in its own folder."""

from __future__ import annotations

from pathlib import Path

from gateway.config import Settings
from gateway.exceptions import ConfigError
from gateway.store.base import ConversationSummary, ResponseLog, Store

__all__ = ["ConversationSummary", "ResponseLog", "Store", "StoreRegistry", "create_store"]


def tenant_root(settings: Settings, tenant: str) -> Path:
    root = Path(settings.storage.data_dir)
    return root if not tenant else root / "tenants" / tenant


def create_store(settings: Settings, tenant: str = "") -> Store:
    backend = settings.storage.backend
    if backend == "jsonl":
        from gateway.store.jsonl import JsonlStore

        return JsonlStore(
            tenant_root(settings, tenant),
            durability=settings.storage.durability,
            cache_size=settings.storage.cache_conversations,
        )
    if backend == "memory":
        from gateway.store.memory import MemoryStore

        return MemoryStore()
    raise ConfigError(f"config error: storage.backend: {backend!r} is not available in this build")


class StoreRegistry:
    """The store of each tenant, created and opened on first use."""

    def __init__(self, settings: Settings, default: Store | None = None) -> None:
        self.settings = settings
        self._stores: dict[str, Store] = {}
        self._opened: set[str] = set()
        if default is not None:
            self._stores[""] = default

    async def get(self, tenant: str) -> Store:
        store = self._stores.get(tenant)
        if store is None:
            store = self._stores[tenant] = create_store(self.settings, tenant)
        if tenant not in self._opened:
            await store.open()
            self._opened.add(tenant)
        return store

    def tenants_on_disk(self) -> list[str]:
        folder = Path(self.settings.storage.data_dir) / "tenants"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    async def close(self) -> None:
        for store in self._stores.values():
            await store.close()
        self._stores.clear()
        self._opened.clear()
