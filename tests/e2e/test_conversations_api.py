"""The Conversations API through the official SDK against a real `gateway serve`, and tenants."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import GatewayProcess, sdk, write_config
from tests.mockserver import MockServer


def test_sdk_conversation_lifecycle(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    conv = client.conversations.create(
        metadata={"topic": "pets"},
        items=[{"type": "message", "role": "system", "content": "You are a vet."}],
    )
    assert (
        conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "pets"}
    )
    created = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "my dog is called Rex"}]
    )
    assert created.data[0].type == "message" and created.data[0].role == "user"

    # A chat completion on that conversation sees the created items.
    reply = client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "what is my dog?"}],
        extra_body={"conversation_id": conv.id},
    )
    sent = upstream.requests[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "You are a vet."}
    assert sent[1] == {"role": "user", "content": "my dog is called Rex"}
    assert reply.choices[0].message.content == "Your dog is Rex."

    # items.list returns the completion's turn (newest first by default), paginated.
    items = client.conversations.items.list(conv.id)
    texts = [(i.role, i.content[0].text) for i in items.data if i.type == "message"]
    assert texts[0] == ("assistant", "Your dog is Rex.")
    assert texts[1] == ("user", "what is my dog?")
    assert texts[-1] == ("system", "You are a vet.")
    asc = client.conversations.items.list(conv.id, order="asc", limit=2)
    assert [i.role for i in asc.data] == ["system", "user"] and asc.has_more
    paged = list(client.conversations.items.list(conv.id, order="asc", limit=1))  # auto-pagination
    assert len(paged) == 4
    one = client.conversations.items.retrieve(paged[1].id, conversation_id=conv.id)
    assert one.id == paged[1].id and one.content[0].text == "my dog is called Rex"

    # Metadata update and retrieval.
    updated = client.conversations.update(conv.id, metadata={"topic": "dogs"})
    assert updated.metadata == {"topic": "dogs"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "dogs"}

    # Deleting an item removes it from what the model sees next.
    client.conversations.items.delete(paged[1].id, conversation_id=conv.id)
    client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "what is my dog?"}],
        extra_body={"conversation_id": conv.id},
    )
    assert "my dog is called Rex" not in [m.get("content") for m in upstream.requests[-1]["messages"]]

    # Delete means gone; the same id then starts a new conversation.
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    assert not (gateway.data_dir / "logs" / "conversations" / f"{conv.id}.jsonl").exists()
    items = gateway.data_dir.joinpath("logs", "responses").glob("items-*.jsonl")
    assert not any(conv.id in p.read_text() for p in items)
    client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "hello again"}],
        extra_body={"conversation_id": conv.id},
    )
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user"]


def test_list_reset_and_responses_lookup(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    for cid in ["a1", "a2", "a3"]:
        r = client.chat.completions.create(
            model="mock/m",
            messages=[{"role": "system", "content": "S"}, {"role": "user", "content": f"my name is {cid}"}],
            extra_body={"conversation_id": cid},
        )
    listing = httpx.get(f"{gateway.url}/v1/conversations", params={"limit": 2}).json()
    assert [c["id"] for c in listing["data"]] == ["a3", "a2"] and listing["has_more"]
    rest = httpx.get(f"{gateway.url}/v1/conversations", params={"after": "a2", "limit": 100}).json()
    assert [c["id"] for c in rest["data"]][0] == "a1" and not rest["has_more"]  # then older ones

    looked_up = httpx.get(f"{gateway.url}/v1/responses/{r.id}").json()
    assert looked_up["status"] == "completed" and looked_up["conversation"] == {"id": "a3"}
    assert looked_up["output"][0]["content"][0]["text"] == r.choices[0].message.content
    assert looked_up["gateway"]["response"]["message"]["content"] == r.choices[0].message.content
    assert httpx.get(f"{gateway.url}/v1/responses/nope-000000000000").status_code == 404

    for bad in ({"keep_system_message": "yes"}, {"keep_system_message": 1}, []):
        refused = httpx.post(f"{gateway.url}/v1/conversations/a3/reset", json=bad)
        assert refused.status_code == 400, (bad, refused.text)  # not taken for true: nothing reset
    index_path = gateway.data_dir / "logs" / "conversations" / "a3.jsonl"
    assert len(index_path.read_text().splitlines()) == 1
    reset = httpx.post(f"{gateway.url}/v1/conversations/a3/reset", json={"keep_system_message": True})
    assert reset.status_code == 200
    client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "what is my name?"}],
        extra_body={"conversation_id": "a3"},
    )
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user"]  # history gone, system prompt kept
    index = (gateway.data_dir / "logs" / "conversations" / "a3.jsonl").read_text().splitlines()
    assert json.loads(index[1])["type"] == "reset"  # appended, nothing rewritten
    assert httpx.post(f"{gateway.url}/v1/conversations/zz/reset", json={}).status_code == 404


def test_archive_deleted(tmp_path: Path, upstream: MockServer) -> None:
    config = write_config(tmp_path / "g.toml", upstream.url, extra="")
    config.write_text(config.read_text().replace("[storage]\n", "[storage]\narchive_deleted = true\n"))
    proc = GatewayProcess(config, tmp_path / "var").start()
    try:
        client = sdk(proc)
        client.chat.completions.create(
            model="mock/m",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"conversation_id": "arch"},
        )
        client.conversations.delete("arch")
    finally:
        proc.stop()
    archived = list((tmp_path / "var" / "archive").iterdir())
    assert len(archived) == 1 and (archived[0] / "conversation.jsonl").exists()
    assert len(list((archived[0] / "responses").iterdir())) == 1


CANARY_A = "sk-gw-CANARY-aaaaaaaaaaaaaaaaaaaa"
CANARY_B = "sk-gw-CANARY-bbbbbbbbbbbbbbbbbbbb"
PROVIDER_CANARY = "sk-provider-CANARY-cccccccccccccc"


@pytest.fixture
def tenant_gateway(tmp_path: Path, upstream: MockServer) -> GatewayProcess:
    config = write_config(tmp_path / "g.toml", upstream.url)
    config.write_text(
        config.read_text().replace(
            "[providers.mock]\n", '[providers.mock]\napi_key_env = "MOCK_PROVIDER_KEY"\n'
        )
        + '\n[auth]\nkeys_env = "GW_TEST_KEYS"\n'
    )
    proc = GatewayProcess(
        config,
        tmp_path / "var",
        env={"GW_TEST_KEYS": f"{CANARY_A},{CANARY_B}", "MOCK_PROVIDER_KEY": PROVIDER_CANARY},
    ).start()
    yield proc
    proc.stop()


def test_tenants_are_isolated_and_secrets_never_stored(
    tenant_gateway: GatewayProcess, upstream: MockServer
) -> None:
    gw = tenant_gateway
    a, b = sdk(gw, CANARY_A), sdk(gw, CANARY_B)
    # No key or a wrong key: 401 on every endpoint but the health checks.
    assert httpx.get(f"{gw.url}/v1/models").status_code == 401
    assert httpx.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{gw.url}/healthz").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        sdk(gw, "wrong").chat.completions.create(model="mock/m", messages=[{"role": "user", "content": "x"}])

    ra = a.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "my name is Alice"}],
        extra_body={"conversation_id": "shared"},
    )
    rb = b.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "my name is Bob"}],
        extra_body={"conversation_id": "shared"},
    )
    # The same id under two keys names two conversations.
    answer = a.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "what is my name?"}],
        extra_body={"conversation_id": "shared"},
    )
    assert answer.choices[0].message.content == "Your name is Alice."
    conv_b = b.conversations.create(metadata={"owner": "b"})

    # Every endpoint: the other tenant's ids are 404.
    hb = {"Authorization": f"Bearer {CANARY_B}"}
    assert httpx.get(f"{gw.url}/v1/responses/{ra.id}", headers=hb).status_code == 404
    ha = {"Authorization": f"Bearer {CANARY_A}"}
    assert httpx.get(f"{gw.url}/v1/responses/{rb.id}", headers=ha).status_code == 404
    for method, path in [
        ("GET", f"/v1/conversations/{conv_b.id}"),
        ("POST", f"/v1/conversations/{conv_b.id}"),
        ("DELETE", f"/v1/conversations/{conv_b.id}"),
        ("GET", f"/v1/conversations/{conv_b.id}/items"),
        ("POST", f"/v1/conversations/{conv_b.id}/items"),
        ("POST", f"/v1/conversations/{conv_b.id}/reset"),
        ("GET", f"/v1/conversations/{conv_b.id}/context"),
    ]:
        body = (
            {"metadata": {"x": "y"}}
            if path.endswith(conv_b.id) and method == "POST"
            else {}
            if path.endswith("/reset")
            else {"items": [{"type": "message", "role": "user", "content": "x"}]}
        )
        r = httpx.request(method, f"{gw.url}{path}", headers=ha, json=body if method == "POST" else None)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
    assert conv_b.id not in [
        c["id"] for c in httpx.get(f"{gw.url}/v1/conversations", headers=ha).json()["data"]
    ]
    assert b.conversations.retrieve(conv_b.id).metadata == {"owner": "b"}  # untouched

    # Canary secrets appear in no file under the data dir and in no log line.
    texts = [p.read_bytes() for p in gw.data_dir.rglob("*") if p.is_file()]
    texts.append(gw.log().encode())
    for canary in (CANARY_A, CANARY_B, PROVIDER_CANARY):
        assert not any(canary.encode() in t for t in texts), canary


def test_the_cli_reads_every_tenants_data(tenant_gateway: GatewayProcess, upstream: MockServer) -> None:
    """With [auth] keys, conversations live under tenants/t…: the operator's commands find them
    (listing every tenant's, or the one named by --tenant) and never mix two tenants up."""
    import subprocess
    import sys

    from gateway.tenants import tenant_id
    from tests.conftest import REPO

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", *args, "--config", str(gw.config), "--data-dir", str(data)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    gw = tenant_gateway
    data = gw.data_dir
    a, b = sdk(gw, CANARY_A), sdk(gw, CANARY_B)
    for client, cid, text in ((a, "both", "I am Alice"), (b, "both", "I am Bob"), (a, "alone", "only Alice")):
        rid = client.chat.completions.create(
            model="mock/m", messages=[{"role": "user", "content": text}], extra_body={"conversation_id": cid}
        ).id
    ta, tb = tenant_id(CANARY_A), tenant_id(CANARY_B)
    listing = cli("conversations")
    assert listing.returncode == 0, listing.stderr
    rows = [line.split()[:2] for line in listing.stdout.splitlines()[1:]]
    assert sorted(rows) == sorted([[ta, "both"], [tb, "both"], [ta, "alone"]])
    only_b = cli("conversations", "--tenant", tb).stdout.splitlines()[1:]
    assert [r.split()[:2] for r in only_b] == [[tb, "both"]]
    shown = cli("show", "alone")  # in one tenant only: found there
    assert shown.returncode == 0 and "only Alice" in shown.stdout, shown.stderr
    ambiguous = cli("show", "both")
    assert ambiguous.returncode == 1 and ta in ambiguous.stderr and "--tenant" in ambiguous.stderr
    assert len(ambiguous.stderr.strip().splitlines()) == 1
    named = cli("show", "both", "--tenant", tb)
    assert named.returncode == 0 and "I am Bob" in named.stdout and "Alice" not in named.stdout
    context = cli("context", rid)  # the last response, Alice's
    assert context.returncode == 0 and "only Alice" in context.stdout, context.stderr
    assert cli("context", rid, "--tenant", tb).returncode == 1  # not Bob's
    assert cli("show", "alone", "--tenant", "default").returncode == 1  # nothing without a key
    assert cli("show", "alone", "--tenant", "../x").returncode == 1


def test_the_sdks_list_and_delete_loop_clears_a_conversation(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    """The SDK's auto-pagination asks for the page after the last item it listed, which the
    loop has deleted meanwhile: the page goes on from where that item was."""
    client = sdk(gateway)
    items = [{"type": "message", "role": "user", "content": f"note {i}"} for i in range(6)]
    conv = client.conversations.create(items=items)  # type: ignore[arg-type]
    for order in ("asc", "desc"):
        seen = []
        for item in client.conversations.items.list(conv.id, limit=2, order=order):
            seen.append(item.id)
            client.conversations.items.delete(item.id, conversation_id=conv.id)
            if order == "asc" and len(seen) == 3:
                break  # half of them in one order, the rest in the other
        assert seen
    assert client.conversations.items.list(conv.id).data == []
    unknown = httpx.get(
        f"{gateway.url}/v1/conversations/{conv.id}/items", params={"after": "msg_nope-0123_0"}
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "after"
