"""End to end: the real `gateway serve` process, a real HTTP mock upstream, the official SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import GatewayProcess, sdk
from tests.mockserver import MockServer

TURNS = ["Hello, my name is Bob.", "I like trains.", "What is my name?"]


def _user_and_assistant(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m.get("content")) for m in messages]


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_recall_sending_only_new_messages(
    gateway: GatewayProcess, upstream: MockServer, stream: bool
) -> None:
    client = sdk(gateway)
    cid = f"c1-{'stream' if stream else 'json'}"
    replies = []
    ids = []
    for text in TURNS:
        kwargs = {
            "model": "mock/tiny",
            "messages": [{"role": "user", "content": text}],
            "extra_body": {"conversation_id": cid},
        }
        if stream:
            chunks = list(
                client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
            )
            assert len({c.id for c in chunks}) == 1
            ids.append(chunks[0].id)
            replies.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].usage is not None and chunks[-1].choices == []
        else:
            completion = client.chat.completions.create(**kwargs)
            ids.append(completion.id)
            replies.append(completion.choices[0].message.content)
            assert completion.model_extra["conversation_id"] == cid
    assert replies[-1] == "Your name is Bob."
    for rid in ids:
        assert rid.startswith("mock-tiny-") and len(rid) == len("mock-tiny-") + 12
    # The upstream saw every message exactly once, in order, user -> assistant per turn.
    assert len(upstream.requests) == 3
    last = upstream.requests[-1]["messages"]
    assert _user_and_assistant(last) == [
        ("user", TURNS[0]),
        ("assistant", replies[0]),
        ("user", TURNS[1]),
        ("assistant", replies[1]),
        ("user", TURNS[2]),
    ]
    assert upstream.requests[-1]["model"] == "tiny"
    assert "conversation_id" not in upstream.requests[-1]
    # The index names the three responses in order; each response log is committed.
    index = (gateway.data_dir / "logs" / "conversations" / f"{cid}.jsonl").read_text().split()
    assert index == ids
    for rid in ids:
        records = [
            json.loads(line)
            for line in (gateway.data_dir / "logs" / "responses" / f"{rid}.jsonl").read_text().splitlines()
        ]
        assert records[0]["type"] == "request" and records[-1]["type"] == "commit"


def test_full_history_client_is_not_duplicated(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    history: list[dict] = [{"role": "system", "content": "Be brief."}]
    for text in TURNS:
        history.append({"role": "user", "content": text})
        completion = client.chat.completions.create(
            model="mock/tiny", messages=history, extra_body={"conversation_id": "full"}
        )
        history.append(completion.choices[0].message.model_dump(exclude_none=True))
    assert history[-1]["content"] == "Your name is Bob."
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in sent] == [m["content"] for m in history[:-1]]


def test_headers_and_body_ids(gateway: GatewayProcess, upstream: MockServer) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "mock/tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Conversation-Id": "hdr-1"},
    )
    assert r.status_code == 200
    body = r.json()
    assert r.headers["x-response-id"] == body["id"]
    assert r.headers["x-conversation-id"] == "hdr-1" == body["conversation_id"]


def test_bad_conversation_id_is_400_in_openai_shape(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    indexes = gateway.data_dir / "logs" / "conversations"
    before = sorted(p.name for p in indexes.iterdir()) if indexes.exists() else []
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="mock/tiny",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"conversation_id": "../etc/passwd"},
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == "conversation_id"
    assert upstream.requests == []
    assert (sorted(p.name for p in indexes.iterdir()) if indexes.exists() else []) == before


def test_upstream_500_adds_nothing_to_history(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    client.chat.completions.create(
        model="mock/tiny",
        messages=[{"role": "user", "content": "my name is Ann"}],
        extra_body={"conversation_id": "e5"},
    )
    upstream.mode = "error500"
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model="mock/tiny",
            messages=[{"role": "user", "content": "lost message"}],
            extra_body={"conversation_id": "e5"},
        )
    assert info.value.status_code == 502
    assert "boom" in info.value.message
    upstream.mode = "normal"
    reply = client.chat.completions.create(
        model="mock/tiny",
        messages=[{"role": "user", "content": "what is my name?"}],
        extra_body={"conversation_id": "e5"},
    )
    assert reply.choices[0].message.content == "Your name is Ann."
    contents = upstream.user_contents()
    assert "lost message" not in contents
    index = (gateway.data_dir / "logs" / "conversations" / "e5.jsonl").read_text().split()
    assert len(index) == 2
    # The failed attempt stays in its own log, marked incomplete.
    attempts = [
        p for p in (gateway.data_dir / "logs" / "responses").iterdir() if "lost message" in p.read_text()
    ]
    assert len(attempts) == 1 and '"incomplete"' in attempts[0].read_text()


def test_unreachable_provider_is_502_naming_it(tmp_path, upstream: MockServer) -> None:
    from tests.conftest import free_port, write_config

    dead = f"http://127.0.0.1:{free_port()}"
    proc = GatewayProcess(write_config(tmp_path / "g.toml", dead), tmp_path / "var").start()
    try:
        r = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json={
                "model": "mock/x",
                "messages": [{"role": "user", "content": "hi"}],
                "conversation_id": "u1",
            },
        )
        assert r.status_code == 502
        err = r.json()["error"]
        assert "'mock'" in err["message"] and dead in err["message"]
        assert err["code"] == "upstream_unreachable"
    finally:
        proc.stop()


def test_demo_model_and_models_endpoint(gateway: GatewayProcess) -> None:
    client = sdk(gateway)
    ids = [m.id for m in client.models.list().data]
    assert "demo" in ids
    client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "My name is Zed."}],
        extra_body={"conversation_id": "d"},
    )
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "What is my name?"}],
        extra_body={"conversation_id": "d"},
    )
    assert r.choices[0].message.content == "Your name is Zed."
    assert r.id.startswith("demo-")
