"""The embedded store: one JSONL file per response, one append-only JSONL index per conversation.

    {data_dir}/logs/responses/{response_id}.jsonl      request, context, response, commit
    {data_dir}/logs/conversations/{conversation_id}.jsonl  one response id per line
    {data_dir}/logs/summaries/{conversation_id}.jsonl  rolling summary versions (append-only)
    {data_dir}/locks/{conversation_id}.lock           flock() per conversation, across worker processes

A response file is written and fsync'd before its id is appended to the index (then the index
is fsync'd), so the index never names an incomplete response. Each process caches assembled
conversations and revalidates them by index size, so writes by another process are noticed.
"""

from __future__ import annotations

import asyncio
import contextvars
import fcntl
import logging
import os
import shutil
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from gateway.exceptions import ConversationBusy, CorruptRecord, InvalidRequest, NotFound, StorageError
from gateway.ids import check_conversation_id, is_valid_conversation_id, is_valid_response_id
from gateway.store.base import LRU, Appended, IndexEntry, IndexRead, Record, ResponseLog, Store, Version, now

log = logging.getLogger("gateway.store")

# Conversations bigger than this (index bytes) are loaded in a worker thread.
_THREAD_LOAD_BYTES = 4096
# The conversations whose lock the running task holds (readers without it never repair).
_HELD: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "gateway_held_locks", default=frozenset()
)
# Context snapshots are the bulk of a response log and are not needed to rebuild history.
_CONTEXT_PREFIX = b'{"type":"context"'
# Append-only logs beside the conversations: logs/{kind}/{key}.jsonl
SIDE_LOGS = frozenset({"summaries", "lifecycle", "users", "digests", "models"})


def parse_jsonl(data: bytes, *, path: str = "", start_line: int = 1) -> tuple[list[Any], int]:
    """Decode complete lines; return (values, bytes consumed). A torn last line is not consumed.

    An undecodable complete line raises CorruptRecord with its path and line number.
    """
    end = data.rfind(b"\n") + 1
    values: list[Any] = []
    for offset, line in enumerate(data[:end].split(b"\n")[:-1]):
        if not line.strip():
            continue
        try:
            values.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            raise CorruptRecord(f"undecodable record: {exc}", path=path, lineno=start_line + offset) from None
    return values, end


def parse_index(data: bytes, *, path: str = "") -> tuple[list[str | Record], int]:
    """Index lines are bare response ids or JSON marker objects."""
    end = data.rfind(b"\n") + 1
    entries: list[str | Record] = []
    for lineno, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith(b"{"):
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise CorruptRecord(f"undecodable index marker: {exc}", path=path, lineno=lineno) from None
            if not isinstance(entry, dict):
                raise CorruptRecord("index marker is not an object", path=path, lineno=lineno)
            entries.append(entry)
            continue
        try:
            text = line.decode("ascii")
        except UnicodeDecodeError:
            raise CorruptRecord("index line is not a response id", path=path, lineno=lineno) from None
        if not is_valid_response_id(text):
            raise CorruptRecord("index line is not a response id", path=path, lineno=lineno)
        entries.append(text)
    return entries, end


def _write_all(fd: int, data: bytes) -> None:
    """os.write, failing instead of leaving a short write (disk full) unnoticed."""
    written = os.write(fd, data)
    if written != len(data):
        raise OSError(28, f"short write ({written} of {len(data)} bytes)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _append(path: Path, data: bytes, *, sync: Callable[[int], None] | None, create: bool = True) -> int:
    """Append `data` to a file (then `sync(fd)`, if given); the file's size before it."""
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        before = os.fstat(fd).st_size
        _write_all(fd, data)
        if sync is not None:
            sync(fd)
    finally:
        os.close(fd)
    return before


class _JsonlLog(ResponseLog):
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
            _fsync_dir(self.store.responses_dir)
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
                _write_all(self._fd, records + commit)
                if store.fsync:
                    store._sync(os.fdatasync, self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1
            if store.fsync and not self._dir_durable:
                store._sync(_fsync_dir, store.responses_dir)
            durable = True
            if store.before_index_append is not None:
                store.before_index_append(self.response_id)
            if conversation_id is None:
                return None
            index = store.index_path(conversation_id)
            line = self.response_id.encode() + b"\n"
            fd = os.open(index, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                stat = os.fstat(fd)
                before = stat.st_size
                _write_all(fd, line)
                if store.fsync:
                    store._sync(os.fdatasync, fd)
            finally:
                os.close(fd)
            if before == 0 and store.fsync:
                store._sync(_fsync_dir, store.conversations_dir)
            store._sizes[conversation_id] = before + len(line)
            return Appended(Version(stat.st_ino, before), Version(stat.st_ino, before + len(line)))
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
                _write_all(fd, records + line)
            finally:
                os.close(fd)
                self._fd = -1
        except OSError as exc:
            log.error("could not mark %s incomplete: %s", self.response_id, exc)

    async def abandon(self, reason: str, error: dict[str, Any] | None = None) -> None:
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


class JsonlStore(Store):
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        durability: str = "fsync",
        cache_size: int = 1024,
    ) -> None:
        self.root = Path(data_dir)
        self.responses_dir = self.root / "logs" / "responses"
        self.conversations_dir = self.root / "logs" / "conversations"
        self.locks_dir = self.root / "locks"
        self.summaries_dir = self.root / "logs" / "summaries"
        self.archive_dir = self.root / "archive"
        self._side: LRU[tuple[str, str], tuple[int, list[Record]]] = LRU(4 * cache_size)
        self.fsync = durability == "fsync"
        self.cache_size = cache_size
        # Index sizes last seen: only to know whether an index file exists yet (no views here).
        self._sizes: LRU[str, int] = LRU(cache_size)
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # Test hook: called after the response is durable and before the index append.
        self.before_index_append: Callable[[str], None] | None = None
        # Set by the first failed fsync: the kernel may have dropped the dirty pages, and a
        # later fsync could succeed without them, so no write is acknowledged after it.
        self.sync_failed: str | None = None

    @property
    def refusing_writes(self) -> str | None:
        return self.sync_failed

    def _datasync(self, fd: int) -> None:
        self._sync(os.fdatasync, fd)

    def _appender(self) -> Callable[[int], None] | None:
        """The sync step for `_append`; raises first if this store already refuses writes."""
        self.refuse_if_failed()
        return self._datasync if self.fsync else None

    def _sync(self, sync: Callable[[Any], None], target: Any) -> None:
        try:
            sync(target)
        except OSError as exc:
            if self.sync_failed is None:
                self.sync_failed = f"{getattr(sync, '__name__', 'fsync')}: {exc.strerror or exc}"
                log.error("fsync failed, refusing further writes: %s", self.sync_failed)
            raise

    async def open(self) -> None:
        for d in (self.responses_dir, self.conversations_dir, self.locks_dir, self.summaries_dir):
            d.mkdir(parents=True, exist_ok=True)

    # -- paths: the only place ids become file names ---------------------------------------
    def index_path(self, conversation_id: str) -> Path:
        return self.conversations_dir / f"{check_conversation_id(conversation_id)}.jsonl"

    def response_path(self, response_id: str) -> Path:
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return self.responses_dir / f"{response_id}.jsonl"

    # -- locking ----------------------------------------------------------------------------
    @asynccontextmanager
    async def lock(self, conversation_id: str, timeout: float) -> AsyncIterator[None]:
        """In this process, one asyncio.Lock per conversation (FIFO). Across processes, an
        flock() on the conversation's own lock file, `locks/{id}.lock`, held for the turn: an
        unrelated conversation never waits for it. Lock files are never removed while the
        gateway runs (removing one could give two processes two different "same" locks)."""
        check_conversation_id(conversation_id)
        lock = self._locks.get(conversation_id)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[conversation_id] = lock
        busy = ConversationBusy(f"Conversation {conversation_id!r} is busy with another request; retry later")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                await lock.acquire()
        except TimeoutError:
            raise busy from None
        fd = -1
        held = False
        try:
            try:
                fd = os.open(self.locks_dir / f"{conversation_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(
                    f"Cannot open the lock of conversation {conversation_id!r}: {exc.strerror}"
                ) from exc
            delay = 0.0005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if loop.time() >= deadline:
                        raise busy from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.02)
            _HELD.set(_HELD.get() | {conversation_id})
            held = True
            yield
        finally:
            if held:  # not a token reset: locks may be released in any order
                _HELD.set(_HELD.get() - {conversation_id})
            if fd >= 0:
                os.close(fd)  # releases the flock
            lock.release()

    def holds_lock(self, conversation_id: str) -> bool:
        """Does the running task hold this conversation's lock? Only then may a read repair."""
        return conversation_id in _HELD.get()

    async def close(self) -> None:
        """Nothing is held between requests."""

    # -- reading ----------------------------------------------------------------------------
    def _read_records(self, path: Path, *, skip_context: bool = False) -> list[Record]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        if skip_context and _CONTEXT_PREFIX in data:
            lines = data.split(b"\n")
            data = b"\n".join(line for line in lines if not line.startswith(_CONTEXT_PREFIX))
        records, _ = parse_jsonl(data, path=str(path))
        return [r for r in records if isinstance(r, dict)]

    def _read_sync(self, conversation_id: str, after: Version | None, repair: bool) -> IndexRead:
        path = self.index_path(conversation_id)
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                restarted = after is None or after.generation != stat.st_ino or stat.st_size < after.position
                start = 0 if restarted or after is None else after.position
                if not restarted and after is not None and stat.st_size == start:
                    return IndexRead([], after, False)
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            self._sizes.pop(conversation_id, None)
            return IndexRead([], None, True)
        raw, consumed = parse_index(data, path=str(path))
        if consumed < len(data) and repair:
            # A torn last line: the crash happened before its fsync, so it was never acknowledged.
            log.warning("repairing torn last line of %s", path)
            os.truncate(path, start + consumed)
        entries = [
            IndexEntry(None, entry, [])
            if isinstance(entry, dict)
            else IndexEntry(entry, None, self._read_records(self.response_path(entry), skip_context=True))
            for entry in raw
        ]
        self._sizes[conversation_id] = start + consumed
        return IndexRead(entries, Version(stat.st_ino, start + consumed), restarted)

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        # A torn last line is cut only by a holder of the lock: without it, the "torn" line may
        # be another writer's append in progress (another task, thread or worker process).
        repair = self.holds_lock(conversation_id)
        try:
            size = os.stat(self.index_path(conversation_id)).st_size
        except FileNotFoundError:
            size = 0
        # Reading many response files is slow: off the event loop unless it is little.
        if size - (after.position if after is not None else 0) > _THREAD_LOAD_BYTES:
            return await asyncio.to_thread(self._read_sync, conversation_id, after, repair)
        return self._read_sync(conversation_id, after, repair)

    def _forget(self, conversation_id: str | None) -> None:
        if conversation_id is not None:
            self._sizes.pop(conversation_id, None)

    def start(self, response_id: str, request: Record) -> ResponseLog:
        return _JsonlLog(self, response_id, request)

    async def read_response(self, response_id: str) -> list[Record]:
        path = self.response_path(response_id)
        if not path.exists():
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return self._read_records(path)

    async def read_index(self, conversation_id: str) -> list[str | Record]:
        path = self.index_path(conversation_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"No conversation {conversation_id!r}", param="conversation_id") from None
        entries, _ = parse_index(data, path=str(path))
        return entries

    async def append_marker(self, conversation_id: str, marker: Record) -> Appended:
        path = self.index_path(conversation_id)
        line = orjson.dumps(marker) + b"\n"

        def write() -> Appended:
            sync = self._appender()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                stat = os.fstat(fd)
                _write_all(fd, line)
                if sync is not None:
                    sync(fd)
            finally:
                os.close(fd)
            if stat.st_size == 0 and self.fsync:
                self._sync(_fsync_dir, self.conversations_dir)
            after = stat.st_size + len(line)
            self._sizes[conversation_id] = after
            return Appended(Version(stat.st_ino, stat.st_size), Version(stat.st_ino, after))

        try:
            return await asyncio.to_thread(write)
        except OSError as exc:
            self._forget(conversation_id)
            raise StorageError(f"could not record the change durably: {exc.strerror or exc}") from exc

    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        index = self.index_path(conversation_id)
        summaries = self.summary_path(conversation_id)
        self._forget(conversation_id)
        for kind in ("summaries", "lifecycle"):
            self._side.pop((kind, conversation_id), None)
        lifecycle = self.side_path("lifecycle", conversation_id)

        def remove() -> bool:
            self.refuse_if_failed()
            try:
                data = index.read_bytes()
            except FileNotFoundError:
                return False
            entries, _ = parse_index(data, path=str(index))
            shared = self._named_by_relatives(conversation_id)
            ids = [e for e in entries if isinstance(e, str)]
            owned = [rid for rid in ids if rid not in shared]
            if archive:
                folder = self.archive_dir / f"{conversation_id}-{int(now() * 1000)}"
                (folder / "responses").mkdir(parents=True, exist_ok=True)
                # The index goes first (one rename): from then on the conversation is gone.
                os.replace(index, folder / "conversation.jsonl")
                if summaries.exists():
                    os.replace(summaries, folder / "summaries.jsonl")
                if lifecycle.exists():
                    os.replace(lifecycle, folder / "lifecycle.jsonl")
                for rid in ids:
                    try:
                        if rid in shared:  # still a fork's: the archive gets a copy
                            shutil.copyfile(self.response_path(rid), folder / "responses" / f"{rid}.jsonl")
                        else:
                            os.replace(self.response_path(rid), folder / "responses" / f"{rid}.jsonl")
                    except FileNotFoundError:
                        pass
            else:
                os.unlink(index)
                for path in [summaries, lifecycle, *(self.response_path(rid) for rid in owned)]:
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass
            if self.fsync:
                self._sync(_fsync_dir, self.conversations_dir)
            return True

        try:
            return await asyncio.to_thread(remove)
        except OSError as exc:
            raise StorageError(f"could not delete the conversation: {exc.strerror or exc}") from exc

    def _named_by_relatives(self, conversation_id: str) -> set[str]:
        """Response ids that other conversations of the same fork family name. A fork
        (`{source[:100]}.fork-{hex}`, made by the Responses API) shares its prefix's response
        files with its source and its siblings instead of copying them."""
        root = conversation_id.split(".fork-", 1)[0][:100]
        candidates = {root} if root != conversation_id else set()
        try:
            with os.scandir(self.conversations_dir) as entries:
                for entry in entries:
                    name = entry.name[:-6] if entry.name.endswith(".jsonl") else ""
                    related = ".fork-" in name or len(name) > 100  # a source cut to 100 in its forks' ids
                    if name.startswith(root) and related and name != conversation_id:
                        candidates.add(name)
        except FileNotFoundError:
            return set()
        named: set[str] = set()
        for other in candidates:
            try:
                listed, _ = parse_index(self.index_path(other).read_bytes())
            except (FileNotFoundError, CorruptRecord):
                continue
            named.update(e for e in listed if isinstance(e, str))
        return named

    def summary_path(self, conversation_id: str) -> Path:
        return self.side_path("summaries", conversation_id)

    def side_path(self, kind: str, key: str) -> Path:
        if kind not in SIDE_LOGS:
            raise ValueError(f"unknown side log {kind!r}")
        return self.root / "logs" / kind / f"{check_conversation_id(key, param='key')}.jsonl"

    async def append_side(self, kind: str, key: str, record: Record) -> None:
        path = self.side_path(kind, key)
        line = orjson.dumps(record) + b"\n"

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _append(path, line, sync=self._appender())

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise StorageError(f"could not record {kind}: {exc.strerror or exc}") from exc
        self._side.pop((kind, key), None)

    async def read_side(self, kind: str, key: str) -> list[Record]:
        path = self.side_path(kind, key)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return []
        cached = self._side.get((kind, key))
        if cached is not None and cached[0] == size:
            return cached[1]
        records = self._read_records(path)
        self._side[(kind, key)] = (size, records)
        return records

    async def fork(self, source: str, target: str, through: str) -> None:
        src, dst = self.index_path(source), self.index_path(target)

        def copy_prefix() -> None:
            data = src.read_bytes()
            end = data.find(through.encode() + b"\n")
            if end < 0 or (end > 0 and data[end - 1 : end] != b"\n"):
                raise NotFound(
                    f"No response {through!r} in conversation {source!r}", param="previous_response_id"
                )
            prefix = data[: end + len(through) + 1]
            sync = self._appender()
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, prefix)
                if sync is not None:
                    sync(fd)
            finally:
                os.close(fd)
            if self.fsync:
                self._sync(_fsync_dir, self.conversations_dir)

        try:
            await asyncio.to_thread(copy_prefix)
        except FileNotFoundError:
            raise NotFound(f"No conversation {source!r}", param="previous_response_id") from None
        except FileExistsError:
            raise InvalidRequest(f"Conversation {target!r} already exists") from None
        except OSError as exc:
            raise StorageError(f"could not branch the conversation: {exc.strerror or exc}") from exc
        self._forget(target)

    async def tombstone(self, response_id: str) -> None:
        path = self.response_path(response_id)
        line = orjson.dumps({"type": "deleted", "at": now()}) + b"\n"

        try:
            await asyncio.to_thread(lambda: _append(path, line, sync=self._appender(), create=False))
        except FileNotFoundError:
            raise NotFound(f"No response {response_id!r}", param="response_id") from None
        except OSError as exc:
            raise StorageError(f"could not delete the response: {exc.strerror or exc}") from exc

    def index_times(self) -> list[tuple[str, float]]:
        out = []
        if self.conversations_dir.is_dir():
            with os.scandir(self.conversations_dir) as entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(".jsonl") and is_valid_conversation_id(name[:-6]):
                        try:
                            out.append((name[:-6], entry.stat().st_mtime))
                        except FileNotFoundError:
                            continue
        return out

    async def conversation_ids(self) -> list[tuple[str, float]]:
        times = await asyncio.to_thread(self.index_times)
        return sorted(times, key=lambda pair: pair[1], reverse=True)
