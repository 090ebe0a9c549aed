"""Rolling summaries, scheduled in the background: one task per conversation.

Each task folds what the turns asked for (`gateway.services.summaries`), retrying failures with
backoff (1, 2, 4, 8 s; 5 attempts, then again on the next truncation). Until a summary is ready,
truncation applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.services.summaries import Summaries

log = logging.getLogger("gateway.summarizer")

MAX_ATTEMPTS = 5
# Failure counts are kept for the conversations that failed most recently, this many at most.
FAILURES_KEPT = 1024


class Summarizer:
    def __init__(
        self,
        summaries: Summaries,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.summaries = summaries
        self.sleep = sleep
        # Keyed by (tenant, conversation).
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._targets: dict[tuple[str, str], tuple[str, str]] = {}  # -> (covers_through, model)
        self.failures: dict[tuple[str, str], int] = {}
        self.on_outcome: Callable[[str], None] = lambda outcome: None  # metrics hook

    def schedule(self, tenant: str, conversation_id: str, covers_through: str, model: str) -> None:
        """Ask for coverage through `covers_through`; one task per conversation folds it."""
        key = (tenant, conversation_id)
        self._targets[key] = (covers_through, self.summaries.model_for(model))
        task = self._tasks.get(key)
        if task is None or task.done():
            task = self._tasks[key] = asyncio.create_task(self._run(tenant, conversation_id))
            task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        """Finished tasks are dropped: the map holds only conversations being folded."""
        for key, value in list(self._tasks.items()):
            if value is task:
                del self._tasks[key]

    async def wait_idle(self) -> None:
        while any(not t.done() for t in self._tasks.values()):
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def aclose(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, tenant: str, cid: str) -> None:
        key = (tenant, cid)
        attempt = 0
        while key in self._targets:
            target, model = self._targets[key]
            try:
                await self.summaries.fold(tenant, cid, target, model)  # versions: Summaries.on_version
                if self._targets.get(key) == (target, model):
                    del self._targets[key]
                self.failures.pop(key, None)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, retried, never raised
                attempt += 1
                self.on_outcome("failed")
                self.failures[key] = self.failures.pop(key, 0) + 1  # re-inserted: newest last
                while len(self.failures) > FAILURES_KEPT:
                    del self.failures[next(iter(self.failures))]
                message = getattr(exc, "message", None) or repr(exc)
                log.warning("summary of %s failed (attempt %d): %s", cid, attempt, message)
                try:
                    await self.summaries.record_failure(tenant, cid, attempt, message)
                except Exception:  # noqa: BLE001 - the failure is logged; the log line is best effort
                    pass
                if attempt >= MAX_ATTEMPTS:
                    self._targets.pop(key, None)
                    return
                await self.sleep(min(2.0 ** (attempt - 1), 60.0))
