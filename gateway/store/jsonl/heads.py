"""The response heads of a JSONL data dir: each response log's request time, model and API.

So a page of a list of responses (stored chat completions) costs what it walks, not a read of
every response log.

    {data_dir}/catalog/responses.jsonl   {"id": ..., "created": ..., "model": ..., "api": ...}

A response log's first record, its request, never changes: what is read from it once holds for
good. Each process loads the file once, then learns of new logs from a listing of
`logs/responses/` (names only, no file opened; not even that while the folder's modification
time says nothing was added or removed since), reads the first record of each log it did not
know, and appends what it read to the file for the next process. In memory the heads of each API
are sorted by (request time, id): a page is a walk from its cursor, a model filter checked in
memory, and the last line of each log it would take read, to leave out attempts that failed, are
under way or were deleted (`last_record_type`).

The file is derived data, written without locks: a line may be lost (its log's head is read
again later) or written twice (by two processes: they agree); a torn line is skipped; heads whose
log is gone (its conversation deleted) are dropped, and the file is rewritten once most of its
lines are such. Deleting it is always safe: the next list reads every log's first record again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from gateway.ids import is_valid_response_id
from gateway.store.jsonl.files import READ_FLAGS, write_all
from gateway.types import Api, request_api

log = logging.getLogger("gateway.store")

APIS: frozenset[str] = frozenset({"chat", "responses", "items", "messages"})
# A first record is read this much at a time (a long one: until its end).
_CHUNK = 8192
# The end of a log read to find its last record: an ending (commit, incomplete, deleted) is short.
_TAIL = 4096
# The folder's modification time is trusted to say "nothing changed" once it is this old: a file
# created within the same clock tick as the last listing would not have changed it.
_SETTLED_NS = 2_000_000_000
# Heads added or dropped at once past this are sorted anew rather than inserted one by one.
_BULK = 64
# Rewrite the file when it holds more than this many lines per head (plus a floor).
_COMPACT_RATIO = 2
_COMPACT_FLOOR = 4096


@dataclass(frozen=True, slots=True)
class Head:
    """What a list needs of a response log's request record."""

    created: float
    model: str | None
    api: Api


def read_head(path: Path) -> Head | None:
    """The head of a response log, from its first record; None when there is none to read.

    None when the log has no first record yet (a file just made) or it cannot be read as one (a
    damaged line: `gateway fsck` names it).
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    with f:
        data = f.read(_CHUNK)
        while b"\n" not in data:
            more = f.read(1 << 20)
            if not more:
                return None
            data += more
    try:
        record = orjson.loads(data[: data.index(b"\n")])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or record.get("type") != "request":
        return None
    created, model = record.get("created"), record.get("model")
    if not isinstance(created, int | float) or isinstance(created, bool):
        return None
    return Head(float(created), sys.intern(model) if isinstance(model, str) else None, request_api(record))


def last_record_type(path: Path) -> str | None:
    """The `type` of a response log's last record, from the log's end only.

    None when the log is gone or empty, ends in a torn line, or ends in a record longer than what
    is read (a reply whose ending is not written yet: an ending is short).
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - _TAIL)
        tail = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    if not tail.endswith(b"\n"):
        return None
    cut = tail.rfind(b"\n", 0, len(tail) - 1) + 1
    if cut == 0 and start > 0:
        return None
    try:
        record = orjson.loads(tail[cut:])
    except orjson.JSONDecodeError:
        return None
    kind = record.get("type") if isinstance(record, dict) else None
    return kind if isinstance(kind, str) else None


def _decode(record: object) -> tuple[str, Head] | None:
    """A line of the file as (response id, head); None for one that is not.

    The id is checked where it is used: a head whose id names no log in the folder is dropped at
    once.
    """
    if not isinstance(record, dict):
        return None
    rid, created, model, api = record.get("id"), record.get("created"), record.get("model"), record.get("api")
    if not isinstance(rid, str) or api not in APIS:
        return None
    if not isinstance(created, int | float) or isinstance(created, bool):
        return None
    return str(rid), Head(float(created), sys.intern(model) if isinstance(model, str) else None, api)


def _encode(rid: str, head: Head) -> bytes:
    return orjson.dumps({"id": rid, "created": head.created, "model": head.model, "api": head.api}) + b"\n"


def _log_names(folder: Path) -> set[str]:
    """The names of the folder's logs (unchecked: a name becomes a head only once checked)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    return {name[:-6] for name in names if name.endswith(".jsonl")}


class Heads:
    """One JSONL store's response heads, in this process. Safe to use from several threads.

    `folder`: `logs/responses/`; `path`: the file kept for the next process.
    """

    def __init__(self, folder: Path, path: Path) -> None:
        self.folder = folder
        self.path = path
        self._heads: dict[str, Head] = {}
        self._order: dict[str, list[tuple[float, str]]] = {api: [] for api in APIS}
        self._unread: set[str] = set()  # logs whose first record could not be read yet
        self._folder_time: int | None = None  # the folder's time at the last listing, if settled
        self._lines = 0  # lines in the file, as far as this process knows
        self._loaded = False
        self._warned = False
        self._mutex = threading.Lock()

    # -- keeping up with the folder ------------------------------------------------------------
    def refresh(self) -> None:
        """Learn the logs added to the folder and forget those removed since the last call."""
        with self._mutex:
            if not self._loaded:
                self._load()
                self._loaded = True
            try:
                folder_time: int | None = os.stat(self.folder).st_mtime_ns
            except FileNotFoundError:
                folder_time = None
            gone: set[str] = set()
            if folder_time is not None and folder_time == self._folder_time:
                new = set(self._unread)  # unchanged: only the logs not read yet
            else:
                names = _log_names(self.folder)
                new = {rid for rid in names - self._heads.keys() if is_valid_response_id(rid)}
                gone = self._heads.keys() - names
            read = {}
            for rid in new:
                head = read_head(self.folder / f"{rid}.jsonl")
                if head is not None:
                    read[rid] = head
            self._unread = new - read.keys()
            self._add(read)
            self._drop(gone)
            self._save(read)
            if self._lines > _COMPACT_RATIO * len(self._heads) + _COMPACT_FLOOR:
                self._rewrite()
            settled = folder_time is not None and time.time_ns() - folder_time > _SETTLED_NS
            self._folder_time = folder_time if settled else None

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._warn(exc)
            return
        end = data.rfind(b"\n") + 1  # (a torn last line is left out)
        lines = data[:end].split(b"\n")[:-1]
        try:
            records: list[object] = orjson.loads(b"[" + b",".join(lines) + b"]") if lines else []
        except orjson.JSONDecodeError:
            records = []
            for line in lines:
                try:
                    records.append(orjson.loads(line))
                except orjson.JSONDecodeError:
                    continue
        self._lines = len(lines)
        self._add(dict(entry for entry in map(_decode, records) if entry is not None))

    def _add(self, heads: dict[str, Head]) -> None:
        heads = {rid: head for rid, head in heads.items() if rid not in self._heads}
        self._heads.update(heads)
        if len(heads) > _BULK:
            for api in APIS:
                self._order[api] = sorted((h.created, rid) for rid, h in self._heads.items() if h.api == api)
            return
        for rid, head in heads.items():
            order, key = self._order[head.api], (head.created, rid)
            if not order or key > order[-1]:
                order.append(key)  # the common case: the newest request
            else:
                insort(order, key)

    def _drop(self, gone: Iterable[str]) -> None:
        """Forget the heads of logs no longer in the folder (and those the file named wrongly)."""
        dropped = [(rid, self._heads.pop(rid)) for rid in gone if rid in self._heads]
        if len(dropped) > _BULK:
            for api in APIS:
                self._order[api] = [key for key in self._order[api] if key[1] in self._heads]
        else:
            for rid, head in dropped:
                order, key = self._order[head.api], (head.created, rid)
                i = bisect_left(order, key)
                if i < len(order) and order[i] == key:
                    del order[i]

    # -- the file ------------------------------------------------------------------------------
    def _save(self, heads: dict[str, Head]) -> None:
        """Append the heads just read, for the next process.

        A failure only costs it reading them again.
        """
        if not heads:
            return
        data = b"".join(_encode(rid, head) for rid, head in heads.items())
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # after a torn line (a writer that died): not glued to it
                write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            self._warn(exc)
            return
        self._lines += len(heads)

    def _rewrite(self) -> None:
        """Write the file anew, one line per head this process knows.

        By a rename: a reader sees the old file or the new one.
        """
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(temp, "wb") as f:
                f.write(b"".join(_encode(rid, head) for rid, head in self._heads.items()))
            os.replace(temp, self.path)
        except OSError as exc:
            self._warn(exc)
            return
        self._lines = len(self._heads)

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("could not keep the response heads in %s (read again instead): %s", self.path, exc)

    # -- pages (call `refresh` first) ----------------------------------------------------------
    def page(
        self,
        limit: int,
        *,
        api: Api,
        model: str | None,
        after: str | None,
        descending: bool,
        taken: Callable[[str], bool],
    ) -> tuple[list[str], bool] | None:
        """Up to `limit` ids of `api`'s logs (and `model`'s), and whether more follow.

        In (request time, id) order after response `after`, each one `taken` says yes to. None
        when `after` is no response log this process knows.
        """
        with self._mutex:
            order = self._order[api]
            if after is None:
                start = len(order) if descending else 0
            else:
                head = self._heads.get(after) if is_valid_response_id(after) else None
                if head is None:
                    return None
                key = (head.created, after)
                start = bisect_left(order, key) if descending else bisect_right(order, key)
            places = range(start - 1, -1, -1) if descending else range(start, len(order))
            out: list[str] = []
            for place in places:
                rid = order[place][1]
                if model is not None and self._heads[rid].model != model:
                    continue
                if is_valid_response_id(rid) and taken(rid):  # (a line of the file named it)
                    out.append(rid)
                    if len(out) > limit:
                        break
            return out[:limit], len(out) > limit
