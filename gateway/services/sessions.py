"""Conversation lifecycle, the use cases (SPEC section 8): which conversations need work, and the work.

The work: expire (archive) after `ttl`, post-process after `idle_after` (fold the whole
conversation into its summary, add it to the user's daily digest), recover a crashed processor's
lease. States are appended to `logs/lifecycle/{conversation_id}.jsonl`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.config import Settings
from gateway.context import ConversationView
from gateway.context.lifecycle import (
    ACTIVE,
    FAILED,
    PROCESSED,
    PROCESSING,
    State,
    derive_state,
    local_day,
    user_key,
    zone,
)
from gateway.services.cache import ConversationCache
from gateway.services.summaries import Summaries
from gateway.store import Store, StoreRegistry
from gateway.types import number

log = logging.getLogger("gateway.lifecycle")

Clock = Callable[[], float]


class Sessions:
    def __init__(
        self, settings: Settings, stores: StoreRegistry, summaries: Summaries, cache: ConversationCache
    ) -> None:
        self.settings = settings
        self.stores = stores
        self.summaries = summaries
        self.cache = cache
        # Called once per failed post-processing attempt: the metrics hook.
        self.on_failed: Callable[[], None] = lambda: None
        # Per tenant: every conversation whose index is older than this was settled at the last
        # pass (processed, failed, or nothing to do), so the next pass need not read its
        # lifecycle log again: a pass reads the logs of recent conversations, not of all.
        self._settled_before: dict[str, float] = {}

    async def tenants(self) -> list[str]:
        """The default tenant and every other one that has data."""
        return ["", *await self.stores.tenants()]

    async def lease(self) -> bool | None:
        """The backend's own processor lease (one per database), or None: none of its own."""
        return await (await self.stores.get("")).try_processor_lease()

    async def candidates(self, tenant: str, clock: Clock) -> list[tuple[str, float]]:
        """Conversations that may need work, found cheaply.

        An index untouched for idle_after (its mtime), and no processed or failed state newer than
        that.
        """
        store = await self.stores.get(tenant)
        sessions = self.settings.sessions
        times = await store.conversation_ids()
        now = clock()
        quiet = self.quiet()
        out = []
        before = self._settled_before.get(tenant, float("-inf"))
        for cid, modified in times:
            if now - modified < quiet:
                continue
            expired = sessions.ttl > 0 and now - modified > sessions.ttl
            if modified < before and not expired:
                continue  # settled at an earlier pass and unchanged since
            records = await store.read_side("lifecycle", cid, keep=False)
            # (an attempt covers the index as it was when it began: a turn landing meanwhile
            # changed it after that, however early the attempt's record is dated)
            last = records[-1] if records else {}
            seen = number(last.get("covers_modified")) or number(last.get("at")) or 0.0
            settled = last.get("state") in (PROCESSED, FAILED) and seen >= modified
            if settled and not expired:
                continue
            out.append((cid, modified))
        return out

    def quiet(self) -> float:
        """How long a conversation must be left alone before a pass looks at it."""
        sessions = self.settings.sessions
        return min((x for x in (sessions.idle_after, sessions.ttl) if x > 0), default=0.0)

    def settled_before(self, tenant: str, when: float) -> None:
        """After a pass: every conversation last changed before `when` is settled."""
        self._settled_before[tenant] = when

    async def state_of(self, tenant: str, cid: str) -> State:
        store = await self.stores.get(tenant)
        view = await self.cache.load(store, cid, keep=False)
        return derive_state(await store.read_side("lifecycle", cid, keep=False), view.last_activity)

    async def visit(self, tenant: str, cid: str, clock: Clock, modified: float | None = None) -> bool:
        """Do whatever the conversation needs now: expiry, lease recovery or post-processing.

        Returns whether it is settled: nothing more to do until it changes (or expires).
        """
        store = await self.stores.get(tenant)
        now = clock()
        sessions = self.settings.sessions
        view = await self.cache.load(store, cid, keep=False)  # idle: not worth a place in the cache
        last = max(view.last_activity or 0.0, modified or 0.0)
        if sessions.ttl > 0 and now - last > sessions.ttl:
            async with store.lock(cid, self.settings.storage.lock_timeout):
                # Decided without the lock: a turn may have landed since. Decide again.
                fresh = await self.cache.load(store, cid, keep=False)
                if fresh.last_activity is None or clock() - fresh.last_activity > sessions.ttl:
                    await store.delete_conversation(cid, archive=True)
                    log.info('{"event": "conversation_expired", "conversation_id": "%s"}', cid)
                    return True
            view = fresh
            last = view.last_activity or last
        state = derive_state(await store.read_side("lifecycle", cid, keep=False), view.last_activity)
        if state.state == PROCESSING:
            if state.lease_until is not None and now > state.lease_until:
                await self._record(
                    store,
                    cid,
                    clock,
                    ACTIVE if state.attempts + 1 < sessions.max_attempts else FAILED,
                    attempts=state.attempts + 1,
                    error="lease expired (processor crashed?)",
                )
            return False
        if state.state != ACTIVE:
            return True  # processed or failed
        if not view.turns:
            return True  # nothing to process until a turn comes
        if state.attempts and now - state.since < sessions.idle_after:
            # After a failed attempt, the next waits idle_after (the next pass made it at once: a
            # short outage of the summary model took every attempt).
            return False
        if sessions.idle_after > 0 and now - last >= sessions.idle_after:
            return await self.process(tenant, store, cid, view, state.attempts, clock, modified) != ACTIVE
        return sessions.idle_after <= 0

    async def _record(self, store: Store, cid: str, clock: Clock, state: str, **fields: object) -> None:
        await store.append_side("lifecycle", cid, {"state": state, "at": clock(), **fields})

    async def process(
        self,
        tenant: str,
        store: Store,
        cid: str,
        view: ConversationView,
        attempts: int,
        clock: Clock,
        modified: float | None = None,
    ) -> str:
        """Post-process the conversation and return the state it ends in.

        The attempt ends with its lease: a summary call that hangs (a provider `timeout` of hours)
        kept the conversation `processing` past `lease_until`, and every other conversation
        waiting behind it.
        """
        sessions = self.settings.sessions
        now = clock()
        await self._record(store, cid, clock, PROCESSING, attempts=attempts, lease_until=now + sessions.lease)
        covered = view.last_activity  # a turn landing from here on is not in this attempt
        seen = {"covers_activity": covered, "covers_modified": modified}
        try:
            async with asyncio.timeout(sessions.lease):
                summary = await self.summaries.summarize_all(tenant, cid, view.last_model or "")
            if view.user and summary:
                tz = zone(view.timezone, sessions.default_timezone)
                day = local_day(view.last_activity or now, tz)
                digest = {
                    "conversation_id": cid,
                    "summary": summary,
                    "at": clock(),
                    "covers_activity": covered,
                }
                await store.append_side("digests", f"{user_key(view.user)}.{day}", digest)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded as the state's error
            message = getattr(exc, "message", None) or repr(exc)
            if isinstance(exc, TimeoutError):
                message = f"post-processing took longer than its lease ({sessions.lease:g} s)"
            attempts += 1
            state = FAILED if attempts >= sessions.max_attempts else ACTIVE
            self.on_failed()
            log.warning(
                "post-processing of %s failed (attempt %d of %d): %s",
                cid,
                attempts,
                sessions.max_attempts,
                message,
            )
            await self._record(store, cid, clock, state, attempts=attempts, error=message[:500], **seen)
            return state
        await self._record(store, cid, clock, PROCESSED, attempts=attempts, **seen)
        return PROCESSED
