"""On the gateway's own HTTP protocol, a client that leaves mid-turn has its turn cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from gateway.app import create_app
from gateway.server import running_in_thread
from gateway.store.memory import MemoryStore
from gateway.upstream import Router
from gateway.upstream.base import Body, Chunk
from gateway.upstream.mock import MockUpstream
from tests.conftest import make_settings


def raw_chat(conversation_id: str, **fields: Any) -> bytes:
    """A whole HTTP/1.1 chat-completions request, as a client's socket sends it."""
    message = {"role": "user", "content": "hi"}
    body = orjson.dumps(
        {"model": "mock/m", "messages": [message], "conversation_id": conversation_id, **fields}
    )
    head = "POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


def leave_after(
    upstream: MockUpstream, request: bytes, caplog: pytest.LogCaptureFixture
) -> list[dict[str, Any]]:
    """Send `request` to a gateway on a real server, leave once it has begun; its access lines."""
    app = create_app(make_settings(), store=MemoryStore(), router=Router({"mock": upstream}, "mock"))
    with caplog.at_level(logging.INFO, logger="gateway.access"), running_in_thread(app) as url:
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port)) as client:
            client.sendall(request)
            client.settimeout(10)
            if b'"stream":true' in request:
                assert b"data: " in client.recv(65536)  # the first chunk came; the next one stalls
            else:
                time.sleep(0.3)  # the turn is waiting for the provider
        lines: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
            time.sleep(0.02)
    return lines


def test_a_client_that_leaves_mid_turn_has_its_turn_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    upstream = MockUpstream(delay=30.0)  # answers long after the client has gone
    lines = leave_after(upstream, raw_chat("left-1"), caplog)
    assert len(lines) == 1, lines
    assert lines[0]["conversation_id"] == "left-1"
    assert (lines[0]["outcome"], lines[0]["status"]) == ("disconnected", 499)
    assert upstream.requests == []  # the provider's answer never came: the call was cancelled


class StallingStream(MockUpstream):
    """Streams its answer's first chunk, then stalls."""

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        async for chunk in super().stream(body):
            yield chunk
            await asyncio.sleep(30.0)


def test_a_client_that_leaves_mid_stream_ends_its_turn(caplog: pytest.LogCaptureFixture) -> None:
    lines = leave_after(StallingStream(), raw_chat("left-2", stream=True), caplog)
    assert len(lines) == 1, lines
    assert lines[0]["conversation_id"] == "left-2" and lines[0]["stream"] is True
    assert lines[0]["outcome"] in ("disconnected", "cancelled"), lines[0]
