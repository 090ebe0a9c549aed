"""Replaying the journals of processes that are gone (at start, and in `gateway fsck`): every
commit a journal holds gets its complete response file and its index line, unless the index
went on without it (the turn was never acknowledged) or the conversation was deleted after it.

    {data_dir}/logs/journal/forgotten.jsonl   {"conversation_id", "at"}: deleted after `at` ns

A journal is its owner's while the owner lives (a lock on the file); one nobody holds is
replayed, its files synced, and removed. A replay is idempotent: a crash of the process only
(the page cache survives) leaves nothing to do but a commit in progress."""

from __future__ import annotations

import logging
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from gateway.exceptions import CorruptRecord
from gateway.ids import is_valid_response_id
from gateway.store.jsonl.files import fsync_dir, parse_index, write_all
from gateway.store.jsonl.journal import syncfs
from gateway.store.jsonl.locks import CrossProcessLock, file_lock, try_lock_file

if TYPE_CHECKING:
    from gateway.store.jsonl.store import JsonlStore

log = logging.getLogger("gateway.store")

FORGOTTEN = "forgotten.jsonl"


@dataclass(frozen=True)
class Entry:
    response_id: str
    conversation_id: str | None
    before: int
    at: int
    content: bytes


def parse_journal(data: bytes) -> tuple[list[Entry], set[str]]:
    """The complete entries of a journal and the response ids aborted after; a torn tail (a
    crash before its sync: never acknowledged) or the zeros after the last entry end it."""
    entries: list[Entry] = []
    aborted: set[str] = set()
    pos = 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            break
        try:
            head = orjson.loads(data[pos:end])
        except orjson.JSONDecodeError:
            break
        if not isinstance(head, dict):
            break
        pos = end + 1
        if isinstance(head.get("abort"), str):
            aborted.add(head["abort"])
            continue
        size = head.get("size")
        rid, cid = head.get("response_id"), head.get("conversation_id")
        if not isinstance(size, int) or not isinstance(rid, str) or len(data) < pos + size:
            break
        content = data[pos : pos + size]
        crc = head.get("crc")
        # Torn (never synced, so never acknowledged): JSON lines hold no zero byte.
        if (crc is not None and crc != zlib.crc32(content)) or b"\0" in content:
            break
        if not is_valid_response_id(rid):
            break
        cid = cid if isinstance(cid, str) else None
        before, at = int(head.get("before", 0)), int(head.get("at", 0))
        entries.append(Entry(rid, cid, before, at, content))
        pos += size
    return entries, aborted


def forget(store: JsonlStore, conversation_id: str) -> None:
    """Record, durably, that a conversation was deleted now: a replay must not bring back
    its turns from a journal that still holds them."""
    store.journal_dir.mkdir(parents=True, exist_ok=True)
    path = store.journal_dir / FORGOTTEN
    line = orjson.dumps({"conversation_id": conversation_id, "at": time.time_ns()}) + b"\n"
    with file_lock(store.locks_dir / "journal.lock"):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fresh = os.fstat(fd).st_size == 0
            write_all(fd, line)
            store._sync(os.fdatasync, fd)
        finally:
            os.close(fd)
    if fresh:
        store._sync(fsync_dir, store.journal_dir)


def _forgotten(folder: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        data = (folder / FORGOTTEN).read_bytes()
    except FileNotFoundError:
        return out
    for line in data.split(b"\n"):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("conversation_id"), str):
            cid = record["conversation_id"]
            out[cid] = max(out.get(cid, 0), int(record.get("at", 0)))
    return out


def recover(store: JsonlStore, lock_timeout: float = 30.0) -> int:
    """Replay every journal no live process holds; the number of commits that needed a fix."""
    folder = store.journal_dir
    if not folder.is_dir():
        return 0
    held: list[tuple[int, Path]] = []
    with file_lock(store.locks_dir / "journal.lock"):  # no journal is being created meanwhile
        for path in sorted(folder.glob("*.wal")):
            fd = os.open(path, os.O_RDWR)
            if try_lock_file(fd):
                held.append((fd, path))
            else:
                os.close(fd)
    if not held:
        return 0
    fixed = 0
    try:
        forgotten = _forgotten(folder)
        entries: list[Entry] = []
        aborted: set[str] = set()
        for fd, _ in held:
            found, gone = parse_journal(os.pread(fd, os.fstat(fd).st_size, 0))
            entries += found
            aborted |= gone
        # One conversation's commits are serialized by its lock: their times give their order.
        entries.sort(key=lambda e: e.at)
        complete = True
        for entry in entries:
            if entry.response_id in aborted:
                continue
            if entry.conversation_id is not None and forgotten.get(entry.conversation_id, -1) >= entry.at:
                continue
            try:
                fixed += _replay(store, entry, lock_timeout)
            except (OSError, TimeoutError) as exc:
                complete = False
                log.error("journal: could not replay %s: %s", entry.response_id, exc)
        if fixed:
            store._sync(syncfs, held[0][0])
        if complete:
            for _, path in held:
                os.unlink(path)
            with file_lock(store.locks_dir / "journal.lock"):
                if not any(folder.glob("*.wal")):  # nothing left that a deletion could concern
                    (folder / FORGOTTEN).unlink(missing_ok=True)
    finally:
        for fd, _ in held:
            os.close(fd)
    if fixed:
        log.warning("journal: replayed %d commit(s) a stopped process left unfinished", fixed)
    return fixed


def _replay(store: JsonlStore, entry: Entry, lock_timeout: float) -> int:
    fixed = 0
    path = store.response_path(entry.response_id)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    if data is None or not data.startswith(entry.content):
        fixed = 1
        if data is not None and entry.content.startswith(data):
            with open(path, "ab") as f:
                f.write(entry.content[len(data) :])
        else:
            temp = path.with_name(f".{path.name}.replay")
            temp.write_bytes(entry.content)
            os.replace(temp, path)
    if entry.conversation_id is None:
        return fixed
    index = store.index_path(entry.conversation_id)
    line = entry.response_id.encode() + b"\n"
    lock = CrossProcessLock(store, entry.conversation_id)
    deadline = time.monotonic() + lock_timeout
    while not lock.try_acquire():
        if time.monotonic() > deadline:
            raise TimeoutError(f"conversation {entry.conversation_id!r} stayed locked")
        time.sleep(0.005)
    try:
        try:
            data = index.read_bytes()
        except FileNotFoundError:
            data = b""
        if data[entry.before : entry.before + len(line)] == line:
            return fixed
        if len(data) < entry.before:
            log.warning("journal: %s not replayed: its index was cut", entry.response_id)
            return fixed
        if len(data) > entry.before:
            try:
                later, _ = parse_index(data[entry.before :])
            except CorruptRecord:
                later = []
            if later:
                return fixed  # the conversation went on without it: never acknowledged
            os.truncate(index, entry.before)  # what follows is a lost write's debris
        with open(index, "ab") as f:
            f.write(line)
        return 1
    finally:
        lock.release()
