"""Stored chat completions through the official SDK's `client.chat.completions.retrieve`, `list`,
`messages.list`, `update` and `delete`, against real `gateway serve` processes; and tenants."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.conftest import GatewayProcess, sdk, write_config
from tests.mockserver import MockServer

KEY_A = "sk-gw-stored-aaaaaaaaaaaaaaaa"
KEY_B = "sk-gw-stored-bbbbbbbbbbbbbbbb"


def say(client: OpenAI, text: str, *, model: str = "mock/m", messages: Any = None, **extra: Any) -> str:
    """One chat completion (`extra`: more of the SDK's arguments); its id."""
    sent = messages if messages is not None else [{"role": "user", "content": text}]
    return client.chat.completions.create(model=model, messages=sent, **extra).id


def test_retrieve_is_the_completion_as_answered(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    cid = f"stored-{uuid.uuid4().hex[:8]}"
    answered = client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "my name is Eve"}],
        metadata={"app": "e2e"},
        extra_body={"conversation_id": cid},
    )
    got = client.chat.completions.retrieve(answered.id)
    assert got.id == answered.id and got.object == "chat.completion" and got.model == "mock/m"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == answered.choices[0].message.content
    assert got.choices[0].finish_reason == answered.choices[0].finish_reason
    assert got.usage is not None and answered.usage is not None
    assert got.usage.total_tokens == answered.usage.total_tokens
    assert got.metadata == {"app": "e2e"} and (got.model_extra or {})["conversation_id"] == cid
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve("mock-m-000000000000")


def test_list_filters_by_metadata_and_model_across_pages(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    client = sdk(gateway)
    run = uuid.uuid4().hex
    ids = [say(client, f"turn {n}", metadata={"run": run, "n": str(n)}) for n in range(5)]
    other = say(client, "another model", model="mock/other", metadata={"run": run})
    # The SDK pages on by itself (`after` = the last id of each page of 2).
    assert [c.id for c in client.chat.completions.list(metadata={"run": run}, limit=2)] == [*ids, other]
    listed = client.chat.completions.list(metadata={"run": run, "n": "3"})
    assert [c.id for c in listed] == [ids[3]]
    newest = client.chat.completions.list(metadata={"run": run}, model="mock/m", order="desc", limit=2)
    assert [c.id for c in newest.data] == ids[::-1][:2] and newest.has_more
    assert [c.id for c in client.chat.completions.list(metadata={"run": run}, model="mock/other")] == [other]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.list(limit=101)


def test_messages_are_listed_in_pages(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "two"},
    ]
    rid = say(client, "", messages=messages)  # stateless: the request's messages, all new
    listed = list(client.chat.completions.messages.list(rid, limit=1))
    assert [(m.id, m.content) for m in listed] == [
        (f"{rid}-{n}", m["content"]) for n, m in enumerate(messages)
    ]
    assert [m.role for m in listed] == [m["role"] for m in messages]
    last = client.chat.completions.messages.list(rid, order="desc", limit=2)
    assert [m.id for m in last.data] == [f"{rid}-3", f"{rid}-2"] and last.has_more
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.messages.list("mock-m-000000000000")


def test_update_and_delete(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    run = uuid.uuid4().hex
    kept, gone = say(client, "kept", metadata={"run": run}), say(client, "gone", metadata={"run": run})
    updated = client.chat.completions.update(kept, metadata={"run": run, "label": "good"})
    assert updated.id == kept and updated.metadata == {"run": run, "label": "good"}
    assert [c.id for c in client.chat.completions.list(metadata={"label": "good", "run": run})] == [kept]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.update(kept, metadata={"k" * 65: "v"})
    deleted = client.chat.completions.delete(gone)
    assert (deleted.id, deleted.object, deleted.deleted) == (gone, "chat.completion.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(gone)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.delete(gone)
    assert [c.id for c in client.chat.completions.list(metadata={"run": run})] == [kept]


@pytest.fixture
def tenant_gateway(tmp_path: Path, upstream: MockServer) -> Iterator[GatewayProcess]:
    config = write_config(tmp_path / "g.toml", upstream.url, extra='\n[auth]\nkeys_env = "GW_STORED_KEYS"\n')
    proc = GatewayProcess(config, tmp_path / "var", env={"GW_STORED_KEYS": f"{KEY_A},{KEY_B}"}).start()
    yield proc
    proc.stop()


def test_another_tenant_gets_404(tenant_gateway: GatewayProcess, upstream: MockServer) -> None:
    a, b = sdk(tenant_gateway, KEY_A), sdk(tenant_gateway, KEY_B)
    rid = say(a, "secret", metadata={"owner": "a"})
    mine = say(b, "mine", metadata={"owner": "b"})
    for call in (
        lambda: b.chat.completions.retrieve(rid),
        lambda: b.chat.completions.messages.list(rid),
        lambda: b.chat.completions.update(rid, metadata={"owner": "b"}),
        lambda: b.chat.completions.delete(rid),
        lambda: b.chat.completions.list(after=rid),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [c.id for c in b.chat.completions.list()] == [mine]
    assert [c.id for c in a.chat.completions.list()] == [rid]
    assert a.chat.completions.retrieve(rid).metadata == {"owner": "a"}  # untouched
