"""The embedded store: one JSONL file per response, one append-only JSONL index per conversation.

The files and folders are in layout.py. A turn's commit is made durable in the process's journal
(one fdatasync shared by the turns committing together), then its response file is completed and
its id appended to the index, so the index never names an incomplete response; a restart replays
what a crash left unfinished. A reader gets the entries after a `Version` (the index file's inode
and byte offset), so writes by another process are noticed.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import logging
import os
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import orjson

from gateway.exceptions import NotFound, StorageError
from gateway.ids import check_conversation_id, is_valid_response_id
from gateway.store.base import (
    LRU,
    Appended,
    Damage,
    IndexEntry,
    IndexList,
    IndexRead,
    Listed,
    ResponseLog,
    SideLog,
    Store,
    Version,
    now,
)
from gateway.store.jsonl import branches, fsck, recovery
from gateway.store.jsonl.catalog import Catalog, index_times
from gateway.store.jsonl.durability import Durability
from gateway.store.jsonl.files import (
    append_file,
    file_size,
    folders_writable,
    fsync_dir,
    index_generation,
    os_errors,
    parse_index,
    probe_file,
    read_records,
    read_turn_records,
    read_whole,
    write_all,
)
from gateway.store.jsonl.heads import Heads, last_record_type
from gateway.store.jsonl.journal import PREALLOCATE, Journal
from gateway.store.jsonl.layout import DataDir
from gateway.store.jsonl.locks import LockFolder, arrival, busy
from gateway.store.jsonl.log import JsonlLog, UnwrittenEndings
from gateway.store.jsonl.reading import read_index_after
from gateway.store.jsonl.spares import Spares, sweep
from gateway.types import Api, JSONObject, Record

log = logging.getLogger("gateway.store")

# Conversations bigger than this (index bytes) are loaded in a worker thread, and so are
# more response files than this at once.
_THREAD_LOAD_BYTES = 4096
_THREAD_LOAD_FILES = 16
# The conversations whose lock the running task holds (readers without it never repair).
_HELD: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("gateway_held", default=frozenset())


def writable(root: Path) -> None:
    """Raise OSError unless a file can be created in `root` (a read-only mount, say)."""
    probe = root / f".writable-{os.getpid()}"
    with open(probe, "wb"):
        pass
    probe.unlink()


class JsonlStore(Store):
    """A data dir of JSONL files, read and written through its parts.

    `data_dir` (where each file lives), `durability` (when writes are synced, and whether they
    still may be), `lock_folder` (the conversations' locks across processes), the `journal`,
    the `catalog` and `heads` (what lists read), `spares` (files made ahead of need) and
    `endings` (of response logs, still to write)."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        durability: str = "fsync",
        cache_size: int = 1024,
    ) -> None:
        self.root = Path(data_dir)
        self.data_dir = DataDir(self.root, cache_size=cache_size)
        self.durability = Durability(fsync=durability == "fsync")
        self.lock_folder = LockFolder(self.data_dir.locks_dir)
        # Side logs read (size, records): at most 4 x cache_size logs and as many records.
        self._side: LRU[tuple[str, str], tuple[int, list[Record]]] = LRU(
            4 * cache_size, weigh=lambda v: len(v[1]) + 1, budget=4 * cache_size
        )
        self.catalog = Catalog(self.data_dir)
        self.heads = Heads(self.data_dir.responses_dir, self.data_dir.catalog_dir / "responses.jsonl")
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.journal = Journal(self.data_dir, self.durability)  # commits' shared fdatasync (durability fsync)
        self.spares = Spares(self.data_dir.spare_dir)  # new files renamed into place
        self.endings = UnwrittenEndings()

    @property
    def refusing_writes(self) -> str | None:
        return self.durability.failed

    def refuse_if_failed(self) -> None:
        """Refuse a turn before its provider is asked (its answer could not be kept) once a sync
        failed, or while the data dir, seen refusing a write, still does.

        Only then is a file as large as the refused write written to find out (and a small one
        where indexes are made), on the loop: a few system calls, and none on a turn while the
        data dir takes writes."""
        super().refuse_if_failed()
        if self.durability.refused is None:
            return
        try:
            probe = f".probe-{os.getpid()}"
            probe_file(self.data_dir.responses_dir / probe, False, self.durability.refused_bytes)
            probe_file(self.data_dir.conversations_dir / probe, False)  # (a new index is made there)
        except OSError as exc:
            self.durability.refused = exc.strerror or str(exc)
            raise StorageError(
                f"the data dir cannot be written: {self.durability.refused}; retry later"
            ) from exc
        self.durability.refused = None

    async def open(self) -> None:
        try:
            self.data_dir.create()
            await asyncio.to_thread(writable, self.root)
        except OSError as exc:
            raise StorageError(self.unwritable(exc)) from exc
        await asyncio.to_thread(sweep, self.spares.folder)
        await self.recover()

    def unwritable(self, exc: OSError, doing: str = "") -> str:
        """A start-up failure to write, naming the data dir and the cause."""
        what = f"{doing}: " if doing else ""
        return (
            f"{what}the data dir {self.root} cannot be written ({exc.strerror or exc}); "
            "the gateway stores every turn there: mount it read-write or give another --data-dir"
        )

    async def recover(self) -> int:
        """Replay the journals of processes that stopped (see recovery.py)."""
        try:
            return await asyncio.to_thread(recovery.recover, self.data_dir, self.durability, self.lock_folder)
        except OSError as exc:
            raise StorageError(self.unwritable(exc, "could not replay the journal")) from exc

    # -- locking ----------------------------------------------------------------------------
    @asynccontextmanager
    async def lock(self, conversation_id: str, timeout: float) -> AsyncIterator[None]:
        """Hold a conversation's lock, in this process and across processes.

        In this process, one asyncio.Lock per conversation (FIFO). Across processes, a lock of the
        conversation's own: one byte of `locks/conversations.lock`, at an offset hashed from the id
        over 2^62 (a Linux open-file-description lock, kept by this store's file descriptor), so an
        unrelated conversation never waits for it and no file is created per conversation. Without
        such locks (not Linux), an flock() on `locks/{id}.lock`.
        """
        check_conversation_id(conversation_id)
        arrived = arrival()  # this request's place in line, across processes too
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        held = self.lock_folder.conversation(conversation_id, arrived)
        lock = self._locks.get(conversation_id)
        try:
            if lock is None:  # nobody else can hold or wait for it: no timer to set up
                lock = self._locks[conversation_id] = asyncio.Lock()
                await lock.acquire()
            else:
                if lock.locked():  # behind this process's own turns: in line for the others now
                    held.wait_in_line()
                try:
                    async with asyncio.timeout(timeout):
                        await lock.acquire()
                except TimeoutError:
                    raise busy(conversation_id) from None
        except BaseException:
            held.release()  # (leaves the line)
            raise
        try:
            delay = 0.0005
            while not held.try_acquire():
                held.wait_in_line()
                if loop.time() >= deadline:
                    raise busy(conversation_id) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.01)
            _HELD.set(_HELD.get() | {conversation_id})
            yield
        finally:
            if held.acquired:  # not a token reset: released in any order
                _HELD.set(_HELD.get() - {conversation_id})
            held.release()
            lock.release()

    def holds_lock(self, conversation_id: str) -> bool:
        """Does the running task hold this conversation's lock? Only then may a read repair."""
        return conversation_id in _HELD.get()

    async def probe(self) -> None:
        """Create, write, sync and remove a small file in the data dir.

        A full or read-only disk, or a vanished folder, fails here before a turn does.
        """
        try:
            locks_dir = self.data_dir.locks_dir
            await asyncio.to_thread(probe_file, locks_dir / f".probe-{os.getpid()}", self.durability.fsync)
            folders_writable(self.data_dir.responses_dir, self.data_dir.conversations_dir)
            if self.durability.fsync and self.journal.current is None:
                # The first turn makes this process's journal: two files of PREALLOCATE bytes.
                stat = os.statvfs(locks_dir)
                if stat.f_bavail * stat.f_frsize < 2 * PREALLOCATE:
                    raise OSError(errno.ENOSPC, "No space left on device for the journal")
        except OSError as exc:
            self.durability.refused = exc.strerror or str(exc)
            raise StorageError(f"the data dir cannot be written: {exc.strerror or exc}") from exc
        self.durability.refused = None  # (written: turns go on)
        self.endings.write()

    async def close(self) -> None:
        self.journal.release()
        await asyncio.to_thread(self.journal.stop)
        await asyncio.to_thread(self.spares.close)
        self.catalog.close()
        self.lock_folder.close()

    # -- reading ----------------------------------------------------------------------------
    def _read_records(self, path: Path, *, skip_context: bool = False) -> list[Record]:
        shown = self.data_dir.shown(path)
        return read_turn_records(path, shown) if skip_context else read_records(path, shown)

    def _read_raw(
        self, conversation_id: str, after: Version | None, repair: bool
    ) -> tuple[list[str | Record], Version, bool] | None:
        """The index lines after `after`: (entries, version, restarted); None if no index."""
        path = self.data_dir.index_path(conversation_id)
        return read_index_after(path, self.data_dir.shown(path), after, repair)

    def _read_sync(self, conversation_id: str, after: Version | None, repair: bool) -> IndexRead:
        found = self._read_raw(conversation_id, after, repair)
        if found is None:
            return IndexRead([], None, True)
        raw, version, restarted = found
        response_path = self.data_dir.response_path
        entries = [
            IndexEntry(None, entry, [])
            if isinstance(entry, dict)
            else IndexEntry(entry, None, self._read_records(response_path(entry), skip_context=True))
            for entry in raw
        ]
        return IndexRead(entries, version, restarted)

    async def read_entries(self, conversation_id: str) -> IndexList:
        with os_errors("read the conversation"):
            found = self._read_raw(conversation_id, None, self.holds_lock(conversation_id))
        return IndexList([], None) if found is None else IndexList(found[0], found[1])

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        # A torn last line is cut only by a holder of the lock: without it, the "torn" line may
        # be another writer's append in progress (another task, thread or worker process).
        repair = self.holds_lock(conversation_id)
        with os_errors("read the conversation"):
            if after is not None:  # a reader that is up to date reads only what was appended since
                return self._read_sync(conversation_id, after, repair)
            # Reading a whole conversation's response files is slow: off the loop unless it is little.
            if file_size(self.data_dir.index_path(conversation_id)) > _THREAD_LOAD_BYTES:
                return await asyncio.to_thread(self._read_sync, conversation_id, after, repair)
            return self._read_sync(conversation_id, after, repair)

    async def read_turns(self, response_ids: Sequence[str]) -> list[list[Record]]:
        def read() -> list[list[Record]]:
            response_path = self.data_dir.response_path
            return [self._read_records(response_path(rid), skip_context=True) for rid in response_ids]

        with os_errors("read the conversation"):
            if len(response_ids) > _THREAD_LOAD_FILES:
                return await asyncio.to_thread(read)
            return read()

    def start(self, response_id: str, request: Record) -> ResponseLog:
        return JsonlLog(
            response_id,
            request,
            data_dir=self.data_dir,
            durability=self.durability,
            journal=self.journal,
            spares=self.spares,
            catalog=self.catalog,
            endings=self.endings,
        )

    async def read_response(self, response_id: str) -> list[Record]:
        path = self.data_dir.response_path(response_id)
        with os_errors("read the response"):
            try:
                os.stat(path)  # (not `exists()`, which says False of a folder that is a file)
            except FileNotFoundError:
                raise NotFound(f"No response {response_id!r}", param="response_id") from None
            return self._read_records(path)

    async def read_index(self, conversation_id: str) -> list[str | Record]:
        path = self.data_dir.index_path(conversation_id)
        with os_errors("read the conversation"):
            try:
                data = read_whole(path)
            except FileNotFoundError:
                raise NotFound(f"No conversation {conversation_id!r}", param="conversation_id") from None
        entries, _ = parse_index(data, path=self.data_dir.shown(path))
        return entries

    async def append_marker(
        self, conversation_id: str, marker: Record, row: JSONObject | None = None
    ) -> Appended:
        path = self.data_dir.index_path(conversation_id)
        line = orjson.dumps(marker) + b"\n"

        def write() -> Appended:
            sync = self.durability.append_sync()
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                stat = os.fstat(fd)
                generation = index_generation(fd, stat, line)
                write_all(fd, line)
                if sync is not None:
                    sync(fd)
            finally:
                os.close(fd)
            if stat.st_size == 0 and self.durability.fsync:
                self.durability.sync(fsync_dir, self.data_dir.conversations_dir)
            after = Version(generation, stat.st_size + len(line))
            self.catalog.changed(conversation_id, now(), (after, row) if row is not None else None)
            return Appended(Version(generation, stat.st_size), after)

        try:
            return await asyncio.to_thread(write)
        except OSError as exc:
            raise StorageError(f"could not record the change durably: {exc.strerror or exc}") from exc

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        for kind in ("summaries", "lifecycle"):
            self._side.pop((kind, conversation_id), None)
        return await branches.delete_conversation(
            self.data_dir, self.durability, self.catalog, conversation_id, archive=archive
        )

    async def fork(self, source: str, target: str, through: str) -> None:
        await branches.fork(self.data_dir, self.durability, self.catalog, source, target, through)

    async def check(self, *, repair: bool = False, lock_timeout: float = 30.0) -> list[Damage]:
        await self.recover()  # what a stopped process left in its journal first
        found = await asyncio.to_thread(fsck.survey, self.data_dir)
        if not repair or not found.damage:
            return found.damage
        done = await fsck.repair(
            self.data_dir,
            found,
            fsync=self.durability.fsync,
            lock=lambda conversation_id: self.lock(conversation_id, lock_timeout),
        )
        return done + (await asyncio.to_thread(fsck.survey, self.data_dir)).damage

    async def append_side(self, kind: SideLog, key: str, record: Record) -> None:
        path = self.data_dir.side_path(kind, key)
        line = orjson.dumps(record) + b"\n"

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            append_file(path, line, sync=self.durability.append_sync())

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise StorageError(f"could not record {kind}: {exc.strerror or exc}") from exc
        self._side.pop((kind, key), None)

    async def read_side(self, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
        path = self.data_dir.side_path(kind, key)
        with os_errors(f"read {kind}"):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return []
            cached = self._side.get((kind, key))
            if cached is not None and cached[0] == size:
                return cached[1]
            records = self._read_records(path)
        if keep or (kind, key) in self._side:
            self._side[(kind, key)] = (size, records)
        return records

    async def sharing(self, conversation_id: str, response_id: str) -> list[str]:
        with os_errors("read the conversation"):
            return await asyncio.to_thread(
                branches.sharing, self.data_dir, self.catalog, conversation_id, response_id
            )

    async def tombstone(self, response_id: str) -> None:
        await branches.tombstone(self.data_dir, self.durability, response_id)

    async def exists(self, conversation_id: str) -> bool:
        path = self.data_dir.index_path(conversation_id)
        with os_errors("read the conversation"):
            return os.path.exists(path)

    async def warm(self) -> None:
        with os_errors("list the conversations"):
            await asyncio.to_thread(self.catalog.refresh)

    async def list_conversations(
        self, limit: int, after: str | None = None
    ) -> tuple[list[tuple[str, float]], bool]:
        page, more = await self._listed(limit, after, rows=False)
        return [(listed.conversation_id, listed.changed) for listed in page], more

    async def list_rows(self, limit: int, after: str | None = None) -> tuple[list[Listed], bool]:
        return await self._listed(limit, after, rows=True)

    async def _listed(self, limit: int, after: str | None, *, rows: bool) -> tuple[list[Listed], bool]:
        if after is not None:
            check_conversation_id(after, param="after")
        with os_errors("list the conversations"):
            page = await asyncio.to_thread(self.catalog.listed, limit, after, rows=rows)
        if page is None:
            raise NotFound(f"No conversation {after!r} in this list", param="after")
        return page

    async def keep_rows(self, rows: list[tuple[str, Version, JSONObject]]) -> None:
        await asyncio.to_thread(self.catalog.keep, rows)

    async def list_responses(
        self,
        limit: int,
        *,
        api: Api,
        model: str | None = None,
        after: str | None = None,
        descending: bool = False,
    ) -> tuple[list[str], bool]:
        """A walk of the response heads (heads.py).

        A page costs a stat of `logs/responses/` and, when files were added or removed since the
        last page, a listing of its names and the first record of each new log; then, for each log
        walked, its last line (and nothing for the other APIs' logs, nor for other models'). The
        first list of a data dir reads every log's first record once, and saves them in
        `catalog/responses.jsonl`.
        """

        def walk() -> tuple[list[str], bool] | None:
            self.heads.refresh()
            return self.heads.page(
                limit, api=api, model=model, after=after, descending=descending, taken=self._committed
            )

        page = None
        if after is None or is_valid_response_id(after):
            with os_errors("list the responses"):
                page = await asyncio.to_thread(walk)
        if page is None:
            raise NotFound(f"No response {after!r} in this list", param="after")
        return page

    def _committed(self, response_id: str) -> bool:
        """Is the log's last record its commit (not failed, under way, or deleted since)?"""
        return last_record_type(self.data_dir.response_path(response_id)) == "commit"

    async def conversation_ids(self) -> list[tuple[str, float]]:
        """A scan of the folder (file times: the lifecycle pass's clock); lists use the catalog."""
        with os_errors("list the conversations"):
            times = await asyncio.to_thread(index_times, self.data_dir.conversations_dir)
        return sorted(times, key=lambda pair: pair[1], reverse=True)
