"""The JSONL files: decoding lines and appending to files.

Decoding keeps where a bad line was found; appending leaves no short write unnoticed.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from gateway.exceptions import CorruptRecord, StorageError
from gateway.ids import RESPONSE_ID_RE, is_valid_response_id
from gateway.store.base import LRU
from gateway.types import Record
from gateway.writers import gone

log = logging.getLogger("gateway.store")

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


# Index lines that are response ids (RESPONSE_ID_RE, not starting with a dot), checked a run
# of lines at a time: only allowed bytes, every line ending in "-" and 12 hex digits, no line
# starting with a dot, every line 14 to 113 bytes long.
_ID_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-\n"
_ID_ENDS = re.compile(rb"-[0-9a-f]{12}\n")
_MARKER_LINE = re.compile(rb"^\{.*\n", re.MULTILINE)
assert RESPONSE_ID_RE.pattern == r"[A-Za-z0-9._-]{1,100}-[0-9a-f]{12}", "update the checks above"


def _plain_ids(run: bytes) -> list[str] | None:
    """The response ids of a run of index lines (ending in a newline), if that is all it is."""
    lines = run[:-1].split(b"\n")
    if run[:1] == b"." or b"\n." in run or run.translate(None, _ID_BYTES):
        return None
    if _ID_ENDS.subn(b"", run)[1] != len(lines) or max(map(len, lines)) > 113 or min(map(len, lines)) < 14:
        return None
    return run[:-1].decode("ascii").split("\n")


def read_index_lines(data: bytes, *, path: str = "") -> tuple[list[str | Record], int]:
    """`parse_index`, at C speed for what indexes hold: runs of plain id lines between marker lines.

    Anything else is left to `parse_index`, which also says where it is.
    """
    end = data.rfind(b"\n") + 1
    entries: list[str | Record] = []
    at = 0
    for found in [*(_MARKER_LINE.finditer(data, 0, end) if b"{" in data else ()), None]:
        stop = found.start() if found is not None else end
        if stop > at:
            ids = _plain_ids(data[at:stop])
            if ids is None:
                return parse_index(data, path=path)
            entries.extend(ids)
        if found is not None:
            try:
                marker = orjson.loads(found.group())
            except orjson.JSONDecodeError:
                return parse_index(data, path=path)
            if not isinstance(marker, dict):
                return parse_index(data, path=path)
            entries.append(marker)
            at = found.end()
    return entries, end


def write_all(fd: int, data: bytes) -> None:
    """os.write, failing instead of leaving a short write (disk full) unnoticed."""
    written = os.write(fd, data)
    if written != len(data):
        raise OSError(28, f"short write ({written} of {len(data)} bytes)")


def end_log(path: Path | str, start: int, data: bytes) -> None:
    """Append `data` (whole lines) to a response log, first cutting what a failed write left torn.

    What is cut lies after offset `start` (the end of the log's first record): every line stays
    whole and the log ends with `data` (a torn line in the middle would make the log unreadable).
    """
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        end = size
        if size > start:
            end = start + os.pread(fd, size - start, start).rfind(b"\n") + 1
        if end < size:
            os.ftruncate(fd, end)
        written = os.pwrite(fd, data, end)
        if written != len(data):
            raise OSError(28, f"short write ({written} of {len(data)} bytes)")
    finally:
        os.close(fd)


def index_generation(fd: int, stat: os.stat_result, first_line: bytes = b"") -> str:
    """An index file's identity across appends: its inode and its first line.

    A deleted file's inode is soon reused, so a reader that saw a deleted index could take a new
    one at the same inode (and by chance the same size) for the one it read; the first line, a
    minted response id or a creation marker, tells them apart. `first_line`: what an append to an
    empty file writes (`fd` must be readable otherwise).
    """
    head = (os.pread(fd, 128, 0) if stat.st_size else first_line).split(b"\n", 1)[0]
    return f"{stat.st_ino}:{head.decode('utf-8', 'replace')}"


@contextmanager
def os_errors(action: str) -> Iterator[None]:
    """What the OS refuses (EACCES, EIO, EMFILE, ENOTDIR, ...) as a StorageError.

    A 503 saying what could not be done and why, and the file by its folder and name (the
    data dir's own names: never a server path).
    """
    try:
        yield
    except OSError as exc:
        named = Path(os.fsdecode(exc.filename)) if isinstance(exc.filename, str | bytes) else None
        where = f" ({named.parent.name}/{named.name})" if named is not None else ""
        raise StorageError(f"could not {action}: {exc.strerror or type(exc).__name__}{where}") from exc


# Reads never wait on a FIFO where a data file should be (its open waits for a writer: one froze
# the event loop, and every request with it); a regular file reads as ever.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def read_whole(path: Path | str) -> bytes:
    """A file's bytes, as `Path.read_bytes` reads them, with READ_FLAGS (a FIFO reads empty)."""
    fd = os.open(path, READ_FLAGS)
    try:
        parts = []
        while chunk := os.read(fd, max(os.fstat(fd).st_size, 1 << 16)):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


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


def file_size(path: Path) -> int:
    """The file's size, 0 if there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def read_records(path: Path, shown: str, *, skip_context: bool = False) -> list[Record]:
    """The records of a JSONL file (none if it is missing).

    `skip_context`: without context snapshot lines (the bulk of a response log, not needed to
    rebuild history). A torn last line is left out, and cut from a response log that nothing can
    still be writing.
    """
    try:
        data = read_whole(path)
    except FileNotFoundError:
        return []
    whole = data.rfind(b"\n") + 1
    torn = whole < len(data)
    if skip_context and CONTEXT_PREFIX in data:
        # (blanked, not left out: a damaged line after them is named by its own line number)
        lines = data[:whole].split(b"\n")
        data = b"\n".join(b"" if line.startswith(CONTEXT_PREFIX) else line for line in lines)
    parsed, _ = parse_jsonl(data, path=shown)
    records = [r for r in parsed if isinstance(r, dict)]
    if torn:
        cut_torn_tail(path, whole, records, shown)
    return records


def cut_torn_tail(path: Path, whole: int, records: list[Record], shown: str) -> None:
    """Cut a response log's torn last line back to its `whole` lines, once nothing can still write it.

    A torn line is a write cut short by a crash. Nothing can still be writing it when the log has
    ended (nothing is written after its commit or incomplete record) or the process that wrote it
    is gone. Otherwise the "torn" line may be a write in progress, and it is only left out.
    """
    ended = bool(records) and records[-1].get("type") in ("commit", "incomplete")
    if not ended and not (records and gone(records[0].get("writer"))):
        return
    try:
        os.truncate(path, whole)
    except OSError as exc:  # (a read-only data dir: still read, as before)
        log.warning("could not cut the torn last line of %s: %s", shown, exc.strerror or exc)
        return
    log.warning("repaired the torn last line of %s", shown)


# A response log is written request, context snapshot(s), response, commit: when the snapshot
# is big, its head and tail hold everything else.
_CHUNK = 8192
_RESPONSE_PREFIX = b'{"type":"response"'


def read_turn_records(path: Path, shown: str) -> list[Record]:
    """`read_records(skip_context=True)`, reading only the head and the tail of a log.

    The head is the request line, the tail the response record on; the log's context snapshot
    lies between them, so a turn costs the same to read whatever window it sent. Any other shape
    is read whole.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return []
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _CHUNK, 0) if size > 2 * _CHUNK else b""
        tail = os.pread(fd, _CHUNK, size - _CHUNK) if head else b""
    finally:
        os.close(fd)
    first, cut = head.find(b"\n") + 1, tail.find(b"\n") + 1
    if (
        first
        and head.startswith(CONTEXT_PREFIX, first)
        and tail.startswith(_RESPONSE_PREFIX, cut)
        and tail.endswith(b"\n")  # (else a torn last line: read whole, and repaired)
    ):
        try:
            records, _ = parse_jsonl(head[:first] + tail[cut:], path=shown)
            return [r for r in records if isinstance(r, dict)]
        except CorruptRecord:
            pass  # read whole, to say on which line
    return read_records(path, shown, skip_context=True)


def probe_file(path: Path, sync: bool, size: int = 0) -> None:
    """Create, write (and sync) and remove a small file, or one of `size` bytes: fails as a
    turn's write would."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, b"probe\n" + bytes(max(0, size - 6)))
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def folders_writable(*folders: Path) -> None:
    """Raise OSError unless each of `folders` is a folder files can be made in.

    The probe file is made in one folder; turns make theirs in others, which can be gone,
    replaced by a file or read-only on their own."""
    for folder in folders:
        named = f"{folder.parent.name}/{folder.name}"  # (no server paths in what clients see)
        try:
            if not stat.S_ISDIR(os.stat(folder).st_mode):
                raise OSError(errno.ENOTDIR, "Not a directory")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise OSError(errno.EACCES, "Permission denied")
        except OSError as exc:
            raise OSError(exc.errno, f"{named}: {exc.strerror}") from exc


class NamedFiles:
    """`folder/{name}.jsonl` for names `check`ed once. At most `limit` kept.

    A turn asks for its index's path several times, and building a Path costs more than the rest
    of the lookup.
    """

    def __init__(self, folder: Path, check: Callable[[str], str], limit: int) -> None:
        self.folder = folder
        self.check = check
        self._paths: LRU[str, Path] = LRU(limit)

    def __call__(self, name: str) -> Path:
        path = self._paths.get(name)
        if path is None:
            path = self._paths[name] = self.folder / f"{self.check(name)}.jsonl"
        return path
