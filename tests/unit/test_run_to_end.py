"""`run_to_end`: a commit runs to its end whatever becomes of its caller; in the caller's task as
far as it goes without waiting (no task, no loop iteration), then in a task of its own."""

from __future__ import annotations

import asyncio

import pytest

from gateway.coroutines import await_commit, run_to_end


async def test_work_that_does_not_wait_is_done_on_return() -> None:
    done: list[str] = []

    async def work() -> None:
        done.append("written")

    before = len(asyncio.all_tasks())
    future = run_to_end(work())
    assert done == ["written"] and future.done()  # no loop iteration was needed
    assert len(asyncio.all_tasks()) == before  # nor a task
    await future


async def test_work_that_waits_goes_on_when_its_caller_is_cancelled() -> None:
    synced: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done: list[str] = []

    async def work() -> None:
        done.append("journal")
        await synced  # the sync thread's answer
        done.append("files")

    async def caller() -> None:
        await asyncio.shield(run_to_end(work()))

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    assert done == ["journal"]
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    synced.set_result(None)
    for _ in range(5):
        await asyncio.sleep(0)
    assert done == ["journal", "files"]


async def test_failures_reach_the_work_and_then_its_future() -> None:
    loop = asyncio.get_running_loop()
    synced: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def work() -> None:
        try:
            await synced
        except OSError as exc:
            seen.append(str(exc))
            raise

    future = run_to_end(work())
    synced.set_exception(OSError("fdatasync failed"))
    with pytest.raises(OSError, match="fdatasync failed"):
        await future
    assert seen == ["fdatasync failed"]

    async def refused() -> None:
        raise ValueError("refused before any wait")

    early = run_to_end(refused())
    assert early.done()
    with pytest.raises(ValueError):
        await early


async def test_settle_waits_for_work_that_yields_and_sleeps() -> None:
    done: list[int] = []

    async def work() -> None:
        for n in range(3):
            await asyncio.sleep(0)  # a bare yield
            await asyncio.sleep(0.001)  # a timer
            done.append(n)

    future = run_to_end(work())
    await await_commit(future)
    assert done == [0, 1, 2]
