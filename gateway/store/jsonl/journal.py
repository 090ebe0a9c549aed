"""The write-ahead journal that makes a turn's commit durable.

A commit is durable once its records are in this process's journal and one fdatasync covers
them, shared by every turn committing at the same time (group commit).

    {data_dir}/logs/journal/{pid}-{token}-{a|b}.wal   this process's journal (two, in turn)

A commit is a header line (`response_id`, `conversation_id`, the index size `before` the
line, `at` in ns, `size`, the content's `crc` 32) then the response file's whole content. The
event loop writes it (page cache only: no thread hop) and has it synced: a turn committing
alone syncs on the loop; turns committing together share one fdatasync, submitted by the loop
to the kernel's native AIO (aio.py), or run by this journal's sync thread where AIO is not
available. The rest of the response file and the index line are then written on the loop
without a sync of their own, and the turn is acknowledged. Every second (or 8 MiB) the loop
switches to the other journal, and the old one is emptied once a syncfs() has made its turns'
files durable. `recovery.py` replays a dead process's journal.

A journal file is written from its start and emptied by overwriting what was written with
zeros, never shortened: it is made PREALLOCATE bytes of zeros when opened, so an fdatasync
writes the commit's blocks only, not the file's size and block map as a growing file needs
(0.09 ms against 0.13 ms per sync here). A reader stops at the first zero byte, and at an
entry whose crc does not match (a torn write over older zeros).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable

import orjson

from gateway.store.jsonl.aio import AioSync, NotSubmitted, resolve
from gateway.store.jsonl.durability import Durability
from gateway.store.jsonl.files import fsync_dir
from gateway.store.jsonl.layout import DataDir
from gateway.store.jsonl.locks import file_lock, try_lock_file

log = logging.getLogger("gateway.store")

ROTATE_SECONDS = 1.0
ROTATE_BYTES = 8 << 20
PREALLOCATE = 1 << 20
IDLE_EXIT_SECONDS = 5.0

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


def entry(response_id: str, conversation_id: str | None, before: int, content: bytes) -> bytes:
    head = {
        "response_id": response_id,
        "conversation_id": conversation_id,
        "before": before,
        "at": time.time_ns(),
        "size": len(content),
        "crc": zlib.crc32(content),
    }
    return orjson.dumps(head) + b"\n" + content


def zero(fd: int, start: int, end: int) -> None:
    block = bytes(min(end - start, 1 << 20))
    while start < end:
        start += os.pwrite(fd, block[: end - start], start)


class JournalFile:
    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.size = 0  # written from the start; the rest of the file is zeros
        self.pending = 0  # commits appended whose files are not written yet
        self.retired = False  # switched away from: to be emptied once nothing is pending
        self.ready = True  # empty and usable (not being checkpointed)

    def write(self, data: bytes) -> None:
        """Write at the end of what is written; a failed write leaves zeros, as before it."""
        written = 0
        try:
            while written < len(data):
                written += os.pwrite(self.fd, data[written:], self.size + written)
        except OSError:
            try:
                zero(self.fd, self.size, self.size + written)  # a torn entry must not hide the next ones
            except OSError:
                pass
            raise
        self.size += len(data)


Waiter = tuple[JournalFile, "asyncio.Future[None]"]


class Journal:
    """This process's journal for one data dir.

    Appended on the event loop, synced by one thread for every commit waiting; its syncs latch
    `durability` when they fail.
    """

    def __init__(self, data_dir: DataDir, durability: Durability) -> None:
        self.data_dir = data_dir
        self.durability = durability
        self.current: JournalFile | None = None
        self.spare: JournalFile | None = None
        self._opening: asyncio.Future[None] | None = None
        self._since = 0.0
        self._waiters: list[Waiter] = []
        self._guard = threading.Lock()
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        self._checkpoints: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False  # by `stop`: nothing is switched or emptied in the background
        self._aio: AioSync | None = None  # the shared syncs of the loop below, if it has AIO
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._appended = 0.0  # monotonic time of the last append
        self.open_logs = 0  # response logs started and not committed or abandoned yet

    # -- the event loop's side --------------------------------------------------------------
    async def append(self, data: bytes) -> JournalFile:
        """Append one commit and wait until it is durable.

        The caller then writes the files and calls `done`. When this is the only turn in
        progress, the loop syncs the journal itself: nobody could share the sync, and the two
        thread hand-offs (about 0.1-0.3 ms) are saved.
        """
        if self.current is None:
            await self._open()
            self._stopped = False
        self._maybe_rotate()
        journal = self.current
        assert journal is not None
        journal.write(data)
        journal.pending += 1
        self._appended = time.monotonic()
        if self.open_logs <= 1:
            try:
                self.durability.sync(os.fdatasync, journal.fd)
            except BaseException:
                self.done(journal)
                raise
            self._ensure_thread()  # it switches and empties the journal once the turns stop
            return journal
        loop = asyncio.get_running_loop()
        self._loop = loop
        aio = self._aio_of(loop)
        if aio is not None:
            try:
                await aio.sync(journal.fd)
            except NotSubmitted as exc:  # no sync was made: the thread's, from now on
                log.warning("native AIO refused a journal sync (%s): syncing in a thread", exc.strerror)
                if self._aio is aio:
                    self._aio = None
                    aio.close()
            except OSError as exc:
                self.durability.latch("fdatasync", exc)
                self.done(journal)
                raise
            except BaseException:
                self.done(journal)
                raise
            else:
                self._ensure_thread()
                return journal
        future: asyncio.Future[None] = loop.create_future()
        with self._guard:
            self._waiters.append((journal, future))
        self._wake.set()
        self._ensure_thread()
        try:
            await future
        except BaseException:
            self.done(journal)
            raise
        return journal

    def _aio_of(self, loop: asyncio.AbstractEventLoop) -> AioSync | None:
        """This loop's AIO syncs, opened on first use (None: the sync thread it is)."""
        aio = self._aio
        if aio is not None and aio.loop is loop and not aio.closed:
            return aio
        if self._aio_loop is loop and aio is None:
            return None  # tried on this loop: not available
        if aio is not None:
            aio.close()
        self._aio_loop = loop
        self._aio = AioSync.open(loop)
        return self._aio

    def release(self) -> None:
        """On the loop, before `stop`: end the AIO context (its reader is the loop's)."""
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        self._aio_loop = None

    def done(self, journal: JournalFile) -> None:
        journal.pending -= 1
        if journal.retired and not journal.pending:
            self._empty_later(journal)

    def abort(self, response_id: str) -> None:
        """Recovery must not replay a commit the client was told failed."""
        journal = self.current
        if journal is None or not journal.size:
            return
        try:
            journal.write(orjson.dumps({"abort": response_id}) + b"\n")
        except OSError as exc:
            log.error("could not write a journal abort record: %s", exc)

    async def _open(self) -> None:
        if self._opening is None:
            self._opening = asyncio.ensure_future(asyncio.to_thread(self._open_pair))
        try:
            await asyncio.shield(self._opening)
        except BaseException:
            if self._opening.done():
                self._opening = None
            raise

    def _open_pair(self) -> None:
        folder = self.data_dir.journal_dir
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        files: list[JournalFile] = []
        with file_lock(self.data_dir.journal_lock):  # not while a recovery lists journals
            try:
                for part in ("a", "b"):
                    path = folder / f"{name}-{part}.wal"
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    files.append(JournalFile(fd, str(path)))
                    if not try_lock_file(fd):
                        raise OSError(f"cannot lock the new journal {path.name}")
                    zero(fd, 0, PREALLOCATE)
                    self.durability.sync(os.fsync, fd)
            except OSError:
                # (a full disk: a half-zeroed journal must not keep the space it took)
                for journal in files:
                    os.close(journal.fd)
                    try:
                        os.unlink(journal.path)
                    except OSError:
                        pass
                raise
        self.durability.sync(fsync_dir, folder)
        self.current, self.spare = files
        self._since = time.monotonic()

    def _maybe_rotate(self, *, idle: bool = False) -> None:
        """Switch to the other journal (every ROTATE_SECONDS, or ROTATE_BYTES, or when idle).

        The old one is emptied once its commits' files are written and synced.
        """
        current, spare = self.current, self.spare
        if self._stopped or current is None or spare is None or not current.size or not spare.ready:
            return
        if not (idle or current.size >= ROTATE_BYTES or time.monotonic() - self._since >= ROTATE_SECONDS):
            return
        self.current, self.spare = spare, current
        self._since = time.monotonic()
        current.retired = True
        if not current.pending:
            self._empty_later(current)

    def _empty_later(self, journal: JournalFile) -> None:
        if self._stopped:
            return  # `stop` syncs and removes it
        journal.retired = False
        journal.ready = False
        thread = threading.Thread(target=self._empty, args=(journal,), name="gateway-journal-checkpoint")
        thread.daemon = True
        self._checkpoints = [t for t in self._checkpoints if t.is_alive()] + [thread]
        thread.start()

    def _empty(self, journal: JournalFile) -> None:
        try:
            self.durability.sync(syncfs, journal.fd)
            zero(journal.fd, 0, journal.size)
            # Synced here, not by the next commit's fdatasync (which would write them all).
            self.durability.sync(os.fdatasync, journal.fd)
            journal.size = 0
            journal.ready = True
        except OSError as exc:
            log.error("could not empty journal %s: %s", journal.path, exc)

    # -- the sync thread --------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._running:
            return
        with self._guard:
            if not self._running:
                self._running = True
                thread = threading.Thread(target=self._run, name="gateway-journal-sync", daemon=True)
                self._thread = thread
                thread.start()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            self._wake.wait(timeout=ROTATE_SECONDS)
            self._wake.clear()
            with self._guard:
                waiters, self._waiters = self._waiters, []
                idle_since = max(idle_since, self._appended)
                if not waiters and time.monotonic() - idle_since > IDLE_EXIT_SECONDS:
                    self._running = False
                    return
            if not waiters:
                loop = self._loop
                if loop is not None and self.current is not None and self.current.size:
                    try:  # idle: have the loop switch journals, so this one is emptied
                        loop.call_soon_threadsafe(functools.partial(self._maybe_rotate, idle=True))
                    except RuntimeError:
                        pass
                continue
            idle_since = time.monotonic()
            error: OSError | None = None
            for journal in {id(j): j for j, _ in waiters}.values():  # two right after a switch
                try:
                    self.durability.sync(os.fdatasync, journal.fd)
                except OSError as exc:
                    error = exc
            by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
            for _, future in waiters:
                by_loop.setdefault(future.get_loop(), []).append(future)
            for loop, futures in by_loop.items():
                try:
                    loop.call_soon_threadsafe(resolve, futures, error)
                except RuntimeError:  # the loop was closed meanwhile: nobody waits any more
                    pass

    def stop(self) -> None:
        """After the last commit: make the journal's turns durable and remove it.

        The record of deletions goes too, when no journal is left that it could concern.
        """
        self._stopped = True
        with self._guard:
            thread = self._thread if self._running else None
        if thread is not None:
            self._wake.set()
        for checkpoint in self._checkpoints:
            checkpoint.join()
        for journal in (self.current, self.spare):
            if journal is None:
                continue
            try:
                if journal.size:
                    self.durability.sync(syncfs, journal.fd)
                os.unlink(journal.path)
            except OSError as exc:
                log.warning("journal %s left for recovery: %s", journal.path, exc)
            os.close(journal.fd)
        folder = self.data_dir.journal_dir
        if folder.is_dir():
            with file_lock(self.data_dir.journal_lock):
                if not any(folder.glob("*.wal")):
                    (folder / "forgotten.jsonl").unlink(missing_ok=True)
        self.current = self.spare = None
        self._opening = None
