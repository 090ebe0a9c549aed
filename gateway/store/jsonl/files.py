"""The JSONL files: decoding lines (keeping where a bad one was found) and appending to files
without leaving a short write unnoticed."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from gateway.exceptions import CorruptRecord, StorageError
from gateway.ids import is_valid_response_id
from gateway.types import Record

CONTEXT_PREFIX = b'{"type":"context"'


def parse_jsonl(data: bytes, *, path: str = "", start_line: int = 1) -> tuple[list[object], int]:
    """Decode complete lines; return (values, bytes consumed). A torn last line is not consumed.

    An undecodable complete line raises CorruptRecord with its path and line number.
    """
    end = data.rfind(b"\n") + 1
    values: list[object] = []
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


def write_all(fd: int, data: bytes) -> None:
    """os.write, failing instead of leaving a short write (disk full) unnoticed."""
    written = os.write(fd, data)
    if written != len(data):
        raise OSError(28, f"short write ({written} of {len(data)} bytes)")


def index_generation(fd: int, stat: os.stat_result, first_line: bytes = b"") -> str:
    """An index file's identity across appends: its inode and its first line. A deleted file's
    inode is soon reused, so a reader that saw a deleted index could take a new one at the same
    inode (and by chance the same size) for the one it read; the first line, a minted response
    id or a creation marker, tells them apart. `first_line`: what an append to an empty file
    writes (`fd` must be readable otherwise)."""
    head = (os.pread(fd, 128, 0) if stat.st_size else first_line).split(b"\n", 1)[0]
    return f"{stat.st_ino}:{head.decode('utf-8', 'replace')}"


@contextmanager
def os_errors(action: str) -> Iterator[None]:
    """What the OS refuses (EACCES, EIO, EMFILE, ENOTDIR, ...) as a StorageError: a 503 saying
    what could not be done and why, never a server path."""
    try:
        yield
    except OSError as exc:
        raise StorageError(f"could not {action}: {exc.strerror or type(exc).__name__}") from exc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_file(path: Path, data: bytes, *, sync: Callable[[int], None] | None, create: bool = True) -> int:
    """Append `data` to a file (then `sync(fd)`, if given); the file's size before it."""
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        before = os.fstat(fd).st_size
        write_all(fd, data)
        if sync is not None:
            sync(fd)
    finally:
        os.close(fd)
    return before


def probe_file(path: Path, sync: bool) -> None:
    """Create, write (and sync) and remove a small file: fails as a turn's write would."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, b"probe\n")
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    os.unlink(path)
