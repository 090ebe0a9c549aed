"""Helpers shared by the test tiers: a turn written the way the service writes it, and checks."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from gateway.context import Message
from gateway.ids import mint_response_id
from gateway.store.base import Store, now
from gateway.store.jsonl.aio import _EVENT as _AIO_EVENT
from gateway.store.jsonl.aio import AioSync


class LongWait:
    """A call that waits long enough to be cut short, and counts how often its cleanup ran."""

    def __init__(self) -> None:
        self.cleanups = 0

    async def __call__(self) -> str:
        try:
            await asyncio.sleep(10)
        finally:
            self.cleanups += 1
        return "not reached"


def assert_openai_tool_order(messages: Sequence[Mapping[str, object]]) -> None:
    """OpenAI's rules for tool messages: each answers a call of the assistant message just
    before its block, once; every call is answered before the next non-tool message."""
    current: list[object] | None = None
    answered: set[object] = set()
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            assert current is not None, f"orphan tool message at {i}"
            call_id = message.get("tool_call_id")
            assert call_id in current, f"tool message {i} answers no call of its assistant"
            assert call_id not in answered, f"call {call_id} answered twice"
            answered.add(call_id)
            continue
        if current is not None:
            missing = [c for c in current if c not in answered]
            assert not missing, f"calls {missing} unanswered before message {i}"
        current, answered = None, set()
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and isinstance(calls, list) and calls:
            current = [c["id"] for c in calls if isinstance(c, dict)]


def user(text: str, **extra: Any) -> Message:
    return {"role": "user", "content": text, **extra}


def reply(text: str) -> Message:
    return {"role": "assistant", "content": text}


def request_record(
    rid: str, cid: str | None, inputs: list[Message], system: list[Message] | None = None
) -> dict[str, Any]:
    return {
        "type": "request",
        "response_id": rid,
        "conversation_id": cid,
        "created": now(),
        "model": "test/model",
        "stream": False,
        "params": {},
        "system": system,
        "input": inputs,
    }


async def commit_turn(
    store: Store,
    cid: str | None,
    text: str,
    answer: str | None = None,
    *,
    inputs: list[Message] | None = None,
    output: Message | None = None,
    system: list[Message] | None = None,
) -> str:
    """Write one acknowledged turn the way the service does: start, context, response, commit."""
    rid = mint_response_id("test/model")
    inputs = inputs if inputs is not None else [user(text)]
    output = output if output is not None else reply(answer if answer is not None else f"re: {text}")
    log = store.start(rid, request_record(rid, cid, inputs, system))
    log.append({"type": "context", "stored_messages": 0, "sent_messages": len(inputs)})
    log.append({"type": "response", "message": output, "finish_reason": "stop", "usage": None})
    await asyncio.sleep(0)  # the provider call: other turns run meanwhile
    log.meanwhile()  # as the service does while the provider works
    await log.commit(cid)
    return rid


async def commit_with_row(store: Store, cid: str, row: dict[str, Any] | None) -> None:
    """One turn, with the list row it brings (`ResponseLog.list_as`)."""
    rid = mint_response_id("test/model")
    log = store.start(rid, request_record(rid, cid, [user("hi")]))
    log.append({"type": "response", "message": reply("yo"), "finish_reason": "stop", "usage": None})
    log.list_as(row)
    await log.commit(cid)


async def say_each(client: Any, cid: str, texts: Sequence[str], model: str = "mock/m") -> list[str]:
    """One turn per text on conversation `cid` through an app client; the response ids."""
    ids = []
    for text in texts:
        body = {"model": model, "conversation_id": cid, "messages": [{"role": "user", "content": text}]}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["id"])
    return ids


def wait_healthy(proc: Any, url: str, timeout: float, what: str, log: Any, poll: float = 0.05) -> bool:
    """Poll `url` until it answers 200 (True) or `timeout` passes (False); a process that
    exits meanwhile is an error naming `what` with the tail of `log()`."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()[-4000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    return False


def failing_syncs_of(aio: AioSync, fd: int, err: int = errno.EIO) -> None:
    """The kernel reports `err` for every sync of `fd` that ends (a failing disk): the
    submission is real, its result is rewritten as io_getevents hands it over."""
    real = aio._call

    def call(number: int, *args: object) -> int:
        got = real(number, *args)
        if number == aio._getevents:
            for i in range(max(got, 0)):
                data, obj, _, res2 = _AIO_EVENT.unpack_from(aio._events, i * _AIO_EVENT.size)
                if data == fd:
                    _AIO_EVENT.pack_into(aio._events, i * _AIO_EVENT.size, data, obj, -err, res2)
        return got

    aio._call = call  # type: ignore[method-assign]


@asynccontextmanager
async def serving_app(app: web.Application) -> AsyncIterator[str]:
    """An aiohttp app (a provider twin) served on a free loopback port: its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
