"""A serving process's heap: startup objects frozen out of the collector, free memory given back.

The collector: CPython runs a young-generation collection every 700 net allocations of
container objects, and every few hundred of those a full one over the whole heap. With 32
requests in flight, their live objects alone cross 700 again and again, and a full collection
walks the modules, tokenizers and settings loaded at startup: under load the collector took
about 0.06 ms per request and 13-32 ms per full collection (docs/performance.md). Once the
startup is over, `freeze_startup_heap` moves what exists then out of the collector's view (`gc.freeze`)
and raises the young threshold to GC_YOUNG: cyclic garbage is still collected, in rarer and
smaller passes.

Freed memory: glibc keeps what Python frees in its arenas (the
main heap and one per worker thread: file reads and fsyncs run in threads), and a long-running
gateway's RSS crept up by ~8 MiB over 45,000 requests while Python's own live memory stayed
flat (docs/memory.md). `malloc_trim(0)` every `every` seconds returns the free pages: a few
milliseconds, in a worker thread. Without glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("gateway")

TRIM_EVERY = 30.0
GC_YOUNG = 10_000  # net container allocations between young collections (CPython's: 700)


def freeze_startup_heap(young: int = GC_YOUNG) -> None:
    """Settle the garbage collector once startup is over: collect, freeze, raise the young threshold.

    It collects once, freezes what is left (it lives as long as the process) and collects the
    young generation every `young` net allocations. A serving process only: a frozen object is
    never collected, whatever it becomes.
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)


def _malloc_trim() -> Callable[[], object] | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class HeapTrimmer:
    def __init__(
        self,
        every: float = TRIM_EVERY,
        *,
        trim: Callable[[], object] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.every = every
        self.trim = trim if trim is not None else _malloc_trim()
        self.sleep = sleep
        self.trims = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.trim is not None and self.every > 0:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        assert self.trim is not None
        while True:
            await self.sleep(self.every)
            try:
                await asyncio.to_thread(self.trim)
                self.trims += 1
            except Exception:  # noqa: BLE001 - never worth stopping the loop for
                log.exception("malloc_trim failed")
