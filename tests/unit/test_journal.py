"""The JSONL store's write-ahead journal: commits waiting together share one fdatasync, and a
restart replays what a crash lost after the acknowledgement (a power cut: the response file and
the index line are written without a sync of their own) and nothing else.

A crash is simulated by copying the data dir while the store still runs (its journal not yet
emptied), then taking away what a power cut could take from the copy."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.exceptions import NotFound, StorageError
from gateway.ids import mint_response_id
from gateway.store.jsonl import JsonlStore, recovery
from gateway.store.jsonl import aio as aio_module
from gateway.store.jsonl import journal as journal_module
from tests.helpers import commit_turn, failing_syncs_of, reply, request_record, user
from tests.views import load


@pytest.fixture
async def jstore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[JsonlStore]:
    monkeypatch.setattr(journal_module, "ROTATE_SECONDS", 3600.0)  # the journal is kept until close
    s = JsonlStore(tmp_path / "var")
    await s.open()
    yield s
    await s.close()


def crash_image(store: JsonlStore, tmp_path: Path) -> Path:
    """The data dir as a machine crash would leave it if every write since the last sync were
    kept (the page cache is part of the copy); the tests then take away what was not synced."""
    image = tmp_path / "image"
    shutil.copytree(store.root, image)
    return image


def journals(root: Path) -> list[Path]:
    return sorted((root / "logs" / "journal").glob("*.wal"))


async def index_after_restart(image: Path, cid: str = "conv") -> list[Any]:
    """The index of `cid` as a store started on `image` holds it (its recovery included)."""
    restarted = JsonlStore(image)
    await restarted.open()
    try:
        return await restarted.read_index(cid)
    finally:
        await restarted.close()


async def test_writes_lost_after_the_acknowledgement_are_replayed(jstore: JsonlStore, tmp_path: Path) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    r2 = await commit_turn(jstore, "conv", "two")
    r3 = await commit_turn(jstore, None, "stateless")
    files = {rid: jstore.data_dir.response_path(rid).read_bytes() for rid in (r1, r2, r3)}
    image = crash_image(jstore, tmp_path)
    assert journals(image)
    # The power cut took the index, one whole response file and the end of another.
    (image / "logs" / "conversations" / "conv.jsonl").unlink()
    (image / "logs" / "responses" / f"{r2}.jsonl").unlink()
    cut = image / "logs" / "responses" / f"{r1}.jsonl"
    cut.write_bytes(files[r1][: len(files[r1]) // 2])
    (image / "logs" / "responses" / f"{r3}.jsonl").write_bytes(b"\0" * 10)

    restarted = JsonlStore(image)
    await restarted.open()
    assert await restarted.read_index("conv") == [r1, r2]
    for rid, data in files.items():
        assert (image / "logs" / "responses" / f"{rid}.jsonl").read_bytes() == data
    assert (await load(restarted, "conv")).response_ids == [r1, r2]
    assert journals(image) == []  # replayed, synced, removed
    await restarted.close()


async def test_a_lost_index_tail_is_refilled_in_commit_order(jstore: JsonlStore, tmp_path: Path) -> None:
    rids = [await commit_turn(jstore, "conv", f"turn {i}") for i in range(4)]
    image = crash_image(jstore, tmp_path)
    index = image / "logs" / "conversations" / "conv.jsonl"
    keep = len(rids[0]) + 1
    index.write_bytes(index.read_bytes()[:keep] + b"\0" * 7)  # a lost page reads as zeros
    assert await index_after_restart(image) == rids


async def test_a_clean_crash_replays_nothing_and_removes_the_journal(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    image = crash_image(jstore, tmp_path)
    before = {p: p.read_bytes() for p in (image / "logs").rglob("*.jsonl")}
    restarted = JsonlStore(image)
    parts = (restarted.data_dir, restarted.durability, restarted.lock_folder)
    assert await asyncio.to_thread(recovery.recover, *parts) == 0
    assert {p: p.read_bytes() for p in (image / "logs").rglob("*.jsonl")} == before
    assert journals(image) == []
    await restarted.open()
    assert await restarted.read_index("conv") == [r1]
    await restarted.close()


async def test_a_conversation_that_went_on_without_a_commit_keeps_its_index(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    """A commit in the journal whose index line never made it, while the conversation went on
    in another process: it was never acknowledged, and is not slipped in after the others."""
    await commit_turn(jstore, "conv", "one")
    other = await commit_turn(jstore, "elsewhere", "other")
    image = crash_image(jstore, tmp_path)
    index = image / "logs" / "conversations" / "conv.jsonl"
    index.write_bytes(f"{other}\n".encode())  # where "one" was to go, another turn now stands
    assert await index_after_restart(image) == [other]


@pytest.mark.parametrize("archive", [False, True])
async def test_a_deleted_conversation_is_not_brought_back(
    jstore: JsonlStore, tmp_path: Path, archive: bool
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    async with jstore.lock("conv", 5):
        assert await jstore.delete_conversation("conv", archive=archive)
    kept = await commit_turn(jstore, "conv", "after")  # the id used again after the deletion
    image = crash_image(jstore, tmp_path)
    (image / "logs" / "conversations" / "conv.jsonl").unlink()
    assert await index_after_restart(image) == [kept]
    assert not (image / "logs" / "responses" / f"{r1}.jsonl").exists()


async def test_a_commit_the_client_was_told_failed_is_not_replayed(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    real_open = os.open

    def index_full(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_APPEND and Path(path).parent == jstore.data_dir.conversations_dir:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", index_full)
    with pytest.raises(StorageError):
        await commit_turn(jstore, "conv", "two")  # in the journal, then the index append failed
    monkeypatch.undo()
    image = crash_image(jstore, tmp_path)
    assert await index_after_restart(image) == [r1]


async def test_a_torn_journal_tail_is_ignored(jstore: JsonlStore, tmp_path: Path) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    image = crash_image(jstore, tmp_path)
    (image / "logs" / "conversations" / "conv.jsonl").unlink()
    path = journals(image)[0]
    end = path.read_bytes().index(b"\0")  # the journal is written from its start, then zeros
    with open(path, "r+b") as f:  # a crash during the next append, before its sync
        f.seek(end)
        f.write(b'{"response_id":"resp_x","conversation_id":"conv","before":37,"at":1,"size":900}\n{"ty')
    assert await index_after_restart(image) == [r1]


async def test_an_entry_torn_over_the_zeros_is_ignored(jstore: JsonlStore, tmp_path: Path) -> None:
    """The file is longer than its entries (zeros), so a torn entry's size alone cannot tell
    it: its content's crc does. A power cut kept its header and part of its content."""
    r1 = await commit_turn(jstore, "conv", "one")
    r2 = await commit_turn(jstore, "conv", "two")
    image = crash_image(jstore, tmp_path)
    path = journals(image)[0]
    data = bytearray(path.read_bytes())
    second = data.index(b'{"response_id":"' + r2.encode())
    content = data.index(b"\n", second) + 1
    data[content + 40 : content + 200] = bytes(160)  # those pages never reached the disk
    path.write_bytes(bytes(data))
    (image / "logs" / "responses" / f"{r2}.jsonl").unlink()
    (image / "logs" / "conversations" / "conv.jsonl").write_text(r1 + "\n")
    assert await index_after_restart(image) == [r1]
    assert not (image / "logs" / "responses" / f"{r2}.jsonl").exists()


async def test_a_journal_written_before_crcs_and_zeros_is_replayed(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    """A process of an earlier version appended entries without a crc to a journal that ends
    with its last entry (no zeros); a start of this version replays them."""
    r1 = await commit_turn(jstore, "conv", "one")
    r2 = await commit_turn(jstore, "conv", "two")
    image = crash_image(jstore, tmp_path)
    path = journals(image)[0]
    data = path.read_bytes()
    entries, _ = recovery.parse_journal(data)
    old = b"".join(
        orjson.dumps(
            {
                "response_id": e.response_id,
                "conversation_id": e.conversation_id,
                "before": e.before,
                "at": e.at,
                "size": len(e.content),
            }
        )
        + b"\n"
        + e.content
        for e in entries
    )
    path.write_bytes(old)
    (image / "logs" / "conversations" / "conv.jsonl").unlink()
    (image / "logs" / "responses" / f"{r2}.jsonl").unlink()
    assert await index_after_restart(image) == [r1, r2]
    assert (image / "logs" / "responses" / f"{r2}.jsonl").read_bytes() == entries[1].content


async def test_an_entry_naming_no_valid_response_is_not_replayed(jstore: JsonlStore, tmp_path: Path) -> None:
    """A damaged journal must not stop the next start: an entry whose response id is not one
    the gateway mints (and so names no file it may write) ends the replay there."""
    r1 = await commit_turn(jstore, "conv", "one")
    image = crash_image(jstore, tmp_path)
    path = journals(image)[0]
    data = path.read_bytes()
    end = data.index(b"\0")
    content = b'{"type":"request"}\n'
    bad = journal_module.entry("../../escape", "conv", 37, content)
    path.write_bytes(data[:end] + bad + data[end + len(bad) :])
    assert await index_after_restart(image) == [r1]
    assert not (image / "escape.jsonl").exists()


async def test_an_emptied_journal_is_zeros_of_the_same_size(
    jstore: JsonlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Emptying overwrites with zeros and keeps the file's blocks (a sync then writes no size
    or block map); nothing in it is replayed again."""
    await commit_turn(jstore, "conv", "one")
    journal = jstore.journal.current
    assert journal is not None
    size = os.fstat(journal.fd).st_size
    assert size >= journal_module.PREALLOCATE and journal.size > 0
    jstore.journal._empty(journal)
    assert journal.size == 0 and os.pread(journal.fd, size, 0) == bytes(size)
    assert os.fstat(journal.fd).st_size == size


async def test_a_live_process_journal_is_left_alone(jstore: JsonlStore, tmp_path: Path) -> None:
    await commit_turn(jstore, "conv", "one")
    held = journals(jstore.root)
    second = JsonlStore(jstore.root)
    await second.open()  # another worker starting: the first one's journal is not its to replay
    assert journals(jstore.root) == held
    r2 = await commit_turn(second, "conv", "two")
    assert (await jstore.read_index("conv"))[-1] == r2
    await second.close()
    await jstore.close()
    assert journals(jstore.root) == []  # a clean stop leaves no journal


def without_aio(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a system without native AIO: commits waiting together go to the sync thread."""
    monkeypatch.setattr(journal_module.AioSync, "open", classmethod(lambda cls, loop: None))


async def test_commits_waiting_together_share_fdatasyncs_in_the_sync_thread(
    jstore: JsonlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_aio(monkeypatch)
    await commit_turn(jstore, "warm", "up")  # the journal exists
    real: Callable[[int], None] = os.fdatasync
    syncs: list[int] = []

    def counting(fd: int) -> None:  # on the sync thread: a slow disk lets the others queue up
        syncs.append(fd)
        time.sleep(0.02)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    rids = await asyncio.gather(*(commit_turn(jstore, f"c{i}", "hi") for i in range(20)))
    assert 1 <= len(syncs) < len(rids)
    for i, rid in enumerate(rids):
        assert await jstore.read_index(f"c{i}") == [rid]


async def test_commits_waiting_together_share_native_aio_fdatasyncs(
    jstore: JsonlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await commit_turn(jstore, "warm", "up")
    called: list[int] = []
    monkeypatch.setattr(os, "fdatasync", called.append)  # the loop's own sync: not used here
    rids = await asyncio.gather(*(commit_turn(jstore, f"c{i}", "hi") for i in range(20)))
    aio = jstore.journal._aio
    assert aio is not None, "this Linux has native AIO: the journal must use it"
    assert called == [] and 1 <= aio.submitted < len(rids)
    for i, rid in enumerate(rids):
        assert await jstore.read_index(f"c{i}") == [rid]
    image = crash_image(jstore, tmp_path=jstore.root.parent)
    assert await index_after_restart(image, "c7") == [rids[7]]


def fdatasync_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that call os.fdatasync from now on, in order."""
    real: Callable[[int], None] = os.fdatasync
    threads: list[str] = []

    def recording(fd: int) -> None:
        threads.append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    return threads


@pytest.mark.parametrize("aio", [True, False], ids=["aio", "thread"])
async def test_a_turn_committing_alone_is_synced_on_the_loop(
    jstore: JsonlStore, monkeypatch: pytest.MonkeyPatch, aio: bool
) -> None:
    if not aio:
        without_aio(monkeypatch)
    await commit_turn(jstore, "warm", "up")
    threads = fdatasync_threads(monkeypatch)
    rid = await commit_turn(jstore, "alone", "hi")  # no other turn in progress: no hand-off
    assert threads == [threading.main_thread().name]
    assert await jstore.read_index("alone") == [rid]
    threads.clear()
    await asyncio.gather(*(commit_turn(jstore, f"many{i}", "hi") for i in range(8)))
    if aio:  # submitted to the kernel by the loop: no fdatasync call of ours at all
        assert threads == [] and jstore.journal._aio is not None and jstore.journal._aio.submitted >= 1
    else:  # shared, on the sync thread
        assert threads and threading.main_thread().name not in threads


async def test_a_sync_native_aio_refuses_to_take_is_made_by_the_thread(
    jstore: JsonlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """io_submit failing (EAGAIN, a seccomp change) is no lost write: the thread syncs instead,
    and the store keeps taking writes."""
    await asyncio.gather(commit_turn(jstore, "warm", "up"), commit_turn(jstore, "warm2", "up"))
    aio = jstore.journal._aio
    assert aio is not None
    real_call = aio._call

    def refusing_submit(number: int, *args: object) -> int:
        if number == aio._submit_nr:
            aio_module.ctypes.set_errno(errno.EAGAIN)
            return -1
        return real_call(number, *args)

    monkeypatch.setattr(aio, "_call", refusing_submit)
    threads = fdatasync_threads(monkeypatch)
    rids = await asyncio.gather(*(commit_turn(jstore, f"c{i}", "hi") for i in range(6)))
    assert jstore.durability.failed is None and jstore.journal._aio is None
    assert any(name != threading.main_thread().name for name in threads)  # the sync thread's
    for i, rid in enumerate(rids):
        assert await jstore.read_index(f"c{i}") == [rid]


async def test_a_failed_native_aio_sync_refuses_the_commit_and_the_next_ones(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    journal = jstore.journal
    await asyncio.gather(commit_turn(jstore, "warm", "up"), commit_turn(jstore, "warm2", "up"))
    aio = journal._aio
    assert aio is not None and journal.current is not None
    failing_syncs_of(aio, journal.current.fd)  # the disk fails the journal's syncs (EIO)
    results = await asyncio.gather(
        *(commit_turn(jstore, "conv" if i == 0 else f"other{i}", "two") for i in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(r, StorageError) for r in results), results
    assert jstore.durability.failed is not None and "fdatasync" in jstore.durability.failed
    monkeypatch.undo()
    with pytest.raises(StorageError, match="refuses writes"):
        await commit_turn(jstore, "conv", "three")
    image = crash_image(jstore, tmp_path)
    assert await index_after_restart(image) == [r1]


async def test_without_durability_there_is_no_journal(tmp_path: Path) -> None:
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    r1 = await commit_turn(store, "conv", "one")
    r2 = await commit_turn(store, "conv", "two")  # the index is known: written on the loop
    assert await store.read_index("conv") == [r1, r2]
    assert journals(store.root) == []
    with pytest.raises(NotFound):
        await store.read_index("other")
    await store.close()


async def test_the_record_of_deletions_goes_with_the_last_journal(tmp_path: Path) -> None:
    first, second = JsonlStore(tmp_path / "var"), JsonlStore(tmp_path / "var")
    await first.open()
    await second.open()
    await commit_turn(first, "conv", "one")
    await commit_turn(second, "other", "two")
    async with first.lock("conv", 5):
        await first.delete_conversation("conv")
    forgotten = first.data_dir.journal_dir / "forgotten.jsonl"
    assert forgotten.exists()
    await first.close()
    assert forgotten.exists()  # the second process's journal may still hold older entries
    await second.close()
    assert not forgotten.exists() and journals(first.root) == []


async def test_after_a_failed_sync_a_commit_is_refused_and_its_log_says_so(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    """Also for a log whose file was not made yet (no provider call: the conversations API)."""
    jstore.durability.failed = "fdatasync: Input/output error"
    rid = mint_response_id("test/model")
    log = jstore.start(rid, request_record(rid, "conv", [user("q")]))
    log.append({"type": "response", "message": reply("a"), "finish_reason": "stop", "usage": None})
    with pytest.raises(StorageError, match="refuses writes"):
        await log.commit("conv")
    path = tmp_path / "var" / "logs" / "responses" / f"{rid}.jsonl"
    records = [orjson.loads(line) for line in path.read_text().splitlines() if line]
    assert [r["type"] for r in records] == ["request", "response", "incomplete"]
    assert records[-1]["reason"] == "storage_error"
    assert not (tmp_path / "var" / "logs" / "conversations" / "conv.jsonl").exists()


async def test_a_commit_whose_journal_sync_failed_is_not_replayed(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    real: Callable[[int], None] = os.fdatasync

    def failing(fd: int) -> None:
        if "/logs/journal/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(StorageError):
        await commit_turn(jstore, "conv", "two")  # written to the journal, its sync failed
    monkeypatch.undo()
    image = crash_image(jstore, tmp_path)
    assert await index_after_restart(image) == [r1]
