"""The heap trimmer: gives freed memory back every period, in a worker thread, and stops."""

from __future__ import annotations

import asyncio

from gateway.jobs.heap import HeapTrimmer, _malloc_trim
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings


async def test_trims_every_period_until_stopped() -> None:
    calls: list[int] = []
    periods: list[float] = []

    async def sleep(seconds: float) -> None:
        periods.append(seconds)
        if len(periods) > 3:
            await asyncio.Event().wait()  # parked: stop() cancels here

    trimmer = HeapTrimmer(7.0, trim=lambda: calls.append(1), sleep=sleep)
    trimmer.start()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if trimmer.trims == 3:
            break
    await trimmer.stop()
    assert len(calls) == 3 and trimmer.trims == 3 and periods[:3] == [7.0, 7.0, 7.0]


async def test_a_failing_trim_does_not_stop_it() -> None:
    seen: list[int] = []

    def trim() -> None:
        seen.append(1)
        raise OSError("no")

    async def sleep(seconds: float) -> None:
        if len(seen) >= 2:
            await asyncio.Event().wait()

    trimmer = HeapTrimmer(trim=trim, sleep=sleep)
    trimmer.start()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if len(seen) >= 2:
            break
    await trimmer.stop()
    assert len(seen) == 2 and trimmer.trims == 0


async def test_the_app_runs_one_on_glibc() -> None:
    async with build_client(make_settings(), None, MockUpstream()) as client:
        app = app_of(client)
        async with app.router.lifespan_context(app):
            trimmer = app.state.trimmer
            assert (trimmer._task is not None) == (_malloc_trim() is not None)
        assert trimmer._task is None or trimmer._task.done()
