"""Replaying the journals of processes that are gone (at start, and in `gateway fsck`).

Every commit a journal holds gets its complete response file and its index line, unless the
index went on without it (the turn was never acknowledged) or the conversation was deleted after
it.

    {data_dir}/logs/journal/forgotten.jsonl   {"conversation_id", "at"}: deleted after `at` ns

A journal is its owner's while the owner lives (a lock on the file); one nobody holds is
replayed, its files synced, and removed. A replay is idempotent: a crash of the process only
(the page cache survives) leaves nothing to do but a commit in progress.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import orjson

from gateway.exceptions import CorruptRecord
from gateway.ids import is_valid_response_id
from gateway.store.jsonl.durability import Durability
from gateway.store.jsonl.files import fsync_dir, parse_index, write_all
from gateway.store.jsonl.journal import syncfs
from gateway.store.jsonl.layout import DataDir
from gateway.store.jsonl.locks import LockFolder, file_lock, try_lock_file

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
    """The complete entries of a journal and the response ids aborted after.

    A torn tail (a crash before its sync: never acknowledged) or the zeros after the last entry
    end it.
    """
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


def forget(data_dir: DataDir, durability: Durability, conversation_id: str) -> None:
    """Record, durably, that a conversation was deleted now.

    A replay must not bring back its turns from a journal that still holds them.
    """
    folder = data_dir.journal_dir
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FORGOTTEN
    line = orjson.dumps({"conversation_id": conversation_id, "at": time.time_ns()}) + b"\n"
    with file_lock(data_dir.journal_lock):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fresh = os.fstat(fd).st_size == 0
            write_all(fd, line)
            durability.sync(os.fdatasync, fd)
        finally:
            os.close(fd)
    if fresh:
        durability.sync(fsync_dir, folder)


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


def recover(
    data_dir: DataDir, durability: Durability, lock_folder: LockFolder, lock_timeout: float = 30.0
) -> int:
    """Replay every journal no live process holds; the number of commits that needed a fix."""
    folder = data_dir.journal_dir
    if not folder.is_dir():
        return 0
    held = claim_journals(data_dir)
    if not held:
        return 0
    try:
        entries = due_entries([fd for fd, _ in held], _forgotten(folder))
        fixed, complete = 0, True
        for entry in entries:
            try:
                fixed += _replay(data_dir, lock_folder, entry, lock_timeout)
            except (OSError, TimeoutError) as exc:
                complete = False
                log.error("journal: could not replay %s: %s", entry.response_id, exc)
        if fixed:
            durability.sync(syncfs, held[0][0])
        if complete:
            remove_journals(data_dir, [path for _, path in held])
    finally:
        for fd, _ in held:
            os.close(fd)
    if fixed:
        log.warning("journal: replayed %d commit(s) a stopped process left unfinished", fixed)
    return fixed


def claim_journals(data_dir: DataDir) -> list[tuple[int, Path]]:
    """The journals no live process holds, each open and locked by this one: (fd, path)."""
    held: list[tuple[int, Path]] = []
    with file_lock(data_dir.journal_lock):  # no journal is being created meanwhile
        for path in sorted(data_dir.journal_dir.glob("*.wal")):
            fd = os.open(path, os.O_RDWR)
            if try_lock_file(fd):
                held.append((fd, path))
            else:
                os.close(fd)
    return held


def due_entries(fds: list[int], forgotten: dict[str, int]) -> list[Entry]:
    """The commits of the journals open as `fds` that a replay must see to, oldest first.

    Left out: those aborted, and those of a conversation deleted after them (`forgotten`:
    conversation id -> when it was deleted, in ns)."""
    entries: list[Entry] = []
    aborted: set[str] = set()
    for fd in fds:
        found, gone = parse_journal(os.pread(fd, os.fstat(fd).st_size, 0))
        entries += found
        aborted |= gone
    # One conversation's commits are serialized by its lock: their times give their order.
    entries.sort(key=lambda e: e.at)
    return [
        e
        for e in entries
        if e.response_id not in aborted
        and (e.conversation_id is None or forgotten.get(e.conversation_id, -1) < e.at)
    ]


def remove_journals(data_dir: DataDir, paths: list[Path]) -> None:
    """Remove replayed journals.

    The record of deletions goes too once no journal is left that it could concern."""
    for path in paths:
        os.unlink(path)
    with file_lock(data_dir.journal_lock):
        if not any(data_dir.journal_dir.glob("*.wal")):
            (data_dir.journal_dir / FORGOTTEN).unlink(missing_ok=True)


def _replay(data_dir: DataDir, lock_folder: LockFolder, entry: Entry, lock_timeout: float) -> int:
    """Complete a commit's response file and index line; 1 if anything had to be written.

    The index is read and appended to under the conversation's lock."""
    fixed = 0
    path = data_dir.response_path(entry.response_id)
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
    index = data_dir.index_path(entry.conversation_id)
    line = entry.response_id.encode() + b"\n"
    lock = lock_folder.conversation(entry.conversation_id)
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
