"""The conversation catalog of a JSONL data dir: which conversations exist, when each last changed.

So a page of the list, a fork family or an existence check costs what it returns, not a scan of
`logs/conversations/`. It also keeps each conversation's list row, so that a page does not read
the conversations either.

    {data_dir}/catalog/conversations.jsonl  {"id": ..., "at": ..., "row": offset} or {"id": ..., "gone": true}
    {data_dir}/catalog/rows.jsonl           {"id": ..., "v": [generation, position], "row": {...}}

One line is appended per change to an index (a commit, a marker, a fork) and per deletion, by
whichever process made it; every process reads the file once and then only what was appended
since (one `stat` per listing), into a list sorted by last change. The catalog is derived data:
it is never fsync'd on a turn's path, and it is rebuilt from the conversations folder when it is
missing (data dirs older than it), when a process finds it out of step with the folder at load
(a line lost in a power cut, files copied in or removed by hand), or when it has grown to many
times the number of conversations (compaction). Appends take `locks/catalog.lock` shared, a
rebuild takes it exclusively (and replaces the files by a rename), so no append is lost to one.
A torn line is skipped (the folder check at the next load puts right what it named).

A change that brings its conversation's list row (the services' JSON, see `Listed`) appends the
row to `rows.jsonl` first, with the index version it describes, then its line naming the row's
offset; a list may also keep a row it made (`{"id": ..., "row": offset}`, no change of time).
Rows are read at their offsets only for a page's conversations, each handed out only while its
index is still at that version (one `stat` and a 128-byte read of the index per row): a row lost,
torn, left behind by a change that brought none (a deletion, a fork, a journal replay, a repair)
or by a power cut, is made again by the list, never shown stale. A rebuild keeps the rows.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from bisect import bisect_left, insort
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import orjson

from gateway.ids import is_valid_conversation_id
from gateway.store.base import Listed, Version
from gateway.store.jsonl.layout import DataDir
from gateway.store.jsonl.reading import index_version
from gateway.types import JSONObject

log = logging.getLogger("gateway.store")

# Compact when the file holds more than this many lines per conversation (plus a floor).
_COMPACT_RATIO = 4
_COMPACT_FLOOR = 4096


def forget_catalogs(root: Path) -> None:
    """Remove the catalogs of a data dir (its tenants' too) after files were copied in (`gateway import`).

    Every process, running or not, then rebuilds its catalog from the folder.
    """
    tenants = root / "tenants"
    bases = [root, *(p for p in tenants.iterdir() if p.is_dir())] if tenants.is_dir() else [root]
    for base in bases:
        (base / "locks").mkdir(parents=True, exist_ok=True)
        fd = os.open(base / "locks" / "catalog.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # not while another process rebuilds or appends
            (base / "catalog" / "conversations.jsonl").unlink(missing_ok=True)
            (base / "catalog" / "rows.jsonl").unlink(missing_ok=True)
        finally:
            os.close(fd)


def index_times(folder: Path) -> list[tuple[str, float]]:
    """(id, index modification time) of every conversation in the folder.

    A scan, for the lifecycle pass (whose idle clock is the file's time), never for a list.
    """
    out = []
    if folder.is_dir():
        with os.scandir(folder) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(".jsonl") and is_valid_conversation_id(name[:-6]):
                    try:
                        out.append((name[:-6], entry.stat().st_mtime))
                    except FileNotFoundError:
                        continue
    return out


def family_root(conversation_id: str) -> str:
    """The conversation a fork family grew from, as fork ids name it (`{source[:100]}.fork-…`)."""
    return conversation_id.split(".fork-", 1)[0][:100]


def _related(conversation_id: str) -> bool:
    """Could it share response files with another conversation?

    It could if it is a fork, or a source cut to 100 characters in its forks' ids.
    """
    return ".fork-" in conversation_id or len(conversation_id) > 100


class _Line(NamedTuple):
    """A catalog line: a change (`at`), a deletion (`gone`), or a row kept alone (neither)."""

    cid: str
    at: float | None
    gone: bool
    row: int | None  # where its row starts in rows.jsonl


def _row_offset(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _decode(line: bytes) -> _Line | None:
    """A catalog line; None for a line that is not one.

    A torn line (a writer that died mid-write) has the next writer's line glued to it: that one
    is kept.
    """
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        start = line.rfind(b'{"id"')
        if start <= 0:
            return None
        return _decode(line[start:])
    if not isinstance(record, dict):
        return None
    cid, at = record.get("id"), record.get("at")
    if not isinstance(cid, str) or not is_valid_conversation_id(cid):
        return None
    if record.get("gone"):
        return _Line(cid, None, True, None)
    row = _row_offset(record.get("row"))
    if isinstance(at, int | float):
        return _Line(cid, float(at), False, row)
    return _Line(cid, None, False, row) if row is not None else None


def _read_line(fd: int, offset: int) -> bytes:
    """The line of a file that starts at `offset` (without its newline; short if torn)."""
    parts = []
    while True:
        chunk = os.pread(fd, 4096, offset)
        end = chunk.find(b"\n")
        if end >= 0 or len(chunk) < 4096:
            parts.append(chunk[:end] if end >= 0 else chunk)
            return b"".join(parts)
        parts.append(chunk)
        offset += len(chunk)


def _row_of(line: bytes, cid: str) -> tuple[Version, JSONObject] | None:
    """A rows.jsonl line's (version, row), if it is `cid`'s."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or record.get("id") != cid:
        return None
    version, row = record.get("v"), record.get("row")
    if not (isinstance(version, list) and len(version) == 2 and isinstance(row, dict)):
        return None
    generation, position = version
    if not isinstance(generation, str) or type(position) is not int:
        return None
    return Version(generation, position), row


def _row_line(cid: str, version: Version, row: JSONObject) -> bytes:
    return orjson.dumps({"id": cid, "v": [version.generation, version.position], "row": row}) + b"\n"


class Catalog:
    """One data dir's catalog, in this process. Safe to use from several threads.

    `at` (id -> last change) and `_keys`, the same as (last change, id) pairs sorted, for keyset
    pages; `rows` (id -> where its newest row starts in rows.jsonl).
    """

    def __init__(self, data_dir: DataDir) -> None:
        self.data_dir = data_dir
        self.path = data_dir.catalog_dir / "conversations.jsonl"
        self.rows_path = data_dir.catalog_dir / "rows.jsonl"
        self.lock_path = data_dir.locks_dir / "catalog.lock"
        self.at: dict[str, float] = {}
        self.rows: dict[str, int] = {}
        self._keys: list[tuple[float, str]] = []
        self._families: dict[str, set[str]] = {}
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file read
        self._offset = 0
        self._lines = 0
        self.loaded = False
        self._quick = False  # a first page was read from the file's end (`newest`)
        self._mutex = threading.RLock()
        # Appends take the lock through a descriptor kept open (two system calls fewer a turn).
        self._appending = threading.Lock()
        self._append_fd = -1

    # -- writing ----------------------------------------------------------------------------------
    @contextmanager
    def _flock(self, kind: int) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, kind)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _append(self, records: list[tuple[dict[str, object], bytes | None]]) -> None:
        """Append lines, each after its row, if any; nothing when there is no catalog yet.

        A row is appended to rows.jsonl first, its offset then named by the line. With no catalog,
        the first load builds it from the folder. A failure is logged, never raised: the turn it
        follows is already durable.
        """
        try:
            with self._appending:  # one thread at a time on the kept descriptor's flock
                if self._append_fd < 0:
                    self._append_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(self._append_fd, fcntl.LOCK_SH)
                try:
                    try:
                        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                    except FileNotFoundError:
                        return
                    try:
                        os.write(fd, self._lines_for(records))
                    finally:
                        os.close(fd)
                finally:
                    fcntl.flock(self._append_fd, fcntl.LOCK_UN)
        except OSError as exc:
            log.warning("could not add to the conversation catalog (rebuilt at next start): %s", exc)

    def _lines_for(self, records: list[tuple[dict[str, object], bytes | None]]) -> bytes:
        """The catalog lines of `records`, their rows appended to rows.jsonl (the lock held)."""
        rows = [row for _, row in records if row is not None]
        if rows:
            fd = os.open(self.rows_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"".join(rows))
                # An O_APPEND write leaves this descriptor's offset at the end of what it
                # wrote, whoever appended after it: the rows start before it, in order.
                offset = os.lseek(fd, 0, os.SEEK_CUR) - sum(map(len, rows))
            finally:
                os.close(fd)
        lines = []
        for record, row in records:
            if row is not None:
                record["row"] = offset
                offset += len(row)
            lines.append(orjson.dumps(record) + b"\n")
        return b"".join(lines)

    def close(self) -> None:
        with self._appending:
            if self._append_fd >= 0:
                os.close(self._append_fd)
                self._append_fd = -1

    def changed(self, conversation_id: str, at: float, row: tuple[Version, JSONObject] | None = None) -> None:
        """The conversation changed at `at`; `row`: its list row, for the version it is now at."""
        line = _row_line(conversation_id, *row) if row is not None else None
        self._append([({"id": conversation_id, "at": at}, line)])

    def removed(self, conversation_id: str) -> None:
        self._append([({"id": conversation_id, "gone": True}, None)])

    def keep(self, rows: list[tuple[str, Version, JSONObject]]) -> None:
        """Rows a list made (no change of time): handed out while their version holds."""
        self._append([({"id": cid}, _row_line(cid, version, row)) for cid, version, row in rows])

    # -- the in-memory index --------------------------------------------------------------------
    def _set(self, cid: str, at: float | None) -> None:
        self.rows.pop(cid, None)
        old = self.at.pop(cid, None)
        if old is not None:
            i = bisect_left(self._keys, (old, cid))
            if i < len(self._keys) and self._keys[i] == (old, cid):
                del self._keys[i]
        if at is None:
            if _related(cid):
                self._families.get(family_root(cid), set()).discard(cid)
            return
        self.at[cid] = at
        if not self._keys or (at, cid) > self._keys[-1]:
            self._keys.append((at, cid))  # the common case: the newest change
        else:
            insort(self._keys, (at, cid))
        if _related(cid):
            self._families.setdefault(family_root(cid), set()).add(cid)

    def _apply(self, data: bytes) -> int:
        """Apply complete lines; the bytes consumed (a torn last line is left for later)."""
        end = data.rfind(b"\n") + 1
        for line in data[:end].split(b"\n"):
            if not line:
                continue
            self._lines += 1
            entry = _decode(line)
            if entry is not None:
                self._take(entry)
        return end

    def _take(self, line: _Line) -> None:
        if line.at is not None or line.gone:
            self._set(line.cid, line.at)
        if line.row is not None and line.cid in self.at:
            self.rows[line.cid] = line.row

    def _reset(self) -> None:
        self.at, self.rows, self._keys, self._families = {}, {}, [], {}
        self._identity, self._offset, self._lines = None, 0, 0

    def _bulk(self, pairs: dict[str, float], rows: dict[str, int]) -> None:
        self.rows = {cid: offset for cid, offset in rows.items() if cid in pairs}
        self.at = dict(pairs)
        self._keys = sorted((at, cid) for cid, at in pairs.items())
        self._families = {}
        for cid in pairs:
            if _related(cid):
                self._families.setdefault(family_root(cid), set()).add(cid)

    def _read_file(self) -> bool:
        """Read the whole file into memory; False when there is none.

        Decoded in one go (a damaged line sends it line by line); ids are checked where they are
        used (`page`).
        """
        self._reset()
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return False
        end = data.rfind(b"\n") + 1
        pairs: dict[str, float] = {}
        rows: dict[str, int] = {}
        try:
            records = orjson.loads(b"[" + data[: end - 1].replace(b"\n", b",") + b"]") if end else []
            for record in records:
                cid = record["id"]
                if type(cid) is not str:
                    continue
                if record.get("gone"):
                    pairs.pop(cid, None)
                    rows.pop(cid, None)
                    continue
                if "at" in record:
                    pairs[cid] = float(record["at"])
                    rows.pop(cid, None)
                row = record.get("row")
                if type(row) is int and cid in pairs:
                    rows[cid] = row
            self._lines = len(records)
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            pairs, rows = {}, {}
            for raw in data[:end].split(b"\n"):
                line = _decode(raw) if raw else None
                if line is None:
                    continue
                if line.gone:
                    pairs.pop(line.cid, None)
                    rows.pop(line.cid, None)
                elif line.at is not None:
                    pairs[line.cid] = line.at
                    rows.pop(line.cid, None)
                if line.row is not None and line.cid in pairs:
                    rows[line.cid] = line.row
            self._lines = data.count(b"\n", 0, end)
        self._bulk(pairs, rows)
        self._identity, self._offset = (stat.st_dev, stat.st_ino), end
        return True

    def _on_disk(self) -> set[str]:
        """The conversations in the folder: their index files' names.

        Checked only where they differ from the catalog's.
        """
        try:
            names = os.listdir(self.data_dir.conversations_dir)
        except FileNotFoundError:
            return set()
        return {name[:-6] for name in names if name.endswith(".jsonl")}

    def _rebuild(self) -> None:
        """Write the catalog anew, one line per conversation, oldest change first.

        What this process knows, checked against the folder (under the exclusive lock, so no
        append is lost and no conversation created meanwhile is missed).
        """
        self.data_dir.locks_dir.mkdir(parents=True, exist_ok=True)
        with self._flock(fcntl.LOCK_EX):
            if not self._read_file():
                self._reset()
            names = self._on_disk()
            pairs = {cid: at for cid, at in self.at.items() if cid in names and isinstance(at, float)}
            for cid in names - pairs.keys():
                with suppress(FileNotFoundError):
                    if is_valid_conversation_id(cid):
                        pairs[cid] = os.stat(self.data_dir.conversations_dir / f"{cid}.jsonl").st_mtime
            self._bulk(pairs, self.rows)
            if not pairs and not self.path.exists():
                return  # an empty data dir stays as it was
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = self._write_anew()
            stat = os.stat(self.path)
            self._identity, self._offset, self._lines = (stat.st_dev, stat.st_ino), len(data), len(pairs)
        log.info("rebuilt the conversation catalog of %s (%d conversations)", self.data_dir.root, len(pairs))

    def _write_anew(self) -> bytes:
        """Replace both files by what this process holds; return the catalog's bytes.

        The rows first: a reader that takes an old offset into the new file finds no row of its
        conversation there.
        """
        kept = self._kept_rows()
        offsets, end = {}, 0
        for cid, row in kept.items():
            offsets[cid], end = end, end + len(row)
        self._replace(self.rows_path, b"".join(kept.values()))
        lines = []
        for at, cid in self._keys:
            record: dict[str, object] = {"id": cid, "at": at}
            if cid in offsets:
                record["row"] = offsets[cid]
            lines.append(orjson.dumps(record) + b"\n")
        data = b"".join(lines)
        self._replace(self.path, data)
        self.rows = offsets
        return data

    def _kept_rows(self) -> dict[str, bytes]:
        """The row lines `rows` names, read from rows.jsonl (a rebuild writes them anew)."""
        out: dict[str, bytes] = {}
        try:
            fd = os.open(self.rows_path, os.O_RDONLY)
        except FileNotFoundError:
            return out
        try:
            for cid, offset in sorted(self.rows.items(), key=lambda pair: pair[1]):
                line = _read_line(fd, offset)
                if _row_of(line, cid) is not None:
                    out[cid] = line + b"\n"
        finally:
            os.close(fd)
        return out

    @staticmethod
    def _replace(path: Path, data: bytes) -> None:
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)

    def _load(self) -> None:
        if self._read_file():
            on_disk = self._on_disk()
            differ = on_disk.symmetric_difference(self.at.keys())
            if any(is_valid_conversation_id(cid) for cid in differ):
                self._rebuild()  # out of step with the folder (see the module's docstring)
            elif self._lines > _COMPACT_RATIO * len(self.at) + _COMPACT_FLOOR:
                self._rebuild()
        elif self._on_disk():
            self._rebuild()  # a data dir older than the catalog
        self.loaded = True

    def refresh(self) -> None:
        """Bring this process's copy up to date.

        Load it once, then read what was appended since (a new file, after another process
        rebuilt it, is read whole).
        """
        with self._mutex:
            if not self.loaded:
                self._load()
                return
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                if self.at or self._on_disk():
                    self._rebuild()  # removed by hand (or never written): from the folder
                return
            if (stat.st_dev, stat.st_ino) != self._identity or stat.st_size < self._offset:
                self.loaded = False
                self._load()
                return
            if stat.st_size == self._offset:
                return
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            self._offset += self._apply(data)

    # -- questions (`page`, `family`: call `refresh` first) ------------------------------------
    def page(self, limit: int, after: str | None) -> tuple[list[tuple[str, float, int | None]], bool] | None:
        """Up to `limit` (id, last change, where its row is), most recent first; and whether more follow.

        The page starts after conversation `after`; None when `after` is not in the catalog.
        """
        with self._mutex:
            end = len(self._keys)
            if after is not None:
                at = self.at.get(after)
                if at is None:
                    return None
                end = bisect_left(self._keys, (at, after))
            while True:
                start = max(0, end - limit)
                keys = self._keys[start:end]
                bad = [key for key in keys if not is_valid_conversation_id(key[1])]
                if not bad:
                    return [(cid, at, self.rows.get(cid)) for at, cid in reversed(keys)], start > 0
                for _, cid in bad:  # a foreign line: never a file name, never listed
                    self._set(cid, None)
                end -= len(bad)

    def forget(self, cid: str) -> None:
        """Take an index found gone by a reader out of this process's copy.

        The file is left alone: readers never write.
        """
        with self._mutex:
            self._set(cid, None)

    def family(self, cid: str) -> set[str]:
        """The other conversations that may share response files with `cid` (its fork family)."""
        with self._mutex:
            root = family_root(cid)
            out = set(self._families.get(root, ()))
            if root != cid and root in self.at:
                out.add(root)
            out.discard(cid)
            return out

    def newest(self, limit: int) -> tuple[list[tuple[str, float, int | None]], bool] | None:
        """The first page (as `page` gives it) without loading the catalog.

        For a process that lists once, such as `gateway conversations`: read from the end of the
        file back, until enough conversations are found (lines are appended in time order, give or
        take a few racing writers: twice the page is read, then sorted). None when there is no
        catalog file.
        """
        want = 2 * limit + 16
        latest: dict[str, float | None] = {}
        rows: dict[str, int | None] = {}
        live = 0
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return None
        with f:
            pos = os.fstat(f.fileno()).st_size
            rest = b""
            while pos > 0 and live < want:
                step = min(1 << 16, pos)
                pos -= step
                f.seek(pos)
                rest = f.read(step) + rest
                cut = 0 if pos == 0 else rest.find(b"\n") + 1
                if cut == 0 and pos > 0:
                    continue  # not one whole line yet
                lines, rest = rest[cut:].split(b"\n"), rest[:cut]
                for raw in reversed(lines):
                    line = _decode(raw) if raw else None
                    if line is None or line.cid in latest:
                        continue
                    rows.setdefault(line.cid, line.row)  # the newest line says where its row is
                    if line.at is not None or line.gone:
                        latest[line.cid] = line.at
                        live += line.at is not None
        found = sorted(((at, cid) for cid, at in latest.items() if at is not None), reverse=True)
        return [(cid, at, rows.get(cid)) for at, cid in found[:limit]], len(found) > limit

    def listed(self, limit: int, after: str | None, *, rows: bool) -> tuple[list[Listed], bool] | None:
        """`page`, up to date, each conversation's index looked at for the version it is at.

        A stat and a small read each: an index removed behind the catalog's back is left out.
        With `rows`, each with its row when one is kept for that version.
        """
        if not self.loaded and after is None and not self._quick:
            self._quick = True  # once: a process that lists again loads the catalog
            quick = self.newest(limit)
            if quick is not None:
                versions = self._versions([cid for cid, _, _ in quick[0]])
                if None not in versions.values():
                    return self._listed(quick[0], versions, rows), quick[1]
        self.refresh()
        while True:
            page = self.page(limit, after)
            if page is None:
                return None
            versions = self._versions([cid for cid, _, _ in page[0]])
            gone = [cid for cid, version in versions.items() if version is None]
            if not gone:
                return self._listed(page[0], versions, rows), page[1]
            for cid in gone:
                self.forget(cid)

    def _versions(self, cids: list[str]) -> dict[str, Version | None]:
        folder = self.data_dir.conversations_dir
        return {cid: index_version(folder / f"{cid}.jsonl") for cid in cids}

    def _listed(
        self, page: list[tuple[str, float, int | None]], versions: dict[str, Version | None], rows: bool
    ) -> list[Listed]:
        """The page's conversations, with the rows kept for the versions they are at."""
        kept: dict[str, JSONObject] = {}
        wanted = [(cid, offset) for cid, _, offset in page if offset is not None] if rows else []
        if wanted:
            try:
                fd = os.open(self.rows_path, os.O_RDONLY)
            except FileNotFoundError:
                wanted = []
            else:
                try:
                    for cid, offset in wanted:
                        found = _row_of(_read_line(fd, offset), cid)
                        if found is not None and found[0] == versions[cid]:
                            kept[cid] = found[1]
                finally:
                    os.close(fd)
        return [Listed(cid, at, versions[cid], kept.get(cid)) for cid, at, _ in page]
