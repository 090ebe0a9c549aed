"""Background responses through the official SDK against `gateway serve`: polled to completion,
a stream resumed from a sequence number, cancelled, and a process killed mid-turn."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.conftest import GatewayProcess, sdk, write_config
from tests.mockserver import MockServer


def test_polled_resumed_and_cancelled_with_the_sdk(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    created = client.responses.create(model="mock/m", input="Hi, my name is Bob.", background=True)
    assert created.status in ("queued", "in_progress") and created.background is True
    for _ in range(200):
        got = client.responses.retrieve(created.id)
        if got.status == "completed":
            break
        time.sleep(0.05)
    assert got.status == "completed" and got.output_text
    whole = list(client.responses.retrieve(created.id, stream=True))
    assert whole[0].type == "response.created" and whole[-1].type == "response.completed"
    resumed = list(client.responses.retrieve(created.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in resumed] == [e.sequence_number for e in whole[3:]]
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in whole[3:]]

    upstream.mode = "hang"
    upstream.hang_seconds = 30
    conv = client.conversations.create()
    slow = client.responses.create(model="mock/m", input="wait", background=True, conversation=conv.id)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    upstream.mode = "normal"
    after = client.responses.create(model="mock/m", input="My name is Ann.", conversation=conv.id)
    assert after.status == "completed"
    users = [i for i in client.conversations.items.list(conv.id, order="asc") if i.role == "user"]
    assert [i.content[0].text for i in users] == ["My name is Ann."]


def test_a_gateway_killed_mid_background_turn_reads_it_as_interrupted(
    tmp_path: Path, upstream: MockServer
) -> None:
    config = write_config(tmp_path / "gateway.toml", upstream.url)
    first = GatewayProcess(config, tmp_path / "var").start()
    try:
        client = sdk(first)
        conv = client.conversations.create()
        upstream.mode = "hang"
        upstream.hang_seconds = 60
        slow = client.responses.create(model="mock/m", input="wait", background=True, conversation=conv.id)
        for _ in range(100):  # the provider has it
            if upstream.requests:
                break
            time.sleep(0.05)
        assert upstream.requests
    finally:
        first.stop(signal.SIGKILL)
    upstream.mode = "normal"
    second = GatewayProcess(config, tmp_path / "var").start()
    try:
        client = sdk(second)
        got = client.responses.retrieve(slow.id)
        assert got.status == "failed" and got.error is not None and got.error.code == "interrupted"
        after = client.responses.create(model="mock/m", input="again", conversation=conv.id)
        assert after.status == "completed"
        users = [i for i in client.conversations.items.list(conv.id, order="asc") if i.role == "user"]
        assert [i.content[0].text for i in users] == ["again"]  # nothing of the killed turn
    finally:
        second.stop()


def test_a_background_stream_begins_before_the_provider_answers_and_ends_when_cancelled(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    """A background stream said nothing until the provider's first chunk (its first event then
    `in_progress`, never `queued`), and a cancel left it with no last event at all."""
    client = sdk(gateway)
    upstream.mode = "hang"
    upstream.hang_seconds = 30
    try:
        stream = client.responses.create(model="mock/m", input="wait", background=True, stream=True)
        events = iter(stream)
        first, second = next(events), next(events)  # while the provider has not answered
        assert (first.type, first.response.status) == ("response.created", "queued")
        assert (second.type, second.sequence_number) == ("response.queued", 1)
        assert client.responses.cancel(first.response.id).status == "cancelled"
        last = list(events)[-1]
        assert (last.type, last.response.status) == ("response.incomplete", "cancelled")
    finally:
        upstream.mode = "normal"
