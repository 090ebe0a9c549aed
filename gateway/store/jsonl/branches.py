"""Deleting (or archiving) a conversation, tombstoning a response, and branching a conversation
at an earlier response. A fork (`{source[:100]}.fork-{hex}`) shares its prefix's response files
with its source instead of copying them, so deletion keeps the files another conversation of the
family still names (found in the catalog, not by scanning the folder)."""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import TYPE_CHECKING

import orjson

from gateway.exceptions import CorruptRecord, InvalidRequest, NotFound, StorageError
from gateway.store.base import now
from gateway.store.jsonl import recovery
from gateway.store.jsonl.files import append_file, fsync_dir, parse_index, write_all

if TYPE_CHECKING:
    from gateway.store.jsonl.store import JsonlStore


async def delete_conversation(store: JsonlStore, conversation_id: str, *, archive: bool = False) -> bool:
    index = store.index_path(conversation_id)
    summaries = store.summary_path(conversation_id)
    for kind in ("summaries", "lifecycle"):
        store._side.pop((kind, conversation_id), None)
    lifecycle = store.side_path("lifecycle", conversation_id)

    def remove() -> bool:
        store.refuse_if_failed()
        try:
            data = index.read_bytes()
        except FileNotFoundError:
            return False
        entries, _ = parse_index(data, path=store.shown(index))
        if store.fsync:
            recovery.forget(store, conversation_id)
        shared = named_by_relatives(store, conversation_id)
        ids = [e for e in entries if isinstance(e, str)]
        owned = [rid for rid in ids if rid not in shared]
        if archive:
            folder = store.archive_dir / f"{conversation_id}-{int(now() * 1000)}"
            (folder / "responses").mkdir(parents=True, exist_ok=True)
            # The index goes first (one rename): from then on the conversation is gone.
            os.replace(index, folder / "conversation.jsonl")
            if summaries.exists():
                os.replace(summaries, folder / "summaries.jsonl")
            if lifecycle.exists():
                os.replace(lifecycle, folder / "lifecycle.jsonl")
            for rid in owned:  # metadata set on a stored chat completion
                metadata = store.side_path("metadata", rid)
                if metadata.exists():
                    (folder / "metadata").mkdir(exist_ok=True)
                    os.replace(metadata, folder / "metadata" / f"{rid}.jsonl")
            for rid in ids:
                try:
                    if rid in shared:  # still a fork's: the archive gets a copy
                        shutil.copyfile(store.response_path(rid), folder / "responses" / f"{rid}.jsonl")
                    else:
                        os.replace(store.response_path(rid), folder / "responses" / f"{rid}.jsonl")
                except FileNotFoundError:
                    pass
        else:
            os.unlink(index)
            metadatas = [store.side_path("metadata", rid) for rid in owned]
            for path in [summaries, lifecycle, *(store.response_path(rid) for rid in owned), *metadatas]:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if store.fsync:
            store._sync(fsync_dir, store.conversations_dir)
        store.catalog.removed(conversation_id)
        return True

    try:
        return await asyncio.to_thread(remove)
    except OSError as exc:
        raise StorageError(f"could not delete the conversation: {exc.strerror or exc}") from exc


def named_by_relatives(store: JsonlStore, conversation_id: str) -> set[str]:
    """Response ids that other conversations of the same fork family name. A fork
    (`{source[:100]}.fork-{hex}`, made by the Responses API) shares its prefix's response
    files with its source and its siblings instead of copying them. The family comes from the
    catalog (no scan of the conversations folder)."""
    store.catalog.refresh()
    named: set[str] = set()
    for other in store.catalog.family(conversation_id):
        try:
            listed, _ = parse_index(store.index_path(other).read_bytes())
        except (FileNotFoundError, CorruptRecord):
            continue
        named.update(e for e in listed if isinstance(e, str))
    return named


def sharing(store: JsonlStore, conversation_id: str, response_id: str) -> list[str]:
    """The other conversations of the fork family whose index names `response_id`."""
    store.catalog.refresh()
    found = []
    for other in sorted(store.catalog.family(conversation_id)):
        try:
            listed, _ = parse_index(store.index_path(other).read_bytes())
        except (FileNotFoundError, CorruptRecord):
            continue
        if response_id in listed:
            found.append(other)
    return found


async def fork(store: JsonlStore, source: str, target: str, through: str) -> None:
    src, dst = store.index_path(source), store.index_path(target)

    def copy_prefix() -> None:
        data = src.read_bytes()
        end = data.find(through.encode() + b"\n")
        if end < 0 or (end > 0 and data[end - 1 : end] != b"\n"):
            raise NotFound(
                f"No response {through!r} in conversation {source!r}", param="previous_response_id"
            )
        prefix = data[: end + len(through) + 1]
        sync = store._appender()
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, prefix)
            if sync is not None:
                sync(fd)
        finally:
            os.close(fd)
        if store.fsync:
            store._sync(fsync_dir, store.conversations_dir)
        store.catalog.changed(target, now())

    try:
        await asyncio.to_thread(copy_prefix)
    except FileNotFoundError:
        raise NotFound(f"No conversation {source!r}", param="previous_response_id") from None
    except FileExistsError:
        raise InvalidRequest(f"Conversation {target!r} already exists") from None
    except OSError as exc:
        raise StorageError(f"could not branch the conversation: {exc.strerror or exc}") from exc


async def tombstone(store: JsonlStore, response_id: str) -> None:
    """Mark a response deleted: a final `deleted` record appended to its file."""
    path = store.response_path(response_id)
    line = orjson.dumps({"type": "deleted", "at": now()}) + b"\n"
    try:
        await asyncio.to_thread(lambda: append_file(path, line, sync=store._appender(), create=False))
    except FileNotFoundError:
        raise NotFound(f"No response {response_id!r}", param="response_id") from None
    except OSError as exc:
        raise StorageError(f"could not delete the response: {exc.strerror or exc}") from exc
