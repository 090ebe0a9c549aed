"""A burst of turns begins a few per pass of the event loop, and every one of them is served."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from gateway.app import create_app
from gateway.services.turns import ChatService
from gateway.store.memory import MemoryStore
from gateway.upstream import Router
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings


async def test_a_burst_of_turns_waits_its_turn_and_is_served() -> None:
    settings = make_settings()
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"starts_per_pass": 1})}
    )
    async with build_client(settings, None, MockUpstream()) as client:
        service: ChatService = app_of(client).state.service
        assert service.starts.per_pass == 1
        waited = 0
        enter = service.starts.enter

        async def counted() -> None:
            nonlocal waited
            waited = max(waited, service.starts.waiting)
            await enter()

        service.starts.enter = counted  # type: ignore[method-assign]

        async def turn(i: int) -> tuple[int, str]:
            body = {
                "model": "mock/m",
                "messages": [{"role": "user", "content": f"hello {i}"}],
                "conversation_id": f"burst-{i}",
                "stream": i % 2 == 0,
            }
            answer = await client.post("/v1/chat/completions", json=body)
            return answer.status_code, answer.text

        answers = await asyncio.gather(*(turn(i) for i in range(12)))
        assert [status for status, _ in answers] == [200] * 12, answers
        assert all("[DONE]" in text for status, text in answers[::2])
        assert waited >= 1  # some did wait for a later pass
        assert service.starts.waiting == 0


async def test_a_turn_s_post_is_admitted_at_the_door_before_its_body_is_read() -> None:
    """In a burst, the turns let go first are also the first read and checked."""
    app = create_app(make_settings(), store=MemoryStore(), router=Router({"mock": MockUpstream()}, "mock"))
    service: ChatService = app.state.service
    assert app.gate is service.starts
    events: list[str] = []
    enter = service.starts.enter

    async def recorded_enter() -> None:
        events.append("gate")
        await enter()

    service.starts.enter = recorded_enter  # type: ignore[method-assign]

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        async def body() -> Any:
            events.append("body")
            return await receive()

        await app(scope, body, send)

    transport = httpx.ASGITransport(app=recorded)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
        turn = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], "conversation_id": "door"}
        answer = await client.post("/v1/chat/completions", json=turn)
        listed = await client.get("/v1/conversations")
    assert answer.status_code == 200 and listed.status_code == 200
    # At the door, before the body is read; then the start's own `enter`, after it (which goes
    # on at once: the task was admitted); the list, not a turn's POST, is not paced.
    assert events[:2] == ["gate", "body"]
    assert events.count("gate") == 2 and events.index("gate", 1) > 1
