"""An open response log on disk: created while the provider works, then committed or marked incomplete.

A commit makes it durable in the journal, then writes the rest of the file, then the index line.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson

from gateway.exceptions import StorageError
from gateway.store.base import LRU, Appended, ResponseLog, Version, now
from gateway.store.jsonl.catalog import Catalog
from gateway.store.jsonl.durability import Durability
from gateway.store.jsonl.files import end_log, index_generation, write_all
from gateway.store.jsonl.journal import Journal, commit_line, entry
from gateway.store.jsonl.layout import DataDir
from gateway.store.jsonl.spares import Spares
from gateway.types import JSONObject, Record

log = logging.getLogger("gateway.store")


class UnwrittenEndings:
    """Response logs whose `incomplete` ending could not be written (a full disk).

    They are written once a write succeeds again (the readiness probe, a commit), so that
    those attempts read as failed, not in progress."""

    def __init__(self, limit: int = 1024) -> None:
        self._endings: LRU[Path, tuple[int, bytes]] = LRU(limit)  # path -> (end of first record, ending)

    def __bool__(self) -> bool:
        return bool(self._endings)

    def add(self, path: Path, start: int, line: bytes) -> None:
        """A log's ending (`line`, after its first record, which ends at `start`) to write later."""
        self._endings[path] = (start, line)

    def write(self) -> None:
        """Write the endings kept; stop at the first that still fails (the next success retries)."""
        for path, (start, line) in list(self._endings.items()):
            try:
                end_log(path, start, line)
            except FileNotFoundError:
                pass  # removed since (its conversation deleted)
            except OSError:
                return
            self._endings.pop(path, None)
            log.info("marked %s incomplete", path.name)


class JsonlLog(ResponseLog):
    """One response's log file, from the request to its commit or its `incomplete` ending."""

    def __init__(
        self,
        response_id: str,
        request: Record,
        *,
        data_dir: DataDir,
        durability: Durability,
        journal: Journal,
        spares: Spares,
        catalog: Catalog,
        endings: UnwrittenEndings,
    ) -> None:
        self.data_dir = data_dir
        self.durability = durability
        self.journal = journal
        self.spares = spares
        self.catalog = catalog
        self.endings = endings
        self.response_id = response_id
        self.path = data_dir.response_path(response_id)
        self.first = orjson.dumps(request) + b"\n"
        self._pending: list[bytes] = []
        self._closed = False
        self._fd = -1
        self._counted = True
        journal.open_logs += 1
        self.create_error: str | None = None
        self._new_index = False  # no index yet (seen by `meanwhile` or the commit): a spare file for it
        self._opened = False
        self._conversation = request.get("conversation_id")
        self._before: int | None = None  # the index's size, read ahead by `meanwhile`
        # A turn that found no index entry (the lock held since) knows the index is empty or
        # absent: `meanwhile` need not look (one path lookup less for a new conversation).
        before = request.get("before")
        self._known_empty = isinstance(before, dict) and before.get("entries") == 0

    def meanwhile(self) -> None:
        if self._opened:
            return
        self._open()
        if isinstance(self._conversation, str):
            if self._known_empty:
                self._before, self._new_index = 0, True
                return
            # Exact until the commit: this turn holds the conversation's lock.
            try:
                self._before = self._index_size(self._conversation)
            except OSError:
                pass  # read again, and reported, by the commit

    async def visible(self) -> None:
        self.meanwhile()  # (the file, made now if the provider has not had the request yet)

    def _open(self) -> None:
        """Create the file with its first records, once, on the event loop.

        A page-cache write, cheaper than a thread hop and the GIL passing to and from that thread;
        made while the provider works on the request, else at the commit or abandon. Nothing here
        is synced: see `commit`.
        """
        if self._opened:
            return
        self._opened = True
        if self._pending:
            # The records known when the provider got the request (its context snapshot) are
            # on file from then on: an attempt in flight, or cut short by a crash, shows what
            # was sent. They count as the file's beginning (the journal's copy included).
            self.first += b"".join(self._pending)
            self._pending.clear()
        try:
            self._fd = self.spares.create(self.path, os.O_WRONLY | os.O_APPEND)
            write_all(self._fd, self.first)
            if self.durability.refused is not None:
                self.durability.refused = None  # (the data dir takes writes again)
        except OSError as exc:
            self.create_error = exc.strerror or str(exc)
            self.durability.refused, self.durability.refused_bytes = self.create_error, len(self.first)
            log.error("cannot create response log %s: %s", self.path.name, self.create_error)
            if self._fd >= 0:  # created, but its first record did not fit (a full disk)
                os.close(self._fd)
                self._fd = -1
                try:  # no empty or torn file left behind to name a response that never was
                    os.unlink(self.path)
                except OSError:
                    pass

    @property
    def commit_waits(self) -> bool:
        # With other turns open, the sync is shared (native AIO, or the journal's thread): a
        # task of its own lets the turns ending in this loop iteration join the same fdatasync.
        journal = self.journal
        return self.durability.fsync and (journal.current is None or journal.open_logs > 1)

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.journal.open_logs -= 1

    def append(self, record: Record) -> None:
        self._pending.append(orjson.dumps(record) + b"\n")

    async def commit(self, conversation_id: str | None) -> Appended | None:
        records = b"".join(self._pending)
        self._pending.clear()
        self._closed = True
        try:
            return await self._commit(records, conversation_id)
        finally:
            self._uncount()

    async def _commit(self, records: bytes, conversation_id: str | None) -> Appended | None:
        before = self.check_commit(records, conversation_id)
        tail = records + commit_line()
        if not self.durability.fsync:
            return self.finish(tail, conversation_id)
        journal = self.journal
        data = entry(self.response_id, conversation_id, before, self.first + tail)
        try:
            held = await journal.append(data)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            self.mark_failed(records, reason, None, -1)
            journal.abort(self.response_id)  # a failed sync may have written it
            raise StorageError(f"could not record the response durably: {reason}") from exc
        try:
            return self.finish(tail, conversation_id)
        except StorageError:
            journal.abort(self.response_id)
            raise
        finally:
            journal.done(held)

    def check_commit(self, records: bytes, conversation_id: str | None) -> int:
        """Before the journal: refuse a commit that cannot be made; the index's size now."""
        self._open()
        if self.durability.failed is not None:
            self.mark_failed(records, self.durability.failed, None, -1)
            self.durability.refuse_if_failed()
        if self._fd < 0:
            raise StorageError(f"the response log could not be created: {self.create_error}")
        if conversation_id is None:
            return 0
        if self._before is not None and conversation_id == self._conversation:
            return self._before
        try:
            return self._index_size(conversation_id)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            self.mark_failed(records, reason, None, -1)
            raise StorageError(f"could not record the response durably: {reason}") from exc

    def _index_size(self, conversation_id: str) -> int:
        try:
            return os.stat(self.data_dir.index_path(conversation_id)).st_size
        except FileNotFoundError:
            self._new_index = True
            return 0

    def finish(self, tail: bytes, conversation_id: str | None) -> Appended | None:
        """Write the rest of the response file, the index line, the catalog's line; return the index append.

        The response file and the index line have no sync of their own: the journal already holds
        both. The catalog's line carries the list row, if any.

        On any failure nothing is acknowledged: an index line already written is taken back
        and the response log is marked incomplete (as far as the disk still allows), so that
        neither the index nor the log claims a turn the client was told failed.
        """
        before = -1
        written = False
        try:
            try:
                write_all(self._fd, tail)
            finally:
                os.close(self._fd)
                self._fd = -1
            written = True
            if conversation_id is None:
                return None
            index = self.data_dir.index_path(conversation_id)
            line = self.response_id.encode() + b"\n"
            fd = self._open_index(index)
            try:
                stat = os.fstat(fd)
                before = stat.st_size
                generation = index_generation(fd, stat, line)
                write_all(fd, line)
            finally:
                os.close(fd)
            after = Version(generation, before + len(line))
            row = (after, self.row) if self.row is not None else None
            self.catalog.changed(conversation_id, now(), row)
            if self.endings:
                self.endings.write()
            return Appended(Version(generation, before), after)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            # (also when the index could not be opened: the client is told the turn failed, and
            # its log must not read back as a completed response)
            self.mark_failed(b"", reason, conversation_id, before)
            if written:  # the index refused (a read-only folder of its own): turns are held too
                self.durability.refused = reason
            raise StorageError(f"could not record the response durably: {reason}") from exc

    def _open_index(self, index: Path) -> int:
        if self._new_index:
            try:
                return self.spares.create(index, os.O_RDWR | os.O_APPEND)
            except FileExistsError:
                pass
        return os.open(index, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)

    def mark_failed(self, records: bytes, reason: str, conversation_id: str | None, before: int) -> None:
        """Best effort after a failed commit: take our index line back and end the log with `incomplete`.

        We hold the conversation's lock, so our index line is the last one.
        """
        if conversation_id is not None and before >= 0:
            index = self.data_dir.index_path(conversation_id)
            try:
                if before == 0:
                    os.unlink(index)
                else:
                    os.truncate(index, before)
            except OSError as exc:
                log.error("could not take %s back out of %s: %s", self.response_id, index, exc)
        error = {"message": reason, "code": StorageError.code}  # (the code its client was answered with)
        line = orjson.dumps({"type": "incomplete", "reason": "storage_error", "error": error})
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            end_log(self.path, len(self.first), records + line + b"\n")
        except OSError as exc:
            log.error("could not mark %s incomplete (again once writes succeed): %s", self.response_id, exc)
            self.endings.add(self.path, len(self.first), line + b"\n")

    async def abandon(self, reason: str, error: JSONObject | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._uncount()
        self._open()
        if self._fd < 0:
            log.warning("could not mark %s incomplete: %s", self.response_id, self.create_error)
            return
        self._pending.append(orjson.dumps({"type": "incomplete", "reason": reason, "error": error}) + b"\n")
        os.close(self._fd)
        self._fd = -1
        try:
            end_log(self.path, len(self.first), b"".join(self._pending))
        except OSError as exc:
            log.warning("could not mark %s incomplete (again once writes succeed): %s", self.response_id, exc)
            self.endings.add(self.path, len(self.first), self._pending[-1])
