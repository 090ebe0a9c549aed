"""The heap trimmer gives freed memory back every period, in a worker thread, and stops; a
serving app settles the garbage collector once started, and only a serving app."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.app import create_app, warm_up
from gateway.jobs.heap import GC_YOUNG, HeapTrimmer, _malloc_trim, freeze_startup_heap
from gateway.upstream import Router
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


@contextmanager
def collector_restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settle_gc_freezes_what_exists_and_raises_the_young_threshold() -> None:
    with collector_restored():
        assert gc.get_threshold()[0] != GC_YOUNG
        _, middle, old = gc.get_threshold()
        freeze_startup_heap()
        assert gc.get_threshold() == (GC_YOUNG, middle, old)
        assert gc.get_freeze_count() > 1000  # the modules loaded so far
        cycle = Cycle()  # garbage made after settling is still collected
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None


async def test_a_serving_app_settles_the_collector_once_warmed_up() -> None:
    with collector_restored():
        app = create_app(make_settings(), router=Router({"mock": MockUpstream()}, "mock"), serving=True)
        async with app.router.lifespan_context(app):
            await app.state.service.warm_up
            assert gc.get_threshold()[0] == GC_YOUNG and gc.get_freeze_count() > 1000


async def test_an_app_not_serving_leaves_the_collector_alone() -> None:
    with collector_restored():
        threshold = gc.get_threshold()
        app = create_app(make_settings(), router=Router({"mock": MockUpstream()}, "mock"))
        async with app.router.lifespan_context(app):
            await app.state.service.warm_up
        assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0


def test_warming_up_a_serving_process_runs_one_full_collection() -> None:
    """The collector's settling and the memory release share one full collection: each holds
    the GIL for about 20 ms while the first requests may be arriving."""
    full: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    with collector_restored():
        gc.disable()  # only the collections warm_up asks for are counted, not automatic ones
        gc.callbacks.append(seen)
        try:
            warm_up(serving=True)
        finally:
            gc.callbacks.remove(seen)
            gc.enable()
    assert len(full) == 1
