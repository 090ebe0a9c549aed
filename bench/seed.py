"""Pre-grow conversations by writing the gateway's JSONL store files directly.

A seeded conversation is its response logs (request, context, response, commit) and its index
(one response id per line), at the paths the store's own `DataDir` gives. They are written in
bulk rather than turn by turn through the store: 10,000 conversations take seconds this way,
where the store's journal and group commit would make each turn durable on its own.

The format is not re-typed here: the gateway itself first serves a short *template*
conversation (bench/run.py does this over HTTP), and every seeded turn is a copy of one of its
committed response logs, record for record and field for field (token counts, context
snapshot and whatever else the gateway writes), with fresh ids and timestamps. Seeded turn t
takes its request and reply from template turn t mod K and its context snapshot from template
turn min(t, K-1), i.e. the steady-state window once the template has filled it. Response ids
named anywhere in a copied record (e.g. the snapshot's included ids) are mapped to the seeded
turns they stand for, and each request's `before` checkpoint is made anew for its place in the
seeded conversation (by the gateway's own code). So a seeded conversation looks exactly like one
the gateway grew, and 10,000 messages take seconds instead of 5,000 round trips.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from gateway.context import ConversationView
from gateway.context.records import turn_from_records
from gateway.context.tail import checkpoint
from gateway.store.jsonl.layout import DataDir

Record = dict[str, Any]
_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
    "juniper", "kestrel", "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "river",
)  # fmt: skip


def user_text(i: int) -> str:
    word = _WORDS[i % len(_WORDS)]
    return f"Turn {i}: please remember that item number {i} is filed under '{word}', thanks."


def read_conversation(data_dir: Path, conversation_id: str) -> list[list[Record]]:
    """The committed response logs of a conversation, oldest first, as parsed records."""
    layout = DataDir(data_dir)
    turns: list[list[Record]] = []
    for line in layout.index_path(conversation_id).read_bytes().splitlines():
        line = line.strip()
        if not line or line.startswith(b"{"):  # markers (e.g. a reset) are not turns
            continue
        path = layout.response_path(line.decode())
        records = [orjson.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()]
        if not records or records[-1].get("type") != "commit":
            raise ValueError(f"template response {path} is not committed")
        turns.append(records)
    return turns


def _turn_shape(records: list[Record]) -> tuple[str, str, int]:
    request = next(r for r in records if r.get("type") == "request")
    inputs = request.get("input") or []
    return str(request["response_id"]), str(request["conversation_id"]), len(inputs) + 1


def _remap(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        return ids.get(value, value)
    if isinstance(value, list):
        return [_remap(v, ids) for v in value]
    if isinstance(value, dict):
        return {k: _remap(v, ids) for k, v in value.items()}
    return value


def clone_conversation(
    data_dir: Path, conversation_id: str, messages: int, template: list[list[Record]]
) -> list[str]:
    """Write a committed conversation of `messages` stored messages made of template turns."""
    layout = DataDir(data_dir)
    index = layout.index_path(conversation_id)
    if index.exists():
        raise FileExistsError(f"{index} already exists")
    new_ids = []
    for rid, out in cloned_turns(conversation_id, messages, template):
        layout.response_path(rid).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in out))
        new_ids.append(rid)
    # The index last: it must never name a response file that is not complete.
    index.write_bytes("".join(f"{rid}\n" for rid in new_ids).encode())
    return new_ids


def cloned_turns(
    conversation_id: str, messages: int, template: list[list[Record]]
) -> Iterator[tuple[str, list[Record]]]:
    """The committed turns (response id, records) of a conversation of `messages` stored
    messages made of template turns, oldest first (for any store to write)."""
    if not template:
        raise ValueError("empty template conversation")
    shapes = [_turn_shape(t) for t in template]
    if any(n != 2 for _, _, n in shapes):
        raise ValueError("template turns must be one user message and one reply each")
    if messages % 2:
        raise ValueError("a seeded conversation holds whole turns: an even number of messages")
    k = len(template)
    template_ids = [rid for rid, _, _ in shapes]
    template_cid = shapes[0][1]
    slug = template_ids[0].rsplit("-", 1)[0]
    turns = messages // 2
    new_ids = [f"{slug}-{secrets.token_hex(6)}" for _ in range(turns)]
    start = time.time() - 2.0 * turns
    view = ConversationView()
    for t in range(turns):
        src = t % k
        ctx_src = min(t, k - 1)
        # Ids of the request/reply source map to this turn; ids inside the context snapshot
        # map to the seeded turns at the same distance back from this one.
        offset = t - ctx_src
        ctx_ids = {template_ids[j]: new_ids[j + offset] for j in range(ctx_src + 1)}
        ctx_ids[template_cid] = conversation_id
        own_ids = {template_ids[src]: new_ids[t], template_cid: conversation_id}
        out: list[Record] = []
        for record in template[src]:
            kind = record.get("type")
            if kind == "context":
                ctx = next((r for r in template[ctx_src] if r.get("type") == "context"), record)
                # Top level only: ids sit in fields like included_response_ids, and walking the
                # sent messages of every snapshot would cost more than writing them.
                record = {
                    key: ctx_ids.get(v, v)
                    if isinstance(v, str)
                    else [ctx_ids.get(x, x) if isinstance(x, str) else x for x in v]
                    if isinstance(v, list)
                    else v
                    for key, v in ctx.items()
                }
                if isinstance(record.get("stored_messages"), int):
                    record["stored_messages"] = 2 * t
                if isinstance(record.get("stored_turns"), int):
                    record["stored_turns"] = t
            else:
                record = _remap(record, own_ids)
            if kind == "request" and isinstance(record.get("created"), int | float):
                record["created"] = start + 2.0 * t
            if kind == "commit" and isinstance(record.get("committed"), int | float):
                record["committed"] = start + 2.0 * t + 0.001
            out.append(record)
        # What the gateway notes in a turn's request about everything before it (its
        # checkpoint, which lets a load start there), made by the gateway's own code.
        request = next(r for r in out if r.get("type") == "request")
        if "before" in request:
            request["before"] = checkpoint(view)
        turn = turn_from_records(out)
        if turn is None:
            raise ValueError(f"seeded turn {t} is not a committed turn")
        view.extend(turn)
        yield new_ids[t], out


def write_created(layout: DataDir, start: float, total: int) -> None:
    """`total` conversations holding their creation marker alone, `created-0000000` on, one a
    second from `start` (the index's time is its creation's)."""
    for i in range(total):
        at = start + i
        path = layout.index_path(f"created-{i:07d}")
        marker = {"type": "conversation", "created_at": int(at), "metadata": {"n": str(i)}}
        path.write_bytes(orjson.dumps(marker) + b"\n")
        os.utime(path, (at, at))


async def insert_created(conn: Any, start: float, total: int) -> None:
    """The conversations of `write_created` in PostgreSQL (namespace ""), on an asyncpg `conn`."""
    await conn.execute(
        "INSERT INTO gateway_conversations (namespace, conversation_id, last_seq, updated_at) "
        "SELECT '', 'created-' || lpad(i::text, 7, '0'), 1, $1 + i FROM generate_series(0, $2 - 1) i",
        start,
        total,
    )
    await conn.execute(
        "INSERT INTO gateway_index (namespace, conversation_id, seq, marker, at) "
        "SELECT '', 'created-' || lpad(i::text, 7, '0'), 1, json_build_object('type', 'conversation', "
        "'created_at', ($1 + i)::bigint, 'metadata', json_build_object('n', i::text)), $1 + i "
        "FROM generate_series(0, $2 - 1) i",
        start,
        total,
    )


def probe_filesystem(folder: Path, files: int = 200, syncs: int = 50) -> dict[str, float]:
    """What the data dir's filesystem costs: p50 ms of creating a small file (open O_CREAT|O_EXCL,
    write, close, as the gateway's response log does), of fsync(file) + fsync(dir), and of one
    small append + fdatasync (the floor of a durable turn: what the journal does per batch).

    The probe's files stay in `folder` (the caller removes it with the rest of its temporary
    data, after the measurements): on ext4 without a journal, inodes deleted in the last 60 s
    (up to 6 min while their table block is dirty) are skipped one by one on every later file
    creation in the same block group, so deleting them here would slow the rows that follow."""
    folder.mkdir(parents=True, exist_ok=True)
    creates: list[float] = []
    fsyncs: list[float] = []
    for i in range(files):
        t = time.perf_counter()
        fd = os.open(folder / f"probe-{i}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            os.write(fd, b"x" * 400 + b"\n")
            creates.append(time.perf_counter() - t)
            if i < syncs:
                t = time.perf_counter()
                os.fsync(fd)
                dfd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                fsyncs.append(time.perf_counter() - t)
        finally:
            os.close(fd)
    # The floor of a durable turn: one small append to one file, then fdatasync.
    appends: list[float] = []
    fd = os.open(folder / "floor.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for _ in range(syncs * 2):
            t = time.perf_counter()
            os.write(fd, b"x" * 600 + b"\n")
            os.fdatasync(fd)
            appends.append(time.perf_counter() - t)
    finally:
        os.close(fd)
    creates.sort()
    fsyncs.sort()
    appends.sort()
    return {
        "append_fdatasync_p50_ms": round(appends[len(appends) // 2] * 1000, 3),
        "create_write_p50_ms": round(creates[len(creates) // 2] * 1000, 3),
        "fsync_file_and_dir_p50_ms": round(fsyncs[len(fsyncs) // 2] * 1000, 3),
    }
