"""Response logs in PostgreSQL, and the endings of failed attempts written once it is back.

An open log's request row is written at once; the commit writes the other records, the commit
record and the index row in one transaction."""

from __future__ import annotations

import asyncio
import logging

from gateway.exceptions import StorageError
from gateway.store.base import LRU, Appended, ResponseLog, Version, now
from gateway.store.postgres.backend import SharedBackend
from gateway.store.postgres.db import Db
from gateway.store.postgres.locks import ConversationLocks
from gateway.store.postgres.schema import (
    INSERT_RECORDS,
    Conflict,
    busy_error,
    encode_record,
    map_errors,
)
from gateway.types import JSONObject, Record

log = logging.getLogger("gateway.store")

MARK_RETRY_SECONDS = 2.0

# How long a failed commit waits for the database to say whether it was done after all.
LANDED_WAIT = 3.0
_LANDED = (
    "SELECT c.incarnation, i.seq FROM gateway_index i JOIN gateway_conversations c "
    "ON c.namespace = i.namespace AND c.conversation_id = i.conversation_id "
    "WHERE i.namespace = $1 AND i.conversation_id = $2 AND i.response_id = $3"
)


class PendingEndings:
    """Endings of failed attempts the database was down for, written once it is back.

    So those attempts read as failed, not in progress."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self._unmarked: LRU[str, list[tuple[str, str]]] = LRU(1024)  # response id -> its rows, from seq 0
        self._marking: asyncio.Task[None] | None = None

    def mark_later(self, response_id: str, rows: list[tuple[str, str]]) -> None:
        """Keep an attempt's `incomplete` ending the database could not take now.

        It is retried every MARK_RETRY_SECONDS (in the background) until the database takes it."""
        self._unmarked[response_id] = rows
        if self._marking is None or self._marking.done():
            self._marking = asyncio.ensure_future(self._mark_unmarked())

    async def _mark_unmarked(self) -> None:
        while self._unmarked:
            await asyncio.sleep(MARK_RETRY_SECONDS)
            for rid, rows in list(self._unmarked.items()):
                try:
                    await self.db.insert(rid, rows, 0, unless_committed=True)
                except StorageError:
                    break  # still down: the next round
                self._unmarked.pop(rid, None)
                log.info("marked %s incomplete", rid)

    def close(self) -> None:
        """Stop retrying (what is still pending stays unwritten)."""
        if self._marking is not None:
            self._marking.cancel()


class PostgresLog(ResponseLog):
    """One attempt's records, written to `gateway_responses` (and its index entry on commit)."""

    def __init__(
        self, db: Db, locks: ConversationLocks, endings: PendingEndings, response_id: str, request: Record
    ) -> None:
        self.db = db
        self.locks = locks
        self.endings = endings
        self.response_id = response_id
        self._rows: list[tuple[str, str]] = [encode_record(request)]
        self._closed = False
        self._created: asyncio.Future[None] | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        # The records known when the provider gets the request (the request and its context
        # snapshot, appended before the turn first waits) are written while the provider works,
        # so an attempt (even one whose process dies) shows at once what was sent; the commit
        # does not wait on it.
        self._created = asyncio.ensure_future(self._insert_known())
        self._created.add_done_callback(lambda f: None if f.cancelled() else f.exception())

    async def _insert_known(self) -> None:
        # (run as a task: the rows are those appended by the time it starts)
        await self.db.insert(self.response_id, list(self._rows), 0)

    def append(self, record: Record) -> None:
        self._rows.append(encode_record(record))

    async def visible(self) -> None:
        if self._created is not None:  # (a failed insert is the commit's or abandon's to report)
            await asyncio.wait([self._created])

    async def commit(self, conversation_id: str | None) -> Appended | None:
        self._closed = True
        rows = [*self._rows, encode_record({"type": "commit", "status": "complete", "committed": now()})]
        hold = self.locks.held(conversation_id) if conversation_id is not None else None
        expected = hold.expected if hold is not None else None
        backend = await self.db.backend()
        task = backend.spawn(self._commit(backend, rows, conversation_id, expected, self.row))
        incarnation, seq = await asyncio.shield(task)
        if conversation_id is None:
            return None
        if hold is not None:
            hold.expected = (incarnation, seq)
        return Appended(Version(incarnation, seq - 1), Version(incarnation, seq))

    async def _commit(
        self,
        backend: SharedBackend,
        rows: list[tuple[str, str]],
        cid: str | None,
        expected: tuple[int | None, int] | None,
        listing: JSONObject | None,
    ) -> tuple[int, int]:
        if self._created is not None:
            await asyncio.wait([self._created])
        try:
            with map_errors("could not record the response durably", backend.outage):
                async with backend.open_pool.acquire() as conn:
                    async with conn.transaction():
                        await self.db.insert_rows(conn, INSERT_RECORDS, self.response_id, rows, 0)
                        if cid is None:
                            return 0, 0
                        return await self.db.append_entry(
                            conn, cid, self.response_id, None, expected, listing
                        )
        except Conflict:
            await self._mark_failed(rows[:-1], "conflict", "the conversation changed on another replica")
            raise busy_error(cid or "") from None
        except StorageError as exc:
            landed = await self._landed(backend, cid) if cid is not None else None
            if landed is not None:
                # The COMMIT was done and only its reply lost (a connection cut, a restart): the
                # turn is in the conversation. Answered as a 503, a client's retry stored it twice.
                log.warning("the commit of %s was done; only its reply was lost (%s)", self.response_id, exc)
                return landed
            if "read-only transaction" in exc.message:
                self.db.saw_read_only()  # the next turns are refused before their provider is asked
            await self._mark_failed(rows[:-1], "storage_error", exc.message)
            raise

    async def _landed(self, backend: SharedBackend, cid: str) -> tuple[int, int] | None:
        """The index entry of a failed commit that was done after all, else None.

        Asked after the failure, the conversation's lock still held (so nobody else appends);
        None also when it cannot be known within LANDED_WAIT (the database still away)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LANDED_WAIT
        while True:
            await asyncio.sleep(0.05)  # (a COMMIT the server had when the connection went is done)
            try:
                with map_errors("could not tell whether the commit was done", backend.outage):
                    row = await backend.open_pool.fetchrow(_LANDED, self.db.namespace, cid, self.response_id)
                return None if row is None else (int(row[0]), int(row[1]))
            except StorageError:
                if loop.time() >= deadline:
                    return None
                await asyncio.sleep(0.2)

    async def _mark_failed(self, rows: list[tuple[str, str]], reason: str, message: str) -> None:
        """End the log with `incomplete` after a failed commit, best effort.

        Never after a commit record, in case the failure hid a commit that did happen."""
        error = {"message": message, "code": StorageError.code}  # (the code its client was answered with)
        rows = [*rows, encode_record({"type": "incomplete", "reason": reason, "error": error})]
        try:
            await self.db.insert(self.response_id, rows, 0, unless_committed=True)
        except StorageError as exc:
            log.error("could not mark %s incomplete (again once it can): %s", self.response_id, exc.message)
            self.endings.mark_later(self.response_id, rows)

    async def abandon(self, reason: str, error: JSONObject | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        rows = [*self._rows, encode_record({"type": "incomplete", "reason": reason, "error": error})]
        try:
            backend = await self.db.backend()
            if self._created is not None:
                await asyncio.wait([self._created])
            await asyncio.shield(
                backend.spawn(self.db.insert(self.response_id, rows, 0, unless_committed=True))
            )
        except StorageError as exc:
            log.warning("could not mark %s incomplete (again once it can): %s", self.response_id, exc.message)
            self.endings.mark_later(self.response_id, rows)
