"""Conversation locks in PostgreSQL, and what this process's holder of each has loaded.

In this process, one asyncio.Lock per conversation (FIFO); across replicas, a session advisory
lock on the backend's lock connection, polled until a timeout, in arrival order (a waiter stands
in line: see `_TRY_IN_TURN` in backend.py). While a task holds a conversation, its `LockHold`
keeps the tail (incarnation, last seq) it loaded, which its writes must extend.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from gateway.exceptions import ConversationBusy
from gateway.ids import check_conversation_id
from gateway.store.postgres.backend import SharedBackend
from gateway.store.postgres.db import Db
from gateway.store.postgres.schema import advisory_key


@dataclass(slots=True)
class LockHold:
    """This process holds a conversation: the tail its holder loaded, which writes must extend."""

    task: asyncio.Task[Any] | None
    expected: tuple[int | None, int] | None = None


class ConversationLocks:
    """The conversations of one namespace this process holds, and the locking that holds them."""

    def __init__(self, db: Db) -> None:
        self.db = db
        self._holds: dict[str, LockHold] = {}

    def held(self, conversation_id: str) -> LockHold | None:
        """The hold on a conversation, if a task of this process has it locked."""
        return self._holds.get(conversation_id)

    def expected(self, conversation_id: str) -> tuple[int | None, int] | None:
        """The tail a write must extend: the one the holder loaded (None when not held)."""
        hold = self._holds.get(conversation_id)
        return hold.expected if hold is not None else None

    def note_load(self, conversation_id: str, incarnation: int | None, seq: int) -> None:
        """The current task read the conversation at this tail: if it holds it, its writes extend it."""
        hold = self._holds.get(conversation_id)
        if hold is not None and hold.task is asyncio.current_task():
            hold.expected = (incarnation, seq)

    @asynccontextmanager
    async def lock(self, conversation_id: str, timeout: float) -> AsyncIterator[None]:
        """Hold a conversation, here and across replicas; ConversationBusy after `timeout` s."""
        check_conversation_id(conversation_id)
        busy = ConversationBusy(f"Conversation {conversation_id!r} is busy with another request; retry later")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        arrived = int(time.time() * 1000) % (1 << 31)  # this request's place in line
        candidate = await self.db.backend()
        key = advisory_key(self.db.namespace, conversation_id)
        line = ((key & 0x7FFFFFFF), arrived)
        # Per backend, not per store: two stores of one tenant in a process share the session,
        # and session advisory locks are reentrant, so only this lock keeps them apart.
        lock = candidate.local_lock(key)
        backend: SharedBackend | None = None
        in_line = False
        try:
            if lock.locked():  # behind this process's own turns: in line for the other replicas now
                in_line = True  # (first: a cancellation during the call still leaves the line)
                await candidate.stand_in_line(line)
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await lock.acquire()
            except TimeoutError:
                raise busy from None
        except BaseException:
            if in_line:
                await candidate.leave_line(line)
            raise
        try:
            delay = 0.001
            while not await candidate.try_lock(key, line):
                if not in_line:
                    in_line = True
                    await candidate.stand_in_line(line)
                if loop.time() >= deadline:
                    raise busy
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 0.01)
            backend = candidate
            if in_line:
                in_line = False
                await candidate.leave_line(line)
            self._holds[conversation_id] = LockHold(asyncio.current_task())
            yield
        finally:
            self._holds.pop(conversation_id, None)
            try:
                if in_line:
                    await candidate.leave_line(line)
                if backend is not None:
                    await asyncio.shield(backend.spawn(backend.unlock(key)))
            finally:
                lock.release()
