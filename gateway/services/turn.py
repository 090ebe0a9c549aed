"""One turn's state while it runs, and the steps of a turn that need no service: taking the
conversation's lock (and forking for `previous_response_id`), settling a commit, and the
`response` record."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from gateway.context import ConversationView, Message
from gateway.exceptions import NotFound
from gateway.services.planning import ContextPlan
from gateway.services.requests import ChatRequest
from gateway.store.base import ResponseLog, Store
from gateway.upstream import Route


@dataclass(slots=True)
class PreparedTurn:
    """Everything decided before the provider is called; closing it releases the lock."""

    request: ChatRequest
    response_id: str
    route: Route
    upstream_body: dict[str, Any]
    log: ResponseLog
    new: list[Message]
    system_in: list[Message] | None
    stack: AsyncExitStack
    started: float = field(default_factory=time.perf_counter)
    upstream_started: float = 0.0
    done: bool = False
    commit_task: asyncio.Future[None] | None = None
    encoding: str | None = None
    new_tokens: list[int] | None = None
    system_tokens: list[int] | None = None
    plan: ContextPlan | None = None
    store: Store | None = None
    created: float | None = None
    timings: dict[str, float] | None = None
    usage: dict[str, Any] | None = None
    upstream_truncated: bool = False
    recap: Message | None = None
    final_message: Message | None = None
    finish_reason: str | None = None
    first_of_user: str | None = None  # a new conversation of this end user: index it for recaps
    replan: Callable[[], Awaitable[ContextPlan]] | None = None  # after a provider's refusal
    refits: int = 0
    tenant: str = ""
    branch_at: int | None = None  # history cut back here first (the client's version diverged)
    view: ConversationView | None = None

    @property
    def conversation_id(self) -> str | None:
        return self.request.conversation_id


async def settle(task: asyncio.Future[None]) -> None:
    """Wait for a commit to finish even while being cancelled: the conversation lock must not
    be released before the turn is on disk, or the next request would miss it."""
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


async def lock_conversation(
    request: ChatRequest, store: Store, stack: AsyncExitStack, timeout: float
) -> str:
    """Lock the request's conversation (held until the turn closes) and return its id. With
    `previous_response_id`: when that response is no longer the newest, the turn moves to a
    fork made at it; decided under the lock, so a turn landing meanwhile cannot slip in."""
    cid = request.conversation_id
    assert cid is not None
    previous = request.previous_response_id
    if previous is None:
        await stack.enter_async_context(store.lock(cid, timeout))
        return cid
    async with AsyncExitStack() as source:
        await source.enter_async_context(store.lock(cid, timeout))
        ids = [e for e in await store.read_index(cid) if isinstance(e, str)]
        if ids and ids[-1] == previous:
            stack.push_async_exit(source.pop_all())
            return cid
        if previous not in ids:
            raise NotFound(
                f"Response {previous!r} is no longer part of a conversation", param="previous_response_id"
            )
        fork = f"{cid[:100]}.fork-{secrets.token_hex(6)}"
        await stack.enter_async_context(store.lock(fork, timeout))
        await store.fork(cid, fork, previous)
    request.conversation_id = fork
    return fork


def response_record(
    turn: PreparedTurn, message: Message, finish_reason: Any, usage: Any, raw: Any = None
) -> dict[str, Any]:
    end = time.perf_counter()
    record: dict[str, Any] = {
        "type": "response",
        "message": message,
        "finish_reason": finish_reason,
        "usage": usage,
        "timings": {
            "upstream_ms": round((end - turn.upstream_started) * 1000, 3),
            "total_ms": round((end - turn.started) * 1000, 3),
        },
    }
    if raw is not None and raw != message:
        record["upstream_message"] = raw
    turn.timings = record["timings"]
    turn.usage = usage if isinstance(usage, dict) else None
    return record
