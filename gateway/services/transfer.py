"""Moving conversations between backends (`gateway export` / `gateway import`).

The JSONL layout is the interchange format. PostgreSQL goes through `gateway.store.transfer`; a
JSONL data dir is copied file by file: its indexes read first and written last (the ordering rule).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path
from typing import NoReturn

from gateway.config import Settings
from gateway.exceptions import GatewayError
from gateway.store.jsonl.catalog import forget_catalogs


def _data_files(root: Path) -> list[Path]:
    """Every data file of a JSONL data dir, relative to it, tenants included.

    Lock files and the write-ahead journals of a running gateway are not: recovery state, its
    turns already in files.
    """
    tenants = root / "tenants"
    bases = [root, *sorted(p for p in tenants.iterdir() if p.is_dir())] if tenants.is_dir() else [root]
    found: list[Path] = []
    for base in bases:
        for folder in (base / "logs", base / "archive"):
            if folder.is_dir():
                for p in sorted(folder.rglob("*")):
                    if "journal" in p.relative_to(folder).parts[:1]:
                        continue
                    if p.is_file():
                        found.append(p.relative_to(root))
                    elif p.name.endswith(".jsonl"):  # (a folder, a FIFO: left out, it lost data)
                        raise GatewayError(f"{p} is not a file (gateway fsck names it); nothing was copied")
    return found


def _is_index(rel: Path) -> bool:
    return "conversations" in rel.parts


def _write(data: bytes, path: Path) -> None:
    path.write_bytes(data)


def _copy_data(source: Path, target: Path) -> int:
    """Copy a JSONL data dir's files, refusing to overwrite any.

    The indexes are read first and written last, the files they name in between (the ordering
    rule holds in the copy while a gateway writes the source): every response an index read names
    was complete before it was named. What was written after those reads comes along unnamed
    (responses no index claims, as a turn in flight leaves) or not at all (the indexes of
    conversations begun since). Each file goes through a temporary name, so a running gateway
    never sees a half-copied one.
    """
    files = _data_files(source)
    clashes = [f for f in files if (target / f).exists()]
    if clashes:
        raise GatewayError(
            f"{len(clashes)} files already exist in {target} (e.g. {clashes[0]}); nothing was copied"
        )
    indexes: dict[Path, bytes] = {}
    for rel in filter(_is_index, files):
        try:
            indexes[rel] = (source / rel).read_bytes()
        except FileNotFoundError:
            continue  # (deleted since it was listed)
        except OSError as exc:
            raise GatewayError(
                f"could not read {source / rel} ({exc.strerror or exc}); nothing was copied"
            ) from None
    rest = [f for f in _data_files(source) if not _is_index(f)]  # (listed after the indexes were read)
    rest.sort(key=lambda rel: 0 if "responses" in rel.parts else 1)
    written = 0

    def put(rel: Path, data: bytes, *, times: bool = True) -> None:
        dest = target / rel
        try:
            if dest.exists():
                raise FileExistsError(errno.EEXIST, "it exists now")
            dest.parent.mkdir(parents=True, exist_ok=True)
            temp = dest.with_name(f".{dest.name}.importing")
            _write(data, temp)
            if times:  # (as the copy it was: a response file's times are its own)
                shutil.copystat(source / rel, temp)
            os.replace(temp, dest)
        except OSError as exc:
            failed(f"write {dest}", exc)

    def failed(what: str, exc: OSError) -> NoReturn:
        raise GatewayError(
            f"could not {what} ({exc.strerror or exc}): {written} of {len(rest) + len(indexes)} "
            f"files copied into {target} (responses first, the conversations' indexes last)"
        ) from None

    for rel in rest:
        try:
            data = (source / rel).read_bytes()  # (read apart from the write: a failure says which)
        except FileNotFoundError:
            continue  # (deleted since it was listed: a file a turn no longer needs)
        except OSError as exc:
            failed(f"read {source / rel}", exc)
        put(rel, data)
        written += 1
    for rel, data in indexes.items():
        put(rel, data, times=False)
        written += 1
    return written


def export_data(settings: Settings, target: Path) -> str:
    """Write every conversation of the configured backend (all tenants) to `target` in the JSONL layout.

    Returns what was written, in words.
    """
    if target.exists() and _data_files(target):
        raise GatewayError(f"{target} already holds gateway data; export into an empty or new folder")
    if target.is_dir() and any(target.iterdir()):
        raise GatewayError(f"{target} is not empty; export into an empty or new folder")
    if target.exists() and not target.is_dir():
        raise GatewayError(f"{target} is a file; export into an empty or new folder")
    backend = settings.storage.backend
    if backend == "postgres":
        from gateway.store.transfer import export_jsonl

        if not settings.storage.dsn:
            raise GatewayError('storage.dsn: required when storage.backend = "postgres"')
        stats = asyncio.run(export_jsonl(settings.storage.dsn, target))
        return f"exported {stats.describe()} to {target}"
    if backend == "jsonl":
        source = Path(settings.storage.data_dir)
        if not source.is_dir() or not _data_files(source):
            raise GatewayError(
                f"{source} holds no gateway data (no logs/ or archive/ folder): nothing to export"
            )
        count = _copy_data(source, target)
        return f"exported {count} files from {settings.storage.data_dir} to {target}"
    raise GatewayError(f"cannot export from storage.backend = {backend!r}")


def import_data(settings: Settings, source: Path) -> str:
    """Conversations from `source` (the JSONL layout) loaded into the configured backend."""
    if not source.is_dir() or not _data_files(source):
        raise GatewayError(f"{source} holds no gateway data (no logs/ or archive/ folder)")
    backend = settings.storage.backend
    if backend == "postgres":
        from gateway.store.transfer import import_jsonl

        stats = asyncio.run(import_jsonl(settings.storage.dsn, source))
        return f"imported {stats.describe()} from {source}"
    if backend == "jsonl":
        count = _copy_data(source, Path(settings.storage.data_dir))
        forget_catalogs(Path(settings.storage.data_dir))
        return f"imported {count} files from {source} into {settings.storage.data_dir}"
    raise GatewayError(f"cannot import into storage.backend = {backend!r}")
