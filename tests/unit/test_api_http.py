"""The HTTP layer's helpers. `read_json`: a body is read within the deadline and the limit
(the server side is a twin of uvicorn's request cycle; the e2e limits tests run the real one).
`until_disconnect`: a client that goes away cancels the work, and only while it runs.
`SSEResponse`: events ready together leave in one send, a client that goes stops the body."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from starlette.requests import Request

from gateway.api.http import ON_GONE, ClientDisconnected, SSEResponse, read_json, until_disconnect
from gateway.exceptions import BodyTimeout, BodyTooLarge, ClientGone
from tests.helpers import LongWait


class Cycle:
    """uvicorn's request cycle as `read_json` sees it: `message_event` is set when a body
    message is ready; `more_body` says whether more follows. `parts` are what arrives, in order
    (None: nothing more ever arrives)."""

    def __init__(self, parts: list[bytes | None], *, whole: bool) -> None:
        self.parts = parts
        self.message_event = asyncio.Event()
        if whole:
            self.message_event.set()
        self.more_body = not whole
        self.received = 0

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        if not self.parts:
            return {"type": "http.disconnect"}
        part = self.parts.pop(0)
        if part is None:
            await asyncio.Event().wait()  # a client that stalls
        return {"type": "http.request", "body": part, "more_body": bool(self.parts)}


def request_of(cycle: Cycle, body_timeout: float = 5.0) -> Request:
    settings = SimpleNamespace(server=SimpleNamespace(body_timeout=body_timeout))
    app = SimpleNamespace(state=SimpleNamespace(settings=settings))
    return Request({"type": "http", "headers": [], "app": app}, cycle.receive)


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def test_a_body_that_came_whole_is_read_with_one_receive() -> None:
    cycle = Cycle([BODY], whole=True)
    assert await read_json(request_of(cycle), 1000) == orjson.loads(BODY)
    assert cycle.received == 1


async def test_a_body_that_came_whole_still_keeps_to_the_limit() -> None:
    with pytest.raises(BodyTooLarge):
        await read_json(request_of(Cycle([BODY], whole=True)), len(BODY) - 1)


async def test_a_client_gone_before_its_body_is_not_taken_for_one() -> None:
    with pytest.raises(ClientGone):
        await read_json(request_of(Cycle([], whole=True)), 1000)


async def test_a_body_still_arriving_is_streamed_in_its_parts() -> None:
    cycle = Cycle([BODY[:10], BODY[10:]], whole=False)
    assert await read_json(request_of(cycle), 1000) == orjson.loads(BODY)
    assert cycle.received == 2
    with pytest.raises(BodyTooLarge):
        await read_json(request_of(Cycle([BODY[:10], BODY[10:]], whole=False)), len(BODY) - 1)


async def test_a_body_that_stalls_gets_the_deadline() -> None:
    with pytest.raises(BodyTimeout):
        await read_json(request_of(Cycle([BODY[:10], None], whole=False), body_timeout=0.05), 1000)


class Client:
    """An ASGI `receive` after the body: it answers `http.disconnect` once `leave()` is called."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.listening = 0

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        self.listening += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_a_client_that_leaves_cancels_the_work() -> None:
    client = Client()
    work = LongWait()
    asyncio.get_running_loop().call_later(0.02, client.leave)
    with pytest.raises(ClientDisconnected):
        await until_disconnect(work(), client.receive)
    assert work.cleanups == 1


async def test_work_that_ends_stops_watching() -> None:
    client = Client()

    async def waits() -> str:
        await asyncio.sleep(0.01)
        return "answer"

    assert await until_disconnect(waits(), client.receive) == "answer"
    assert client.listening == 1
    await asyncio.sleep(0.01)
    client.leave()  # after the answer: nothing is cancelled any more
    await asyncio.sleep(0.01)


async def test_a_body_the_server_has_whole_is_taken_without_arming_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gateway.api.http as http

    def no_deadline(delay: float | None) -> Any:
        raise AssertionError("the body deadline was armed for a body already received")

    monkeypatch.setattr(http.asyncio, "timeout", no_deadline)
    cycle = Cycle([BODY], whole=True)
    request = request_of(cycle)
    request.scope[http.BODY_COMPLETE] = True
    assert await read_json(request, 1000) == orjson.loads(BODY)
    assert cycle.received == 1
    request = request_of(Cycle([BODY], whole=True))
    request.scope[http.BODY_COMPLETE] = True
    with pytest.raises(BodyTooLarge):
        await read_json(request, len(BODY) - 1)
    request = request_of(Cycle([], whole=True))  # the client left: a disconnect
    request.scope[http.BODY_COMPLETE] = True
    with pytest.raises(ClientGone):
        await read_json(request, 1000)


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_events_ready_together_leave_in_one_send_the_last_with_the_end() -> None:
    more = asyncio.Event()

    async def body() -> Any:
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"  # (ready with the first)
        await more.wait()  # the body waits: what is ready goes out first
        yield b"data: 3\n\n"
        yield b"data: [DONE]\n\n"

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            more.set()

    closed: list[BaseException | None] = []

    async def on_close(exc: BaseException | None) -> None:
        closed.append(exc)

    response = SSEResponse(body(), headers={}, on_close=on_close)
    await response({"type": "http"}, never_disconnects, send)
    assert sent[0]["type"] == "http.response.start"
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 1\n\ndata: 2\n\n", True),
        (b"data: 3\n\ndata: [DONE]\n\n", False),
    ]
    assert closed == [None]


async def test_a_client_gone_while_a_send_waits_stops_the_body_in_its_wait() -> None:
    stopped: list[bool] = []

    async def body() -> Any:
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(30)  # (the body waits while its first event is sent)
            yield b"data: 2\n\n"
        finally:
            stopped.append(True)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # a client that stopped reading: the send never ends

    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    closed: list[BaseException | None] = []

    async def on_close(exc: BaseException | None) -> None:
        closed.append(exc)

    response = SSEResponse(body(), headers={}, on_close=on_close)
    task = asyncio.ensure_future(response({"type": "http"}, receive, send))
    await asyncio.sleep(0.01)
    gone.set()
    await asyncio.wait_for(task, 5)
    assert stopped == [True]
    assert len(closed) == 1 and isinstance(closed[0], ClientDisconnected)


class HookedCycle:
    """A request cycle of the gateway's own protocol: it calls the ON_GONE hook when the client goes."""

    def __init__(self) -> None:
        self.disconnected = False
        setattr(self, ON_GONE, None)

    def leave(self) -> None:
        self.disconnected = True
        hook = getattr(self, ON_GONE)
        if hook is not None:
            hook()

    async def receive(self) -> dict[str, Any]:
        raise AssertionError("the protocol says when the client goes: nothing waits on receive")


async def test_on_the_gateway_s_protocol_the_hook_cancels_the_work_without_a_watcher_task() -> None:
    cycle = HookedCycle()
    work = LongWait()
    tasks: list[int] = []

    async def counted() -> None:
        tasks.append(len(asyncio.all_tasks()))
        await work()

    asyncio.get_running_loop().call_later(0.02, cycle.leave)
    with pytest.raises(ClientDisconnected):
        await until_disconnect(counted(), cycle.receive)
    assert work.cleanups == 1 and tasks == [1]  # only the request's own task
    assert getattr(cycle, ON_GONE) is None  # the hook is taken back


@pytest.mark.parametrize("waited", [1.0, 0.0])
async def test_on_the_gateway_s_protocol_work_for_a_client_already_gone_is_not_begun(waited: float) -> None:
    """Queued a while or not (an answer's body about to be sent): the hook would never be called."""
    cycle = HookedCycle()
    cycle.disconnected = True
    began = []

    async def work() -> None:
        began.append(True)

    started = time.perf_counter() - waited if waited else 0.0
    with pytest.raises(ClientDisconnected):
        await until_disconnect(work(), cycle.receive, started=started)
    assert began == []


async def test_on_the_gateway_s_protocol_work_that_ends_takes_the_hook_back() -> None:
    cycle = HookedCycle()

    async def answer() -> str:
        await asyncio.sleep(0.01)
        return "answer"

    assert await until_disconnect(answer(), cycle.receive) == "answer"
    assert getattr(cycle, ON_GONE) is None
    cycle.leave()  # after the answer: nothing to cancel
