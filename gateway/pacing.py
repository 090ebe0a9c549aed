"""Turn starts paced a few per pass of the event loop, first come first served.

A burst of requests (hundreds of clients starting at once) would otherwise run every turn's
start (parse, lock, load, plan, the response log) in one pass of the event loop, during which
no running stream's chunk is relayed and no first chunk sent: the longest gap and the time to
the first chunk would both grow with the burst.
"""

from __future__ import annotations

import asyncio
from collections import deque


class StartGate:
    """Admits at most `per_pass` turn starts to each pass of the event loop, in arrival order.

    A start finding the gate open (nobody waiting, this pass's share not used) goes on at once,
    with no wait: a turn arriving alone pays one comparison. The others wait their turn; each
    pass of the loop lets the next `per_pass` of them go, so the relaying of running streams
    (their chunks are read and sent between passes) is never held up by more than that many
    starts. `per_pass = 0` turns pacing off."""

    def __init__(self, per_pass: int) -> None:
        self.per_pass = per_pass
        self._admitted = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._armed = False

    async def enter(self) -> None:
        """Return when this start may run: at once, or in a later pass of the loop."""
        if self.per_pass <= 0:
            return
        if not self._waiting and self._admitted < self.per_pass:
            self._admitted += 1
            self._arm()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._arm()
        try:
            await waiter
        except asyncio.CancelledError:
            if not waiter.cancelled():  # let go and cancelled in the same pass: the slot is unused
                self._admitted -= 1
            raise

    @property
    def waiting(self) -> int:
        """Starts waiting for a later pass."""
        return len(self._waiting)

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        """A new pass: this pass's share goes to the first waiting starts."""
        self._armed = False
        self._admitted = 0
        waiting = self._waiting
        while waiting and self._admitted < self.per_pass:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._admitted += 1
        if self._admitted:
            self._arm()
