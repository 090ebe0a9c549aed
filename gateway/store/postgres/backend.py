"""One asyncpg pool and one advisory-lock connection per (dsn, durability, event loop).

Shared by every tenant's store in a process."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

import asyncpg

from gateway.exceptions import StorageError
from gateway.redact import redact_dsn
from gateway.store.postgres.outage import Outage, quiet_asyncpg_pool
from gateway.store.postgres.schema import (
    COMMAND_TIMEOUT,
    POOL_SIZE,
    bad_dsn,
    map_errors,
    migrate,
)

log = logging.getLogger("gateway.store")
T = TypeVar("T")

# -- one pool and one lock connection per (dsn, durability, event loop) -----------------------


class SharedBackend:
    """A pool for queries and one session for advisory locks, shared by every tenant's store.

    The session holds the advisory locks of this process's busy conversations."""

    def __init__(self, dsn: str, durability: str, loop: asyncio.AbstractEventLoop) -> None:
        self.dsn = dsn
        self.durability = durability
        self.loop = loop
        self.pool: asyncpg.Pool[asyncpg.Record] | None = None
        self.users = 0
        self._opening = asyncio.Lock()
        self._lock_conn: asyncpg.Connection[asyncpg.Record] | None = None
        self._lock_mutex = asyncio.Lock()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._local: weakref.WeakValueDictionary[int, asyncio.Lock] = weakref.WeakValueDictionary()
        self.outage = Outage(redact_dsn(dsn))
        quiet_asyncpg_pool()

    def local_lock(self, key: int) -> asyncio.Lock:
        lock = self._local.get(key)
        if lock is None:
            lock = self._local[key] = asyncio.Lock()
        return lock

    @property
    def open_pool(self) -> asyncpg.Pool[asyncpg.Record]:
        """The pool, once `acquire` has opened it."""
        if self.pool is None:
            raise StorageError("PostgreSQL storage is not open")
        return self.pool

    def _settings(self) -> dict[str, str]:
        settings = {"application_name": "gateway"}
        if self.durability == "none":
            settings["synchronous_commit"] = "off"
        return settings

    async def acquire(self) -> None:
        async with self._opening:
            if self.pool is None:
                with (
                    map_errors(f"cannot open PostgreSQL storage at {redact_dsn(self.dsn)}"),
                    bad_dsn(self.dsn),
                ):
                    pool = await asyncpg.create_pool(
                        self.dsn,
                        min_size=1,
                        max_size=POOL_SIZE,
                        command_timeout=COMMAND_TIMEOUT,
                        server_settings=self._settings(),
                    )
                    try:
                        async with pool.acquire() as conn:
                            await migrate(conn)
                    except BaseException:
                        await pool.close()
                        raise
                self.pool = pool
            self.users += 1

    async def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        for task in list(self._tasks):
            await asyncio.wait([task], timeout=5)
        if self._lock_conn is not None:
            with map_errors("closing the lock connection"):
                await self._lock_conn.close()
            self._lock_conn = None
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), 10)
            except TimeoutError:  # a connection still busy: do not hang the shutdown on it
                self.pool.terminate()
            self.pool = None
        _BACKENDS.get(self.loop, {}).pop((self.dsn, self.durability), None)

    def spawn(self, coro: Awaitable[T]) -> asyncio.Future[T]:
        """Run to completion even if the awaiting request is cancelled."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        return task

    async def _lock_call(self, sql: str, *args: int) -> bool:
        async with self._lock_mutex:
            conn = self._lock_conn
            if conn is None or conn.is_closed():
                if conn is not None and not self.outage.ongoing:
                    log.warning("the PostgreSQL lock connection was lost; reconnecting")
                with map_errors("cannot connect for conversation locks", self.outage):
                    conn = self._lock_conn = await asyncpg.connect(
                        self.dsn,
                        command_timeout=COMMAND_TIMEOUT,
                        server_settings={"application_name": "gateway-locks"},
                    )
            with map_errors("conversation lock", self.outage):
                return bool(await conn.fetchval(sql, *args))

    async def try_lock(self, key: int, line: tuple[int, int] | None = None) -> bool:
        """Try to take a conversation's advisory lock; False when it is held, or in line.

        With `line` (its queue, this waiter's place), a waiter of another replica standing in
        line before this one keeps it from being taken."""
        if line is None:
            call = self._lock_call("SELECT pg_try_advisory_lock($1)", key)
        else:
            call = self._lock_call(_TRY_IN_TURN, key, *line)
        task = self.spawn(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Cancelled while asking: if the lock was granted after all, give it back.
            def undo(t: asyncio.Future[bool]) -> None:
                if not t.cancelled() and t.exception() is None and t.result():
                    self.spawn(self.unlock(key))

            task.add_done_callback(undo)
            raise

    async def stand_in_line(self, line: tuple[int, int]) -> None:
        """Hold a shared advisory lock (queue, place): replicas' later waiters let this one first.

        Runs to completion even if the caller is cancelled (who then leaves the line)."""
        call = self._lock_call("SELECT pg_advisory_lock_shared($1::int4, $2::int4)", *line)
        await asyncio.shield(self.spawn(call))

    async def leave_line(self, line: tuple[int, int]) -> None:
        """Give the place back; runs to completion even if the caller is cancelled."""

        async def leave() -> None:
            try:
                await self._lock_call("SELECT pg_advisory_unlock_shared($1::int4, $2::int4)", *line)
            except StorageError as exc:  # the session is gone, and with it the place in line
                log.warning("could not leave a conversation's line: %s", exc.message)

        await asyncio.shield(self.spawn(leave()))

    async def unlock(self, key: int) -> None:
        try:
            await self._lock_call("SELECT pg_advisory_unlock($1)", key)
        except StorageError as exc:  # the session is gone, and with it the lock
            log.warning("could not release a conversation lock: %s", exc.message)


# Arrival order across replicas: every request waiting for a conversation holds a shared
# advisory lock (queue, place) in the two-int4 key space (apart from the conversations' int8 keys):
# queue = 31 bits of the conversation's key, place = its arrival in wall-clock milliseconds modulo
# 2^31 (24.8 days; replicas on several hosts share that clock). The lock is taken only when no
# other session holds a place in the same queue before it.
_TRY_IN_TURN = """
SELECT CASE WHEN EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND pid <> pg_backend_pid()
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = $2::int4::oid AND objid < $3::int4::oid
) THEN false ELSE pg_try_advisory_lock($1) END
"""


_BACKENDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], SharedBackend]] = (
    weakref.WeakKeyDictionary()
)


async def backend_for(dsn: str, durability: str) -> SharedBackend:
    loop = asyncio.get_running_loop()
    backends = _BACKENDS.setdefault(loop, {})
    backend = backends.get((dsn, durability))
    if backend is None:
        backend = backends[(dsn, durability)] = SharedBackend(dsn, durability, loop)
    await backend.acquire()
    return backend
