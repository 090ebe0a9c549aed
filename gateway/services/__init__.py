"""Use cases: the only users of the store.

HTTP handlers, commands and background jobs call these; the pure core (`gateway.context`) and the
providers (`gateway.upstream`) are called from here. One `Services` per app (or per command),
created from the settings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.config import Settings
from gateway.exceptions import GatewayError
from gateway.services.cache import ConversationCache
from gateway.services.compaction import Compactions
from gateway.services.completions import StoredCompletions
from gateway.services.conversations import Conversations
from gateway.services.fsck import Fsck
from gateway.services.model_catalog import ModelCatalog
from gateway.services.models import ModelFacts
from gateway.services.queries import Queries
from gateway.services.responses import StoredResponses
from gateway.services.sessions import Sessions
from gateway.services.summaries import Summaries
from gateway.services.turns import ChatService
from gateway.store import Store, StoreRegistry, create_store, require_data, tenant_root
from gateway.upstream import Router

log = logging.getLogger("gateway.services")

__all__ = ["Services", "StoreBackend"]

# /readyz probes the store at most this often, and waits at most this long for it.
PROBE_EVERY = 2.0
PROBE_TIMEOUT = 2.0

# The store seam's type, for the composition root and tests that hand in a twin.
StoreBackend = Store


class Services:
    def __init__(self, settings: Settings, router: Router, stores: StoreRegistry) -> None:
        self.settings = settings
        self.router = router
        self.stores = stores
        self.facts = ModelFacts(settings)
        self.cache = ConversationCache.of(settings)
        self.turns = ChatService(settings, router, stores=stores, facts=self.facts, cache=self.cache)
        self.summaries = Summaries(settings, router, stores, self.facts, self.cache)
        self.compactions = Compactions(settings, stores, self.cache, self.summaries, self.facts, router)
        self.sessions = Sessions(settings, stores, self.summaries, self.cache)
        self.conversations = Conversations(settings, stores, self.cache)
        self.responses = StoredResponses(settings, stores, self.cache)
        self.completions = StoredCompletions(stores, self.responses)
        self.queries = Queries(stores, self.cache, settings.sessions.ttl)
        self.model_catalog = ModelCatalog(settings, router)
        self.fsck = Fsck(settings, stores)
        self._probed_at: float | None = None
        self._probe_failure: str | None = None

    @classmethod
    @asynccontextmanager
    async def for_command(cls, settings: Settings, *, writes: bool = False) -> AsyncIterator[Services]:
        """The services of one command.

        A JSONL store is opened (which creates the data dir) only by commands that write; reads
        need no durability. A command finds a PostgreSQL database without the gateway's tables an
        error (`NoGatewayData`), and leaves it so (opening the store would make them).
        """
        if not writes and settings.storage.backend == "jsonl":
            settings = settings.model_copy(
                update={"storage": settings.storage.model_copy(update={"durability": "none"})}
            )
        await require_data(settings)
        store = create_store(settings)
        if settings.storage.backend != "jsonl" or writes:
            await store.open()
        try:
            yield cls.from_settings(settings, store=store, opened=True)
        finally:
            await store.close()

    @staticmethod
    def data_folder(settings: Settings, tenant: str = "") -> str:
        """Where a tenant's JSONL files are (the data dir itself without keys)."""
        return str(tenant_root(settings, tenant))

    @staticmethod
    async def check_store(settings: Settings) -> None:
        """Open (and migrate) the store once, before any worker starts.

        An unreachable database or an unwritable data dir is then one clear error.
        """
        backend = settings.storage.backend
        where = settings.storage.data_dir if backend == "jsonl" else backend
        try:
            store = create_store(settings)
            await store.open()
            await store.close()
        except GatewayError:
            raise
        except Exception as exc:
            raise GatewayError(f"cannot open the {backend} store ({where}): {exc}") from None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        store: Store | None = None,
        router: Router | None = None,
        opened: bool = False,
    ) -> Services:
        """`store`: the default tenant's store (a test twin, or one the caller opened itself)."""
        stores = StoreRegistry(settings, default=store, opened=opened)
        return cls(settings, router or Router.from_settings(settings), stores)

    def refusing_writes(self) -> str | None:
        """Why some store acknowledges no more writes, or None."""
        return self.stores.refusing_writes()

    async def readiness(self) -> str | None:
        """Why this process should get no traffic now, or None.

        A store that refuses writes (a failed fsync: until restarted), else the outcome of a write
        probe made at most every PROBE_EVERY seconds, so a full, read-only or unreachable store
        takes the replica out of the load balancer and a recovered one brings it back.
        """
        sticky = self.refusing_writes()
        if sticky is not None:
            return sticky
        now = time.monotonic()
        if self._probed_at is None or now - self._probed_at >= PROBE_EVERY:
            self._probed_at = now
            try:
                async with asyncio.timeout(PROBE_TIMEOUT):
                    await (await self.stores.get("")).probe()
                self._probe_failure = None
            except (GatewayError, TimeoutError) as exc:
                self._probe_failure = getattr(exc, "message", None) or "the storage probe timed out"
        return self._probe_failure

    async def open(self) -> None:
        await self.stores.get("")

    async def warm(self) -> None:
        """Before serving, load what the first list needs, so the first request does not pay for it.

        That is the JSONL catalog, and a one-row page read (PostgreSQL prepares its statements). A
        failure is left for that request to report.
        """
        try:
            await (await self.stores.get("")).warm()
            await self.queries.conversations("", limit=1)
        except GatewayError as exc:
            log.warning("could not load the conversation catalog: %s", exc.message)

    async def aclose(self) -> None:
        await self.router.aclose()
        await self.stores.close()
