"""Reading a JSONL conversation index from a `Version` on.

The lines appended since (all of them when the index was replaced), a torn last line cut only by
a holder of the lock.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gateway.store.base import Version
from gateway.store.jsonl.files import READ_FLAGS, index_generation, read_index_lines
from gateway.types import Record

log = logging.getLogger("gateway.store")


def read_from(fd: int, start: int, size: int) -> bytes:
    """The file's bytes from `start` to its end (`size` as last seen: more if it grew since)."""
    parts = []
    while True:
        want = max(size - start, 0) + 4096
        chunk = os.pread(fd, want, start)
        parts.append(chunk)
        if len(chunk) < want:  # the end
            return b"".join(parts)
        start += len(chunk)


def read_index_after(
    path: Path, shown: str, after: Version | None, repair: bool
) -> tuple[list[str | Record], Version, bool] | None:
    """The index lines after `after`: (entries, version, restarted); None if no index.

    `shown`: `path` as errors name it; `repair`: cut a torn last line (only a holder of the
    conversation's lock may)."""
    try:
        fd = os.open(path, READ_FLAGS)  # (no buffered file: four system calls fewer)
    except FileNotFoundError:
        return None
    try:
        stat = os.fstat(fd)
        generation = index_generation(fd, stat)
        restarted = after is None or after.generation != generation or stat.st_size < after.position
        start = 0 if restarted or after is None else after.position
        if not restarted and after is not None and stat.st_size == start:
            return [], after, False
        data = read_from(fd, start, stat.st_size)
    finally:
        os.close(fd)
    raw, consumed = read_index_lines(data, path=shown)
    if consumed < len(data) and repair:
        # A torn last line: the crash happened before its fsync, so it was never acknowledged.
        log.warning("repairing torn last line of %s", path)
        os.truncate(path, start + consumed)
    return raw, Version(generation, start + consumed), restarted


def index_version(path: Path) -> Version | None:
    """The version an index is at now, without reading it: its generation and its size.

    None: there is no index. One with a torn last line is at no version a reader was given.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return None
    try:
        stat = os.fstat(fd)
        return Version(index_generation(fd, stat), stat.st_size)
    finally:
        os.close(fd)
