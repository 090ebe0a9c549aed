"""Native AIO fdatasync: done when the kernel's sync ends, shared by the callers that asked
while one was in flight, failures reach every caller of that sync, and nothing is left at close."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gateway.store.jsonl import aio as aio_module
from gateway.store.jsonl.aio import AioSync, NotSubmitted
from tests.helpers import failing_syncs_of


@pytest.fixture
async def aio() -> AsyncIterator[AioSync]:
    made = AioSync.open(asyncio.get_running_loop())
    assert made is not None, "Linux with native AIO: io_setup must work here"
    yield made
    made.close()


@pytest.fixture
def file_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    yield fd
    os.close(fd)


async def test_a_sync_ends_when_the_kernel_is_done(aio: AioSync, file_fd: int) -> None:
    os.write(file_fd, b"x" * 4096)
    await asyncio.wait_for(aio.sync(file_fd), 10)
    assert aio.submitted == 1


async def test_callers_during_a_sync_share_the_next_one(aio: AioSync, file_fd: int) -> None:
    first = aio.sync(file_fd)
    later = [aio.sync(file_fd) for _ in range(9)]  # the first is in flight: these wait for one more
    assert aio.submitted == 1
    await asyncio.wait_for(asyncio.gather(first, *later), 10)
    assert aio.submitted == 2


async def test_files_are_synced_apart(aio: AioSync, tmp_path: Path, file_fd: int) -> None:
    other = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        await asyncio.wait_for(asyncio.gather(aio.sync(file_fd), aio.sync(other), aio.sync(file_fd)), 10)
    finally:
        os.close(other)
    assert aio.submitted == 3  # one per file, then the file asked for again during its sync


async def test_a_failed_sync_fails_every_caller_that_shared_it(
    aio: AioSync, tmp_path: Path, file_fd: int
) -> None:
    failing = os.open(tmp_path / "failing", os.O_RDWR | os.O_CREAT, 0o644)
    failing_syncs_of(aio, failing)
    try:
        futures = [aio.sync(failing), aio.sync(failing), aio.sync(file_fd)]
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
    finally:
        os.close(failing)
    assert [type(r) for r in results] == [OSError, OSError, type(None)]
    assert all(isinstance(r, OSError) and r.errno == errno.EIO for r in results[:2])


async def test_a_sync_the_kernel_will_not_take_is_not_submitted(aio: AioSync) -> None:
    read, write = os.pipe()  # a pipe cannot be synced: io_submit itself refuses (EINVAL)
    try:
        results = await asyncio.gather(aio.sync(read), aio.sync(read), return_exceptions=True)
    finally:
        os.close(read)
        os.close(write)
    assert all(isinstance(r, NotSubmitted) and r.errno == errno.EINVAL for r in results), results
    assert aio.submitted == 0


async def test_close_ends_the_sync_in_flight_and_refuses_new_ones(file_fd: int) -> None:
    aio = AioSync.open(asyncio.get_running_loop())
    assert aio is not None
    future = aio.sync(file_fd)
    aio.close()
    assert future.done() and future.exception() is None
    with pytest.raises(RuntimeError):
        aio.sync(file_fd)
    aio.close()  # twice: nothing


async def test_a_cancelled_caller_does_not_disturb_the_others(aio: AioSync, file_fd: int) -> None:
    gone, kept = aio.sync(file_fd), aio.sync(file_fd)
    gone.cancel()
    await asyncio.wait_for(kept, 10)
    assert gone.cancelled()


async def test_without_a_known_architecture_there_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_module.platform, "machine", lambda: "s390x")
    assert AioSync.open(asyncio.get_running_loop()) is None


async def test_a_refused_io_setup_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(*args: object) -> int:
        aio_module.ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(aio_module, "_syscall", lambda: refusing)
    assert AioSync.open(asyncio.get_running_loop()) is None


async def test_an_interrupted_collection_is_retried(aio: AioSync, file_fd: int) -> None:
    """io_getevents cut by a signal (EINTR) leaves the events in the ring, and the eventfd was
    already read: without a retry the sync's waiters would wait forever."""
    real = aio._call
    interrupted = [0]

    def call(number: int, *args: object) -> int:
        if number == aio._getevents and not interrupted[0]:
            interrupted[0] += 1
            aio_module.ctypes.set_errno(errno.EINTR)
            return -1
        return real(number, *args)

    aio._call = call  # type: ignore[method-assign]
    await asyncio.wait_for(aio.sync(file_fd), 10)
    assert interrupted[0] == 1
