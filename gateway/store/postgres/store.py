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

import logging
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

import orjson

from gateway.exceptions import NotFound, StorageError
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
from gateway.store.postgres import branches, fsck, index, sides
from gateway.store.postgres.db import READ_ONLY, Db
from gateway.store.postgres.locks import ConversationLocks
from gateway.store.postgres.log import PendingEndings, PostgresLog
from gateway.store.postgres.schema import (
    LOAD,
    LOAD_INDEX,
    PROCESSOR_LOCK,
    RESPONSE_CREATED,
    SELECT_TURNS,
    Conflict,
    Conn,
    busy_error,
    decode_record,
    encode_record,
    responses_walk,
)
from gateway.types import Api, JSONObject, Record, as_object

log = logging.getLogger("gateway.store")

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
        self.db = Db(dsn, durability, namespace)
        self.locks = ConversationLocks(self.db)
        self.endings = PendingEndings(self.db)
        self._side: sides.SideCaches = LRU(
            4 * cache_size, weigh=lambda v: len(v.records) + 1, budget=4 * cache_size
        )

    def __repr__(self) -> str:
        return f"PostgresStore({redact_dsn(self.dsn)!r}, namespace={self.namespace!r})"

    # -- connections ------------------------------------------------------------------------------
    async def open(self) -> None:
        await self.db.backend()

    async def probe(self) -> None:
        """Make one round trip: StorageError when the database is down or takes no writes."""
        await self.db.probe()

    @property
    def refusing_writes(self) -> str | None:
        return self.db.refusing_writes

    def refuse_if_failed(self) -> None:
        """Refuse a turn, before its provider is asked, when the database was seen taking no writes.

        Without it the provider was asked, and its answer thrown away with a 503."""
        if self.refusing_writes is not None:
            raise StorageError(f"the database {READ_ONLY}: the turn could not be recorded; retry later")

    async def try_processor_lease(self) -> bool | None:
        """Take the one lifecycle processor's lease of the database, or say it is taken.

        A session advisory lock on the lock connection, held until this process exits
        (PostgreSQL frees it if the process dies)."""
        backend = await self.db.backend()
        if getattr(backend, "processor_lease", False):
            return True
        granted = await backend.try_lock(PROCESSOR_LOCK)
        backend.processor_lease = granted  # type: ignore[attr-defined]
        return granted

    async def close(self) -> None:
        self.endings.close()
        await self.db.close()

    # -- locking ------------------------------------------------------------------------------------
    def lock(self, conversation_id: str, timeout: float) -> AbstractAsyncContextManager[None]:
        """Serialize turns on one conversation, here and across replicas (`ConversationLocks`)."""
        return self.locks.lock(conversation_id, timeout)

    async def read_entries(self, conversation_id: str) -> IndexList:
        check_conversation_id(conversation_id)
        rows = await self.db.fetch(
            "could not load the conversation", LOAD_INDEX, self.namespace, conversation_id
        )
        if not rows:
            self.locks.note_load(conversation_id, None, 0)
            return IndexList([], None)
        incarnation, seq = int(rows[0]["incarnation"]), int(rows[0]["last_seq"])
        self.locks.note_load(conversation_id, incarnation, seq)
        entries = index.index_entries(rows[0]["ids"] or [], rows[0]["markers"] or [])
        return IndexList(entries, Version(incarnation, seq))

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        """The entries after `after`, with their records, in one query.

        One round trip when nothing changed."""
        check_conversation_id(conversation_id)
        since = after.position if after is not None else 0
        rows = await self.db.fetch(
            "could not load the conversation", LOAD, self.namespace, conversation_id, since
        )
        if not rows:
            self.locks.note_load(conversation_id, None, 0)
            return IndexRead([], None, True)
        read = index.index_read(rows, after)
        if read is None:
            return await self.read_conversation(conversation_id, None)  # begun anew since
        assert read.version is not None
        self.locks.note_load(conversation_id, int(read.version.generation), read.version.position)
        return read

    async def read_many(self, wanted: list[tuple[str, Version | None]]) -> list[IndexRead]:
        """One query for all of them (a page of a list); no lock is held by such readers."""
        reads = await index.read_many(self.db, wanted)
        return [
            read if read is not None else await self.read_conversation(cid, None)  # begun anew since
            for read, (cid, _) in zip(reads, wanted, strict=True)
        ]

    async def read_sides(self, kind: SideLog, keys: list[str]) -> list[list[Record]]:
        return await sides.read_sides(self.db, kind, keys)

    def start(self, response_id: str, request: Record) -> ResponseLog:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return PostgresLog(self.db, self.locks, self.endings, response_id, request)

    async def read_response(self, response_id: str) -> list[Record]:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        rows = await self.db.fetch(
            "could not read the response",
            "SELECT record FROM gateway_responses WHERE namespace = $1 AND response_id = $2 ORDER BY seq",
            self.namespace,
            response_id,
        )
        if not rows:
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return [r for r in (decode_record(row["record"]) for row in rows) if isinstance(r, dict)]

    async def read_turns(self, response_ids: Sequence[str]) -> list[list[Record]]:
        rows = await self.db.fetch(
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
        rows = await self.db.fetch(
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
        rows = await self.db.fetch(
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
        expected = self.locks.expected(conversation_id)

        async def work(conn: Conn) -> tuple[int, int]:
            return await self.db.append_entry(conn, conversation_id, None, text, expected, row)

        try:
            incarnation, seq = await self.db.write("could not record the change durably", work)
        except Conflict:
            raise busy_error(conversation_id) from None
        hold = self.locks.held(conversation_id)
        if hold is not None:
            hold.expected = (incarnation, seq)
        return Appended(Version(incarnation, seq - 1), Version(incarnation, seq))

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        check_conversation_id(conversation_id)
        for kind in ("summaries", "lifecycle"):
            self._side.pop((kind, conversation_id), None)
        deleted = await branches.delete_conversation(self.db, conversation_id, archive=archive)
        hold = self.locks.held(conversation_id)
        if hold is not None:
            hold.expected = (None, 0)
        return deleted

    async def fork(self, source: str, target: str, through: str) -> None:
        await branches.fork(self.db, source, target, through)

    async def check(self, *, repair: bool = False, lock_timeout: float = 30.0) -> list[Damage]:
        return await fsck.check(self.db, self.locks, repair=repair, lock_timeout=lock_timeout)

    async def sharing(self, conversation_id: str, response_id: str) -> list[str]:
        rows = await self.db.fetch(
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

        if await self.db.write("could not delete the response", work) is None:
            raise NotFound(f"No response {response_id!r}", param="response_id")

    # -- side logs ----------------------------------------------------------------------------------
    async def append_side(self, kind: SideLog, key: str, record: Record) -> None:
        await sides.append_side(self.db, self._side, kind, key, record)

    async def read_side(self, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
        """Cached per process; each read fetches only rows after the last one seen."""
        return await sides.read_side(self.db, self._side, kind, key, keep=keep)

    # -- listing ------------------------------------------------------------------------------------
    async def _index_times(self) -> list[tuple[str, float]]:
        rows = await self.db.fetch(
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
        page, more = await index.page(self.db, limit, after)
        return [(listed.conversation_id, listed.changed) for listed in page], more

    async def list_rows(self, limit: int, after: str | None = None) -> tuple[list[Listed], bool]:
        return await index.page(self.db, limit, after)

    async def keep_rows(self, rows: list[tuple[str, Version, JSONObject]]) -> None:
        await index.keep_rows(self.db, rows)

    async def list_responses(
        self,
        limit: int,
        *,
        api: Api,
        model: str | None = None,
        after: str | None = None,
        descending: bool = False,
    ) -> tuple[list[str], bool]:
        """A page of committed responses of one API (and model), in creation order.

        Walks of index gateway_responses_created (`schema.responses_walk`), WALK_BATCH rows
        or a page's worth at a time: a page costs its rows, plus those it walks past (other
        APIs' turns, other models', failed or deleted ones); a small query finds `after`."""
        action = "could not list responses"
        cursor: tuple[float, str] | None = None
        if after is not None:
            found = (
                await self.db.fetch(action, RESPONSE_CREATED, self.namespace, after)
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
            rows = await self.db.fetch(action, sql, self.namespace, batch, *(cursor or ()))
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
        rows = await self.db.fetch(
            "could not list tenants",
            "SELECT namespace FROM gateway_conversations UNION SELECT namespace FROM gateway_side",
        )
        return sorted(row["namespace"] for row in rows)
