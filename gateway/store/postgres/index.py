"""Conversations' indexes as read from PostgreSQL, and pages of the conversation list.

An index is read after a version, one or several conversations at once; a page comes with the
list rows kept for it (`keep_rows`)."""

from __future__ import annotations

import logging

import orjson

from gateway.exceptions import NotFound, StorageError
from gateway.ids import check_conversation_id, is_valid_conversation_id
from gateway.store.base import IndexEntry, IndexRead, Listed, Version
from gateway.store.postgres.db import Db
from gateway.store.postgres.schema import FIRST_PAGE, LOAD_MANY, NEXT_PAGE, Conn, Row, decode_record
from gateway.types import JSONObject, Record

log = logging.getLogger("gateway.store")


async def page(db: Db, limit: int, after: str | None) -> tuple[list[Listed], bool]:
    """A page of the conversation list, newest first, and whether more follow.

    One keyset query on (updated_at, conversation_id) (index `gateway_conversations_page`), each
    row with its version and list row; a second, small one to find `after`."""
    action = "could not list conversations"
    if after is None:
        rows = await db.fetch(action, FIRST_PAGE, db.namespace, limit + 1)
    else:
        check_conversation_id(after, param="after")
        found = await db.fetch(
            action,
            "SELECT updated_at FROM gateway_conversations WHERE namespace = $1 AND conversation_id = $2",
            db.namespace,
            after,
        )
        if not found:
            raise NotFound(f"No conversation {after!r} in this list", param="after")
        at = found[0]["updated_at"]
        rows = await db.fetch(action, NEXT_PAGE, db.namespace, limit + 1, at, after)
    listed = [
        Listed(
            str(row["conversation_id"]),
            float(row["updated_at"]),
            Version(int(row["incarnation"]), int(row["last_seq"])),
            _listing(row["listing"]),
        )
        for row in rows[:limit]
    ]
    return [r for r in listed if is_valid_conversation_id(r.conversation_id)], len(rows) > limit


# Rows a list made, each kept only while its conversation is still at the version it was made at.
_KEEP_ROWS = """
UPDATE gateway_conversations AS c SET listing = w.listing::json, listing_seq = w.seq
FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::text[]) AS w(cid, incarnation, seq, listing)
WHERE c.namespace = $1 AND c.conversation_id = w.cid AND c.incarnation = w.incarnation
  AND c.last_seq = w.seq
"""


def _listing(text: str | None) -> JSONObject | None:
    value = decode_record(text) if text is not None else None
    return value if isinstance(value, dict) else None


async def keep_rows(db: Db, rows: list[tuple[str, Version, JSONObject]]) -> None:
    """Store the list rows a page made, each kept only at its version; best effort, one statement."""
    if not rows:
        return
    columns = (
        [cid for cid, _, _ in rows],
        [int(v.generation) for _, v, _ in rows],
        [v.position for _, v, _ in rows],
        [orjson.dumps(row).decode() for _, _, row in rows],
    )

    async def work(conn: Conn) -> None:
        await conn.execute(_KEEP_ROWS, db.namespace, *columns)

    try:
        await db.write("could not keep the list's rows", work)
    except StorageError as exc:  # (a read-only replica): the next list makes them again
        log.warning("%s", exc.message)


def index_read(rows: list[Row], after: Version | None) -> IndexRead | None:
    """A conversation's `LOAD` rows as an IndexRead; None when it was replaced since `after`.

    Replaced, it is to be read again from the start."""
    incarnation, last_seq = int(rows[0]["incarnation"]), int(rows[0]["last_seq"])
    if after is not None and (after.generation != incarnation or last_seq < after.position):
        return None
    entries: list[IndexEntry] = []
    current = None
    for row in rows:
        if row["seq"] is None:
            continue  # nothing new
        if row["seq"] != current:
            current = row["seq"]
            marker = decode_record(row["marker"]) if row["marker"] is not None else None
            marker = marker if isinstance(marker, dict) else None
            entries.append(IndexEntry(row["response_id"], marker, []))
        if row["record"] is not None:
            value = decode_record(row["record"])
            if isinstance(value, dict) and value.get("type") != "context":
                entries[-1].records.append(value)
    return IndexRead(entries, Version(incarnation, last_seq), after is None)


def index_entries(ids: list[str | None], markers: list[str | None]) -> list[str | Record]:
    """A whole index from `LOAD_INDEX`'s arrays, as `index_read` gives its entries.

    Response ids, and marker objects (an entry whose marker is not an object stands as its
    response id)."""
    out: list[str | Record] = []
    for rid, text in zip(ids, markers, strict=True):
        marker = decode_record(text) if text is not None else None
        out.append(marker if isinstance(marker, dict) else str(rid))
    return out


async def read_many(db: Db, wanted: list[tuple[str, Version | None]]) -> list[IndexRead | None]:
    """Several conversations, each after its version, in one query.

    None for one replaced since its version (to be read again from the start)."""
    for cid, _ in wanted:
        check_conversation_id(cid)
    since = [after.position if after is not None else 0 for _, after in wanted]
    rows = await db.fetch(
        "could not load the conversations", LOAD_MANY, db.namespace, [c for c, _ in wanted], since
    )
    grouped: dict[int, list[Row]] = {}
    for row in rows:
        grouped.setdefault(int(row["n"]), []).append(row)
    return [
        index_read(grouped[n], after) if n in grouped else IndexRead([], None, True)
        for n, (_, after) in enumerate(wanted, start=1)
    ]
