"""`while_waiting`: a provider call driven in the calling task, with work done once it waits."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest

from gateway.coroutines import while_waiting
from tests.helpers import LongWait


class Steps:
    """What happened, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def meanwhile(self) -> None:
        self.seen.append("meanwhile")


async def test_the_work_runs_once_the_call_waits_and_the_call_s_value_comes_back() -> None:
    steps = Steps()

    async def call() -> int:
        steps.seen.append("request written")
        await asyncio.sleep(0.01)
        steps.seen.append("answer read")
        return 42

    assert await while_waiting(call(), steps.meanwhile) == 42
    assert steps.seen == ["request written", "meanwhile", "answer read"]


async def test_a_call_that_never_waits_still_gets_its_work_done() -> None:
    steps = Steps()

    async def call() -> str:
        return "at once"

    assert await while_waiting(call(), steps.meanwhile) == "at once"
    assert steps.seen == ["meanwhile"]


async def test_no_task_is_made_and_bare_yields_work() -> None:
    steps = Steps()
    tasks: list[asyncio.Task[object] | None] = []

    async def call() -> int:
        tasks.append(asyncio.current_task())
        await asyncio.sleep(0)  # a bare yield
        await asyncio.sleep(0)
        tasks.append(asyncio.current_task())
        return 1

    assert await while_waiting(call(), steps.meanwhile) == 1
    assert tasks == [asyncio.current_task()] * 2


async def test_what_the_call_waits_on_fails_inside_the_call() -> None:
    loop = asyncio.get_running_loop()
    failing: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, failing.set_exception, ConnectionResetError("reset"))

    async def call() -> str:
        try:
            await failing
        except ConnectionResetError as exc:
            return f"handled {exc}"
        return "not reached"

    assert await while_waiting(call(), Steps().meanwhile) == "handled reset"

    async def unhandled() -> int:
        return await asyncio.wait_for(asyncio.shield(failing), 1)

    with pytest.raises(ConnectionResetError):
        await while_waiting(unhandled(), Steps().meanwhile)


@pytest.mark.parametrize("bare", [False, True])
async def test_cancelling_the_caller_cancels_the_call_which_cleans_up(bare: bool) -> None:
    steps = Steps()
    started = asyncio.Event()

    async def call() -> int:
        try:
            started.set()
            while True:
                await (asyncio.sleep(0) if bare else asyncio.sleep(10))
        except asyncio.CancelledError:
            steps.seen.append("call cancelled")
            await asyncio.sleep(0)  # cleanup may still wait
            steps.seen.append("cleaned up")
            raise

    caller = asyncio.ensure_future(while_waiting(call(), steps.meanwhile))
    await started.wait()
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 5)  # a call the cancellation missed would run on
    assert steps.seen == ["meanwhile", "call cancelled", "cleaned up"]


async def test_timeouts_inside_and_around_the_call_work() -> None:
    async def slow_connect() -> str:
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        except TimeoutError:
            return "connect timed out"
        return "not reached"

    assert await while_waiting(slow_connect(), Steps().meanwhile) == "connect timed out"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    slow_answer = LongWait()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await while_waiting(slow_answer(), Steps().meanwhile)
    assert slow_answer.cleanups == 1
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_stream_s_first_chunk_and_its_end() -> None:
    steps = Steps()

    async def chunks() -> AsyncIterator[str]:
        await asyncio.sleep(0.01)
        yield "first"
        yield "second"

    stream = chunks().__aiter__()
    assert await while_waiting(stream.__anext__(), steps.meanwhile) == "first"
    assert steps.seen == ["meanwhile"]
    assert [chunk async for chunk in stream] == ["second"]

    async def empty() -> AsyncIterator[str]:
        await asyncio.sleep(0.01)
        return
        yield  # an async generator

    with pytest.raises(StopAsyncIteration):
        await while_waiting(empty().__aiter__().__anext__(), Steps().meanwhile)


async def test_work_that_fails_ends_the_call_with_its_cleanup() -> None:
    call = LongWait()

    def broken() -> None:
        raise RuntimeError("a bug in the work")

    running = call()  # held here: only the fix can end it, not the garbage collector
    with pytest.raises(RuntimeError, match="a bug"):
        await while_waiting(running, broken)
    assert call.cleanups == 1
    assert inspect.getcoroutinestate(running) == inspect.CORO_CLOSED
