"""Deleting (or archiving) a conversation and branching one, in PostgreSQL.

A branch copies the index rows up to a response; the response rows are shared."""

from __future__ import annotations

from gateway.exceptions import InvalidRequest, NotFound
from gateway.ids import check_conversation_id
from gateway.store.base import now
from gateway.store.postgres.db import Db
from gateway.store.postgres.schema import ARCHIVE, NOW, Conn


async def delete_conversation(db: Db, conversation_id: str, *, archive: bool = False) -> bool:
    """Delete a conversation (archived first with `archive`); False if there is none.

    With it go the responses and metadata no other conversation shares, and its summaries and
    lifecycle."""
    check_conversation_id(conversation_id)
    ns = db.namespace

    async def work(conn: Conn) -> bool:
        found = await conn.fetchval(
            "DELETE FROM gateway_conversations WHERE namespace = $1 AND conversation_id = $2 "
            "RETURNING incarnation",
            ns,
            conversation_id,
        )
        if found is None:
            return False
        if archive:
            await conn.execute(ARCHIVE, ns, conversation_id, f"{conversation_id}-{int(now() * 1000)}")
        # Responses a fork shares (its prefix) stay while another index names them, and so does
        # the metadata set on them (stored chat completions).
        await conn.execute(
            "DELETE FROM gateway_side s WHERE namespace = $1 AND kind = 'metadata' AND key IN "
            "(SELECT response_id FROM gateway_index WHERE namespace = $1 AND conversation_id = $2) "
            "AND NOT EXISTS (SELECT 1 FROM gateway_index o WHERE o.namespace = $1 "
            "AND o.response_id = s.key AND o.conversation_id <> $2)",
            ns,
            conversation_id,
        )
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

    return await db.write("could not delete the conversation", work)


async def fork(db: Db, source: str, target: str, through: str) -> None:
    """Start conversation `target` with the index of `source` up to response `through`."""
    check_conversation_id(source)
    check_conversation_id(target)
    ns = db.namespace

    async def work(conn: Conn) -> None:
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
            f"VALUES ($1, $2, $3, {NOW})",
            ns,
            target,
            upto,
        )
        await conn.execute(
            f"INSERT INTO gateway_index (namespace, conversation_id, seq, response_id, marker, at) "
            f"SELECT namespace, $3, seq, response_id, marker, {NOW} FROM gateway_index "
            f"WHERE namespace = $1 AND conversation_id = $2 AND seq <= $4",
            ns,
            source,
            target,
            upto,
        )

    await db.write("could not branch the conversation", work)
