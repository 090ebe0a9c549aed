"""Conversation lifecycle (SPEC section 8): post-processing, "earlier today" recap, expiry.

States, persisted append-only in logs/lifecycle/{conversation_id}.jsonl:

    active ──idle_after──> processing ──ok──> processed
      ^                       │  └──error──> active (attempts + 1) ... failed (max_attempts)
      └── lease expired ──────┘   a new message makes processed/failed conversations active

One processor per data dir (an flock on locks/processor.lock; the other workers stand by).
Processing folds the whole conversation into its summary and appends it to the user's daily
digest; the recap of a user's new conversation is built from that day's digests and turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gateway.config import Settings
from gateway.context import ConversationView, Message
from gateway.exceptions import InvalidRequest
from gateway.store import Store, StoreRegistry
from gateway.store.base import Record
from gateway.summarizer import Summarizer

log = logging.getLogger("gateway.lifecycle")

ACTIVE, PROCESSING, PROCESSED, FAILED = "active", "processing", "processed", "failed"
RECAP_PREFIX = "Earlier today"


def user_key(user: str) -> str:
    """A file-safe name for an end user (the raw `user` value is never a file name)."""
    return "u" + hashlib.sha256(user.encode()).hexdigest()[:24]


def zone(name: str | None, default: str) -> ZoneInfo:
    try:
        return ZoneInfo(name or default)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest(
            f"Unknown time zone {name!r}: use an IANA name such as 'Europe/Berlin'", param="user_timezone"
        ) from None


def local_day(ts: float, tz: ZoneInfo) -> str:
    return datetime.fromtimestamp(ts, tz).strftime("%Y-%m-%d")


@dataclass(frozen=True, slots=True)
class State:
    state: str
    attempts: int
    since: float
    lease_until: float | None = None
    error: str | None = None


def derive_state(records: list[Record], last_activity: float | None) -> State:
    """The current state from the lifecycle log and the conversation's last activity."""
    if not records:
        return State(ACTIVE, 0, 0.0)
    last = records[-1]
    state = str(last.get("state", ACTIVE))
    at = float(last.get("at", 0.0))
    attempts = int(last.get("attempts", 0))
    if state in (PROCESSED, FAILED) and last_activity is not None and last_activity > at:
        return State(ACTIVE, 0, last_activity)  # a new message reactivates it
    return State(state, attempts, at, last.get("lease_until"), last.get("error"))


# -- recap ----------------------------------------------------------------------------------------


def _text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


# The recap looks at most at this many of the user's most recently started conversations: its
# budget holds a few of them, and a user with thousands must not make every new one slower.
RECAP_SCAN = 50


async def build_recap(
    store: Store,
    user: str,
    tz: ZoneInfo,
    *,
    exclude: str,
    now: float,
    max_tokens: int,
    count: Callable[[Message], int],
) -> tuple[Message | None, list[str]]:
    """An "Earlier today" system message from the user's other conversations of the same
    local day, newest first, within `max_tokens`; and the conversations it drew on."""
    today = local_day(now, tz)
    ukey = user_key(user)
    digests = {r.get("conversation_id"): r for r in await store.read_side("digests", f"{ukey}.{today}")}
    seen: set[str] = set()
    candidates: list[tuple[float, str, list[str]]] = []
    for entry in reversed(await store.read_side("users", ukey)):
        cid = entry.get("conversation_id")
        if not isinstance(cid, str) or cid == exclude or cid in seen:
            continue
        if len(seen) >= RECAP_SCAN:
            break  # a long-lived user: only the newest conversations, not all they ever had
        seen.add(cid)
        view = await store.load(cid)
        if not view.turns or view.last_activity is None or local_day(view.last_activity, tz) != today:
            continue
        digest = digests.get(cid)
        if digest and float(digest.get("at", 0)) >= view.last_activity:
            lines = [str(digest.get("summary", ""))]
        else:
            lines = _todays_user_lines(view, tz, today)
        if lines:
            candidates.append((view.last_activity, cid, lines))
    candidates.sort(reverse=True)
    header = f"{RECAP_PREFIX} ({tz.key}), this user talked with you in other conversations:"
    body: list[str] = []
    used: list[str] = []
    budget = max_tokens - count({"role": "system", "content": header})
    for last, cid, lines in candidates:
        when = datetime.fromtimestamp(last, tz).strftime("%H:%M")
        block = f"- [{when}, {cid}] " + " / ".join(lines)
        cost = count({"role": "system", "content": block}) - 3
        if cost > budget:
            continue
        budget -= cost
        body.append(block)
        used.append(cid)
    if not body:
        return None, []
    return {"role": "system", "content": "\n".join([header, *body])}, used


def _todays_user_lines(view: ConversationView, tz: ZoneInfo, today: str) -> list[str]:
    lines = []
    for message in view.history:
        if message.get("role") == "user":
            text = _text(message).strip()
            if text:
                lines.append(f"user: {text}")
    del tz, today  # a conversation's turns are all recent when it was active today
    return lines[-20:]


# -- processor ------------------------------------------------------------------------------------


class Processor:
    """Moves idle conversations through post-processing; expires them after `ttl`."""

    def __init__(
        self,
        settings: Settings,
        stores: StoreRegistry,
        summarizer: Summarizer,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.stores = stores
        self.summarizer = summarizer
        self.clock = clock
        self._lock_fd: int | None = None
        self._task: asyncio.Task[None] | None = None

    # one processor per data dir
    async def acquire_lease(self) -> bool:
        """The processor's lease: the backend's own (one per database) or the data dir's."""
        granted = await (await self.stores.get("")).try_processor_lease()
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
        while True:
            await asyncio.sleep(interval)
            try:
                if await self.acquire_lease():
                    await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("lifecycle processor pass failed")

    async def run_once(self) -> None:
        tenants = ["", *await self.stores.tenants()]
        for tenant in tenants:
            store = await self.stores.get(tenant)
            for cid, modified in await self._candidates(store):
                await self.visit(store, cid, modified)

    async def _candidates(self, store: Store) -> list[tuple[str, float]]:
        """Conversations that may need work, found cheaply: an index untouched for idle_after
        (its mtime), and no processed or failed state newer than that."""
        sessions = self.settings.sessions
        times = await asyncio.to_thread(store.index_times)
        if self.clock is not time.time:
            return [(cid, 0.0) for cid, _ in times]  # a test's clock: file times mean nothing there
        now = self.clock()
        quiet = (
            min(x for x in (sessions.idle_after, sessions.ttl) if x > 0)
            if (sessions.idle_after or sessions.ttl)
            else 0
        )
        out = []
        for cid, modified in times:
            if now - modified < quiet:
                continue
            records = await store.read_side("lifecycle", cid)
            settled = (
                bool(records)
                and records[-1].get("state") in (PROCESSED, FAILED)
                and float(records[-1].get("at", 0)) >= modified
            )
            expired = sessions.ttl > 0 and now - modified > sessions.ttl
            if settled and not expired:
                continue
            out.append((cid, modified))
        return out

    async def state_of(self, store: Store, cid: str) -> State:
        view = await store.load(cid)
        return derive_state(await store.read_side("lifecycle", cid), view.last_activity)

    async def visit(self, store: Store, cid: str, modified: float | None = None) -> None:
        now = self.clock()
        sessions = self.settings.sessions
        view = await store.load(cid)
        last = max(view.last_activity or 0.0, modified or 0.0)
        if sessions.ttl > 0 and now - last > sessions.ttl:
            async with store.lock(cid, self.settings.storage.lock_timeout):
                # Decided without the lock: a turn may have landed since. Decide again.
                fresh = await store.load(cid)
                if fresh.last_activity is None or self.clock() - fresh.last_activity > sessions.ttl:
                    await store.delete_conversation(cid, archive=True)
                    log.info('{"event": "conversation_expired", "conversation_id": "%s"}', cid)
                    return
            view = fresh
            last = view.last_activity or last
        state = derive_state(await store.read_side("lifecycle", cid), view.last_activity)
        if state.state == PROCESSING:
            if state.lease_until is not None and now > state.lease_until:
                await self._record(
                    store,
                    cid,
                    ACTIVE if state.attempts + 1 < sessions.max_attempts else FAILED,
                    attempts=state.attempts + 1,
                    error="lease expired (processor crashed?)",
                )
            return
        if (
            state.state == ACTIVE
            and sessions.idle_after > 0
            and now - last >= sessions.idle_after
            and view.turns
        ):
            await self.process(store, cid, view, state.attempts)

    async def _record(self, store: Store, cid: str, state: str, **fields: Any) -> None:
        await store.append_side("lifecycle", cid, {"state": state, "at": self.clock(), **fields})

    async def process(self, store: Store, cid: str, view: ConversationView, attempts: int) -> None:
        sessions = self.settings.sessions
        now = self.clock()
        await self._record(store, cid, PROCESSING, attempts=attempts, lease_until=now + sessions.lease)
        try:
            summary = await self.summarizer.summarize_all(store, cid, view.last_model or "")
            if view.user and summary:
                tz = zone(view.timezone, sessions.default_timezone)
                day = local_day(view.last_activity or now, tz)
                await store.append_side(
                    "digests",
                    f"{user_key(view.user)}.{day}",
                    {"conversation_id": cid, "summary": summary, "at": self.clock()},
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded as the state's error
            message = getattr(exc, "message", None) or repr(exc)
            attempts += 1
            await self._record(
                store,
                cid,
                FAILED if attempts >= sessions.max_attempts else ACTIVE,
                attempts=attempts,
                error=message[:500],
            )
            return
        await self._record(store, cid, PROCESSED, attempts=attempts)
