"""An open response log on disk: created while the provider works, committed (records, then
the commit record, fsync'd, then the index line) or marked incomplete."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

import orjson

from gateway.exceptions import StorageError
from gateway.store.base import Appended, ResponseLog, Version, now
from gateway.store.jsonl.files import fsync_dir, index_generation, write_all
from gateway.types import JSONObject, Record

if TYPE_CHECKING:
    from gateway.store.jsonl.store import JsonlStore

log = logging.getLogger("gateway.store")


class JsonlLog(ResponseLog):
    def __init__(self, store: JsonlStore, response_id: str, request: Record) -> None:
        self.store = store
        self.response_id = response_id
        self.path = store.response_path(response_id)
        self._pending: list[bytes] = []
        self._closed = False
        self._fd = -1
        self._dir_durable = False
        first = orjson.dumps(request) + b"\n"
        # The file is created, and its directory entry made durable, in a worker thread while
        # the provider works: file creation is slow and erratic on some disks, and the commit
        # then only waits for the file's data and the index line.
        self._created: asyncio.Future[None] | None = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._create(first)
            return
        self._created = loop.run_in_executor(None, self._create, first)
        # An abandoned log may never await it: retrieve its outcome so nothing is left unread.
        self._created.add_done_callback(lambda f: None if f.cancelled() else f.exception())

    def _create(self, first: bytes) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            os.write(self._fd, first)
        except OSError as exc:
            raise StorageError(f"cannot create response log: {exc.strerror or exc}") from exc
        if self.store.fsync:
            fsync_dir(self.store.responses_dir)
            self._dir_durable = True

    async def _wait_created(self) -> None:
        if self._created is not None:
            try:
                await asyncio.shield(self._created)
            except OSError as exc:
                # The file exists (or not); only the early directory fsync may have failed.
                log.warning("early directory fsync failed: %s", exc)
        if self._fd < 0:
            raise StorageError("the response log could not be created")

    def append(self, record: Record) -> None:
        self._pending.append(orjson.dumps(record) + b"\n")

    async def commit(self, conversation_id: str | None) -> Appended | None:
        records = b"".join(self._pending)
        self._pending.clear()
        store = self.store
        await self._wait_created()
        known = store._sizes.get(conversation_id) if conversation_id is not None else None
        if store.fsync or (conversation_id is not None and not known):
            # Waiting on the disk (fsync, or creating a new index file) happens off the loop.
            return await asyncio.shield(asyncio.to_thread(self._commit_sync, records, conversation_id))
        return self._commit_sync(records, conversation_id)

    def _commit_sync(self, records: bytes, conversation_id: str | None) -> Appended | None:
        """Write and commit; return the index append (None without a conversation).

        On any failure nothing is acknowledged: an index line already written is taken back
        and the response log is marked incomplete (as far as the disk still allows), so that
        neither the index nor the log claims a turn the client was told failed."""
        store = self.store
        self._closed = True
        if store.sync_failed is not None:
            self._mark_failed(records, store.sync_failed, conversation_id, -1)
            store.refuse_if_failed()
        commit = orjson.dumps({"type": "commit", "status": "complete", "committed": now()}) + b"\n"
        before = -1
        durable = False
        try:
            try:
                write_all(self._fd, records + commit)
                if store.fsync:
                    store._sync(os.fdatasync, self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1
            if store.fsync and not self._dir_durable:
                store._sync(fsync_dir, store.responses_dir)
            durable = True
            if conversation_id is None:
                return None
            index = store.index_path(conversation_id)
            line = self.response_id.encode() + b"\n"
            fd = os.open(index, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                stat = os.fstat(fd)
                before = stat.st_size
                generation = index_generation(fd, stat, line)
                write_all(fd, line)
                if store.fsync:
                    store._sync(os.fdatasync, fd)
            finally:
                os.close(fd)
            if before == 0 and store.fsync:
                store._sync(fsync_dir, store.conversations_dir)
            store._sizes[conversation_id] = before + len(line)
            store.catalog.changed(conversation_id, now())
            return Appended(Version(generation, before), Version(generation, before + len(line)))
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if durable and before < 0:
                # Complete on disk, not indexed: the state a crash at this point leaves too.
                store._forget(conversation_id)
            else:
                self._mark_failed(b"", reason, conversation_id, before)
            raise StorageError(f"could not record the response durably: {reason}") from exc

    def _mark_failed(self, records: bytes, reason: str, conversation_id: str | None, before: int) -> None:
        """Best effort after a failed commit: take our index line back (we hold the
        conversation's lock, so it is the last one) and end the log with `incomplete`."""
        store = self.store
        store._forget(conversation_id)
        if conversation_id is not None and before >= 0:
            index = store.index_path(conversation_id)
            try:
                if before == 0:
                    os.unlink(index)
                else:
                    os.truncate(index, before)
            except OSError as exc:
                log.error("could not take %s back out of %s: %s", self.response_id, index, exc)
        # A leading newline ends a line the failed write may have torn.
        line = (
            b"\n"
            + orjson.dumps({"type": "incomplete", "reason": "storage_error", "error": {"message": reason}})
            + b"\n"
        )
        try:
            fd = self._fd if self._fd >= 0 else os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                write_all(fd, records + line)
            finally:
                os.close(fd)
                self._fd = -1
        except OSError as exc:
            log.error("could not mark %s incomplete: %s", self.response_id, exc)

    async def abandon(self, reason: str, error: JSONObject | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._wait_created()
        except StorageError as exc:
            log.warning("could not mark %s incomplete: %s", self.response_id, exc.message)
            return
        self._pending.append(orjson.dumps({"type": "incomplete", "reason": reason, "error": error}) + b"\n")
        try:
            os.write(self._fd, b"".join(self._pending))
        except OSError as exc:
            log.warning("could not mark %s incomplete: %s", self.response_id, exc)
        finally:
            os.close(self._fd)
