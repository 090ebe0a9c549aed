"""`gateway fsck` for the JSONL layout: find damaged lines and files, and set them aside.

Damage is: lines no reader can decode (in an index, a response file or a side log), torn last
lines, index lines naming a response file that is missing, empty or not committed, and empty
response files. Repairing moves each damaged line or file into `{data_dir}/quarantine/{time}/`
(same relative path; a line as `FILE.line-N`) and notes it in that folder's `notes.jsonl`:
nothing is deleted. A conversation's index and response files are repaired under its lock, so a
running gateway can stay up.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gateway.exceptions import ConversationBusy, GatewayError
from gateway.ids import is_valid_conversation_id, is_valid_response_id
from gateway.store.base import SIDE_LOGS, Damage
from gateway.store.jsonl.files import fsync_dir, write_all
from gateway.store.jsonl.layout import DataDir
from gateway.types import Record

TORN = "torn last line (a write cut short)"
MOVE_LINE = "the line is moved to quarantine/"
MOVE_FILE = "the file is moved to quarantine/"
LEFT = "left as it is: make it readable, or move it away"
# A response file no conversation claims may be one a stateless request is still writing.
LOOSE_QUIET_SECONDS = 900.0


@dataclass(slots=True)
class Scanned:
    """One file read line by line: what is wrong where, and what could be read."""

    data: bytes
    bad: dict[int, str] = field(default_factory=dict)  # line number -> problem
    torn: int | None = None  # line number of a torn last line
    records: list[Record] = field(default_factory=list)  # response files and side logs
    entries: list[tuple[int, str | Record]] = field(default_factory=list)  # index files
    unreadable: str | None = None  # why it could not be read at all (a permission, a folder)


def scan(path: Path, *, index: bool = False) -> Scanned | None:
    """Read a file as its readers do (`files.parse_jsonl` / `parse_index`), but go on past a bad line.

    None when there is no such file.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # (a FIFO's read waits for ever)
            return Scanned(b"", unreadable="not a regular file")
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # (a file its readers cannot open either: named, not a traceback)
        return Scanned(b"", unreadable=exc.strerror or str(exc))
    out = Scanned(data)
    lines = data.split(b"\n")
    if lines[-1]:
        out.torn = len(lines)
    for lineno, raw in enumerate(lines[:-1], start=1):
        line = raw.strip()
        if not line:
            continue
        if index and not line.startswith(b"{"):
            text = line.decode("ascii", "replace")
            if is_valid_response_id(text):
                out.entries.append((lineno, text))
            else:
                out.bad[lineno] = "index line is neither a response id nor a JSON marker"
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            out.bad[lineno] = f"undecodable {'index marker' if index else 'record'}: {exc}"
            continue
        if index and not isinstance(value, dict):
            out.bad[lineno] = "index marker is not an object"
        elif index:
            out.entries.append((lineno, value))
        elif isinstance(value, dict):
            out.records.append(value)
    return out


def response_problem(scanned: Scanned | None) -> str | None:
    """Why an index may not name this response file (None: it may).

    Readers skip such an entry (with a warning); fsck reports it and a repair moves the index
    line aside.
    """
    if scanned is None:
        return "names a response file that is missing"
    if not scanned.records:
        empty = not scanned.data.strip()
        return (
            "names a response file that is empty"
            if empty
            else "names a response file with no readable record"
        )
    kinds = {r.get("type") for r in scanned.records}
    if "commit" not in kinds:
        return "names a response that is not committed"
    request = next((r for r in scanned.records if r.get("type") == "request"), None)
    if request is None or (request.get("kind") != "items" and "response" not in kinds):
        return "names a response that lacks its request or reply record"
    return None


def _files(folder: Path, valid: Callable[[str], bool] | None = None) -> list[Path]:
    """The folder's `*.jsonl` entries with a valid stem (a folder so named among them: its
    readers fail on it, and `scan` says so)."""
    if not folder.is_dir():
        return []
    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        stem = entry.name[:-6] if entry.name.endswith(".jsonl") else ""
        if stem and (valid is None or valid(stem)):
            out.append(Path(entry.path))
    return out


@dataclass(slots=True)
class Survey:
    """Everything found in one pass, and who owns each damaged file.

    The owner is the conversation whose lock its repair takes (None: no lock).
    """

    damage: list[Damage] = field(default_factory=list)
    owners: dict[Path, str | None] = field(default_factory=dict)
    files: int = 0


def survey(data_dir: DataDir) -> Survey:
    """Read every index, response file and side log of a data dir, noting what is damaged."""
    if not data_dir.root.is_dir():
        raise GatewayError(f"there is no data dir at {data_dir.root}")
    walk = Walk(data_dir)
    walk.indexes()
    walk.response_files()
    walk.side_logs()
    walk.found.damage.sort(key=lambda d: (d.path, d.line or 0))
    return walk.found


class Walk:
    """One survey of a data dir: what it found so far, and the response files it read.

    Each response file is read once: an index's check reads those it names, the walk of their
    folder reads the rest."""

    def __init__(self, data_dir: DataDir) -> None:
        self.data_dir = data_dir
        self.found = Survey()
        self.responses: dict[str, Scanned | None] = {}
        self.claimed: dict[str, str] = {}  # response id -> a conversation naming it

    def response(self, rid: str) -> Scanned | None:
        if rid not in self.responses:
            self.responses[rid] = scan(self.data_dir.response_path(rid))
        return self.responses[rid]

    def report(self, path: Path, owner: str | None, line: int | None, problem: str, action: str) -> None:
        self.found.damage.append(Damage(self.data_dir.shown(path), line, problem, action))
        self.found.owners.setdefault(path, owner)

    def report_lines(self, path: Path, scanned: Scanned, owner: str | None) -> None:
        """A file's undecodable lines and torn last line, or that it cannot be read at all."""
        if scanned.unreadable is not None:
            self.report(path, owner, None, f"cannot be read ({scanned.unreadable})", LEFT)
        for lineno, problem in sorted(scanned.bad.items()):
            self.report(path, owner, lineno, problem, MOVE_LINE)
        if scanned.torn is not None:
            self.report(path, owner, scanned.torn, TORN, MOVE_LINE)

    def indexes(self) -> None:
        """Each index's bad lines, and its lines naming a response file no reader can use."""
        for path in _files(self.data_dir.conversations_dir, is_valid_conversation_id):
            cid = path.name[:-6]
            scanned = scan(path, index=True)
            if scanned is None:
                continue
            self.found.files += 1
            self.report_lines(path, scanned, cid)
            for lineno, entry in scanned.entries:
                if isinstance(entry, str):
                    self.claimed.setdefault(entry, cid)
                    named = self.response(entry)
                    problem = response_problem(named) if named is None or named.unreadable is None else None
                    if problem is not None:  # (one that cannot be read is reported as a file)
                        self.report(path, cid, lineno, f"{problem} ({entry})", MOVE_LINE)

    def response_files(self) -> None:
        """Each response file's bad lines, and empty files.

        A file no conversation claims is left alone while it may still be being written."""
        now = time.time()
        for path in _files(self.data_dir.responses_dir, is_valid_response_id):
            rid = path.name[:-6]
            scanned = self.response(rid)
            if scanned is None:
                continue
            self.found.files += 1
            owner = self.claimed.get(rid) or _requested_conversation(scanned)
            if (
                owner is None
                and scanned.unreadable is None
                and now - path.stat().st_mtime < LOOSE_QUIET_SECONDS
            ):
                continue  # perhaps a stateless request's log being written: looked at later
            self.report_lines(path, scanned, owner)
            if not scanned.records and not scanned.bad and scanned.unreadable is None:
                self.report(path, owner, None, "empty response file", MOVE_FILE)

    def side_logs(self) -> None:
        """Each side log's bad lines (no lock guards them: repaired as they are)."""
        for kind in sorted(SIDE_LOGS):
            for path in _files(self.data_dir.logs_dir / kind):
                scanned = scan(path)
                if scanned is not None:
                    self.found.files += 1
                    self.report_lines(path, scanned, None)


def _requested_conversation(scanned: Scanned) -> str | None:
    request = next((r for r in scanned.records if r.get("type") == "request"), None)
    cid = request.get("conversation_id") if request is not None else None
    return cid if isinstance(cid, str) and is_valid_conversation_id(cid) else None


class Quarantine:
    """`{root}/quarantine/{time}-{pid}/`: damaged lines and files, and their notes.

    `notes.jsonl` says where each came from and why it was moved.
    """

    def __init__(self, data_dir: DataDir, *, fsync: bool) -> None:
        self.data_dir = data_dir
        self.fsync = fsync
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.folder = data_dir.root / "quarantine" / f"{stamp}-{os.getpid()}"

    def _target(self, path: Path, suffix: str = "") -> Path:
        target = self.folder / f"{path.relative_to(self.data_dir.root)}{suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def _note(self, path: Path, line: int | None, problem: str, moved: Path) -> Damage:
        shown = self.data_dir.shown(moved)
        note = {
            "file": self.data_dir.shown(path),
            "line": line,
            "problem": problem,
            "moved_to": shown,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self._write(self.folder / "notes.jsonl", orjson.dumps(note) + b"\n", append=True)
        return Damage(self.data_dir.shown(path), line, problem, f"moved to {shown}", repaired=True)

    def _write(self, path: Path, data: bytes, *, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        fd = os.open(path, flags, 0o644)
        try:
            write_all(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.fsync:
            fsync_dir(path.parent)

    def move_file(self, path: Path, problem: str) -> Damage:
        target = self._target(path)
        os.replace(path, target)
        if self.fsync:
            fsync_dir(target.parent)
            fsync_dir(path.parent)
        return self._note(path, None, problem, target)

    def move_lines(self, path: Path, scanned: Scanned, drop: dict[int, str]) -> list[Damage]:
        """Rewrite `path` without the lines in `drop` (each kept in quarantine first).

        A file with no line left is moved whole.
        """
        lines = scanned.data.split(b"\n")
        kept = [line for n, line in enumerate(lines[:-1], start=1) if n not in drop]
        if not any(line.strip() for line in kept):
            return [self.move_file(path, "; ".join(drop[n] for n in sorted(drop)))]
        done = []
        for n in sorted(drop):
            target = self._target(path, f".line-{n}")
            self._write(target, lines[n - 1] + (b"\n" if n < len(lines) else b""))
            done.append(self._note(path, n, drop[n], target))
        if os.stat(path).st_size != len(scanned.data):
            raise _Changed(path)
        temp = path.with_name(f".{path.name}.fsck")
        self._write(temp, b"".join(line + b"\n" for line in kept))
        os.replace(temp, path)  # a new inode: readers of an index read it again from the start
        if self.fsync:
            fsync_dir(path.parent)
        return done


class _Changed(Exception):
    """The file grew while it was being repaired (a writer that takes no lock): left as it was."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def repair_file(q: Quarantine, path: Path) -> list[Damage]:
    """Set aside a file's undecodable lines and torn tail; an empty file is moved whole."""
    scanned = scan(path)
    if scanned is None or scanned.unreadable is not None:
        return []
    drop = dict(scanned.bad)
    if scanned.torn is not None:
        drop[scanned.torn] = TORN
    if drop:
        return q.move_lines(path, scanned, drop)
    if not scanned.records and path.parent == q.data_dir.responses_dir:
        return [q.move_file(path, "empty response file")]
    return []


def repair_conversation(q: Quarantine, cid: str, files: list[Path]) -> list[Damage]:
    """Repair one conversation under its lock: its damaged response files first, then its index.

    The index lines moved aside are those that are unreadable or name a response that is (now)
    missing, empty or not committed.
    """
    done: list[Damage] = []
    index = q.data_dir.index_path(cid)
    scanned = scan(index, index=True)
    named = [entry for _, entry in scanned.entries if isinstance(entry, str)] if scanned else []
    # As found, before a response file is set aside (an empty one is then missing).
    found = {rid: response_problem(scan(q.data_dir.response_path(rid))) for rid in named}
    for path in files:
        if path.parent != q.data_dir.conversations_dir:
            done += repair_file(q, path)
    if scanned is None or scanned.unreadable is not None:
        return done
    drop = dict(scanned.bad)
    if scanned.torn is not None:
        drop[scanned.torn] = TORN
    for lineno, entry in scanned.entries:
        if isinstance(entry, str):
            response = scan(q.data_dir.response_path(entry))
            problem = response_problem(response) if response is None or response.unreadable is None else None
            if problem is not None:  # (one that cannot be read is left: it may be whole)
                drop[lineno] = f"{found.get(entry) or problem} ({entry})"
    return done + (q.move_lines(index, scanned, drop) if drop else [])


async def repair(
    data_dir: DataDir,
    found: Survey,
    *,
    fsync: bool,
    lock: Callable[[str], AbstractAsyncContextManager[None]],
) -> list[Damage]:
    """Move what `found` names to quarantine.

    A conversation's files are repaired under its `lock` (one that stays busy is left as it
    is), files of no conversation directly."""
    q = Quarantine(data_dir, fsync=fsync)
    done: list[Damage] = []
    units: dict[str | None, list[Path]] = {}
    for path, owner in found.owners.items():
        units.setdefault(owner, []).append(path)
    for owner, paths in sorted(units.items(), key=lambda unit: unit[0] or ""):
        try:
            if owner is None:
                for path in paths:
                    done += await asyncio.to_thread(repair_file, q, path)
                continue
            async with lock(owner):
                done += await asyncio.to_thread(repair_conversation, q, owner, paths)
        except ConversationBusy:
            continue  # still damaged: the survey after the repair says so
        except _Changed:
            continue
    return done
