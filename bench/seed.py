"""Pre-grow a conversation by writing the gateway's JSONL store files directly.

The files match, record for record, what the gateway writes for a committed non-streaming
turn (see gateway/store/jsonl.py and gateway/store/records.py):

    {data_dir}/logs/responses/{response_id}.jsonl      request, context, response, commit
    {data_dir}/logs/conversations/{conversation_id}.jsonl  one bare response id per line

Each turn is one user message and one assistant reply, so N stored messages = N/2 turns.
Seeding 10,000 messages this way takes well under a second instead of 5,000 HTTP round trips.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import orjson

_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
    "juniper", "kestrel", "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "river",
)  # fmt: skip


def model_slug(model: str) -> str:
    """As gateway.ids.model_slug: every character outside [A-Za-z0-9._-] becomes '-'."""
    return re.sub(r"^\.+", lambda m: "-" * len(m.group()), _SLUG_UNSAFE.sub("-", model)[:80]) or "model"


def user_text(i: int) -> str:
    word = _WORDS[i % len(_WORDS)]
    return f"Turn {i}: please remember that item number {i} is filed under '{word}', thanks."


def assistant_text(i: int) -> str:
    word = _WORDS[(i * 7) % len(_WORDS)]
    return (
        f"Noted: item {i} is filed under '{word}'. I will keep that in mind for the rest of this "
        f"conversation and can recall it whenever you ask about item {i} again, together with "
        f"everything else you told me earlier."
    )


def _turn_records(
    response_id: str, conversation_id: str, i: int, created: float, model: str, provider: str
) -> list[dict[str, Any]]:
    user = {"role": "user", "content": user_text(i)}
    reply = {"role": "assistant", "content": assistant_text(i)}
    prompt_tokens = 8 * (2 * i + 1)
    return [
        {
            "type": "request",
            "response_id": response_id,
            "conversation_id": conversation_id,
            "created": created,
            "model": model,
            "provider": provider,
            "upstream_model": model,
            "stream": False,
            "params": {},
            "system": None,
            "input": [user],
        },
        {
            "type": "context",
            "stored_messages": 2 * i,
            "stored_turns": i,
            "new_messages": 1,
            "sent_messages": 2 * i + 1,
            "system_messages": 0,
        },
        {
            "type": "response",
            "message": reply,
            "finish_reason": "stop",
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 40, "total_tokens": prompt_tokens + 40},
            "timings": {"upstream_ms": 0.5, "total_ms": 1.5},
        },
        {"type": "commit", "status": "complete", "committed": created + 0.001},
    ]


def grow_conversation(
    data_dir: Path, conversation_id: str, messages: int, *, model: str, provider: str
) -> list[str]:
    """Write a committed conversation of `messages` stored messages; return its response ids."""
    if messages % 2:
        raise ValueError("a seeded conversation holds whole turns: an even number of messages")
    responses = data_dir / "logs" / "responses"
    conversations = data_dir / "logs" / "conversations"
    responses.mkdir(parents=True, exist_ok=True)
    conversations.mkdir(parents=True, exist_ok=True)
    index = conversations / f"{conversation_id}.jsonl"
    if index.exists():
        raise FileExistsError(f"{index} already exists")
    slug = model_slug(model)
    turns = messages // 2
    start = time.time() - 2.0 * turns
    ids: list[str] = []
    for i in range(turns):
        response_id = f"{slug}-{secrets.token_hex(6)}"
        records = _turn_records(response_id, conversation_id, i, start + 2.0 * i, model, provider)
        (responses / f"{response_id}.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
        ids.append(response_id)
    # The index last: it must never name a response file that is not complete.
    index.write_bytes("".join(f"{rid}\n" for rid in ids).encode())
    return ids


def probe_filesystem(folder: Path, files: int = 200, syncs: int = 50) -> dict[str, float]:
    """What the data dir's filesystem costs: p50 ms of creating a small file (open O_CREAT|O_EXCL,
    write, close, as the gateway's response log does) and of fsync(file) + fsync(dir)."""
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
    for i in range(files):
        (folder / f"probe-{i}.jsonl").unlink()
    folder.rmdir()
    creates.sort()
    fsyncs.sort()
    return {
        "create_write_p50_ms": round(creates[len(creates) // 2] * 1000, 3),
        "fsync_file_and_dir_p50_ms": round(fsyncs[len(fsyncs) // 2] * 1000, 3),
    }
