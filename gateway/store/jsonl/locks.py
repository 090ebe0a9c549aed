"""A conversation's lock across worker processes, and the order of its waiters.

One byte of `locks/conversations.lock` at an offset hashed from the id over 2^62 (a Linux
open-file-description lock, kept by the file descriptor `LockFolder` opens once: no file per
conversation); without such locks, an flock() on `locks/{id}.lock`.

Arrival order across processes: every request that has to wait for a conversation (behind
another process, or behind a turn of its own process, whose asyncio queue keeps those in order)
stands in line by holding a read lock on one byte of the conversation's queue region, above 2^62,
at its arrival time (CLOCK_MONOTONIC microseconds, the same clock in every process, modulo 2^42:
51 days). Before trying the lock, a waiter asks the kernel whether another process holds a byte
of that region below its own arrival (F_OFD_GETLK over the range): if one does, that earlier
waiter goes first. A process that dies leaves no place in line (its locks go with its file
descriptor).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway.exceptions import ConversationBusy, StorageError

_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)
_FLOCK = "hhqqi4x"  # struct flock: type, whence, start, len, pid
# The queue regions: 2^19 buckets of 2^42 bytes from 2^62 (the lock bytes stay below 2^62).
_QUEUE_BASE = 1 << 62
_QUEUE_SPAN = 1 << 42


def arrival() -> int:
    """Now, as a place in line: CLOCK_MONOTONIC microseconds (shared by the machine's processes)."""
    return time.monotonic_ns() // 1000


def busy(conversation_id: str) -> ConversationBusy:
    return ConversationBusy(f"Conversation {conversation_id!r} is busy with another request; retry later")


class CrossProcessLock:
    """One conversation's lock across worker processes (see `JsonlStore.lock`).

    A byte of the file open as `range_fd`; without byte-range locks (`range_fd` -1), a file of
    its own in `folder`."""

    def __init__(self, conversation_id: str, range_fd: int, folder: Path, arrived: int | None = None) -> None:
        self.acquired = False
        self._file_fd = -1
        self._in_line = False
        self._place = (arrival() if arrived is None else arrived) % _QUEUE_SPAN
        if _OFD_SETLK is not None:
            self._fd = range_fd
            digest = hashlib.blake2b(conversation_id.encode(), digest_size=8).digest()
            self._offset = int.from_bytes(digest, "big") >> 2
            self._queue = _QUEUE_BASE + (int.from_bytes(digest, "big") >> 45) * _QUEUE_SPAN
        else:
            path = folder / f"{conversation_id}.lock"
            try:
                self._fd = self._file_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(
                    f"Cannot open the lock of conversation {conversation_id!r}: {exc.strerror}"
                ) from exc

    def _range(self, kind: int, start: int | None = None) -> None:
        assert _OFD_SETLK is not None
        at = self._offset if start is None else start
        fcntl.fcntl(self._fd, _OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, at, 1, 0))

    def _someone_earlier(self) -> bool:
        """Does another process have a waiter for this conversation that arrived before ours?"""
        if _OFD_GETLK is None or self._file_fd >= 0 or self._place == 0:
            return False
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, self._queue, self._place, 0)
        kind: int = struct.unpack(_FLOCK, fcntl.fcntl(self._fd, _OFD_GETLK, query))[0]
        return kind != fcntl.F_UNLCK

    def wait_in_line(self) -> None:
        """Stand in line (once): later arrivals in other processes let this waiter go first."""
        if not self._in_line and _OFD_GETLK is not None and self._file_fd < 0:
            self._range(fcntl.F_RDLCK, self._queue + self._place)
            self._in_line = True

    def leave_line(self) -> None:
        if self._in_line:
            self._in_line = False
            self._range(fcntl.F_UNLCK, self._queue + self._place)

    def try_acquire(self) -> bool:
        try:
            if self._someone_earlier():
                return False
            if _OFD_SETLK is not None:
                self._range(fcntl.F_WRLCK)
            else:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            return False
        self.acquired = True
        self.leave_line()
        return True

    def release(self) -> None:
        self.leave_line()
        if self._file_fd >= 0:
            os.close(self._file_fd)  # releases the flock
        elif self.acquired:
            self._range(fcntl.F_UNLCK)
        self.acquired = False


class LockFolder:
    """The `locks/` folder of a data dir, and the descriptor this store's locks are held by.

    `conversations.lock` is opened on first use and kept until `close`: a lock held by an open
    file description is released when that description closes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._range_fd = -1

    def conversation(self, conversation_id: str, arrived: int | None = None) -> CrossProcessLock:
        """A conversation's lock across processes, not taken yet."""
        range_fd = self.range_fd() if _OFD_SETLK is not None else -1
        return CrossProcessLock(conversation_id, range_fd, self.folder, arrived)

    def range_fd(self) -> int:
        if self._range_fd < 0:
            try:
                self._range_fd = os.open(self.folder / "conversations.lock", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(f"Cannot open the conversation locks: {exc.strerror}") from exc
        return self._range_fd

    def close(self) -> None:
        if self._range_fd >= 0:
            os.close(self._range_fd)
            self._range_fd = -1


def try_lock_file(fd: int) -> bool:
    """Lock a whole file for as long as `fd` is open (a journal's owner is alive while it holds it).

    An open-file-description lock on Linux, flock() elsewhere.
    """
    try:
        if _OFD_SETLK is not None:
            fcntl.fcntl(fd, _OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    return True


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock() on `path` for the block (short sections only: it blocks)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
