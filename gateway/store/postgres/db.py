"""One tenant's database: its queries and transactions, and whether it takes writes.

The layer under the store and its helpers, on the pool this process shares for the DSN
(`backend.SharedBackend`): it knows connections, namespaces and the statements every write
shares (a response's rows, an index entry), nothing of conversations or locks. Each operation
tells the backend's `Outage` whether the database was reached (`map_errors`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson

from gateway.exceptions import StorageError
from gateway.store.postgres.backend import SharedBackend, backend_for
from gateway.store.postgres.schema import (
    APPEND,
    INSERT_RECORDS,
    INSERT_UNLESS_COMMITTED,
    Conflict,
    Conn,
    Row,
    map_errors,
)
from gateway.types import JSONObject

READ_ONLY = "takes no writes (read-only: a standby, or in recovery)"
READ_ONLY_HOLD = 5.0  # seconds a database seen read-only is taken to be so
T = TypeVar("T")


class Db:
    """One namespace of a shared database, on the pool of this process's event loop."""

    def __init__(self, dsn: str, durability: str, namespace: str) -> None:
        self.dsn = dsn
        self.durability = durability
        self.namespace = namespace
        self._backend: SharedBackend | None = None
        # When the database was last seen taking no writes (a standby): turns are refused
        # before their provider is asked, for READ_ONLY_HOLD seconds (the probe looks again).
        self._read_only_at: float | None = None

    # -- connections ------------------------------------------------------------------------------
    async def backend(self) -> SharedBackend:
        """The shared pool and lock session of the running event loop, connected on first use."""
        backend = self._backend
        if backend is None or backend.loop is not asyncio.get_running_loop() or backend.pool is None:
            # First use, or a new event loop (a CLI command may run several): connect anew.
            self._backend = backend = await backend_for(self.dsn, self.durability)
        return backend

    async def close(self) -> None:
        """Give back this store's share of the backend (closed when its last user leaves)."""
        backend, self._backend = self._backend, None
        if backend is not None and backend.loop is asyncio.get_running_loop():
            await backend.release()

    # -- whether it takes writes ------------------------------------------------------------------
    async def probe(self) -> None:
        """Make one round trip: StorageError when the database is down or takes no writes.

        A hot standby (`default_transaction_read_only`) answers `SELECT 1` too: `/readyz` said
        ready while every turn was a 503."""
        rows = await self.fetch(
            "cannot reach the database", "SELECT current_setting('transaction_read_only')"
        )
        if rows and rows[0][0] == "on":
            self.saw_read_only()
            raise StorageError(f"the database {READ_ONLY}")
        self._read_only_at = None

    def saw_read_only(self) -> None:
        """Note that the database just refused a write as read-only."""
        self._read_only_at = time.monotonic()

    @property
    def refusing_writes(self) -> str | None:
        """Why writes are refused (the database was seen read-only lately), or None."""
        at = self._read_only_at
        return READ_ONLY if at is not None and time.monotonic() - at < READ_ONLY_HOLD else None

    # -- statements -------------------------------------------------------------------------------
    async def fetch(self, action: str, sql: str, *args: object) -> list[Row]:
        """Run one query on a pooled connection; errors become StorageError("{action}: ...")."""
        backend = await self.backend()
        with map_errors(action, backend.outage):
            return list(await backend.open_pool.fetch(sql, *args))

    async def write(self, action: str, work: Callable[[Conn], Awaitable[T]]) -> T:
        """Run `work` in one transaction, to its end even if the caller is cancelled.

        A cancelled caller never leaves a pooled connection mid-transaction."""
        backend = await self.backend()

        async def run() -> T:
            with map_errors(action, backend.outage):
                async with backend.open_pool.acquire() as conn:
                    async with conn.transaction():
                        return await work(conn)

        return await asyncio.shield(backend.spawn(run()))

    async def insert(
        self, response_id: str, rows: list[tuple[str, str]], first_seq: int, *, unless_committed: bool = False
    ) -> None:
        """Write a response's encoded records, numbered from `first_seq`, on a connection of its own.

        With `unless_committed`, none of them when the response has a commit record."""
        backend = await self.backend()
        sql = INSERT_UNLESS_COMMITTED if unless_committed else INSERT_RECORDS
        with map_errors("could not write the response log", backend.outage):
            async with backend.open_pool.acquire() as conn:
                await self.insert_rows(conn, sql, response_id, rows, first_seq)

    async def insert_rows(
        self, conn: Conn, sql: str, response_id: str, rows: list[tuple[str, str]], first_seq: int
    ) -> None:
        """Run `sql` (INSERT_RECORDS or INSERT_UNLESS_COMMITTED) for a response's encoded records."""
        seqs = list(range(first_seq, first_seq + len(rows)))
        await conn.execute(sql, self.namespace, response_id, seqs, [k for k, _ in rows], [r for _, r in rows])

    async def append_entry(
        self,
        conn: Conn,
        cid: str,
        response_id: str | None,
        marker: str | None,
        expected: tuple[int | None, int] | None,
        listing: JSONObject | None = None,
    ) -> tuple[int, int]:
        """Add an index entry to a conversation (created if new): its (incarnation, last seq) after.

        The entry is a response id or a marker's text. Raises Conflict when the tail is no
        longer `expected` (None: whatever it is; (None, _): the conversation must be new)."""
        extra: list[int | None] = []
        if expected is None:
            sql = APPEND["any"]
        elif expected[0] is None:
            sql = APPEND["new"]
        else:
            sql, extra = APPEND["tail"], list(expected)
        text = orjson.dumps(listing).decode() if listing is not None else None
        row = await conn.fetchrow(sql, self.namespace, cid, response_id, marker, text, *extra)
        if row is None:
            raise Conflict()
        return int(row["incarnation"]), int(row["last_seq"])
