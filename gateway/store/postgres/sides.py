"""Side logs in PostgreSQL (`gateway_side`): summaries, lifecycle, users, digests, models.

A read is cached per process and fetches only the rows after the last one seen; it notices (by
that row being gone) that another replica deleted the log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import orjson

from gateway.ids import check_side_key
from gateway.store.base import LRU, SIDE_LOGS, SideLog
from gateway.store.postgres.db import Db
from gateway.store.postgres.schema import Conn, decode_record
from gateway.types import Record


@dataclass(slots=True)
class SideCache:
    """A side log as this process last read it: its records, up to the row `last_id`."""

    last_id: int
    records: list[Record] = field(default_factory=list)


# The side logs this process keeps, by (kind, key).
SideCaches: TypeAlias = LRU[tuple[str, str], SideCache]


def check_side(kind: str, key: str) -> None:
    """Refuse an unknown kind of side log (ValueError) or an invalid key."""
    if kind not in SIDE_LOGS:
        raise ValueError(f"unknown side log {kind!r}")
    check_side_key(key)


async def append_side(db: Db, cache: SideCaches, kind: SideLog, key: str, record: Record) -> None:
    """Add a record to a side log (and drop the log from the cache: the next read fetches it)."""
    check_side(kind, key)
    text = orjson.dumps(record).decode()

    async def work(conn: Conn) -> None:
        await conn.execute(
            "INSERT INTO gateway_side (namespace, kind, key, record) VALUES ($1, $2, $3, $4::json)",
            db.namespace,
            kind,
            key,
            text,
        )

    await db.write(f"could not record {kind}", work)
    cache.pop((kind, key), None)


async def read_side(db: Db, cache: SideCaches, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
    """A side log's records, through the cache (kept there unless `keep` is false).

    Each read fetches only rows after the last one seen, and notices (by that row being gone)
    that another replica deleted the log."""
    check_side(kind, key)
    cached = cache.get((kind, key))
    sql = (
        "SELECT id, record FROM gateway_side WHERE namespace = $1 AND kind = $2 AND key = $3 "
        "AND id >= $4 ORDER BY id"
    )
    rows = await db.fetch(
        f"could not read {kind}", sql, db.namespace, kind, key, cached.last_id if cached else 0
    )
    if cached is not None and (not rows or rows[0]["id"] != cached.last_id):
        cached = None
        rows = await db.fetch(f"could not read {kind}", sql, db.namespace, kind, key, 0)
    if cached is None:
        cached = SideCache(0)
    fresh = [row for row in rows if row["id"] > cached.last_id]
    cached.records.extend(r for r in (decode_record(row["record"]) for row in fresh) if isinstance(r, dict))
    if fresh:
        cached.last_id = int(fresh[-1]["id"])
    if cached.last_id and (keep or (kind, key) in cache):
        cache[(kind, key)] = cached
    else:
        cache.pop((kind, key), None)
    return list(cached.records)


async def read_sides(db: Db, kind: SideLog, keys: list[str]) -> list[list[Record]]:
    """Several side logs of one kind in one query (nothing is added to the cache)."""
    for key in keys:
        check_side(kind, key)
    rows = await db.fetch(
        f"could not read {kind}",
        "SELECT key, record FROM gateway_side WHERE namespace = $1 AND kind = $2 AND key = ANY($3::text[]) "
        "ORDER BY key, id",
        db.namespace,
        kind,
        keys,
    )
    found: dict[str, list[Record]] = {}
    for row in rows:
        value = decode_record(row["record"])
        if isinstance(value, dict):
            found.setdefault(row["key"], []).append(value)
    return [found.get(key, []) for key in keys]
