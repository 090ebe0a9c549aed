"""A conversation's lock across worker processes: one byte of `locks/conversations.lock` at an
offset hashed from the id over 2^62 (a Linux open-file-description lock, kept by the store's file
descriptor: no file per conversation); without such locks, an flock() on `locks/{id}.lock`."""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.exceptions import ConversationBusy, StorageError

if TYPE_CHECKING:
    from gateway.store.jsonl.store import JsonlStore

_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)


def busy(conversation_id: str) -> ConversationBusy:
    return ConversationBusy(f"Conversation {conversation_id!r} is busy with another request; retry later")


class CrossProcessLock:
    """One conversation's lock across worker processes (see `JsonlStore.lock`)."""

    def __init__(self, store: JsonlStore, conversation_id: str) -> None:
        self.acquired = False
        self._file_fd = -1
        if _OFD_SETLK is not None:
            self._fd = store._range_fd()
            digest = hashlib.blake2b(conversation_id.encode(), digest_size=8).digest()
            self._offset = int.from_bytes(digest, "big") >> 2
        else:
            path = store.locks_dir / f"{conversation_id}.lock"
            try:
                self._fd = self._file_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(
                    f"Cannot open the lock of conversation {conversation_id!r}: {exc.strerror}"
                ) from exc

    def _range(self, kind: int) -> None:
        assert _OFD_SETLK is not None
        fcntl.fcntl(self._fd, _OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, self._offset, 1, 0))

    def try_acquire(self) -> bool:
        try:
            if _OFD_SETLK is not None:
                self._range(fcntl.F_WRLCK)
            else:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            return False
        self.acquired = True
        return True

    def release(self) -> None:
        if self._file_fd >= 0:
            os.close(self._file_fd)  # releases the flock
        elif self.acquired:
            self._range(fcntl.F_UNLCK)
        self.acquired = False


def try_lock_file(fd: int) -> bool:
    """Lock a whole file for as long as `fd` is open (a journal's owner is alive while it holds
    it): an open-file-description lock on Linux, flock() elsewhere."""
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
