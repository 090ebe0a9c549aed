"""The shared store for several gateway replicas: PostgreSQL through an asyncpg pool.

Same contract as the JSONL store, in tables instead of files, one namespace per tenant:

    gateway_responses      (namespace, response_id, seq)      kind, record   one row per record
    gateway_conversations  (namespace, conversation_id)       incarnation, last_seq, updated_at
    gateway_index          (namespace, conversation_id, seq)  response_id | marker
    gateway_side           (namespace, kind, key, id)         record   summaries, lifecycle, users,
                                                                       digests, models, metadata
    gateway_archive        (namespace, archive_id, path)      content  deleted conversations, as files

Records are `json`, not `jsonb`: json keeps the exact text (key order, `\\u0000`), so an export
gives back byte for byte what JSONL wrote. A turn's records, its commit record and its index row
are written in one transaction, so the index never names an incomplete response. Turns on one
conversation are serialized across replicas by a session advisory lock held on one dedicated
connection per process (released by PostgreSQL if the process dies), and every append checks
the tail the turn was built on, so even a lost lock can never fork a history (409 instead).
A reader gets the entries after a `Version` (incarnation, last seq) in one query.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import orjson

from gateway.exceptions import ConversationBusy, NotFound, StorageError
from gateway.ids import check_conversation_id, is_valid_conversation_id, is_valid_response_id
from gateway.redact import dsn_password, keep_password, redact_dsn
from gateway.store.base import (
    LRU,
    Appended,
    Damage,
    IndexList,
    IndexRead,
    Listed,
    ResponseLog,
    SideLog,
    Store,
    Version,
    now,
)
from gateway.store.postgres import branches, fsck, sides
from gateway.store.postgres.backend import SharedBackend, backend_for
from gateway.store.postgres.log import LockHold, PostgresLog, SideCache
from gateway.store.postgres.schema import (
    APPEND,
    INSERT_RECORDS,
    INSERT_UNLESS_COMMITTED,
    LOAD,
    LOAD_INDEX,
    PROCESSOR_LOCK,
    RESPONSE_CREATED,
    SELECT_TURNS,
    Conflict,
    Conn,
    Row,
    advisory_key,
    busy_error,
    decode_record,
    encode_record,
    map_errors,
    responses_walk,
)
from gateway.types import Api, JSONObject, Record, as_object

log = logging.getLogger("gateway.store")

READ_ONLY = "takes no writes (read-only: a standby, or in recovery)"
READ_ONLY_HOLD = 5.0  # seconds a database seen read-only is taken to be so
T = TypeVar("T")

MARK_RETRY_SECONDS = 2.0
# A list of responses walks their requests this many (or a page's worth) at a time.
WALK_BATCH = 100


class PostgresStore(Store):
    """One tenant's conversations (its `namespace`; "" without auth) in a shared database."""

    def __init__(
        self,
        dsn: str,
        *,
        namespace: str = "",
        durability: str = "fsync",
        cache_size: int = 1024,
    ) -> None:
        self.dsn = dsn
        keep_password(dsn_password(dsn))  # never in a message, whatever library words one
        self.namespace = namespace
        self.durability = durability
        self.cache_size = cache_size
        self._backend: SharedBackend | None = None
        self._side: LRU[tuple[str, str], SideCache] = LRU(
            4 * cache_size, weigh=lambda v: len(v.records) + 1, budget=4 * cache_size
        )
        self._holds: dict[str, LockHold] = {}
        # Endings of failed attempts the database was down for: written once it is back, so that
        # those attempts read as failed, not in progress (response id -> its rows, from seq 0).
        self._unmarked: LRU[str, list[tuple[str, str]]] = LRU(1024)
        self._marking: asyncio.Task[None] | None = None
        # When the database was last seen taking no writes (a standby): turns are refused
        # before their provider is asked, for READ_ONLY_HOLD seconds (the probe looks again).
        self._read_only_at: float | None = None
        # Test hook: called inside the commit transaction, after the records, before the index.

    def __repr__(self) -> str:
        return f"PostgresStore({redact_dsn(self.dsn)!r}, namespace={self.namespace!r})"

    # -- connections ------------------------------------------------------------------------------
    async def _open_backend(self) -> SharedBackend:
        backend = self._backend
        if backend is None or backend.loop is not asyncio.get_running_loop() or backend.pool is None:
            # First use, or a new event loop (a CLI command may run several): connect anew.
            self._backend = backend = await backend_for(self.dsn, self.durability)
        return backend

    async def open(self) -> None:
        await self._open_backend()

    async def probe(self) -> None:
        """One round trip to the database: StorageError when it is down, or when it takes no
        writes (a hot standby, `default_transaction_read_only`), which `SELECT 1` did not tell:
        `/readyz` said ready while every turn was a 503."""
        rows = await self._fetch(
            "cannot reach the database", "SELECT current_setting('transaction_read_only')"
        )
        if rows and rows[0][0] == "on":
            self.saw_read_only()
            raise StorageError(f"the database {READ_ONLY}")
        self._read_only_at = None

    def saw_read_only(self) -> None:
        self._read_only_at = time.monotonic()

    @property
    def refusing_writes(self) -> str | None:
        at = self._read_only_at
        return READ_ONLY if at is not None and time.monotonic() - at < READ_ONLY_HOLD else None

    def refuse_if_failed(self) -> None:
        """Before a turn's provider is asked: a database seen taking no writes refuses it (the
        provider was asked, and its answer thrown away with a 503)."""
        if self.refusing_writes is not None:
            raise StorageError(f"the database {READ_ONLY}: the turn could not be recorded; retry later")

    def mark_later(self, response_id: str, rows: list[tuple[str, str]]) -> None:
        """An attempt's `incomplete` ending the database could not take now: retried every
        MARK_RETRY_SECONDS (in the background) until it can."""
        self._unmarked[response_id] = rows
        if self._marking is None or self._marking.done():
            self._marking = asyncio.ensure_future(self._mark_unmarked())

    async def _mark_unmarked(self) -> None:
        while self._unmarked:
            await asyncio.sleep(MARK_RETRY_SECONDS)
            for rid, rows in list(self._unmarked.items()):
                try:
                    await self._insert(rid, rows, 0, unless_committed=True)
                except StorageError:
                    break  # still down: the next round
                self._unmarked.pop(rid, None)
                log.info("marked %s incomplete", rid)

    async def try_processor_lease(self) -> bool | None:
        """One lifecycle processor per database: a session advisory lock on the lock
        connection, held until this process exits (PostgreSQL frees it if the process dies)."""
        backend = await self._open_backend()
        if getattr(backend, "processor_lease", False):
            return True
        granted = await backend.try_lock(PROCESSOR_LOCK)
        backend.processor_lease = granted  # type: ignore[attr-defined]
        return granted

    async def close(self) -> None:
        if self._marking is not None:
            self._marking.cancel()
        backend, self._backend = self._backend, None
        if backend is not None and backend.loop is asyncio.get_running_loop():
            await backend.release()

    async def _fetch(self, action: str, sql: str, *args: object) -> list[Row]:
        backend = await self._open_backend()
        with map_errors(action, backend.outage):
            return list(await backend.open_pool.fetch(sql, *args))

    async def _write(self, action: str, work: Callable[[Conn], Awaitable[T]]) -> T:
        """One transaction, run to its end even if the caller is cancelled (never leaving a pooled
        connection mid-transaction)."""
        backend = await self._open_backend()

        async def run() -> T:
            with map_errors(action, backend.outage):
                async with backend.open_pool.acquire() as conn:
                    async with conn.transaction():
                        return await work(conn)

        return await asyncio.shield(backend.spawn(run()))

    async def _insert_rows(
        self, conn: Conn, sql: str, response_id: str, rows: list[tuple[str, str]], first_seq: int
    ) -> None:
        seqs = list(range(first_seq, first_seq + len(rows)))
        await conn.execute(sql, self.namespace, response_id, seqs, [k for k, _ in rows], [r for _, r in rows])

    async def _insert(
        self, response_id: str, rows: list[tuple[str, str]], first_seq: int, *, unless_committed: bool = False
    ) -> None:
        backend = await self._open_backend()
        sql = INSERT_UNLESS_COMMITTED if unless_committed else INSERT_RECORDS
        with map_errors("could not write the response log", backend.outage):
            async with backend.open_pool.acquire() as conn:
                await self._insert_rows(conn, sql, response_id, rows, first_seq)

    async def _append_entry(
        self,
        conn: Conn,
        cid: str,
        response_id: str | None,
        marker: str | None,
        expected: tuple[int | None, int] | None,
        listing: JSONObject | None = None,
    ) -> tuple[int, int]:
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

    # -- locking ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def lock(self, conversation_id: str, timeout: float) -> AsyncIterator[None]:
        """In this process, one asyncio.Lock per conversation (FIFO); across replicas, a session
        advisory lock on the backend's lock connection, polled until `timeout`, in arrival
        order (a waiter stands in line: see `_TRY_IN_TURN` in backend.py)."""
        check_conversation_id(conversation_id)
        busy = ConversationBusy(f"Conversation {conversation_id!r} is busy with another request; retry later")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        arrived = int(time.time() * 1000) % (1 << 31)  # this request's place in line
        candidate = await self._open_backend()
        key = advisory_key(self.namespace, conversation_id)
        line = ((key & 0x7FFFFFFF), arrived)
        # Per backend, not per store: two stores of one tenant in a process share the session,
        # and session advisory locks are reentrant, so only this lock keeps them apart.
        lock = candidate.local_lock(key)
        backend: SharedBackend | None = None
        in_line = False
        try:
            if lock.locked():  # behind this process's own turns: in line for the other replicas now
                in_line = True  # (first: a cancellation during the call still leaves the line)
                await candidate.stand_in_line(line)
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await lock.acquire()
            except TimeoutError:
                raise busy from None
        except BaseException:
            if in_line:
                await candidate.leave_line(line)
            raise
        try:
            delay = 0.001
            while not await candidate.try_lock(key, line):
                if not in_line:
                    in_line = True
                    await candidate.stand_in_line(line)
                if loop.time() >= deadline:
                    raise busy
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 0.01)
            backend = candidate
            if in_line:
                in_line = False
                await candidate.leave_line(line)
            self._holds[conversation_id] = LockHold(asyncio.current_task())
            yield
        finally:
            self._holds.pop(conversation_id, None)
            try:
                if in_line:
                    await candidate.leave_line(line)
                if backend is not None:
                    await asyncio.shield(backend.spawn(backend.unlock(key)))
            finally:
                lock.release()

    def _note_load(self, cid: str, incarnation: int | None, seq: int) -> None:
        hold = self._holds.get(cid)
        if hold is not None and hold.task is asyncio.current_task():
            hold.expected = (incarnation, seq)

    def _expected(self, cid: str) -> tuple[int | None, int] | None:
        hold = self._holds.get(cid)
        return hold.expected if hold is not None else None

    async def read_entries(self, conversation_id: str) -> IndexList:
        check_conversation_id(conversation_id)
        rows = await self._fetch(
            "could not load the conversation", LOAD_INDEX, self.namespace, conversation_id
        )
        if not rows:
            self._note_load(conversation_id, None, 0)
            return IndexList([], None)
        incarnation, seq = int(rows[0]["incarnation"]), int(rows[0]["last_seq"])
        self._note_load(conversation_id, incarnation, seq)
        entries = sides.index_entries(rows[0]["ids"] or [], rows[0]["markers"] or [])
        return IndexList(entries, Version(incarnation, seq))

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        """The entries after `after`, with their records, in one query (one round trip when
        nothing changed)."""
        check_conversation_id(conversation_id)
        since = after.position if after is not None else 0
        rows = await self._fetch(
            "could not load the conversation", LOAD, self.namespace, conversation_id, since
        )
        if not rows:
            self._note_load(conversation_id, None, 0)
            return IndexRead([], None, True)
        read = sides.index_read(rows, after)
        if read is None:
            return await self.read_conversation(conversation_id, None)  # begun anew since
        assert read.version is not None
        self._note_load(conversation_id, int(read.version.generation), read.version.position)
        return read

    async def read_many(self, wanted: list[tuple[str, Version | None]]) -> list[IndexRead]:
        """One query for all of them (a page of a list); no lock is held by such readers."""
        return await sides.read_many(self, wanted)

    async def read_sides(self, kind: SideLog, keys: list[str]) -> list[list[Record]]:
        return await sides.read_sides(self, kind, keys)

    def _forget(self, conversation_id: str | None) -> None:
        """Nothing is cached here (the services cache views): the place to drop it if ever."""

    def start(self, response_id: str, request: Record) -> ResponseLog:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return PostgresLog(self, response_id, request)

    async def read_response(self, response_id: str) -> list[Record]:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        rows = await self._fetch(
            "could not read the response",
            "SELECT record FROM gateway_responses WHERE namespace = $1 AND response_id = $2 ORDER BY seq",
            self.namespace,
            response_id,
        )
        if not rows:
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return [r for r in (decode_record(row["record"]) for row in rows) if isinstance(r, dict)]

    async def read_turns(self, response_ids: Sequence[str]) -> list[list[Record]]:
        rows = await self._fetch(
            "could not read the responses", SELECT_TURNS, self.namespace, list(response_ids)
        )
        found: dict[str, list[Record]] = {}
        for row in rows:
            value = decode_record(row["record"])
            if isinstance(value, dict):
                found.setdefault(str(row["response_id"]), []).append(value)
        return [found.get(rid, []) for rid in response_ids]

    async def read_index(self, conversation_id: str) -> list[str | Record]:
        check_conversation_id(conversation_id)
        rows = await self._fetch(
            "could not read the conversation",
            "SELECT response_id, marker FROM gateway_index "
            "WHERE namespace = $1 AND conversation_id = $2 ORDER BY seq",
            self.namespace,
            conversation_id,
        )
        if not rows:
            raise NotFound(f"No conversation {conversation_id!r}", param="conversation_id")
        return [
            str(row["response_id"]) if row["marker"] is None else as_object(decode_record(row["marker"]))
            for row in rows
        ]

    async def exists(self, conversation_id: str) -> bool:
        check_conversation_id(conversation_id)
        rows = await self._fetch(
            "could not read the conversation",
            "SELECT 1 FROM gateway_conversations WHERE namespace = $1 AND conversation_id = $2",
            self.namespace,
            conversation_id,
        )
        return bool(rows)

    # -- writing ------------------------------------------------------------------------------------
    async def append_marker(
        self, conversation_id: str, marker: Record, row: JSONObject | None = None
    ) -> Appended:
        check_conversation_id(conversation_id)
        text = orjson.dumps(marker).decode()
        expected = self._expected(conversation_id)

        async def work(conn: Conn) -> tuple[int, int]:
            return await self._append_entry(conn, conversation_id, None, text, expected, row)

        try:
            incarnation, seq = await self._write("could not record the change durably", work)
        except Conflict:
            self._forget(conversation_id)
            raise busy_error(conversation_id) from None
        except StorageError:
            self._forget(conversation_id)
            raise
        hold = self._holds.get(conversation_id)
        if hold is not None:
            hold.expected = (incarnation, seq)
        return Appended(Version(incarnation, seq - 1), Version(incarnation, seq))

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        return await branches.delete_conversation(self, conversation_id, archive=archive)

    async def fork(self, source: str, target: str, through: str) -> None:
        await branches.fork(self, source, target, through)

    async def check(self, *, repair: bool = False, lock_timeout: float = 30.0) -> list[Damage]:
        return await fsck.check(self, repair=repair, lock_timeout=lock_timeout)

    async def sharing(self, conversation_id: str, response_id: str) -> list[str]:
        rows = await self._fetch(
            "could not read the conversation",
            "SELECT DISTINCT conversation_id FROM gateway_index WHERE namespace = $1 AND response_id = $2 "
            "AND conversation_id <> $3 ORDER BY conversation_id",
            self.namespace,
            response_id,
            conversation_id,
        )
        return [str(row["conversation_id"]) for row in rows]

    async def tombstone(self, response_id: str) -> None:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        kind, text = encode_record({"type": "deleted", "at": now()})

        async def work(conn: Conn) -> object:
            return await conn.fetchval(
                "INSERT INTO gateway_responses (namespace, response_id, seq, kind, record) "
                "SELECT $1::text, $2::text, max(seq) + 1, $3::text, $4::json FROM gateway_responses "
                "WHERE namespace = $1 AND response_id = $2 HAVING count(*) > 0 RETURNING seq",
                self.namespace,
                response_id,
                kind,
                text,
            )

        if await self._write("could not delete the response", work) is None:
            raise NotFound(f"No response {response_id!r}", param="response_id")

    # -- side logs ----------------------------------------------------------------------------------
    async def append_side(self, kind: SideLog, key: str, record: Record) -> None:
        await sides.append_side(self, kind, key, record)

    async def read_side(self, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
        """Cached per process; each read fetches only rows after the last one seen."""
        return await sides.read_side(self, kind, key, keep=keep)

    # -- listing ------------------------------------------------------------------------------------
    async def _index_times(self) -> list[tuple[str, float]]:
        rows = await self._fetch(
            "could not list conversations",
            "SELECT conversation_id, updated_at FROM gateway_conversations WHERE namespace = $1",
            self.namespace,
        )
        return [(row["conversation_id"], float(row["updated_at"])) for row in rows]

    async def conversation_ids(self) -> list[tuple[str, float]]:
        times = [(c, t) for c, t in await self._index_times() if is_valid_conversation_id(c)]
        return sorted(times, key=lambda t: t[1], reverse=True)

    async def list_conversations(
        self, limit: int, after: str | None = None
    ) -> tuple[list[tuple[str, float]], bool]:
        page, more = await sides.page(self, limit, after)
        return [(listed.conversation_id, listed.changed) for listed in page], more

    async def list_rows(self, limit: int, after: str | None = None) -> tuple[list[Listed], bool]:
        return await sides.page(self, limit, after)

    async def keep_rows(self, rows: list[tuple[str, Version, JSONObject]]) -> None:
        await sides.keep_rows(self, rows)

    async def list_responses(
        self,
        limit: int,
        *,
        api: Api,
        model: str | None = None,
        after: str | None = None,
        descending: bool = False,
    ) -> tuple[list[str], bool]:
        """Walks of index gateway_responses_created (`schema.responses_walk`), WALK_BATCH rows
        or a page's worth at a time: a page costs its rows, plus those it walks past (other
        APIs' turns, other models', failed or deleted ones); a small query finds `after`."""
        action = "could not list responses"
        cursor: tuple[float, str] | None = None
        if after is not None:
            found = (
                await self._fetch(action, RESPONSE_CREATED, self.namespace, after)
                if is_valid_response_id(after)
                else []
            )
            if not found or found[0]["created"] is None:
                raise NotFound(f"No response {after!r} in this list", param="after")
            cursor = (float(found[0]["created"]), after)
        batch = max(limit + 1, WALK_BATCH)
        out: list[str] = []
        while True:
            sql = responses_walk(after=cursor is not None, descending=descending)
            rows = await self._fetch(action, sql, self.namespace, batch, *(cursor or ()))
            for row in rows:
                wanted = row["api"] == api and (model is None or row["model"] == model)
                if wanted and row["ending"] == "commit":
                    out.append(str(row["response_id"]))
                    if len(out) > limit:
                        return out[:limit], True
            if len(rows) < batch:
                return out, False
            cursor = (float(rows[-1]["created"]), str(rows[-1]["response_id"]))

    async def namespaces(self) -> list[str]:
        """Every tenant with conversations or side logs in this database ("" included)."""
        rows = await self._fetch(
            "could not list tenants",
            "SELECT namespace FROM gateway_conversations UNION SELECT namespace FROM gateway_side",
        )
        return sorted(row["namespace"] for row in rows)
