"""What a client of `gateway serve` sees, against a provider as strict as OpenAI (it rejects
any argument or message field it does not know): the gateway's own fields never reach it,
`session_id` continues a conversation, a trimmed history is not sent twice, `/v1/models`
lists the provider's own models, and every Responses turn is one log line and one upstream
observation."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import GatewayProcess, sdk, write_config
from tests.mockserver import MockServer, unknown_fields


def ask(gateway: GatewayProcess, messages: list[dict[str, object]], **extra: object) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "mock/tiny", "messages": messages, **extra},
        timeout=30,
    )


def user(text: str, **extra: object) -> dict[str, object]:
    return {"role": "user", "content": text, **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_fields_never_reach_a_strict_provider(
    gateway: GatewayProcess, upstream: MockServer, stream: bool
) -> None:
    cid = f"strict-{stream}"
    fields = {
        "conversation_id": cid,
        "agent_id": "agent-7",
        "session_id": "ignored-when-conversation_id-is-set",
        "response_id": "resp-from-the-client",
        "user_timezone": "Europe/Paris",
        "is_feedback": False,  # a message field; sent at the top level, it is stripped as well
        "user": "end-user-1",
    }
    for text in ["my name is Strict", "what is my name?"]:
        r = ask(gateway, [user(text)], stream=stream, **fields)
        assert r.status_code == 200, r.text
    feedback = ask(gateway, [user("thanks, that was right", is_feedback=True)], **fields)
    assert feedback.status_code == 200, feedback.text
    assert len(upstream.requests) == 3
    assert all(unknown_fields(body) == [] for body in upstream.requests)
    assert upstream.requests[-1]["user"] == "end-user-1"  # OpenAI's own field is passed on


def test_session_id_continues_a_conversation(gateway: GatewayProcess, upstream: MockServer) -> None:
    first = ask(gateway, [user("my colour is teal")], session_id="sess-42")
    assert first.status_code == 200 and first.headers["x-conversation-id"] == "sess-42"
    second = ask(gateway, [user("what is my colour?")], session_id="sess-42")
    assert second.json()["choices"][0]["message"]["content"] == "Your colour is teal."


def test_a_trimmed_history_is_not_sent_twice(gateway: GatewayProcess, upstream: MockServer) -> None:
    cid = "trimmed"
    q1, q2 = user("my name is Tim"), user("my city is Oslo")
    a1 = ask(gateway, [q1], conversation_id=cid).json()["choices"][0]["message"]
    a2 = ask(gateway, [q1, a1, q2], conversation_id=cid).json()["choices"][0]["message"]
    # A client that keeps only its newest messages: the overlap with the stored tail is dropped.
    r = ask(gateway, [q2, a2, user("what is my name?")], conversation_id=cid)
    assert r.json()["choices"][0]["message"]["content"] == "Your name is Tim."
    contents = [m["content"] for m in upstream.requests[-1]["messages"]]
    assert contents == [q1["content"], a1["content"], q2["content"], a2["content"], "what is my name?"]


def test_models_lists_the_providers_own_models(gateway: GatewayProcess, upstream: MockServer) -> None:
    ids = [m.id for m in sdk(gateway).models.list()]
    assert {"mock/tiny", "mock/m", "mock/big"} <= set(ids)
    # models.retrieve: one entry of the list (a model id holds a slash), or a 404
    one = sdk(gateway).models.retrieve("mock/tiny")
    assert (one.id, one.object) == ("mock/tiny", "model")
    with pytest.raises(openai.NotFoundError) as info:
        sdk(gateway).models.retrieve("mock/no-such-model")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_each_responses_turn_is_one_log_line_and_one_upstream_observation(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    def observed() -> float:
        text = httpx.get(f"{gateway.url}/metrics").text
        match = re.search(r'gateway_upstream_seconds_count\{provider="mock"\} ([0-9.]+)', text)
        return float(match.group(1)) if match else 0.0

    before = observed()
    log_before = gateway.log_path.read_text().count('"event":"response"')
    client = sdk(gateway)
    first = client.responses.create(model="mock/tiny", input="my name is Resa")
    client.responses.create(model="mock/tiny", input="what is my name?", previous_response_id=first.id)
    assert observed() - before == 2
    lines = [line for line in gateway.log_path.read_text().splitlines() if '"event":"response"' in line]
    assert len(lines) - log_before == 2
    assert all('"outcome":"complete"' in line for line in lines[log_before:])


def test_the_recap_is_off_by_default_so_one_conversation_never_reaches_another(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    secret = ask(
        gateway, [user("my secret project is Falcon")], conversation_id="recap-a", user="shared-user"
    )
    assert secret.status_code == 200
    other = ask(gateway, [user("hello")], conversation_id="recap-b", user="shared-user")
    assert other.status_code == 200
    assert "Falcon" not in str(upstream.requests[-1]["messages"])


def test_reading_after_a_delete_logs_no_damage(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    client.conversations.create(extra_body={"id": "del-1"})
    first = client.responses.create(model="mock/tiny", input="my name is Del", conversation="del-1")
    client.responses.create(model="mock/tiny", input="and my pet is Rex", conversation="del-1")
    log_before = len(gateway.log_path.read_text())
    client.responses.delete(first.id)
    reply = client.responses.create(model="mock/tiny", input="what is my name?", conversation="del-1")
    assert "Del" not in str(upstream.requests[-1]["messages"])
    assert reply.output_text
    assert "not committed" not in gateway.log_path.read_text()[log_before:]


def test_an_expired_conversation_starts_afresh_on_its_next_request(
    tmp_path: Path, upstream: MockServer
) -> None:
    """Expiry is checked when the conversation is loaded, not only by the background pass."""
    config = write_config(tmp_path / "ttl.toml", upstream.url, extra="[sessions]\nttl = 1\nidle_after = 0\n")
    proc = GatewayProcess(config, tmp_path / "var").start()
    try:
        first = ask(proc, [user("my name is Old")], conversation_id="ttl-1")
        assert first.status_code == 200
        expires = httpx.get(f"{proc.url}/v1/conversations/ttl-1").json()["expires_at"]
        time.sleep(max(0.0, expires - time.time()) + 1.1)
        again = ask(proc, [user("what is my name?")], conversation_id="ttl-1")
        assert again.json()["choices"][0]["message"]["content"] == "I don't know your name yet."
        assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user"]
        assert list((tmp_path / "var" / "archive").iterdir())  # the expired one was archived
    finally:
        proc.stop()


def test_a_provider_key_quoted_back_by_the_provider_is_never_passed_on(
    tmp_path: Path, upstream: MockServer
) -> None:
    """A provider's error may quote the key it was sent ("Incorrect API key provided: …"): the
    client, the response log and the log lines get the text with the key replaced."""
    key = "sk-provider-secret-7f3a9c"
    config = write_config(tmp_path / "gateway.toml", upstream.url)
    config.write_text(
        config.read_text().replace("timeout = 5\n", 'timeout = 5\napi_key_env = "QUOTED_KEY"\n', 1)
    )
    proc = GatewayProcess(config, tmp_path / "var", env={"QUOTED_KEY": key}).start()
    try:
        upstream.mode = "echo_key"
        said = []
        for text, stream in (("hello", False), ("hello", True), ("[500] hello", False)):
            r = httpx.post(
                f"{proc.url}/v1/chat/completions",
                json={"model": "mock/tiny", "messages": [user(text)], "stream": stream},
                headers={"x-conversation-id": "quoted-key"},
                timeout=30,
            )
            assert r.status_code in (401, 502), r.text
            said.append(r.text)
        assert upstream.headers[-1]["authorization"] == f"Bearer {key}"  # it was sent, and quoted
        assert all("Incorrect API key provided: Bearer [redacted]" in text for text in said), said
        rid = r.headers["x-response-id"]
        logged = httpx.get(f"{proc.url}/v1/responses/{rid}", timeout=10).text
        assert "[redacted]" in logged
    finally:
        proc.stop()
    files = [p for p in (tmp_path / "var").rglob("*") if p.is_file()]
    assert files and not [p for p in files if key.encode() in p.read_bytes()]
    assert key not in proc.log()


def test_an_open_gateway_refuses_other_sites_pages_and_rebound_names(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    """Open (no keys) means open to its clients, not to any web page its user visits: a page of
    another site could post a `text/plain` body (no preflight) and rewrite local conversations,
    or reach them through a DNS name rebound to 127.0.0.1."""
    body = '{"model": "mock/tiny", "messages": [{"role": "user", "content": "from a web page"}]}'
    url = f"{gateway.url}/v1/chat/completions"
    plain = {"content-type": "text/plain", "x-conversation-id": "csrf"}
    rebound = f"http://rebound.example:{gateway.port}"  # a DNS name rebound to 127.0.0.1
    # Names that only begin like a loopback address are other sites' (they were taken as local).
    lookalikes = ({"origin": "http://127.0.0.1.attacker.example"}, {"origin": "http://127.evil.example"})
    for headers in (
        {"origin": "https://evil.example"},
        {"origin": rebound, "host": rebound[7:]},
        *lookalikes,
    ):
        r = httpx.post(url, content=body, headers={**plain, **headers}, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin", (headers, r.text)
    assert httpx.get(f"{gateway.url}/v1/conversations/csrf", timeout=10).status_code == 404  # nothing stored
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text  # (was "unmatched": no such path)
    assert 'gateway_requests_total{route="cross_origin",status="403"} 4.0' in metrics
    for local in ("http://127.0.0.2:9", "http://[::1]:9", "http://localhost:9"):  # this machine's own
        assert (
            httpx.post(url, content=body, headers={**plain, "origin": local}, timeout=10).status_code == 200
        )
    same_site = {"origin": gateway.url}  # the inspector's own page, and clients that send none
    assert httpx.post(url, content=body, headers={**plain, **same_site}, timeout=10).status_code == 200
    assert httpx.post(url, content=body, headers=plain, timeout=10).status_code == 200
