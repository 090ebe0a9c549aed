"""`gateway fsck` for PostgreSQL: index rows naming an unusable response.

Records are `json` the database checked when they were written, so what can be wrong is an
index row naming a response with no records or without a commit (a restore of some tables only,
a hand edit). Repairing moves each such row into `gateway_archive` (archive id
`quarantine-{time}`) under the conversation's lock, and gives the conversation a new incarnation
so that every reader loads it again."""

from __future__ import annotations

import time

import orjson

from gateway.exceptions import ConversationBusy
from gateway.store.base import Damage
from gateway.store.postgres.db import Db
from gateway.store.postgres.locks import ConversationLocks
from gateway.store.postgres.schema import Conn, Row

_UNUSABLE = """
SELECT i.conversation_id, i.seq, i.response_id, count(r.seq) AS records,
       coalesce(bool_or(r.kind = 'commit'), false) AS committed
  FROM gateway_index i
  LEFT JOIN gateway_responses r ON r.namespace = i.namespace AND r.response_id = i.response_id
 WHERE i.namespace = $1 AND i.response_id IS NOT NULL {only}
 GROUP BY i.conversation_id, i.seq, i.response_id
HAVING count(r.seq) = 0 OR NOT coalesce(bool_or(r.kind = 'commit'), false)
 ORDER BY i.conversation_id, i.seq
"""
_MOVE = """
WITH gone AS (
    DELETE FROM gateway_index WHERE namespace = $1::text AND conversation_id = $2::text AND seq = $3::bigint
    RETURNING seq
), kept AS (
    INSERT INTO gateway_archive (namespace, archive_id, path, content, archived_at)
    SELECT $1::text, $4::text, $5::text, $6::text, extract(epoch FROM clock_timestamp())::float8 FROM gone
)
UPDATE gateway_conversations SET incarnation = nextval('gateway_incarnations'), listing = NULL
 WHERE namespace = $1 AND conversation_id = $2 AND EXISTS (SELECT 1 FROM gone)
"""


def _damage(row: Row, action: str, *, repaired: bool = False) -> Damage:
    missing = not row["records"]
    problem = "names a response that is missing" if missing else "names a response that is not committed"
    where = f"gateway_index/{row['conversation_id']}"
    return Damage(where, int(row["seq"]), f"{problem} ({row['response_id']})", action, repaired)


async def check(db: Db, locks: ConversationLocks, *, repair: bool, lock_timeout: float) -> list[Damage]:
    """The index rows naming an unusable response, each moved to `gateway_archive` with `repair`.

    A row is moved under its conversation's lock; one busy past `lock_timeout` is left as it is."""
    action = "the row is moved to gateway_archive"
    rows = await db.fetch("could not check the index", _UNUSABLE.format(only=""), db.namespace)
    if not repair or not rows:
        return [_damage(row, action) for row in rows]
    archive_id = f"quarantine-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    done: list[Damage] = []
    for cid in sorted({row["conversation_id"] for row in rows}):
        try:
            async with locks.lock(cid, lock_timeout):
                # Decided again under the lock: only what is still unusable moves.
                again = await db.fetch(
                    "could not check the index",
                    _UNUSABLE.format(only="AND i.conversation_id = $2"),
                    db.namespace,
                    cid,
                )
                for row in again:
                    path = f"conversations/{cid}.jsonl.line-{row['seq']}"
                    note = orjson.dumps({"seq": row["seq"], "response_id": row["response_id"]}).decode()
                    args = (db.namespace, cid, int(row["seq"]), archive_id, path, note)

                    async def move(conn: Conn, args: tuple[object, ...] = args) -> None:
                        await conn.execute(_MOVE, *args)

                    await db.write("could not move the index row", move)
                    done.append(_damage(row, f"moved to gateway_archive {archive_id}/{path}", repaired=True))
        except ConversationBusy:
            continue
    remaining = await db.fetch("could not check the index", _UNUSABLE.format(only=""), db.namespace)
    return done + [_damage(row, action) for row in remaining]
