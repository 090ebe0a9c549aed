"""`gateway export` / `gateway import`: PostgreSQL <-> the JSONL layout, which is the interchange format.

Export writes JsonlStore's exact layout (one consistent snapshot per tenant); import loads such a
folder into an empty database, leaving torn last lines out.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import orjson

from gateway.exceptions import GatewayError, StorageError
from gateway.ids import is_valid_conversation_id, is_valid_response_id, is_valid_side_key
from gateway.redact import redact_dsn
from gateway.store.base import SIDE_LOGS
from gateway.store.jsonl import parse_index, parse_jsonl
from gateway.store.postgres import has_schema, map_errors, migrate
from gateway.store.postgres.schema import Conn, Row

log = logging.getLogger("gateway.store")


@dataclass
class TransferStats:
    conversations: int = 0
    responses: int = 0
    side_records: int = 0
    archived_files: int = 0
    torn_lines: int = 0
    tenants: list[str] = field(default_factory=list)

    def describe(self) -> str:
        text = (
            f"{self.conversations} conversations, {self.responses} responses, "
            f"{self.side_records} side-log records, {self.archived_files} archived files"
        )
        if len(self.tenants) > 1 or (self.tenants and self.tenants[0]):
            text += f" ({len(self.tenants)} tenants)"
        if self.torn_lines:
            text += f"; {self.torn_lines} torn last lines left out (never acknowledged)"
        return text


def _is_safe_name(name: str) -> bool:
    return is_valid_conversation_id(name) or (name == "")


def _tenant_root(root: Path, namespace: str) -> Path:
    return root if not namespace else root / "tenants" / namespace


def _write_file(path: Path, lines: list[str], mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(f"{line}\n" for line in lines).encode())
    if mtime is not None:
        os.utime(path, (mtime, mtime))


async def export_jsonl(dsn: str, target: Path) -> TransferStats:
    """Write every tenant's data in JsonlStore's exact layout under `target`.

    `target` must not hold gateway data yet. One consistent snapshot per tenant.
    """
    stats = TransferStats()
    with map_errors(f"cannot export from {redact_dsn(dsn)}"):
        conn = await asyncpg.connect(dsn, command_timeout=None)
        try:
            # A database without the gateway's tables (a DSN naming another one) holds nothing to
            # export: said, as of a data dir, not "exported 0" after making the tables there.
            if not await has_schema(conn):
                raise GatewayError(
                    f"{redact_dsn(dsn)} holds no gateway data (no gateway tables): nothing to export"
                )
            await migrate(conn)
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                namespaces = [
                    r["namespace"]
                    for r in await conn.fetch(
                        "SELECT namespace FROM gateway_responses UNION SELECT namespace FROM gateway_index "
                        "UNION SELECT namespace FROM gateway_side "
                        "UNION SELECT namespace FROM gateway_archive ORDER BY 1"
                    )
                ]
                if not namespaces:
                    raise GatewayError(f"{redact_dsn(dsn)} holds no gateway data: nothing to export")
                for ns in namespaces:
                    if not _is_safe_name(ns):
                        log.warning("skipping tenant %r: not a safe folder name", ns)
                        continue
                    stats.tenants.append(ns)
                    await _export_namespace(conn, ns, _tenant_root(target, ns), stats)
        finally:
            await conn.close()
    return stats


async def _grouped(conn: Conn, sql: str, *args: object) -> AsyncIterator[tuple[object, list[Row]]]:
    """Rows of `sql` (ordered by its first column) grouped by that column, streamed by a cursor."""
    key: object = None
    group: list[Row] = []
    async for row in conn.cursor(sql, *args, prefetch=2000):
        if group and row[0] != key:
            yield key, group
            group = []
        key = row[0]
        group.append(row)
    if group:
        yield key, group


async def _export_namespace(conn: Conn, ns: str, root: Path, stats: TransferStats) -> None:
    logs = root / "logs"
    for folder in ("responses", "conversations", "summaries"):
        (logs / folder).mkdir(parents=True, exist_ok=True)
    async for rid, rows in _grouped(
        conn,
        "SELECT response_id, record::text FROM gateway_responses WHERE namespace = $1 "
        "ORDER BY response_id, seq",
        ns,
    ):
        if is_valid_response_id(rid):
            _write_file(logs / "responses" / f"{rid}.jsonl", [r[1] for r in rows])
            stats.responses += 1
    times = {
        r["conversation_id"]: float(r["updated_at"])
        for r in await conn.fetch(
            "SELECT conversation_id, updated_at FROM gateway_conversations WHERE namespace = $1", ns
        )
    }
    async for cid, rows in _grouped(
        conn,
        "SELECT conversation_id, coalesce(response_id, marker::text) FROM gateway_index "
        "WHERE namespace = $1 ORDER BY conversation_id, seq",
        ns,
    ):
        if is_valid_conversation_id(cid):
            _write_file(logs / "conversations" / f"{cid}.jsonl", [r[1] for r in rows], times.get(cid))
            stats.conversations += 1
    async for kind_key, rows in _grouped(
        conn,
        "SELECT kind || '/' || key, record::text FROM gateway_side WHERE namespace = $1 "
        "ORDER BY kind, key, id",
        ns,
    ):
        kind, _, key = str(kind_key).partition("/")
        if kind in SIDE_LOGS and is_valid_side_key(key):
            _write_file(logs / kind / f"{key}.jsonl", [r[1] for r in rows])
            stats.side_records += len(rows)
    for row in await conn.fetch(
        "SELECT archive_id, path, content FROM gateway_archive WHERE namespace = $1 "
        "ORDER BY archive_id, path",
        ns,
    ):
        path = Path(row["path"])
        if not is_valid_conversation_id(row["archive_id"]) or path.is_absolute() or ".." in path.parts:
            log.warning("skipping archived file %s/%s: not a safe path", row["archive_id"], row["path"])
            continue
        dest = root / "archive" / row["archive_id"] / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(row["content"].encode())
        stats.archived_files += 1


def _complete_lines(path: Path, stats: TransferStats) -> list[str]:
    """A JSONL file's complete, non-blank lines, verbatim; each must be JSON."""
    data = path.read_bytes()
    parse_jsonl(data, path=str(path))  # raises CorruptRecord with the line number
    end = data.rfind(b"\n") + 1
    if end < len(data):
        stats.torn_lines += 1
    return [line.decode() for line in data[:end].split(b"\n") if line.strip()]


def _jsonl_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.jsonl") if p.is_file()) if folder.is_dir() else []


async def import_jsonl(dsn: str, source: Path) -> TransferStats:
    """Load a JSONL data dir (JsonlStore's layout, tenants included) into the database.

    One transaction per tenant: all of it or none. Refuses conversations that already exist.
    """
    roots = [("", source)]
    tenants = source / "tenants"
    if tenants.is_dir():
        roots += [
            (p.name, p) for p in sorted(tenants.iterdir()) if p.is_dir() and is_valid_conversation_id(p.name)
        ]
    stats = TransferStats()
    with map_errors(f"cannot import into {redact_dsn(dsn)}"):
        conn = await asyncpg.connect(dsn, command_timeout=None)
        try:
            await migrate(conn)
            for ns, root in roots:
                logs = root / "logs"
                if not logs.is_dir() and not (root / "archive").is_dir():
                    continue
                stats.tenants.append(ns)
                async with conn.transaction():
                    await _import_namespace(conn, ns, root, stats)
        except asyncpg.UniqueViolationError as exc:
            raise StorageError(
                f"import refused: {_existing(exc.detail)}; nothing of its tenant was imported"
            ) from None
        finally:
            await conn.close()
    return stats


def _existing(detail: str | None) -> str:
    """What already exists, in words, from PostgreSQL's detail of a unique violation.

    `Key (namespace, response_id, seq)=(, r1, 0) already exists.` gives "response 'r1' (tenant
    default) is already in the database".
    """
    found = re.match(r"Key \((.*?)\)=\((.*?)\) already exists", detail or "")
    if found is None:
        return f"{detail or 'a record'} (already in the database)"
    key = dict(zip(found.group(1).split(", "), found.group(2).split(", "), strict=False))
    tenant = key.get("namespace") or "default"
    for column, what in (("conversation_id", "conversation"), ("response_id", "response")):
        if key.get(column):
            return f"{what} {key[column]!r} (tenant {tenant}) is already in the database"
    return f"{found.group(2)} is already in the database"


async def _import_namespace(conn: Conn, ns: str, root: Path, stats: TransferStats) -> None:
    logs = root / "logs"
    # The indexes are read before the response logs (the ordering rule, while a gateway writes
    # the source): every response an index read names was complete before it was named.
    conversations: list[tuple[str, str, int, float]] = []
    entries: list[tuple[str, str, int, str | None, str | None, float]] = []
    for path in _jsonl_files(logs / "conversations"):
        cid = path.name[: -len(".jsonl")]
        if not is_valid_conversation_id(cid):
            log.warning("skipping %s: not a conversation index", path)
            continue
        data = path.read_bytes()
        parse_index(data, path=str(path))  # validates every line
        end = data.rfind(b"\n") + 1
        if end < len(data):
            stats.torn_lines += 1
        lines = [line.strip().decode() for line in data[:end].split(b"\n") if line.strip()]
        if not lines:
            continue
        mtime = path.stat().st_mtime
        conversations.append((ns, cid, len(lines), mtime))
        for seq, line in enumerate(lines, start=1):
            is_marker = line.startswith("{")
            entries.append((ns, cid, seq, None if is_marker else line, line if is_marker else None, mtime))
        stats.conversations += 1
    responses: list[tuple[str, str, int, str, str]] = []
    for path in _jsonl_files(logs / "responses"):
        rid = path.name[: -len(".jsonl")]
        if not is_valid_response_id(rid):
            log.warning("skipping %s: not a response log", path)
            continue
        for seq, line in enumerate(_complete_lines(path, stats)):
            value = orjson.loads(line)
            kind = str(value.get("type") or "") if isinstance(value, dict) else ""
            responses.append((ns, rid, seq, kind, line))
        stats.responses += 1
    await conn.copy_records_to_table(
        "gateway_responses", records=responses, columns=["namespace", "response_id", "seq", "kind", "record"]
    )
    await conn.copy_records_to_table(
        "gateway_conversations",
        records=conversations,
        columns=["namespace", "conversation_id", "last_seq", "updated_at"],
    )
    await conn.copy_records_to_table(
        "gateway_index",
        records=entries,
        columns=["namespace", "conversation_id", "seq", "response_id", "marker", "at"],
    )
    side: list[tuple[str, str, str, str]] = []
    for kind in sorted(SIDE_LOGS):
        for path in _jsonl_files(logs / kind):
            key = path.name[: -len(".jsonl")]
            if not is_valid_side_key(key):
                log.warning("skipping %s: not a side log", path)
                continue
            side += [(ns, kind, key, line) for line in _complete_lines(path, stats)]
    await conn.copy_records_to_table(
        "gateway_side", records=side, columns=["namespace", "kind", "key", "record"]
    )
    stats.side_records += len(side)
    archive = root / "archive"
    files: list[tuple[str, str, str, str, float]] = []
    if archive.is_dir():
        for folder in sorted(p for p in archive.iterdir() if p.is_dir() and is_valid_conversation_id(p.name)):
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                content = path.read_bytes().decode()
                files.append(
                    (ns, folder.name, path.relative_to(folder).as_posix(), content, path.stat().st_mtime)
                )
    await conn.copy_records_to_table(
        "gateway_archive",
        records=files,
        columns=["namespace", "archive_id", "path", "content", "archived_at"],
    )
    stats.archived_files += len(files)
