"""Store backends, chosen by name; an optional backend's dependencies load only when chosen.

One store per tenant (`StoreRegistry`): its own folder (jsonl) or its own namespace (postgres).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.config import Settings
from gateway.exceptions import ConfigError
from gateway.store.base import ResponseLog, Store

__all__ = ["ResponseLog", "Store", "StoreRegistry", "create_store", "require_data"]


def tenant_root(settings: Settings, tenant: str) -> Path:
    root = Path(settings.storage.data_dir)
    return root if not tenant else root / "tenants" / tenant


async def require_data(settings: Settings) -> None:
    """For a command: NoGatewayData when a PostgreSQL store holds no gateway data (opening it
    would make the tables there).

    (A JSONL data dir that is not there reads as empty: the commands that only read open none.)"""
    if settings.storage.backend == "postgres" and settings.storage.dsn:
        from gateway.store.postgres import require_schema

        await require_schema(settings.storage.dsn)


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
    if backend == "postgres":
        if not settings.storage.dsn:
            raise ConfigError('config error: storage.dsn: required when storage.backend = "postgres"')
        try:
            from gateway.store.postgres import PostgresStore
        except ImportError as exc:
            raise ConfigError(
                f"config error: storage.backend: 'postgres' needs the asyncpg package ({exc.msg})"
            ) from None
        return PostgresStore(
            settings.storage.dsn,
            namespace=tenant,
            durability=settings.storage.durability,
            cache_size=settings.storage.cache_conversations,
        )
    raise ConfigError(f"config error: storage.backend: {backend!r} is not available in this build")


class StoreRegistry:
    """The store of each tenant, created and opened on first use."""

    def __init__(self, settings: Settings, default: Store | None = None, *, opened: bool = False) -> None:
        """`default`: the default tenant's store, already opened by the caller when `opened`."""
        self.settings = settings
        self._stores: dict[str, Store] = {}
        self._opened: set[str] = set()
        self._opening: dict[str, asyncio.Future[Store]] = {}
        if default is not None:
            self._stores[""] = default
            if opened:
                self._opened.add("")

    async def get(self, tenant: str) -> Store:
        if tenant in self._opened:
            return self._stores[tenant]
        # Concurrent first requests of a tenant share one opening (a backend opened twice
        # would count its users twice and release them once).
        opening = self._opening.get(tenant)
        if opening is None:
            opening = self._opening[tenant] = asyncio.ensure_future(self._open(tenant))
            opening.add_done_callback(lambda _: self._opening.pop(tenant, None))
        return await asyncio.shield(opening)

    async def _open(self, tenant: str) -> Store:
        store = self._stores.get(tenant)
        if store is None:
            store = self._stores[tenant] = create_store(self.settings, tenant)
        await store.open()
        self._opened.add(tenant)
        return store

    def refusing_writes(self) -> str | None:
        """Why some opened store acknowledges no more writes (they share one disk), or None."""
        return next((r for s in self._stores.values() if (r := s.refusing_writes) is not None), None)

    def tenants_on_disk(self) -> list[str]:
        if self.settings.storage.backend == "postgres":
            # In the database, not on disk: the tenants this process has served (see `tenants`).
            return sorted(t for t in self._stores if t)
        folder = Path(self.settings.storage.data_dir) / "tenants"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    async def tenants(self) -> list[str]:
        """Every tenant other than the default one that has data (also across replicas)."""
        if self.settings.storage.backend == "postgres":
            store = await self.get("")
            namespaces = getattr(store, "namespaces", None)
            if namespaces is not None:
                return [t for t in await namespaces() if t]
        return self.tenants_on_disk()

    async def close(self) -> None:
        for store in self._stores.values():
            await store.close()
        self._stores.clear()
        self._opened.clear()
