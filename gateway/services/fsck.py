"""`gateway fsck`: every tenant's store looked over for damage a reader would trip on.

Optionally repaired too: damaged lines and files set aside in quarantine, never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.config import Settings
from gateway.store import StoreRegistry
from gateway.store.base import Damage


@dataclass(frozen=True, slots=True)
class FsckReport:
    damage: list[Damage]  # paths relative to the data dir (jsonl) or naming the table (postgres)
    repair: bool

    @property
    def repaired(self) -> list[Damage]:
        return [d for d in self.damage if d.repaired]

    @property
    def remaining(self) -> list[Damage]:
        """What is still wrong (everything found, without a repair)."""
        return [d for d in self.damage if not d.repaired]


class Fsck:
    def __init__(self, settings: Settings, stores: StoreRegistry) -> None:
        self.settings = settings
        self.stores = stores

    async def run(self, *, repair: bool = False) -> FsckReport:
        found: list[Damage] = []
        jsonl = self.settings.storage.backend == "jsonl"
        for tenant in ["", *await self.stores.tenants()]:
            store = await self.stores.get(tenant)
            prefix = "" if not tenant else f"tenants/{tenant}/" if jsonl else f"namespace {tenant}: "
            for damage in await store.check(repair=repair, lock_timeout=self.settings.storage.lock_timeout):
                found.append(replace(damage, path=prefix + damage.path))
        return FsckReport(found, repair)
