"""Coroutines driven step by step in the calling task, as a Task would drive them.

What a turn needs of asyncio below `await`: work that must run to its end whatever becomes of
its caller (a commit), a provider call that lets other work run once it first waits, a commit
awaited through cancellation, and the loop that drives an awaitable on from a wait (also used
to send a stream's events as they become ready).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

T = TypeVar("T")


def run_to_end(work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
    """Start `work` (a commit), which must run to its end whatever becomes of the caller.

    Returns the future of that end. `work` runs in the calling task as far as it goes without
    waiting, which is all of it for a turn committing alone (no task, no loop iteration: a
    coroutine that does not wait cannot be cancelled); what is left after its first wait goes on
    in a task of its own, which the caller's cancellation does not reach."""
    loop = asyncio.get_running_loop()
    try:
        waits_for = work.send(None)
    except StopIteration:
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return done
    except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
        failed: asyncio.Future[None] = loop.create_future()
        failed.set_exception(exc)
        return failed
    return asyncio.ensure_future(_go_on(work, waits_for))


async def _go_on(work: Coroutine[Any, Any, None], waits_for: Any) -> None:
    """Drive `work` on from where it first waited, as a Task would.

    `waits_for` is the future it waits on, or None for a bare yield."""
    loop = asyncio.get_running_loop()
    while True:
        if waits_for is None:
            await asyncio.sleep(0)
        elif not waits_for.done():
            waits_for._asyncio_future_blocking = False
            woken: asyncio.Future[None] = loop.create_future()
            waits_for.add_done_callback(functools.partial(_wake, woken))
            await woken  # its outcome is work's to take, below
        try:
            waits_for = work.send(None)
        except StopIteration:
            return


def _wake(woken: asyncio.Future[None], _: object) -> None:
    if not woken.done():
        woken.set_result(None)


async def while_waiting(call: Awaitable[T], meanwhile: Callable[[], None]) -> T:
    """Await `call` (a provider call) and run `meanwhile` as soon as the call first waits.

    By its first wait the call has written its request: work done then costs the client nothing,
    the provider is busy anyway. No task is made: the call is driven here, in the calling task,
    step by step as that task would drive it (what it waits on, cancellations and timeouts reach
    it as usual)."""
    steps = call.__await__()
    try:
        waits_for = steps.send(None)
    except StopIteration as stop:
        meanwhile()
        return cast(T, stop.value)
    try:
        meanwhile()
    except BaseException:
        steps.close()  # the call's own cleanup runs (its connection is released), then this
        raise
    return cast(T, await resume(steps, waits_for))


async def await_commit(task: asyncio.Future[None]) -> None:
    """Wait for a commit to finish even while being cancelled.

    The conversation lock must not be released before the turn is on disk, or the next request
    would miss it."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 - the commit's own caller reports it
            break
    if cancelled:
        raise asyncio.CancelledError()


async def resume(step: Any, waits_for: Any) -> Any:
    """Drive `step` to its end, as the calling task would have, and return its value.

    `step` is an awaitable's iterator stopped at its first wait, on `waits_for`: a future, or
    None for a bare yield. Cancellations and timeouts reach it as usual."""
    while True:
        try:
            if waits_for is None:
                await asyncio.sleep(0)
            else:
                waits_for._asyncio_future_blocking = False  # as a task takes it from the step
                await waits_for
        except BaseException as exc:  # noqa: BLE001 - handed to the step, as its task would
            if waits_for is None or not waits_for.done():
                # Thrown at this task (a cancellation), not the outcome of what the step waits on.
                try:
                    waits_for = step.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
        try:
            waits_for = step.send(None)  # the step takes the outcome of what it waited on
        except StopIteration as stop:
            return stop.value
