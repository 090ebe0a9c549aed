"""Deleting (or archiving) a conversation, tombstoning a response, branching one at an earlier response.

A fork (`{source[:100]}.fork-{hex}`) shares its prefix's response files with its source instead
of copying them, so deletion keeps the files another conversation of the family still names
(found in the catalog, not by scanning the folder).
"""

from __future__ import annotations

import asyncio
import os
import shutil

import orjson

from gateway.exceptions import CorruptRecord, InvalidRequest, NotFound, StorageError
from gateway.store.base import now
from gateway.store.jsonl import recovery
from gateway.store.jsonl.catalog import Catalog
from gateway.store.jsonl.durability import Durability
from gateway.store.jsonl.files import append_file, fsync_dir, parse_index, write_all
from gateway.store.jsonl.layout import DataDir


async def delete_conversation(
    data_dir: DataDir, durability: Durability, catalog: Catalog, conversation_id: str, *, archive: bool
) -> bool:
    """Delete a conversation, or move it to `archive/`; False if there is none."""
    try:
        return await asyncio.to_thread(
            remove_conversation, data_dir, durability, catalog, conversation_id, archive
        )
    except OSError as exc:
        raise StorageError(f"could not delete the conversation: {exc.strerror or exc}") from exc


def remove_conversation(
    data_dir: DataDir, durability: Durability, catalog: Catalog, conversation_id: str, archive: bool
) -> bool:
    """Remove a conversation's files; False if it has no index.

    The index goes first (from then on the conversation is gone), then its side logs and the
    response files no other conversation of its fork family names."""
    durability.refuse_if_failed()
    index = data_dir.index_path(conversation_id)
    try:
        data = index.read_bytes()
    except FileNotFoundError:
        return False
    entries, _ = parse_index(data, path=data_dir.shown(index))
    if durability.fsync:
        recovery.forget(data_dir, durability, conversation_id)
    shared = named_by_relatives(data_dir, catalog, conversation_id)
    ids = [e for e in entries if isinstance(e, str)]
    if archive:
        move_to_archive(data_dir, conversation_id, ids, shared)
    else:
        delete_files(data_dir, conversation_id, [rid for rid in ids if rid not in shared])
    if durability.fsync:
        durability.sync(fsync_dir, data_dir.conversations_dir)
    catalog.removed(conversation_id)
    return True


def move_to_archive(data_dir: DataDir, conversation_id: str, ids: list[str], shared: set[str]) -> None:
    """Move a conversation's files to `archive/{id}-{ms}/`.

    The response files in `shared` (a fork still names them) are copied instead."""
    folder = data_dir.archive_dir / f"{conversation_id}-{int(now() * 1000)}"
    (folder / "responses").mkdir(parents=True, exist_ok=True)
    # The index goes first (one rename): from then on the conversation is gone.
    os.replace(data_dir.index_path(conversation_id), folder / "conversation.jsonl")
    for kind in ("summaries", "lifecycle"):
        side = data_dir.side_path(kind, conversation_id)
        if side.exists():
            os.replace(side, folder / f"{kind}.jsonl")
    for rid in (rid for rid in ids if rid not in shared):  # metadata set on a stored chat completion
        metadata = data_dir.side_path("metadata", rid)
        if metadata.exists():
            (folder / "metadata").mkdir(exist_ok=True)
            os.replace(metadata, folder / "metadata" / f"{rid}.jsonl")
    for rid in ids:
        target = folder / "responses" / f"{rid}.jsonl"
        try:
            if rid in shared:
                shutil.copyfile(data_dir.response_path(rid), target)
            else:
                os.replace(data_dir.response_path(rid), target)
        except FileNotFoundError:
            pass


def delete_files(data_dir: DataDir, conversation_id: str, owned: list[str]) -> None:
    """Remove a conversation's index, side logs, and `owned` response files with their metadata."""
    os.unlink(data_dir.index_path(conversation_id))
    sides = [data_dir.side_path(kind, conversation_id) for kind in ("summaries", "lifecycle")]
    responses = [data_dir.response_path(rid) for rid in owned]
    metadatas = [data_dir.side_path("metadata", rid) for rid in owned]
    for path in [*sides, *responses, *metadatas]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def named_by_relatives(data_dir: DataDir, catalog: Catalog, conversation_id: str) -> set[str]:
    """Response ids that other conversations of the same fork family name.

    A fork (`{source[:100]}.fork-{hex}`, made by the Responses API) shares its prefix's response
    files with its source and its siblings instead of copying them. The family comes from the
    catalog (no scan of the conversations folder).
    """
    catalog.refresh()
    named: set[str] = set()
    for other in catalog.family(conversation_id):
        try:
            listed, _ = parse_index(data_dir.index_path(other).read_bytes())
        except (FileNotFoundError, CorruptRecord):
            continue
        named.update(e for e in listed if isinstance(e, str))
    return named


def sharing(data_dir: DataDir, catalog: Catalog, conversation_id: str, response_id: str) -> list[str]:
    """The other conversations of the fork family whose index names `response_id`."""
    catalog.refresh()
    found = []
    for other in sorted(catalog.family(conversation_id)):
        try:
            listed, _ = parse_index(data_dir.index_path(other).read_bytes())
        except (FileNotFoundError, CorruptRecord):
            continue
        if response_id in listed:
            found.append(other)
    return found


async def fork(
    data_dir: DataDir, durability: Durability, catalog: Catalog, source: str, target: str, through: str
) -> None:
    """Begin conversation `target` with `source`'s index up to response `through`.

    The response files are shared, not copied."""
    src, dst = data_dir.index_path(source), data_dir.index_path(target)

    def copy_prefix() -> None:
        data = src.read_bytes()
        end = data.find(through.encode() + b"\n")
        if end < 0 or (end > 0 and data[end - 1 : end] != b"\n"):
            raise NotFound(
                f"No response {through!r} in conversation {source!r}", param="previous_response_id"
            )
        prefix = data[: end + len(through) + 1]
        sync = durability.append_sync()
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, prefix)
            if sync is not None:
                sync(fd)
        finally:
            os.close(fd)
        if durability.fsync:
            durability.sync(fsync_dir, data_dir.conversations_dir)
        catalog.changed(target, now())

    try:
        await asyncio.to_thread(copy_prefix)
    except FileNotFoundError:
        raise NotFound(f"No conversation {source!r}", param="previous_response_id") from None
    except FileExistsError:
        raise InvalidRequest(f"Conversation {target!r} already exists") from None
    except OSError as exc:
        raise StorageError(f"could not branch the conversation: {exc.strerror or exc}") from exc


async def tombstone(data_dir: DataDir, durability: Durability, response_id: str) -> None:
    """Mark a response deleted: a final `deleted` record appended to its file."""
    path = data_dir.response_path(response_id)
    line = orjson.dumps({"type": "deleted", "at": now()}) + b"\n"
    try:
        await asyncio.to_thread(lambda: append_file(path, line, sync=durability.append_sync(), create=False))
    except FileNotFoundError:
        raise NotFound(f"No response {response_id!r}", param="response_id") from None
    except OSError as exc:
        raise StorageError(f"could not delete the response: {exc.strerror or exc}") from exc
