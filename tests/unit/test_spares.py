"""Spare files: a turn's new files (its response log, a new conversation's index) are empty files
made ahead by a thread and renamed into place, never over an existing file; a filesystem that
cannot rename that way, or an empty pool, falls back to creating the file on the spot."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.store.jsonl import JsonlStore
from gateway.store.jsonl import spares as spares_module
from gateway.store.jsonl.spares import Spares, sweep
from tests.helpers import commit_turn


def spare_inodes(store: JsonlStore) -> dict[int, str]:
    folder = store.spares.folder
    return {os.stat(folder / n).st_ino: n for n in os.listdir(folder)} if folder.is_dir() else {}


def slow(spares: Spares) -> None:
    """Creations are slow here (ext4 without a journal after many deletions), for a while."""
    spares.creation = 1.0
    spares.slow = True


async def until_ready(spares: Spares, count: int) -> None:
    for _ in range(500):
        if len(spares._ready) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {len(spares._ready)} spare files were made")


async def test_a_new_conversations_files_are_spares_renamed_into_place(jstore: JsonlStore) -> None:
    slow(jstore.spares)
    await commit_turn(jstore, "first", "hello")  # the first turn wakes the thread
    jstore.spares._start()  # filled up again (its index may have taken one)
    await until_ready(jstore.spares, spares_module.TARGET)  # (all made: none is made after the look)
    before = spare_inodes(jstore)
    rid = await commit_turn(jstore, "second", "hi there")
    response = os.stat(jstore.data_dir.response_path(rid)).st_ino
    index = os.stat(jstore.data_dir.index_path("second")).st_ino
    assert response in before and index in before and response != index
    assert set(spare_inodes(jstore)) == set(before) - {response, index}
    # The files are the store's as ever: the index names the turn, the log holds it.
    assert await jstore.read_index("second") == [rid]
    records = await jstore.read_response(rid)
    assert [r["type"] for r in records] == ["request", "context", "response", "commit"]


async def test_creations_are_timed_and_spares_used_only_while_they_are_slow(tmp_path: Path) -> None:
    spares = Spares(tmp_path / "spare")
    for _ in range(5):
        spares._seen(0.015e-3)  # what a creation costs on a filesystem at ease
    assert not spares.slow
    os.close(spares.create(tmp_path / "fast", os.O_WRONLY))  # created in place, no spares made
    assert not spares._ready and not (tmp_path / "spare").exists()
    for _ in range(30):
        spares._seen(0.6e-3)  # what creations cost on ext4 without a journal after deletions
    assert spares.slow
    os.close(spares.create(tmp_path / "slow0", os.O_WRONLY))  # none ready yet: made in place
    await until_ready(spares, spares_module.TARGET)  # (all made: none is made after the look)
    inodes = {os.stat(tmp_path / "spare" / n).st_ino for n in os.listdir(tmp_path / "spare")}
    slow(spares)  # (the thread's own creations, timed too, may have brought the average down)
    os.close(spares.create(tmp_path / "slow1", os.O_WRONLY))
    assert os.stat(tmp_path / "slow1").st_ino in inodes
    for _ in range(120):
        spares._seen(0.015e-3)
    assert not spares.slow  # at ease again: in place
    spares.close()


async def test_a_spare_never_replaces_an_existing_file(tmp_path: Path) -> None:
    spares = Spares(tmp_path / "spare")
    slow(spares)
    spares._start()
    await until_ready(spares, spares_module.TARGET)
    target = tmp_path / "taken.jsonl"
    target.write_bytes(b"kept\n")
    ready = len(spares._ready)
    with pytest.raises(FileExistsError):
        spares.create(target, os.O_WRONLY | os.O_APPEND)
    assert target.read_bytes() == b"kept\n"
    assert len(spares._ready) == ready  # the spare went back to the pool
    spares.close()
    assert not any((tmp_path / "spare").iterdir())


async def test_without_renameat2_files_are_created_on_the_spot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spares = Spares(tmp_path / "spare")
    slow(spares)
    spares._start()
    await until_ready(spares, 1)

    def refuse(*args: object) -> int:
        import ctypes
        import errno

        ctypes.set_errno(errno.EINVAL)  # what a filesystem without RENAME_NOREPLACE answers
        return -1

    monkeypatch.setattr(spares_module, "_renameat2", refuse)
    fd = spares.create(tmp_path / "new.jsonl", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"line\n")
    os.close(fd)
    assert (tmp_path / "new.jsonl").read_bytes() == b"line\n"
    assert not spares.usable  # and no more spares are made or taken
    with pytest.raises(FileExistsError):
        spares.create(tmp_path / "new.jsonl", os.O_WRONLY | os.O_APPEND)
    spares.close()


async def test_the_store_removes_its_spares_on_close_and_a_dead_processs_at_open(tmp_path: Path) -> None:
    store = JsonlStore(tmp_path / "var")
    await store.open()
    slow(store.spares)
    await commit_turn(store, "c", "hello")
    await until_ready(store.spares, 1)
    folder = store.spares.folder
    await store.close()
    assert os.listdir(folder) == []

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (folder / f"{dead.stdout.strip()}-deadbeef-1").touch()  # its process is gone
    (folder / f"{os.getppid()}-cafecafe-1").touch()  # a running process's
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # killed, not yet reaped
    for _ in range(500):
        with open(f"/proc/{zombie.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.01)
    (folder / f"{zombie.pid}-0badf00d-1").touch()
    assert sweep(folder) == 2
    assert os.listdir(folder) == [f"{os.getppid()}-cafecafe-1"]
    zombie.wait()
