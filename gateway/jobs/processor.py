"""The lifecycle processor: moves idle conversations through post-processing, expires them after `ttl`.

It runs every so often; the work is `gateway.services.sessions`. One processor per data dir (an
flock on locks/processor.lock) or per database (the backend's lease); the others stand by.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.config import Settings
from gateway.context.lifecycle import State
from gateway.exceptions import StorageError
from gateway.services.sessions import Sessions

log = logging.getLogger("gateway.lifecycle")


class Processor:
    def __init__(
        self,
        settings: Settings,
        sessions: Sessions,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.clock = clock
        self.sleep = sleep
        self._lock_fd: int | None = None
        self._task: asyncio.Task[None] | None = None

    async def acquire_lease(self) -> bool:
        """The processor's lease: the backend's own (one per database) or the data dir's."""
        granted = await self.sessions.lease()
        return self.try_lease() if granted is None else granted

    def try_lease(self) -> bool:
        if self._lock_fd is not None:
            return True
        folder = Path(self.settings.storage.data_dir) / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / "processor.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def start(self) -> None:
        if self.settings.sessions.idle_after > 0 or self.settings.sessions.ttl > 0:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _loop(self) -> None:
        sessions = self.settings.sessions
        shortest = min(x for x in (sessions.idle_after, sessions.ttl) if x > 0)
        interval = max(1.0, min(60.0, shortest / 4))
        failing = False
        while True:
            await self.sleep(interval)
            try:
                if await self.acquire_lease():
                    await self.run_once()
            except asyncio.CancelledError:
                raise
            except StorageError as exc:  # once until a pass succeeds: the store says its outages
                if not failing:
                    log.warning("lifecycle processor pass failed: %s (said once until a pass succeeds)", exc)
                failing = True
                continue
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("lifecycle processor pass failed")
            failing = False

    async def run_once(self) -> None:
        for tenant in await self.sessions.tenants():
            started = self.clock()
            unsettled = [started - self.sessions.quiet()]  # younger ones were not looked at
            for cid, modified in await self.sessions.candidates(tenant, self.clock):
                if not await self.sessions.visit(tenant, cid, self.clock, modified):
                    unsettled.append(modified)
            self.sessions.settled_before(tenant, min(unsettled))

    async def visit(self, tenant: str, cid: str, modified: float | None = None) -> bool:
        return await self.sessions.visit(tenant, cid, self.clock, modified)

    async def state_of(self, tenant: str, cid: str) -> State:
        return await self.sessions.state_of(tenant, cid)
