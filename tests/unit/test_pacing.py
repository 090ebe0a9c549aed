"""Turn starts paced a few per pass of the event loop, in arrival order."""

from __future__ import annotations

import asyncio

from gateway.pacing import StartGate


def passes_of(gate: StartGate, n: int, cancel: int | None = None) -> dict[int, int]:
    """The pass in which each of `n` starts arriving together was let go (`cancel`: cancelled)."""

    async def main() -> dict[int, int]:
        loop = asyncio.get_running_loop()
        passes = 0
        admitted: dict[int, int] = {}

        def tick() -> None:
            nonlocal passes
            passes += 1
            loop.call_soon(tick)

        async def start(i: int) -> None:
            await gate.enter()
            admitted[i] = passes

        loop.call_soon(tick)
        await asyncio.sleep(0)
        tasks = [asyncio.ensure_future(start(i)) for i in range(n)]
        if cancel is not None:
            await asyncio.sleep(0)
            tasks[cancel].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        first = min(admitted.values())
        return {i: p - first for i, p in admitted.items()}

    return asyncio.run(main())


def test_a_burst_goes_per_pass_in_arrival_order() -> None:
    # the first `per_pass` at once; the others, let go at the next pass, run at the one after
    assert passes_of(StartGate(2), 7) == {0: 0, 1: 0, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4}
    assert passes_of(StartGate(3), 7) == {0: 0, 1: 0, 2: 0, 3: 2, 4: 2, 5: 2, 6: 3}


def test_no_limit_lets_every_start_go_at_once() -> None:
    assert set(passes_of(StartGate(0), 50).values()) == {0}


def test_a_cancelled_start_gives_its_place_to_the_next() -> None:
    passes = passes_of(StartGate(2), 6, cancel=3)
    assert 3 not in passes
    assert passes == {0: 0, 1: 0, 2: 2, 4: 2, 5: 3}
    assert StartGate(2).waiting == 0


def test_a_start_arriving_alone_does_not_wait() -> None:
    async def main() -> None:
        gate = StartGate(1)
        for _ in range(3):  # one a pass: never a wait
            step = gate.enter().__await__()
            try:
                step.send(None)
                raise AssertionError("the start waited")
            except StopIteration:
                pass
            await asyncio.sleep(0)
        assert gate.waiting == 0

    asyncio.run(main())
