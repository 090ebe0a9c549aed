"""The JSONL store's response heads (`catalog/responses.jsonl`): a list of responses reads each
log's first record once, keeps up with the folder without opening the logs it knows, and treats
its file as derived data."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

import gateway.store.jsonl.heads as heads
from gateway.store.jsonl import JsonlStore
from tests.helpers import commit_turn


async def fresh(root: Path) -> JsonlStore:
    """Another process's store: no head in memory yet."""
    s = JsonlStore(root)
    await s.open()
    return s


async def chat(store: JsonlStore, limit: int = 100, after: str | None = None) -> list[str]:
    return (await store.list_responses(limit, api="chat", after=after))[0]


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[object]:
    """Count the calls of `heads.<name>` (os.listdir for `listdir`)."""
    calls: list[object] = []
    target, attr = (heads.os, "listdir") if name == "listdir" else (heads, name)
    real = getattr(target, attr)

    def counted(*args: object) -> object:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(target, attr, counted)
    return calls


def settle(folder: Path) -> None:
    """Make the folder's time old, as if nothing had been added to it for a while."""
    old = os.stat(folder).st_mtime_ns - 10 * 10**9
    os.utime(folder, ns=(old, old))


async def test_each_first_record_is_read_once_and_kept_for_the_next_process(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "var"
    rids = [await commit_turn(jstore, "conv", f"t{n}") for n in range(5)]
    reads = counting(monkeypatch, "read_head")
    assert await chat(jstore) == rids
    assert len(reads) == 5
    assert await chat(jstore, 2, after=rids[1]) == rids[2:4]
    assert len(reads) == 5  # known: not read again
    lines = (root / "catalog" / "responses.jsonl").read_bytes().splitlines()
    assert sorted(orjson.loads(line)["id"] for line in lines) == sorted(rids)
    other = await fresh(root)  # another process: the file, not the logs
    assert await chat(other) == rids
    assert len(reads) == 5
    newer = await commit_turn(other, "conv", "t5")
    assert await chat(jstore) == [*rids, newer]  # seen at once (the same clock tick included)
    assert len(reads) == 6
    await other.close()


async def test_a_settled_folder_is_not_listed_again_until_it_changes(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "var" / "logs" / "responses"
    first = await commit_turn(jstore, "conv", "one")
    settle(folder)
    listings = counting(monkeypatch, "listdir")
    assert await chat(jstore) == [first]
    assert await chat(jstore) == [first]
    assert len(listings) == 1  # the second page: one stat of the folder
    second = await commit_turn(jstore, "conv", "two")
    assert await chat(jstore) == [first, second]
    assert len(listings) == 2


async def test_the_file_is_derived_data(jstore: JsonlStore, tmp_path: Path) -> None:
    """Lost, torn, repeated or foreign lines, heads of logs since removed, or no file at all:
    a list is the same (what is missing is read from the logs again)."""
    root = tmp_path / "var"
    rids = [await commit_turn(jstore, f"c{n}", f"t{n}") for n in range(4)]
    assert await chat(jstore) == rids
    path = root / "catalog" / "responses.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(
        b"".join([lines[0], lines[0], b'{"id": "../x", "api": "chat"}\n', b"[]\n", lines[1][:9]])
    )
    other = await fresh(root)
    assert await chat(other) == rids
    newer = await commit_turn(other, "c4", "t4")  # its head goes on a line of its own
    assert await chat(other) == [*rids, newer]
    assert orjson.loads(path.read_bytes().splitlines()[-1])["id"] == newer
    rids.append(newer)
    assert await jstore.delete_conversation("c0")
    assert await chat(jstore) == rids[1:]
    assert await chat(other) == rids[1:]
    path.unlink()
    assert await chat(jstore) == rids[1:]
    await other.close()
    other = await fresh(root)
    assert await chat(other) == rids[1:]
    await other.close()


async def test_the_file_is_rewritten_once_most_of_it_names_removed_logs(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heads, "_COMPACT_FLOOR", 2)
    rids = [await commit_turn(jstore, f"c{n}", f"t{n}") for n in range(8)]
    assert await chat(jstore) == rids
    path = tmp_path / "var" / "catalog" / "responses.jsonl"
    assert len(path.read_bytes().splitlines()) == 8
    for n in range(6):
        assert await jstore.delete_conversation(f"c{n}")
    assert await chat(jstore) == rids[6:]
    assert sorted(orjson.loads(line)["id"] for line in path.read_bytes().splitlines()) == sorted(rids[6:])


def test_the_last_record_is_read_from_the_end_of_a_log(tmp_path: Path) -> None:
    log = tmp_path / "r.jsonl"
    request = b'{"type":"request","created":1}\n'
    for data, kind in [
        (request + b'{"type":"commit"}\n', "commit"),
        (request + b'{"type":"commit"}\n{"type":"deleted","at":2}\n', "deleted"),
        (request + b'{"type":"commit"}\n{"type":"del', None),  # torn
        (request + b'{"type":"response","message":"' + b"x" * 10_000 + b'"}\n', None),  # longer than read
        (b"", None),
    ]:
        log.write_bytes(data)
        assert heads.last_record_type(log) == kind, data[-40:]
    assert heads.last_record_type(tmp_path / "gone.jsonl") is None


def test_a_long_first_record_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "r.jsonl"
    request = {"type": "request", "created": 5.5, "model": "m", "input": [{"content": "x" * 100_000}]}
    log.write_bytes(orjson.dumps(request) + b"\n")
    assert heads.read_head(log) == heads.Head(5.5, "m", "chat")
    log.write_bytes(orjson.dumps(request))  # no end yet: a write under way
    assert heads.read_head(log) is None
    log.write_bytes(b'{"type":"context"}\n')
    assert heads.read_head(log) is None
