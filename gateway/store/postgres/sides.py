"""Side logs in PostgreSQL (`gateway_side`): summaries, lifecycle, users, digests, models. A
read is cached per process and fetches only the rows after the last one seen; it notices (by
that row being gone) that another replica deleted the log."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from gateway.ids import check_conversation_id
from gateway.store.base import SIDE_LOGS, SideLog
from gateway.store.postgres.log import _SideCache
from gateway.store.postgres.schema import Conn, _decode
from gateway.types import Record

if TYPE_CHECKING:
    from gateway.store.postgres.store import PostgresStore


def check_side(kind: str, key: str) -> None:
    if kind not in SIDE_LOGS:
        raise ValueError(f"unknown side log {kind!r}")
    check_conversation_id(key, param="key")


async def append_side(store: PostgresStore, kind: SideLog, key: str, record: Record) -> None:
    check_side(kind, key)
    text = orjson.dumps(record).decode()

    async def work(conn: Conn) -> None:
        await conn.execute(
            "INSERT INTO gateway_side (namespace, kind, key, record) VALUES ($1, $2, $3, $4::json)",
            store.namespace,
            kind,
            key,
            text,
        )

    await store._write(f"could not record {kind}", work)
    store._side.pop((kind, key), None)


async def read_side(store: PostgresStore, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
    """Cached per process; each read fetches only rows after the last one seen, and notices
    (by that row being gone) that another replica deleted the log."""
    check_side(kind, key)
    cached = store._side.get((kind, key))
    sql = (
        "SELECT id, record FROM gateway_side WHERE namespace = $1 AND kind = $2 AND key = $3 "
        "AND id >= $4 ORDER BY id"
    )
    rows = await store._fetch(
        f"could not read {kind}", sql, store.namespace, kind, key, cached.last_id if cached else 0
    )
    if cached is not None and (not rows or rows[0]["id"] != cached.last_id):
        cached = None
        rows = await store._fetch(f"could not read {kind}", sql, store.namespace, kind, key, 0)
    if cached is None:
        cached = _SideCache(0)
    fresh = [row for row in rows if row["id"] > cached.last_id]
    cached.records.extend(r for r in (_decode(row["record"]) for row in fresh) if isinstance(r, dict))
    if fresh:
        cached.last_id = int(fresh[-1]["id"])
    if cached.last_id and (keep or (kind, key) in store._side):
        store._side[(kind, key)] = cached
    else:
        store._side.pop((kind, key), None)
    return list(cached.records)
