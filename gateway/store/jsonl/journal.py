"""The store's file work in one writer thread, and the write-ahead journal that makes a turn
durable with one fdatasync shared by every turn committing at the same time (group commit).

    {data_dir}/logs/journal/{pid}-{token}-{a|b}.wal   this process's journal (two, in turn)

A commit is a header line (`response_id`, `conversation_id`, the index size `before` the
line, `at` in ns, `size`) then the response file's whole content. Once the journal is synced,
the rest of the response file and the index line are written without a sync of their own; the
turn is acknowledged after both. Every second (or 8 MiB) the writer switches to the other
journal, and the old one is emptied once a syncfs() has made its turns' files durable.
`recovery.py` replays a dead process's journal."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from gateway.exceptions import StorageError
from gateway.store.base import Appended
from gateway.store.jsonl.files import fsync_dir, write_all
from gateway.store.jsonl.locks import file_lock, try_lock_file

if TYPE_CHECKING:
    from gateway.store.jsonl.log import JsonlLog
    from gateway.store.jsonl.store import JsonlStore

log = logging.getLogger("gateway.store")

ROTATE_SECONDS = 1.0
ROTATE_BYTES = 8 << 20
IDLE_EXIT_SECONDS = 5.0
LAZY_SECONDS = 0.02  # the longest a job queued without waking the thread waits

_syncfs: Callable[[int], int] | None = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)


def syncfs(fd: int) -> None:
    """Write back every dirty file of the filesystem holding `fd` (os.sync() elsewhere)."""
    if _syncfs is None:
        os.sync()
        return
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def commit_line() -> bytes:
    return orjson.dumps({"type": "commit", "status": "complete", "committed": time.time()}) + b"\n"


class Job:
    """One piece of file work for the writer: create a response log, commit it, or abandon it."""

    __slots__ = ("kind", "log", "data", "conversation_id", "loop", "future", "result", "error", "commit")

    def __init__(
        self, kind: str, log: JsonlLog, data: bytes = b"", conversation_id: str | None = None
    ) -> None:
        self.kind = kind
        self.log = log
        self.data = data
        self.conversation_id = conversation_id
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[Appended | None] | None = None
        self.result: Appended | None = None
        self.error: BaseException | None = None
        self.commit = b""


class JournalFile:
    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.size = 0


class Writer:
    """The store's writer thread: jobs are taken in order, commits waiting together share
    one journal append and one fdatasync (durability "fsync")."""

    def __init__(self, store: JsonlStore) -> None:
        self.store = store
        self._jobs: deque[Job | None] = deque()
        self._wake = threading.Event()
        self._guard = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None
        self.current: JournalFile | None = None
        self.spare: JournalFile | None = None
        self._since = 0.0
        self._checkpoint: threading.Thread | None = None

    # -- submitting (event loop side) -------------------------------------------------------
    def submit(self, job: Job, *, wake: bool = True) -> None:
        """Queue a job; `wake=False` for work nobody waits on yet (a response file to create):
        the thread takes it with the next woken batch (or within LAZY_SECONDS when busy)."""
        self._jobs.append(job)
        if wake:
            self._wake.set()
        if not self._running:
            with self._guard:
                if not self._running:
                    self._running = True
                    thread = threading.Thread(target=self._run, name="gateway-store-writer", daemon=True)
                    self._thread = thread
                    thread.start()

    async def run(self, job: Job) -> Appended | None:
        loop = asyncio.get_running_loop()
        job.loop = loop
        job.future = loop.create_future()
        self.submit(job)
        return await job.future

    def stop(self) -> None:
        """Finish the queued work, then make the journal's turns durable and remove it."""
        thread = self._thread
        if thread is not None and self._running:
            self.submit(None)  # type: ignore[arg-type]
            thread.join()
        if self._checkpoint is not None:
            self._checkpoint.join()
        for journal in (self.current, self.spare):
            if journal is None:
                continue
            try:
                if journal.size:
                    self.store._sync(syncfs, journal.fd)
                os.unlink(journal.path)
            except OSError as exc:
                log.warning("journal %s left for recovery: %s", journal.path, exc)
            os.close(journal.fd)
        self.current = self.spare = None

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            # Queued work nobody waits on yet is taken within LAZY_SECONDS; an idle thread
            # sleeps until woken (a commit then takes the queued creations along).
            self._wake.wait(timeout=LAZY_SECONDS if self._jobs else ROTATE_SECONDS)
            self._wake.clear()
            jobs: list[Job | None] = []
            while self._jobs:
                jobs.append(self._jobs.popleft())
            if not jobs:
                if time.monotonic() - idle_since >= ROTATE_SECONDS:
                    self._rotate(idle=True)
                    if time.monotonic() - idle_since > IDLE_EXIT_SECONDS and self._exit_if_idle():
                        return
                continue
            stop = None in jobs
            self._process([job for job in jobs if job is not None])
            if stop:
                with self._guard:
                    self._running = False
                return
            self._rotate(idle=False)
            idle_since = time.monotonic()

    def _exit_if_idle(self) -> bool:
        with self._guard:
            if not self._jobs and (self.current is None or not self.current.size):
                self._running = False
                return True
        return False

    def _process(self, jobs: list[Job]) -> None:
        commits: list[Job] = []
        for job in jobs:
            try:
                if job.kind == "create":
                    job.log.create()
                elif job.kind == "abandon":
                    job.log.write_abandoned(job.data)
                else:
                    commits.append(job)
                    continue
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting task
                job.error = exc
        if commits:
            self._commit(commits)
        by_loop: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        for job in jobs:
            if job.loop is not None:
                by_loop.setdefault(job.loop, []).append(job)
        for loop, done in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, done)
            except RuntimeError:  # the loop was closed meanwhile: nobody waits any more
                pass

    def _commit(self, jobs: list[Job]) -> None:
        store = self.store
        ready: list[Job] = []
        parts: list[bytes] = []
        for job in jobs:
            job.commit = commit_line()
            try:
                before = job.log.check_commit(job.data, job.conversation_id)
            except StorageError as exc:
                job.error = exc
                continue
            if store.fsync:
                content = job.log.first + job.data + job.commit
                head = {
                    "response_id": job.log.response_id,
                    "conversation_id": job.conversation_id,
                    "before": before,
                    "at": time.time_ns(),
                    "size": len(content),
                }
                parts += (orjson.dumps(head) + b"\n", content)
            ready.append(job)
        if parts:
            try:
                self._append(b"".join(parts))
            except OSError as exc:
                reason = exc.strerror or str(exc)
                for job in ready:
                    job.log.mark_failed(job.data, reason, None, -1)
                    job.error = StorageError(f"could not record the response durably: {reason}")
                self._abort(ready)  # a sync that failed may still have written them
                return
        for job in ready:
            try:
                job.result = job.log.finish(job.data + job.commit, job.conversation_id)
            except StorageError as exc:
                job.error = exc
                self._abort([job])

    # -- the journal ------------------------------------------------------------------------
    def _append(self, data: bytes) -> None:
        store = self.store
        if self.current is None:
            self.current, self.spare = self._open_pair()
            self._since = time.monotonic()
        journal = self.current
        try:
            write_all(journal.fd, data)
        except OSError:
            os.ftruncate(journal.fd, journal.size)  # a torn entry must not hide the next ones
            raise
        journal.size += len(data)
        store._sync(os.fdatasync, journal.fd)

    def _abort(self, jobs: list[Job]) -> None:
        """Recovery must not replay a commit the client was told failed."""
        if self.current is None or not self.current.size:
            return
        lines = b"".join(orjson.dumps({"abort": job.log.response_id}) + b"\n" for job in jobs)
        try:
            write_all(self.current.fd, lines)
            self.current.size += len(lines)
        except OSError as exc:
            log.error("could not write journal abort records: %s", exc)

    def _open_pair(self) -> tuple[JournalFile, JournalFile]:
        store = self.store
        folder = store.journal_dir
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        files = []
        with file_lock(store.locks_dir / "journal.lock"):  # not while a recovery lists journals
            for part in ("a", "b"):
                path = folder / f"{name}-{part}.wal"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                if not try_lock_file(fd):
                    os.close(fd)
                    raise OSError(f"cannot lock the new journal {path.name}")
                files.append(JournalFile(fd, str(path)))
        store._sync(fsync_dir, folder)
        return files[0], files[1]

    def _rotate(self, *, idle: bool) -> None:
        """Switch to the other journal and empty this one in the background once its turns'
        files are durable (every ROTATE_SECONDS, or ROTATE_BYTES, or when idle)."""
        current, spare = self.current, self.spare
        if current is None or spare is None or not current.size:
            return
        if self._checkpoint is not None and self._checkpoint.is_alive():
            return
        due = idle or current.size >= ROTATE_BYTES or time.monotonic() - self._since >= ROTATE_SECONDS
        if not due:
            return
        self.current, self.spare = spare, current
        self._since = time.monotonic()
        self._checkpoint = threading.Thread(
            target=self._empty, args=(current,), name="gateway-store-checkpoint", daemon=True
        )
        self._checkpoint.start()

    def _empty(self, journal: JournalFile) -> None:
        try:
            self.store._sync(syncfs, journal.fd)
            os.ftruncate(journal.fd, 0)
            journal.size = 0
        except OSError as exc:
            log.error("could not checkpoint journal %s: %s", journal.path, exc)


def _deliver(jobs: list[Job]) -> None:
    for job in jobs:
        future = job.future
        if future is None or future.done():
            continue
        if job.error is not None:
            future.set_exception(job.error)
        else:
            future.set_result(job.result)
