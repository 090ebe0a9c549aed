"""The shared store for several gateway replicas: PostgreSQL through an asyncpg pool.

Same contract as the JSONL store, in tables instead of files, one namespace per tenant:

    gateway_responses      (namespace, response_id, seq)      kind, record   one row per record
    gateway_conversations  (namespace, conversation_id)       incarnation, last_seq, updated_at
    gateway_index          (namespace, conversation_id, seq)  response_id | marker
    gateway_side           (namespace, kind, key, id)         record   summaries, lifecycle, users,
                                                                       digests, models
    gateway_archive        (namespace, archive_id, path)      content  deleted conversations, as files

Records are `json`, not `jsonb`: json keeps the exact text (key order, `\\u0000`), so an export
gives back byte for byte what JSONL wrote. A turn's records, its commit record and its index row
are written in one transaction, so the index never names an incomplete response. Turns on one
conversation are serialized across replicas by a session advisory lock held on one dedicated
connection per process (released by PostgreSQL if the process dies), and every append checks
the tail the turn was built on, so even a lost lock can never fork a history (409 instead).
Each process caches assembled conversations, revalidated by (incarnation, last seq) on every load.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import orjson

from gateway.exceptions import ConversationBusy, GatewayError, InvalidRequest, NotFound, StorageError
from gateway.ids import check_conversation_id, is_valid_conversation_id, is_valid_response_id
from gateway.store.base import LRU, Appended, IndexEntry, IndexRead, Record, ResponseLog, Store, Version, now

log = logging.getLogger("gateway.store")
T = TypeVar("T")

SIDE_LOGS = frozenset({"summaries", "lifecycle", "users", "digests", "models"})
POOL_SIZE = 10
COMMAND_TIMEOUT = 60.0
_MIGRATION_LOCK = 0x6761746577617901  # "gateway\x01": one migrating replica at a time
_NOW = "extract(epoch FROM clock_timestamp())::float8"

# Versioned migrations, applied in order at open() under an advisory lock; never edit one
# that has shipped: add the next version.
MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE gateway_responses (
            namespace   text    NOT NULL,
            response_id text    NOT NULL,
            seq         integer NOT NULL,
            kind        text    NOT NULL,
            record      json    NOT NULL,
            PRIMARY KEY (namespace, response_id, seq)
        );
        CREATE SEQUENCE gateway_incarnations;
        CREATE TABLE gateway_conversations (
            namespace       text   NOT NULL,
            conversation_id text   NOT NULL,
            incarnation     bigint NOT NULL DEFAULT nextval('gateway_incarnations'),
            last_seq        bigint NOT NULL,
            updated_at      float8 NOT NULL,
            PRIMARY KEY (namespace, conversation_id)
        );
        CREATE INDEX gateway_conversations_recent ON gateway_conversations (namespace, updated_at);
        CREATE TABLE gateway_index (
            namespace       text   NOT NULL,
            conversation_id text   NOT NULL,
            seq             bigint NOT NULL,
            response_id     text,
            marker          json,
            at              float8 NOT NULL,
            PRIMARY KEY (namespace, conversation_id, seq),
            CHECK ((response_id IS NULL) <> (marker IS NULL))
        );
        CREATE TABLE gateway_side (
            namespace text   NOT NULL,
            kind      text   NOT NULL,
            key       text   NOT NULL,
            id        bigint GENERATED ALWAYS AS IDENTITY,
            record    json   NOT NULL,
            PRIMARY KEY (namespace, kind, key, id)
        );
        CREATE TABLE gateway_archive (
            namespace   text   NOT NULL,
            archive_id  text   NOT NULL,
            path        text   NOT NULL,
            content     text   NOT NULL,
            archived_at float8 NOT NULL,
            PRIMARY KEY (namespace, archive_id, path)
        );
        """,
    ),
    (
        2,
        # Deleting a conversation keeps the responses a fork still names: find them by id.
        """
        CREATE INDEX gateway_index_response ON gateway_index (namespace, response_id)
            WHERE response_id IS NOT NULL;
        """,
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]

_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)


def redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        port = f":{parts.port}" if parts.port else ""
        user = f"{parts.username}@" if parts.username else ""
        return f"{parts.scheme}://{user}{host}{port}{parts.path}"
    except ValueError:
        return "(unparsable dsn)"


@contextmanager
def map_errors(action: str) -> Iterator[None]:
    """asyncpg and socket errors become StorageError (503): the one place they are translated."""
    try:
        yield
    except GatewayError:
        raise
    except _DB_ERRORS as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageError(f"{action}: {detail}") from exc


_PROCESSOR_LOCK = int.from_bytes(
    hashlib.blake2b(b"gateway\0lifecycle-processor", digest_size=8).digest(), "big", signed=True
)


def advisory_key(namespace: str, conversation_id: str) -> int:
    digest = hashlib.blake2b(f"gateway\0{namespace}\0{conversation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def migrate(conn: Any) -> int:
    """Bring the schema up to SCHEMA_VERSION (idempotent, safe with replicas starting together)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS gateway_schema (version integer PRIMARY KEY, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        current = int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM gateway_schema"))
        if current > SCHEMA_VERSION:
            raise StorageError(
                f"the database schema is at version {current}, newer than this gateway "
                f"understands ({SCHEMA_VERSION}); upgrade the gateway"
            )
        for version, sql in MIGRATIONS:
            if version > current:
                await conn.execute(sql)
                await conn.execute("INSERT INTO gateway_schema (version) VALUES ($1)", version)
                log.info("applied storage migration %d", version)
    return SCHEMA_VERSION


# -- one pool and one lock connection per (dsn, durability, event loop) -----------------------


class _Backend:
    """Shared by the stores of every tenant: a pool for queries and one session that holds the
    advisory locks of this process's busy conversations."""

    def __init__(self, dsn: str, durability: str, loop: asyncio.AbstractEventLoop) -> None:
        self.dsn = dsn
        self.durability = durability
        self.loop = loop
        self.pool: Any = None
        self.users = 0
        self._opening = asyncio.Lock()
        self._lock_conn: Any = None
        self._lock_mutex = asyncio.Lock()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._local: weakref.WeakValueDictionary[int, asyncio.Lock] = weakref.WeakValueDictionary()

    def local_lock(self, key: int) -> asyncio.Lock:
        lock = self._local.get(key)
        if lock is None:
            lock = self._local[key] = asyncio.Lock()
        return lock

    def _settings(self) -> dict[str, str]:
        settings = {"application_name": "gateway"}
        if self.durability == "none":
            settings["synchronous_commit"] = "off"
        return settings

    async def acquire(self) -> None:
        async with self._opening:
            if self.pool is None:
                with map_errors(f"cannot open PostgreSQL storage at {redact(self.dsn)}"):
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

    async def _lock_call(self, sql: str, key: int) -> bool:
        async with self._lock_mutex:
            conn = self._lock_conn
            if conn is None or conn.is_closed():
                if conn is not None:
                    log.warning("the PostgreSQL lock connection was lost; reconnecting")
                with map_errors("cannot connect for conversation locks"):
                    conn = self._lock_conn = await asyncpg.connect(
                        self.dsn,
                        command_timeout=COMMAND_TIMEOUT,
                        server_settings={"application_name": "gateway-locks"},
                    )
            with map_errors("conversation lock"):
                return bool(await conn.fetchval(sql, key))

    async def try_lock(self, key: int) -> bool:
        task = self.spawn(self._lock_call("SELECT pg_try_advisory_lock($1)", key))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Cancelled while asking: if the lock was granted after all, give it back.
            def undo(t: asyncio.Future[bool]) -> None:
                if not t.cancelled() and t.exception() is None and t.result():
                    self.spawn(self.unlock(key))

            task.add_done_callback(undo)
            raise

    async def unlock(self, key: int) -> None:
        try:
            await self._lock_call("SELECT pg_advisory_unlock($1)", key)
        except StorageError as exc:  # the session is gone, and with it the lock
            log.warning("could not release a conversation lock: %s", exc.message)


_BACKENDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], _Backend]] = (
    weakref.WeakKeyDictionary()
)


async def _backend_for(dsn: str, durability: str) -> _Backend:
    loop = asyncio.get_running_loop()
    backends = _BACKENDS.setdefault(loop, {})
    backend = backends.get((dsn, durability))
    if backend is None:
        backend = backends[(dsn, durability)] = _Backend(dsn, durability, loop)
    await backend.acquire()
    return backend


# -- SQL -------------------------------------------------------------------------------------------

_INSERT_RECORDS = """
INSERT INTO gateway_responses (namespace, response_id, seq, kind, record)
SELECT $1::text, $2::text, s, k, r::json FROM unnest($3::int[], $4::text[], $5::text[]) AS t(s, k, r)
ON CONFLICT DO NOTHING
"""
# Only a response that has no commit record may be marked incomplete.
_INSERT_UNLESS_COMMITTED = """
INSERT INTO gateway_responses (namespace, response_id, seq, kind, record)
SELECT $1::text, $2::text, s, k, r::json FROM unnest($3::int[], $4::text[], $5::text[]) AS t(s, k, r)
WHERE NOT EXISTS (SELECT 1 FROM gateway_responses
                  WHERE namespace = $1 AND response_id = $2 AND kind = 'commit')
ON CONFLICT DO NOTHING
"""
# Appending an index entry: the conversation row hands out the next seq (and is where the tail
# the turn was built on is checked); the entry takes it.
_NEXT_SEQ = {
    "any": f"""
        INSERT INTO gateway_conversations AS c (namespace, conversation_id, last_seq, updated_at)
        VALUES ($1, $2, 1, {_NOW})
        ON CONFLICT (namespace, conversation_id)
        DO UPDATE SET last_seq = c.last_seq + 1, updated_at = {_NOW}
        RETURNING c.incarnation, c.last_seq, c.updated_at""",
    "new": f"""
        INSERT INTO gateway_conversations AS c (namespace, conversation_id, last_seq, updated_at)
        VALUES ($1, $2, 1, {_NOW})
        ON CONFLICT (namespace, conversation_id) DO NOTHING
        RETURNING c.incarnation, c.last_seq, c.updated_at""",
    "tail": f"""
        UPDATE gateway_conversations AS c SET last_seq = c.last_seq + 1, updated_at = {_NOW}
        WHERE c.namespace = $1 AND c.conversation_id = $2 AND c.incarnation = $5 AND c.last_seq = $6
        RETURNING c.incarnation, c.last_seq, c.updated_at""",
}
_APPEND_ENTRY = """
WITH c AS ({next_seq}),
entry AS (
    INSERT INTO gateway_index (namespace, conversation_id, seq, response_id, marker, at)
    SELECT $1::text, $2::text, c.last_seq, $3::text, $4::json, c.updated_at FROM c
)
SELECT incarnation, last_seq FROM c
"""
_APPEND = {name: _APPEND_ENTRY.format(next_seq=sql) for name, sql in _NEXT_SEQ.items()}
_LOAD = """
SELECT c.incarnation, c.last_seq, i.seq, i.response_id, i.marker, r.record
FROM gateway_conversations c
LEFT JOIN gateway_index i
       ON i.namespace = c.namespace AND i.conversation_id = c.conversation_id AND i.seq > $3
LEFT JOIN gateway_responses r
       ON r.namespace = i.namespace AND r.response_id = i.response_id AND r.kind <> 'context'
WHERE c.namespace = $1 AND c.conversation_id = $2
ORDER BY i.seq, r.seq
"""
_ARCHIVE = f"""
INSERT INTO gateway_archive (namespace, archive_id, path, content, archived_at)
SELECT $1::text, $3::text, 'conversation.jsonl',
       string_agg(coalesce(response_id, marker::text), E'\\n' ORDER BY seq) || E'\\n', {_NOW}
  FROM gateway_index WHERE namespace = $1 AND conversation_id = $2
UNION ALL
SELECT $1::text, $3::text, kind || '.jsonl', string_agg(record::text, E'\\n' ORDER BY id) || E'\\n', {_NOW}
  FROM gateway_side WHERE namespace = $1 AND kind IN ('summaries', 'lifecycle') AND key = $2
 GROUP BY kind
UNION ALL
SELECT $1::text, $3::text, 'responses/' || response_id || '.jsonl',
       string_agg(record::text, E'\\n' ORDER BY seq) || E'\\n', {_NOW}
  FROM gateway_responses
 WHERE namespace = $1 AND response_id IN (SELECT response_id FROM gateway_index
                                          WHERE namespace = $1 AND conversation_id = $2)
 GROUP BY response_id
"""


class _Conflict(Exception):
    """The conversation moved on since the turn loaded it (a lost lock, another writer)."""


def _busy(conversation_id: str) -> ConversationBusy:
    return ConversationBusy(
        f"Conversation {conversation_id!r} changed while this request was being answered "
        "(another replica wrote to it); retry"
    )


def _encode(record: Record) -> tuple[str, str]:
    return str(record.get("type") or ""), orjson.dumps(record).decode()


def _decode(text: str) -> Any:
    return orjson.loads(text)


# -- the store ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Hold:
    """This process holds a conversation: the tail its holder loaded, which writes must extend."""

    task: asyncio.Task[Any] | None
    expected: tuple[int | None, int] | None = None


@dataclass(slots=True)
class _SideCache:
    last_id: int
    records: list[Record] = field(default_factory=list)


class _PostgresLog(ResponseLog):
    def __init__(self, store: PostgresStore, response_id: str, request: Record) -> None:
        self.store = store
        self.response_id = response_id
        self._rows: list[tuple[str, str]] = [_encode(request)]
        self._closed = False
        self._created: asyncio.Future[None] | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        # The request record is written while the provider works, so an attempt (even one
        # whose process dies) is visible at once; the commit does not wait on it.
        self._created = asyncio.ensure_future(store._insert(response_id, self._rows[:1], 0))
        self._created.add_done_callback(lambda f: None if f.cancelled() else f.exception())

    def append(self, record: Record) -> None:
        self._rows.append(_encode(record))

    async def commit(self, conversation_id: str | None) -> Appended | None:
        self._closed = True
        store = self.store
        rows = [*self._rows, _encode({"type": "commit", "status": "complete", "committed": now()})]
        hold = store._holds.get(conversation_id) if conversation_id is not None else None
        expected = hold.expected if hold is not None else None
        backend = await store._open_backend()
        task = backend.spawn(self._commit(backend, rows, conversation_id, expected))
        incarnation, seq = await asyncio.shield(task)
        if conversation_id is None:
            return None
        if hold is not None:
            hold.expected = (incarnation, seq)
        return Appended(Version(incarnation, seq - 1), Version(incarnation, seq))

    async def _commit(
        self,
        backend: _Backend,
        rows: list[tuple[str, str]],
        cid: str | None,
        expected: tuple[int | None, int] | None,
    ) -> tuple[int, int]:
        store = self.store
        if self._created is not None:
            await asyncio.wait([self._created])
        try:
            with map_errors("could not record the response durably"):
                async with backend.pool.acquire() as conn:
                    async with conn.transaction():
                        await store._insert_rows(conn, _INSERT_RECORDS, self.response_id, rows, 0)
                        if store.before_index_append is not None:
                            store.before_index_append(self.response_id)
                        if cid is None:
                            return 0, 0
                        return await store._append_entry(conn, cid, self.response_id, None, expected)
        except _Conflict:
            await self._mark_failed(rows[:-1], "conflict", "the conversation changed on another replica")
            raise _busy(cid or "") from None
        except StorageError as exc:
            store._forget(cid)
            await self._mark_failed(rows[:-1], "storage_error", exc.message)
            raise

    async def _mark_failed(self, rows: list[tuple[str, str]], reason: str, message: str) -> None:
        """Best effort after a failed commit: end the log with `incomplete` (never after a commit
        record, in case the failure hid a commit that did happen)."""
        rows = [*rows, _encode({"type": "incomplete", "reason": reason, "error": {"message": message}})]
        try:
            await self.store._insert(self.response_id, rows, 0, unless_committed=True)
        except StorageError as exc:
            log.error("could not mark %s incomplete: %s", self.response_id, exc.message)

    async def abandon(self, reason: str, error: dict[str, Any] | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        rows = [*self._rows, _encode({"type": "incomplete", "reason": reason, "error": error})]
        try:
            backend = await self.store._open_backend()
            if self._created is not None:
                await asyncio.wait([self._created])
            await asyncio.shield(
                backend.spawn(self.store._insert(self.response_id, rows, 0, unless_committed=True))
            )
        except StorageError as exc:
            log.warning("could not mark %s incomplete: %s", self.response_id, exc.message)


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
        self.namespace = namespace
        self.durability = durability
        self.cache_size = cache_size
        self._backend: _Backend | None = None
        self._side: LRU[tuple[str, str], _SideCache] = LRU(4 * cache_size)
        self._holds: dict[str, _Hold] = {}
        self._times: list[tuple[str, float]] = []
        # Test hook: called inside the commit transaction, after the records, before the index.
        self.before_index_append: Callable[[str], None] | None = None

    def __repr__(self) -> str:
        return f"PostgresStore({redact(self.dsn)!r}, namespace={self.namespace!r})"

    # -- connections ------------------------------------------------------------------------------
    async def _open_backend(self) -> _Backend:
        backend = self._backend
        if backend is None or backend.loop is not asyncio.get_running_loop() or backend.pool is None:
            # First use, or a new event loop (a CLI command may run several): connect anew.
            self._backend = backend = await _backend_for(self.dsn, self.durability)
        return backend

    async def open(self) -> None:
        await self._open_backend()

    async def try_processor_lease(self) -> bool | None:
        """One lifecycle processor per database: a session advisory lock on the lock
        connection, held until this process exits (PostgreSQL frees it if the process dies)."""
        backend = await self._open_backend()
        if getattr(backend, "processor_lease", False):
            return True
        granted = await backend.try_lock(_PROCESSOR_LOCK)
        backend.processor_lease = granted  # type: ignore[attr-defined]
        return granted

    async def close(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None and backend.loop is asyncio.get_running_loop():
            await backend.release()

    async def _fetch(self, action: str, sql: str, *args: Any) -> list[Any]:
        backend = await self._open_backend()
        with map_errors(action):
            return list(await backend.pool.fetch(sql, *args))

    async def _write(self, action: str, work: Callable[[Any], Awaitable[T]]) -> T:
        """One transaction, run to its end even if the caller is cancelled (never leaving a pooled
        connection mid-transaction)."""
        backend = await self._open_backend()

        async def run() -> T:
            with map_errors(action):
                async with backend.pool.acquire() as conn:
                    async with conn.transaction():
                        return await work(conn)

        return await asyncio.shield(backend.spawn(run()))

    async def _insert_rows(
        self, conn: Any, sql: str, response_id: str, rows: list[tuple[str, str]], first_seq: int
    ) -> None:
        seqs = list(range(first_seq, first_seq + len(rows)))
        await conn.execute(sql, self.namespace, response_id, seqs, [k for k, _ in rows], [r for _, r in rows])

    async def _insert(
        self, response_id: str, rows: list[tuple[str, str]], first_seq: int, *, unless_committed: bool = False
    ) -> None:
        backend = await self._open_backend()
        sql = _INSERT_UNLESS_COMMITTED if unless_committed else _INSERT_RECORDS
        with map_errors("could not write the response log"):
            async with backend.pool.acquire() as conn:
                await self._insert_rows(conn, sql, response_id, rows, first_seq)

    async def _append_entry(
        self,
        conn: Any,
        cid: str,
        response_id: str | None,
        marker: str | None,
        expected: tuple[int | None, int] | None,
    ) -> tuple[int, int]:
        extra: list[int | None] = []
        if expected is None:
            sql = _APPEND["any"]
        elif expected[0] is None:
            sql = _APPEND["new"]
        else:
            sql, extra = _APPEND["tail"], list(expected)
        row = await conn.fetchrow(sql, self.namespace, cid, response_id, marker, *extra)
        if row is None:
            raise _Conflict()
        return int(row["incarnation"]), int(row["last_seq"])

    # -- locking ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def lock(self, conversation_id: str, timeout: float) -> AsyncIterator[None]:
        """In this process, one asyncio.Lock per conversation (FIFO); across replicas, a session
        advisory lock on the backend's lock connection, polled until `timeout`."""
        check_conversation_id(conversation_id)
        busy = ConversationBusy(f"Conversation {conversation_id!r} is busy with another request; retry later")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        candidate = await self._open_backend()
        key = advisory_key(self.namespace, conversation_id)
        # Per backend, not per store: two stores of one tenant in a process share the session,
        # and session advisory locks are reentrant, so only this lock keeps them apart.
        lock = candidate.local_lock(key)
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await lock.acquire()
        except TimeoutError:
            raise busy from None
        backend: _Backend | None = None
        try:
            delay = 0.001
            while not await candidate.try_lock(key):
                if loop.time() >= deadline:
                    raise busy
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 0.025)
            backend = candidate
            self._holds[conversation_id] = _Hold(asyncio.current_task())
            yield
        finally:
            self._holds.pop(conversation_id, None)
            try:
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

    # -- reading ------------------------------------------------------------------------------------
    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        """The entries after `after`, with their records, in one query (one round trip when
        nothing changed)."""
        check_conversation_id(conversation_id)
        since = after.position if after is not None else 0
        rows = await self._fetch(
            "could not load the conversation", _LOAD, self.namespace, conversation_id, since
        )
        if not rows:
            self._note_load(conversation_id, None, 0)
            return IndexRead([], None, True)
        incarnation, last_seq = int(rows[0]["incarnation"]), int(rows[0]["last_seq"])
        if after is not None and (after.generation != incarnation or last_seq < after.position):
            return await self.read_conversation(conversation_id, None)  # deleted and started anew since
        entries: list[IndexEntry] = []
        current = None
        for row in rows:
            if row["seq"] is None:
                continue  # nothing new
            if row["seq"] != current:
                current = row["seq"]
                marker = _decode(row["marker"]) if row["marker"] is not None else None
                marker = marker if isinstance(marker, dict) else None
                entries.append(IndexEntry(row["response_id"], marker, []))
            if row["record"] is not None:
                value = _decode(row["record"])
                if isinstance(value, dict) and value.get("type") != "context":
                    entries[-1].records.append(value)
        self._note_load(conversation_id, incarnation, last_seq)
        return IndexRead(entries, Version(incarnation, last_seq), after is None)

    def _forget(self, conversation_id: str | None) -> None:
        """Nothing is cached here (the services cache views); kept as the one place to drop
        per-conversation state after a failed or foreign write."""

    def start(self, response_id: str, request: Record) -> ResponseLog:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return _PostgresLog(self, response_id, request)

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
        return [r for r in (_decode(row["record"]) for row in rows) if isinstance(r, dict)]

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
        return [row["response_id"] if row["marker"] is None else _decode(row["marker"]) for row in rows]

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
    async def append_marker(self, conversation_id: str, marker: Record) -> Appended:
        check_conversation_id(conversation_id)
        text = orjson.dumps(marker).decode()
        expected = self._expected(conversation_id)

        async def work(conn: Any) -> tuple[int, int]:
            return await self._append_entry(conn, conversation_id, None, text, expected)

        try:
            incarnation, seq = await self._write("could not record the change durably", work)
        except _Conflict:
            self._forget(conversation_id)
            raise _busy(conversation_id) from None
        except StorageError:
            self._forget(conversation_id)
            raise
        hold = self._holds.get(conversation_id)
        if hold is not None:
            hold.expected = (incarnation, seq)
        return Appended(Version(incarnation, seq - 1), Version(incarnation, seq))

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        check_conversation_id(conversation_id)
        ns = self.namespace
        self._forget(conversation_id)
        for kind in ("summaries", "lifecycle"):
            self._side.pop((kind, conversation_id), None)

        async def work(conn: Any) -> bool:
            found = await conn.fetchval(
                "DELETE FROM gateway_conversations WHERE namespace = $1 AND conversation_id = $2 "
                "RETURNING incarnation",
                ns,
                conversation_id,
            )
            if found is None:
                return False
            if archive:
                await conn.execute(_ARCHIVE, ns, conversation_id, f"{conversation_id}-{int(now() * 1000)}")
            # Responses a fork shares (its prefix) stay while another index names them.
            await conn.execute(
                "DELETE FROM gateway_responses r WHERE namespace = $1 AND response_id IN "
                "(SELECT response_id FROM gateway_index WHERE namespace = $1 AND conversation_id = $2) "
                "AND NOT EXISTS (SELECT 1 FROM gateway_index o WHERE o.namespace = $1 "
                "AND o.response_id = r.response_id AND o.conversation_id <> $2)",
                ns,
                conversation_id,
            )
            await conn.execute(
                "DELETE FROM gateway_index WHERE namespace = $1 AND conversation_id = $2", ns, conversation_id
            )
            await conn.execute(
                "DELETE FROM gateway_side WHERE namespace = $1 AND kind IN ('summaries', 'lifecycle') "
                "AND key = $2",
                ns,
                conversation_id,
            )
            return True

        deleted = await self._write("could not delete the conversation", work)
        hold = self._holds.get(conversation_id)
        if hold is not None:
            hold.expected = (None, 0)
        return deleted

    async def fork(self, source: str, target: str, through: str) -> None:
        check_conversation_id(source)
        check_conversation_id(target)
        ns = self.namespace

        async def work(conn: Any) -> None:
            if await conn.fetchval(
                "SELECT 1 FROM gateway_conversations WHERE namespace = $1 AND conversation_id = $2",
                ns,
                target,
            ):
                raise InvalidRequest(f"Conversation {target!r} already exists")
            if not await conn.fetchval(
                "SELECT 1 FROM gateway_conversations WHERE namespace = $1 AND conversation_id = $2",
                ns,
                source,
            ):
                raise NotFound(f"No conversation {source!r}", param="previous_response_id")
            upto = await conn.fetchval(
                "SELECT min(seq) FROM gateway_index "
                "WHERE namespace = $1 AND conversation_id = $2 AND response_id = $3",
                ns,
                source,
                through,
            )
            if upto is None:
                raise NotFound(
                    f"No response {through!r} in conversation {source!r}", param="previous_response_id"
                )
            await conn.execute(
                f"INSERT INTO gateway_conversations (namespace, conversation_id, last_seq, updated_at) "
                f"VALUES ($1, $2, $3, {_NOW})",
                ns,
                target,
                upto,
            )
            await conn.execute(
                f"INSERT INTO gateway_index (namespace, conversation_id, seq, response_id, marker, at) "
                f"SELECT namespace, $3, seq, response_id, marker, {_NOW} FROM gateway_index "
                f"WHERE namespace = $1 AND conversation_id = $2 AND seq <= $4",
                ns,
                source,
                target,
                upto,
            )

        await self._write("could not branch the conversation", work)
        self._forget(target)

    async def tombstone(self, response_id: str) -> None:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        kind, text = _encode({"type": "deleted", "at": now()})

        async def work(conn: Any) -> Any:
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
    @staticmethod
    def _check_side(kind: str, key: str) -> None:
        if kind not in SIDE_LOGS:
            raise ValueError(f"unknown side log {kind!r}")
        check_conversation_id(key, param="key")

    async def append_side(self, kind: str, key: str, record: Record) -> None:
        self._check_side(kind, key)
        text = orjson.dumps(record).decode()

        async def work(conn: Any) -> None:
            await conn.execute(
                "INSERT INTO gateway_side (namespace, kind, key, record) VALUES ($1, $2, $3, $4::json)",
                self.namespace,
                kind,
                key,
                text,
            )

        await self._write(f"could not record {kind}", work)
        self._side.pop((kind, key), None)

    async def read_side(self, kind: str, key: str) -> list[Record]:
        """Cached per process; each read fetches only rows after the last one seen, and notices
        (by that row being gone) that another replica deleted the log."""
        self._check_side(kind, key)
        cached = self._side.get((kind, key))
        sql = (
            "SELECT id, record FROM gateway_side WHERE namespace = $1 AND kind = $2 AND key = $3 "
            "AND id >= $4 ORDER BY id"
        )
        rows = await self._fetch(
            f"could not read {kind}", sql, self.namespace, kind, key, cached.last_id if cached else 0
        )
        if cached is not None and (not rows or rows[0]["id"] != cached.last_id):
            cached = None
            rows = await self._fetch(f"could not read {kind}", sql, self.namespace, kind, key, 0)
        if cached is None:
            cached = _SideCache(0)
        fresh = [row for row in rows if row["id"] > cached.last_id]
        cached.records.extend(r for r in (_decode(row["record"]) for row in fresh) if isinstance(r, dict))
        if fresh:
            cached.last_id = int(fresh[-1]["id"])
        if cached.last_id:
            self._side[(kind, key)] = cached
        else:
            self._side.pop((kind, key), None)
        return list(cached.records)

    # -- listing ------------------------------------------------------------------------------------
    async def _index_times(self) -> list[tuple[str, float]]:
        rows = await self._fetch(
            "could not list conversations",
            "SELECT conversation_id, updated_at FROM gateway_conversations WHERE namespace = $1",
            self.namespace,
        )
        self._times = [(row["conversation_id"], float(row["updated_at"])) for row in rows]
        return self._times

    def index_times(self) -> list[tuple[str, float]]:
        """Called from a worker thread (as the lifecycle processor does), it asks the database
        through the store's event loop; on the loop itself it returns the last answer."""
        backend = self._backend
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        if backend is not None and not on_loop and backend.loop.is_running():
            future = asyncio.run_coroutine_threadsafe(self._index_times(), backend.loop)
            return list(future.result(timeout=COMMAND_TIMEOUT))
        return list(self._times)

    async def conversation_ids(self) -> list[tuple[str, float]]:
        times = [(c, t) for c, t in await self._index_times() if is_valid_conversation_id(c)]
        return sorted(times, key=lambda t: t[1], reverse=True)

    async def namespaces(self) -> list[str]:
        """Every tenant with conversations or side logs in this database ("" included)."""
        rows = await self._fetch(
            "could not list tenants",
            "SELECT namespace FROM gateway_conversations UNION SELECT namespace FROM gateway_side",
        )
        return sorted(row["namespace"] for row in rows)
