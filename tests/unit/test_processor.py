"""The lifecycle processor's own duties: one lease per data dir, and a loop that survives a
failing pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.jobs.processor import Processor
from gateway.services import Services
from tests.conftest import make_settings


def processor(tmp_path: Path) -> Processor:
    settings = make_settings(tmp_path, durability="none")
    settings = settings.model_copy(
        update={"sessions": settings.sessions.model_copy(update={"idle_after": 60.0})}
    )
    return Processor(settings, Services.from_settings(settings).sessions)


async def test_one_processor_per_data_dir_holds_the_lease(tmp_path: Path) -> None:
    first, second = processor(tmp_path), processor(tmp_path)
    assert await first.acquire_lease()
    assert not await second.acquire_lease()  # another process's flock on locks/processor.lock
    assert await first.acquire_lease()  # kept, not taken twice
    await first.stop()
    assert await second.acquire_lease()  # released with the processor
    await second.stop()


async def test_the_loop_survives_a_failing_pass_and_stops_cleanly(tmp_path: Path) -> None:
    p = processor(tmp_path)
    passes: list[str] = []
    intervals: list[float] = []
    three = asyncio.Event()

    async def run_once() -> None:
        passes.append("pass")
        if len(passes) == 1:
            raise RuntimeError("the store was unreachable")
        if len(passes) == 3:
            three.set()

    async def sleep(seconds: float) -> None:
        intervals.append(seconds)
        await asyncio.sleep(0)

    p.run_once = run_once  # type: ignore[method-assign]
    p.sleep = sleep
    p.start()
    await asyncio.wait_for(three.wait(), 5)
    await p.stop()
    assert passes[:3] == ["pass", "pass", "pass"]  # the failure did not end the loop
    assert intervals[0] == 15.0  # a quarter of idle_after, between 1 s and 60 s
    assert p._task is not None and p._task.done()
