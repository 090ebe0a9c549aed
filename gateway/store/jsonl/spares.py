"""Empty files made ahead of need, renamed into place when a turn needs a new file.

    {data_dir}/spare/{pid}-{token}-{n}   a running process's empty files

A new conversation's turn creates two files (its response log and its index). Creating a file
is the dearest system call of a turn on some filesystems: ext4 without a journal, for minutes
after files were deleted, spends 0.1-0.8 ms of kernel time per creation skipping the freed
inodes (docs/performance.md). Then a background thread keeps a few empty files ready here,
and a turn takes one with `renameat2(RENAME_NOREPLACE)`, which never replaces an existing file
(the same guarantee as `O_EXCL`) and allocates no inode. A rename costs about what a creation
costs on a filesystem at ease (0.02-0.04 ms), so spares are used only while creations are seen to
be slow (their time, averaged, above SLOW; the turns time their own creations, the thread its
own). When none is ready (a burst, a full disk, a filesystem without that call) the turn
creates its file itself, as before.

The files are never synced on their own: a turn's durability is the journal's, and the
checkpoint's syncfs() covers a renamed file as it covers a created one. A process removes its
spares when its store closes; spares of a process that died are removed at the next start.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from gateway.writers import start_time

log = logging.getLogger("gateway.store")

TARGET = 32  # spares kept ready
LOW = 16  # the thread is woken when fewer are left
IDLE_EXIT_SECONDS = 30.0
SLOW = 100e-6  # a creation slower than this, on average: use spares (a rename costs 0.02-0.04 ms)
FAST = 50e-6  # faster than this: create in place again
_WEIGHT = 0.1  # of the newest creation time in the average

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def rename_noreplace(source: str, target: str) -> None:
    """Rename `source` to `target`, failing with FileExistsError when `target` exists."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _alive(pid: int) -> bool:
    """Does process `pid` run (a zombie, killed and not yet reaped, does not)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # `start_time` is None for a zombie; without /proc it cannot be told: its files are kept.
    return start_time(pid) is not None or not os.path.isdir(f"/proc/{pid}")


def sweep(folder: Path) -> int:
    """Remove the spares of processes that no longer run; how many were removed."""
    removed = 0
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    for name in names:
        pid = name.split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            continue
        try:
            os.unlink(folder / name)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


class Spares:
    """One store's ready empty files, in this process.

    `create` runs on the event loop; the refill runs in a thread of its own.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._ready: list[str] = []
        self._prefix = ""
        self._made = 0
        self._guard = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.usable = _renameat2 is not None  # False after a filesystem refused the rename
        self.creation = 0.0  # seconds a creation takes here, averaged
        self.slow = False  # creations are slow: turns take spares

    def _seen(self, seconds: float) -> None:
        self.creation += _WEIGHT * (seconds - self.creation)
        if self.slow != (self.creation > (FAST if self.slow else SLOW)):
            self.slow = not self.slow
            state = "on" if self.slow else "off"
            log.debug("file creation %.3f ms: spare files %s", self.creation * 1e3, state)

    def create(self, path: Path, flags: int) -> int:
        """A new empty file at `path`, opened with `flags`; FileExistsError if `path` exists."""
        spare = self._take() if self.slow else None
        if spare is not None:
            try:
                fd = os.open(spare, flags)
            except OSError:
                fd = -1  # removed behind our back: create it ourselves
            if fd >= 0:
                try:
                    rename_noreplace(spare, str(path))
                    return fd
                except FileExistsError:
                    os.close(fd)
                    self._give_back(spare)
                    raise
                except OSError as exc:
                    os.close(fd)
                    if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.EPERM):
                        self.usable = False  # this filesystem cannot: stop making spares
                        log.info("spare files disabled: %s", exc.strerror)
                    self._discard(spare)
        started = time.thread_time()  # kernel time too, not waits for the GIL
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        self._seen(time.thread_time() - started)
        return fd

    def _take(self) -> str | None:
        if not self.usable or self._closed:
            return None
        with self._guard:
            spare = self._ready.pop() if self._ready else None
            low = len(self._ready) < LOW
        if low:
            self._start()
        return spare

    def _give_back(self, spare: str) -> None:
        with self._guard:
            self._ready.append(spare)

    def _discard(self, spare: str) -> None:
        try:
            os.unlink(spare)
        except OSError:
            pass

    def _start(self) -> None:
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            return
        with self._guard:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="gateway-spare-files", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.clear()
            self._fill()
            if not self._wake.wait(timeout=IDLE_EXIT_SECONDS):
                with self._guard:
                    if not self._wake.is_set():
                        self._thread = None
                        return

    def _fill(self) -> None:
        if not self._prefix:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.debug("no spare files: %s", exc)
                return
            self._prefix = str(self.folder / f"{os.getpid()}-{secrets.token_hex(4)}-")
        while not self._closed:
            with self._guard:
                if len(self._ready) >= TARGET:
                    return
                self._made += 1
                name = f"{self._prefix}{self._made}"
            try:
                started = time.thread_time()  # kernel time too, not waits for the GIL
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                self._seen(time.thread_time() - started)
            except OSError as exc:  # a full disk, a read-only dir: turns create their own files
                log.debug("could not make a spare file: %s", exc)
                return
            with self._guard:
                if self._closed:
                    self._discard(name)
                    return
                self._ready.append(name)

    def close(self) -> None:
        """Stop making spares and remove the ones left (the store is closing)."""
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._guard:
            left, self._ready = self._ready, []
        for name in left:
            self._discard(name)
