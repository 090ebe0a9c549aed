"""Loading a conversation's newest part only.

The index, then the response logs a turn's window needs, newest first, back to a turn whose
request record says what came before it (`before`, `context/tail.py`). A turn on a conversation
of any length so reads a bounded number of files; what needs more (a resent or edited history,
`keep_first`, an older summary) loads it all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import cast

from gateway.context import ConversationView
from gateway.context.history import NotLoaded, Turn
from gateway.context.records import turn_from_records
from gateway.context.tail import checkpoint_of, resume
from gateway.store.base import IndexEntry, Store, Version
from gateway.types import JSONObject, Record, as_object

Skipped = Callable[[str, str, list[Record]], None]

# Responses read first (a turn stores two messages or more), then twice as many each time.
_FIRST_READ = 8


def apply_entries(
    view: ConversationView,
    cid: str,
    entries: Sequence[IndexEntry],
    skipped: Skipped,
    *,
    resumed: bool = False,
) -> None:
    """Apply index entries in order.

    `resumed`: the view stands at the first one's checkpoint, which was taken after that turn's
    `branch_at` cut.
    """
    for n, entry in enumerate(entries):
        if entry.marker is not None:
            view.apply_marker(entry.marker)
            continue
        turn = turn_from_records(entry.records)
        if turn is None:
            skipped(cid, str(entry.response_id), entry.records)
            view.entries += 1
            continue
        if resumed and n == 0:
            turn = dataclasses.replace(turn, branch_at=None)
        view.extend(turn)


async def tail_view(
    store: Store, cid: str, tail: int, through: str | None, skipped: Skipped
) -> tuple[Version, ConversationView] | None:
    """A view holding at least the newest `tail` history messages, and the version it is at.

    The view also holds the turn `through` when the conversation still holds it. None if there is
    no such conversation.
    """
    index = await store.read_entries(cid)
    if index.version is None:
        return None
    entries = index.entries
    markers = [i for i, e in enumerate(entries) if e.__class__ is not str]
    positions = (
        [i for i, e in enumerate(entries) if e.__class__ is str] if markers else list(range(len(entries)))
    )
    records: dict[int, list[Record]] = {}
    want = max(_FIRST_READ, tail // 2 + 2)
    if through is not None:  # back to the turn the summary covers through, at once
        found_at = [n for n, i in enumerate(positions) if entries[i] == through]
        want = max(want, len(positions) - found_at[-1] + 1) if found_at else want
    while True:
        unread = len(positions) - len(records)
        batch = positions[max(0, unread - want) : unread]
        if batch:
            found = await store.read_turns([str(entries[i]) for i in batch])
            records.update(zip(batch, found, strict=True))
        if len(records) == len(positions):  # all of it was read after all
            whole = ConversationView()
            apply_entries(whole, cid, _entries(entries, records, 0), skipped)
            return index.version, whole
        # The oldest turn read whose checkpoint can be trusted: it names its own position (a
        # copied or rewritten index, or turns written before checkpoints, are read whole).
        start = next((i for i in sorted(records) if _point(records[i], i)), None)
        view = (
            await _resumed(store, cid, entries, markers, records, start, skipped)
            if start is not None
            else None
        )
        enough = view is not None and (len(view.history) >= tail or not view.partial)
        if view is not None and enough and (through is None or through not in view.prefix_ids):
            return index.version, view
        want *= 2


def _entries(entries: list[str | Record], records: dict[int, list[Record]], start: int) -> list[IndexEntry]:
    return [
        IndexEntry(e, None, records[i]) if isinstance(e, str) else IndexEntry(None, e, [])
        for i, e in enumerate(entries[start:], start)
    ]


def _point(records: list[Record], position: int) -> JSONObject | None:
    point = checkpoint_of(records)
    return point if point is not None and point["entries"] == position else None


async def _resumed(
    store: Store,
    cid: str,
    entries: list[str | Record],
    markers: list[int],
    records: dict[int, list[Record]],
    start: int,
    skipped: Skipped,
) -> ConversationView | None:
    """The view from index entry `start` on (its turn's checkpoint on), or None.

    None when something after it needs what came before or what the checkpoint names is gone.
    """
    point = _point(records[start], start)
    if point is None:
        return None
    # The turns that set the system prompt and the recap in force; gone (deleted or damaged
    # since), or not holding them: the checkpoint no longer tells the truth.
    owners: list[Turn | None] = []
    for key, field in (("system_from", "system"), ("recap_from", "recap")):
        rid = point.get(key)
        owner = None
        if rid is not None:
            (found,) = await store.read_turns([rid]) if isinstance(rid, str) else ([],)
            owner = turn_from_records(found)
            if owner is None or getattr(owner, field) is None:
                return None
        owners.append(owner)
    before = [i for i in markers if i < start]
    reset = max((i for i in before if as_object(entries[i]).get("type") == "reset"), default=-1)
    ids = entries[reset + 1 : start]
    prefix = frozenset(cast(list[str], ids) if not before else (e for e in ids if isinstance(e, str)))
    view = resume(point, prefix, *owners)
    for i in before:  # the metadata in force comes from the index's markers
        marker = as_object(entries[i])
        metadata = marker.get("metadata")
        if marker.get("type") in ("conversation", "metadata") and isinstance(metadata, dict):
            view.metadata = {str(k): str(v) for k, v in metadata.items()}
    try:
        apply_entries(view, cid, _entries(entries, records, start), skipped, resumed=True)
    except NotLoaded:
        return None
    return view
