"""Background responses (`background: true`): a turn run to its end without its client.

Its Responses events are kept so that a client can poll it, follow it from any sequence number
(`GET /v1/responses/{id}?stream=true&starting_after=N`) or cancel it.

The events of a run are kept in this process: a run in progress is followed live; a finished
one is replayed byte for byte while it is among the newest `keep_finished` runs (and its events
within `max_events`). Elsewhere (another worker, a replica, after a restart) its log answers: the
stored response, replayed as the events of a whole answer once it has ended. A cancel asked
elsewhere is written down (the `cancels` side log), and the process running the response looks
for one every CANCEL_POLL seconds. A run whose process stopped is read back as interrupted (its
turn never committed: nothing to duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from gateway.exceptions import TooManyBackground

# Finished runs whose events are kept for replay (the newest this many, per process).
KEEP_FINISHED = 256
# How often a running background response looks for a cancel asked in another process, in seconds.
CANCEL_POLL = 0.5


@dataclass(slots=True)
class Run:
    """One background response: its events so far, and whether it is over."""

    response_id: str
    tenant: str
    max_events: int
    events: list[bytes] = field(default_factory=list)
    started: bool = False  # its task began (before: `queued`)
    done: bool = False
    cancelled: bool = False
    dropped: int = 0  # events past max_events, not kept (the run still ends)
    task: asyncio.Task[None] | None = None
    abandon: Callable[[], Awaitable[None]] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, frame: bytes) -> None:
        if len(self.events) < self.max_events:
            self.events.append(frame)
        else:
            self.dropped += 1
        self.changed.set()

    def finish(self) -> None:
        self.done = True
        self.changed.set()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The events after sequence number `after`, then those still to come."""
        sent = 0
        while True:
            while sent < len(self.events):
                frame = self.events[sent]
                sent += 1
                if sequence_of(frame) > after:
                    yield frame
            if self.done:
                return
            self.changed.clear()
            await self.changed.wait()


def sequence_of(frame: bytes) -> int:
    """The `sequence_number` of an SSE frame `event: ...\\ndata: {...}\\n\\n`."""
    data = frame.partition(b"\ndata: ")[2]
    value = orjson.loads(data).get("sequence_number") if data else None
    return value if isinstance(value, int) else -1


class BackgroundRuns:
    """The background responses of this process: at most `per_tenant` running per tenant."""

    def __init__(self, per_tenant: int, max_events: int) -> None:
        self.per_tenant = per_tenant
        self.max_events = max_events
        self._runs: OrderedDict[str, Run] = OrderedDict()

    def get(self, response_id: str, tenant: str) -> Run | None:
        run = self._runs.get(response_id)
        return run if run is not None and run.tenant == tenant else None

    def check_room(self, tenant: str) -> None:
        running = sum(1 for run in self._runs.values() if run.tenant == tenant and not run.done)
        if running >= self.per_tenant:
            raise TooManyBackground(
                f"{running} background responses are already running for this key (at most "
                f"{self.per_tenant}: server.background_responses); wait for one to end or cancel one"
            )

    def start(
        self,
        response_id: str,
        tenant: str,
        work: Callable[[Run], Awaitable[None]],
        abandon: Callable[[], Awaitable[None]],
        cancel_asked: Callable[[], Awaitable[bool]] | None = None,
    ) -> Run:
        """Run `work(run)` as a task of its own; it adds the run's events and ends it.

        `abandon()` ends what `work` would have, when the run is cancelled before it began;
        `cancel_asked()` says whether another process asked for a cancel (looked at every
        CANCEL_POLL seconds while the run goes on).
        """
        run = Run(response_id, tenant, self.max_events)
        self._runs[response_id] = run

        async def body() -> None:
            run.started = True
            watch = asyncio.ensure_future(self._watch(run, cancel_asked)) if cancel_asked else None
            try:
                await work(run)
            finally:
                if watch is not None:
                    watch.cancel()
                run.finish()
                self._forget_old()

        run.task = asyncio.ensure_future(body())
        run.abandon = abandon
        return run

    async def _watch(self, run: Run, cancel_asked: Callable[[], Awaitable[bool]]) -> None:
        """Cancel `run` once another process asks to (a failed look is tried again)."""
        while not run.done:
            await asyncio.sleep(CANCEL_POLL)
            try:
                asked = await cancel_asked()
            except Exception:  # noqa: BLE001 - the store could not say: look again later
                continue
            if asked and not run.done:
                # (not awaited here: `cancel` waits for the task this watch belongs to)
                run.cancelled = True
                if run.task is not None:
                    run.task.cancel()
                return

    async def cancel(self, run: Run) -> None:
        """Stop the run's turn (it is closed as cancelled) and wait until it has ended."""
        if run.task is None or run.done:
            return
        run.cancelled = True
        began = run.started
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.task
        if not began and run.abandon is not None:  # (its task never ran: nothing closed it)
            await run.abandon()
            run.finish()
            self._forget_old()

    async def aclose(self) -> None:
        """Cancel every run still going (the server is stopping): each is closed as cancelled."""
        for run in list(self._runs.values()):
            await self.cancel(run)

    def _forget_old(self) -> None:
        finished = [rid for rid, run in self._runs.items() if run.done]
        for rid in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._runs[rid]
