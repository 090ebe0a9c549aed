"""A burst of turns begins a few per pass of the event loop, and every one of them is served."""

from __future__ import annotations

import asyncio

from gateway.services.turns import ChatService
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
