"""PostgreSQL: the schema and its migrations, the SQL the store runs, and error mapping."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import asyncpg
import orjson

from gateway.exceptions import ConversationBusy, GatewayError, NoGatewayData, StorageError
from gateway.redact import redact_dsn
from gateway.store.postgres.outage import UNREACHABLE, Outage
from gateway.types import Record

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

# A connection of the pool, or one opened on its own (locks, export/import).
Conn: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
Row: TypeAlias = asyncpg.Record

log = logging.getLogger("gateway.store")

T = TypeVar("T")

POOL_SIZE = 10
COMMAND_TIMEOUT = 60.0
_MIGRATION_LOCK = 0x6761746577617901  # "gateway\x01": one migrating replica at a time
NOW = "extract(epoch FROM clock_timestamp())::float8"

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
    (
        3,
        # Listing pages by (last change, id), newest first: one index range scan per page.
        """
        CREATE INDEX gateway_conversations_page
            ON gateway_conversations (namespace, updated_at, conversation_id);
        DROP INDEX gateway_conversations_recent;
        """,
    ),
    (
        4,
        # Each conversation's list row (the services' JSON), valid while `listing_seq = last_seq`.
        """
        ALTER TABLE gateway_conversations ADD COLUMN listing json, ADD COLUMN listing_seq bigint;
        """,
    ),
    (
        5,
        # Listing responses (stored chat completions) by their request's time: a keyset range
        # over request records only. The expression is `_CREATED`'s, which queries repeat.
        r"""
        CREATE INDEX gateway_responses_created
            ON gateway_responses (
                namespace,
                (CASE WHEN strpos(record::text, E'\\u0000') > 0 THEN NULL
                      WHEN json_typeof(record->'created') = 'number' THEN (record->>'created')::float8 END),
                response_id
            )
            WHERE kind = 'request';
        """,
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]

# InternalClientError: a connection whose server went away mid-operation ("cannot switch to state
# ..."), seen when PostgreSQL stops under load.
_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError)


@contextmanager
def bad_dsn(dsn: str) -> Iterator[None]:
    """Turn the ValueErrors of asyncpg's DSN parser into one StorageError line.

    A port that is not a number (which an unescaped `/` in a password makes) raises a plain
    ValueError; the line names the DSN without its password."""
    try:
        yield
    except ValueError:  # (its text may quote part of the password: not repeated)
        why = (
            "a character such as / @ : in the password must be percent-encoded"
            if "://" in dsn
            else "write it as a URI, postgresql://user:password@host:port/dbname"
        )
        raise StorageError(
            f"cannot open PostgreSQL storage at {redact_dsn(dsn)}: invalid DSN ({why})"
        ) from None


@contextmanager
def map_errors(action: str, outage: Outage | None = None) -> Iterator[None]:
    """Turn asyncpg and socket errors into StorageError (503): the one place they are translated.

    `outage` is told whether the database was reached."""
    try:
        yield
    except GatewayError:
        raise
    except _DB_ERRORS as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if outage is not None:
            if isinstance(exc, UNREACHABLE):
                outage.failed(f"{action}: {detail}")
            else:
                outage.reached()
        raise StorageError(f"{action}: {detail}") from exc
    if outage is not None:
        outage.reached()


PROCESSOR_LOCK = int.from_bytes(
    hashlib.blake2b(b"gateway\0lifecycle-processor", digest_size=8).digest(), "big", signed=True
)


def advisory_key(namespace: str, conversation_id: str) -> int:
    digest = hashlib.blake2b(f"gateway\0{namespace}\0{conversation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def has_schema(conn: Conn) -> bool:
    """Whether the database holds the gateway's tables (`migrate` makes them)."""
    return await conn.fetchval("SELECT to_regclass('gateway_schema')") is not None


async def require_schema(dsn: str) -> None:
    """NoGatewayData unless the database at `dsn` holds the gateway's tables.

    For the commands: they leave a database that is not the gateway's (a DSN naming another
    one) as they found it, and say so, where opening the store would make the tables there and
    report an empty gateway."""
    with map_errors(f"cannot open PostgreSQL storage at {redact_dsn(dsn)}"), bad_dsn(dsn):
        conn = await asyncpg.connect(dsn)
        try:
            found = await has_schema(conn)
        finally:
            await conn.close()
    if not found:
        raise NoGatewayData(
            f"{redact_dsn(dsn)} holds no gateway data (no gateway tables: `gateway serve` or "
            "`gateway import` makes them)"
        )


async def migrate(conn: Conn) -> int:
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


# -- SQL -------------------------------------------------------------------------------------------

INSERT_RECORDS = """
INSERT INTO gateway_responses (namespace, response_id, seq, kind, record)
SELECT $1::text, $2::text, s, k, r::json FROM unnest($3::int[], $4::text[], $5::text[]) AS t(s, k, r)
ON CONFLICT DO NOTHING
"""
# Only a response that has no commit record may be marked incomplete.
INSERT_UNLESS_COMMITTED = """
INSERT INTO gateway_responses (namespace, response_id, seq, kind, record)
SELECT $1::text, $2::text, s, k, r::json FROM unnest($3::int[], $4::text[], $5::text[]) AS t(s, k, r)
WHERE NOT EXISTS (SELECT 1 FROM gateway_responses
                  WHERE namespace = $1 AND response_id = $2 AND kind = 'commit')
ON CONFLICT DO NOTHING
"""
# Appending an index entry: the conversation row hands out the next seq (and is where the tail
# the turn was built on is checked); the entry takes it. The list row ($5, or NULL) is the one
# the append brings.
_NEXT_SEQ = {
    "any": f"""
        INSERT INTO gateway_conversations AS c
               (namespace, conversation_id, last_seq, updated_at, listing, listing_seq)
        VALUES ($1, $2, 1, {NOW}, $5::json, 1)
        ON CONFLICT (namespace, conversation_id)
        DO UPDATE SET last_seq = c.last_seq + 1, updated_at = {NOW}, listing = $5::json,
                      listing_seq = c.last_seq + 1
        RETURNING c.incarnation, c.last_seq, c.updated_at""",
    "new": f"""
        INSERT INTO gateway_conversations AS c
               (namespace, conversation_id, last_seq, updated_at, listing, listing_seq)
        VALUES ($1, $2, 1, {NOW}, $5::json, 1)
        ON CONFLICT (namespace, conversation_id) DO NOTHING
        RETURNING c.incarnation, c.last_seq, c.updated_at""",
    "tail": f"""
        UPDATE gateway_conversations AS c SET last_seq = c.last_seq + 1, updated_at = {NOW},
               listing = $5::json, listing_seq = c.last_seq + 1
        WHERE c.namespace = $1 AND c.conversation_id = $2 AND c.incarnation = $6 AND c.last_seq = $7
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
APPEND = {name: _APPEND_ENTRY.format(next_seq=sql) for name, sql in _NEXT_SEQ.items()}
LOAD = """
SELECT c.incarnation, c.last_seq, i.seq, i.response_id, i.marker, r.record
FROM gateway_conversations c
LEFT JOIN gateway_index i
       ON i.namespace = c.namespace AND i.conversation_id = c.conversation_id AND i.seq > $3
LEFT JOIN gateway_responses r
       ON r.namespace = i.namespace AND r.response_id = i.response_id AND r.kind <> 'context'
WHERE c.namespace = $1 AND c.conversation_id = $2
ORDER BY i.seq, r.seq
"""
_PAGE = """
SELECT conversation_id, updated_at, incarnation, last_seq,
       CASE WHEN listing_seq = last_seq THEN listing END AS listing
FROM gateway_conversations
WHERE namespace = $1 {after}
ORDER BY updated_at DESC, conversation_id DESC LIMIT $2
"""
FIRST_PAGE = _PAGE.format(after="")
NEXT_PAGE = _PAGE.format(after="AND (updated_at, conversation_id) < ($3, $4)")
# The index alone (`read_entries`: the responses a view needs are read with SELECT_TURNS), as one
# row of two arrays: decoding a row per entry cost more than the entries (30 ms at 5,000).
LOAD_INDEX = """
SELECT c.incarnation, c.last_seq,
       array_agg(i.response_id ORDER BY i.seq) FILTER (WHERE i.seq IS NOT NULL) AS ids,
       array_agg(i.marker::text ORDER BY i.seq) FILTER (WHERE i.seq IS NOT NULL) AS markers
FROM gateway_conversations c
LEFT JOIN gateway_index i ON i.namespace = c.namespace AND i.conversation_id = c.conversation_id
WHERE c.namespace = $1 AND c.conversation_id = $2
GROUP BY c.incarnation, c.last_seq
"""
SELECT_TURNS = """
SELECT response_id, record FROM gateway_responses
WHERE namespace = $1 AND response_id = ANY($2::text[]) AND kind <> 'context'
ORDER BY response_id, seq
"""
# `LOAD` of several conversations, each after its own seq.
LOAD_MANY = """
SELECT w.n, c.incarnation, c.last_seq, i.seq, i.response_id, i.marker, r.record
FROM unnest($2::text[], $3::bigint[]) WITH ORDINALITY AS w(cid, since, n)
JOIN gateway_conversations c ON c.namespace = $1 AND c.conversation_id = w.cid
LEFT JOIN gateway_index i
       ON i.namespace = c.namespace AND i.conversation_id = c.conversation_id AND i.seq > w.since
LEFT JOIN gateway_responses r
       ON r.namespace = i.namespace AND r.response_id = i.response_id AND r.kind <> 'context'
ORDER BY w.n, i.seq, r.seq
"""
# A request record's `created`: the key of index gateway_responses_created, written the same
# way. PostgreSQL's json operators refuse a text that holds a NUL character (`\u0000`, which
# `json` keeps): such a record gets no key (it is not listed) rather than failing its insert.
# (WHEN clauses are tried in order: the json is never read when it holds one.)
_CREATED = (
    r"(CASE WHEN strpos(r.record::text, E'\\u0000') > 0 THEN NULL "
    "WHEN json_typeof(r.record->'created') = 'number' THEN (r.record->>'created')::float8 END)"
)
# The API a request came through (gateway.types.request_api, in SQL), read only of records that
# have a key (and so no NUL character).
_API = (
    "(CASE WHEN r.record->>'kind' = 'items' THEN 'items' "
    "WHEN r.record->>'api' = 'messages' THEN 'messages' "
    "WHEN r.record->'responses' IS NOT NULL THEN 'responses' ELSE 'chat' END)"
)
RESPONSE_CREATED = f"SELECT {_CREATED} AS created FROM gateway_responses r "
RESPONSE_CREATED += "WHERE r.namespace = $1 AND r.response_id = $2 AND r.kind = 'request'"


def responses_walk(*, after: bool, descending: bool) -> str:
    """The query walking `$2` request records in (created, id) order from a cursor.

    A walk of index gateway_responses_created (asked nothing else of the rows, so that the
    planner never trades it for a sort of them all), with what `list_responses` checks of each:
    its API, its model, and the kind of its last record (`ending`: committed, and not deleted
    since, when it is "commit"), one probe of the primary key per row walked (a scalar subquery:
    never hashed over the whole table). Arguments: namespace, limit, then the cursor's (created,
    response id) with `after`."""
    sign, direction = ("<", "DESC") if descending else (">", "ASC")
    cursor = f" AND ({_CREATED}, r.response_id) {sign} ($3::float8, $4::text)" if after else ""
    return (
        f"SELECT r.response_id, {_CREATED} AS created, {_API} AS api, r.record->>'model' AS model, "
        "(SELECT e.kind FROM gateway_responses e WHERE e.namespace = r.namespace "
        "AND e.response_id = r.response_id ORDER BY e.seq DESC LIMIT 1) AS ending "
        f"FROM gateway_responses r WHERE r.namespace = $1 AND r.kind = 'request' AND {_CREATED} IS NOT NULL"
        f"{cursor} ORDER BY {_CREATED} {direction}, r.response_id {direction} LIMIT $2"
    )


ARCHIVE = f"""
INSERT INTO gateway_archive (namespace, archive_id, path, content, archived_at)
SELECT $1::text, $3::text, 'conversation.jsonl',
       string_agg(coalesce(response_id, marker::text), E'\\n' ORDER BY seq) || E'\\n', {NOW}
  FROM gateway_index WHERE namespace = $1 AND conversation_id = $2
UNION ALL
SELECT $1::text, $3::text, kind || '.jsonl', string_agg(record::text, E'\\n' ORDER BY id) || E'\\n', {NOW}
  FROM gateway_side WHERE namespace = $1 AND kind IN ('summaries', 'lifecycle') AND key = $2
 GROUP BY kind
UNION ALL
SELECT $1::text, $3::text, 'metadata/' || key || '.jsonl',
       string_agg(record::text, E'\\n' ORDER BY id) || E'\\n', {NOW}
  FROM gateway_side
 WHERE namespace = $1 AND kind = 'metadata' AND key IN (SELECT response_id FROM gateway_index
                                                        WHERE namespace = $1 AND conversation_id = $2)
 GROUP BY key
UNION ALL
SELECT $1::text, $3::text, 'responses/' || response_id || '.jsonl',
       string_agg(record::text, E'\\n' ORDER BY seq) || E'\\n', {NOW}
  FROM gateway_responses
 WHERE namespace = $1 AND response_id IN (SELECT response_id FROM gateway_index
                                          WHERE namespace = $1 AND conversation_id = $2)
 GROUP BY response_id
"""


class Conflict(Exception):
    """The conversation moved on since the turn loaded it (a lost lock, another writer)."""


def busy_error(conversation_id: str) -> ConversationBusy:
    return ConversationBusy(
        f"Conversation {conversation_id!r} changed while this request was being answered "
        "(another replica wrote to it); retry"
    )


def encode_record(record: Record) -> tuple[str, str]:
    return str(record.get("type") or ""), orjson.dumps(record).decode()


def decode_record(text: str) -> object:
    return orjson.loads(text)
