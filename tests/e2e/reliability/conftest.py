"""Fixtures for the reliability tests: the fault-injecting upstream, a `gateway serve` process
wired to it (and to a refused port and a black-holed one), and checks of what ended up on disk."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import GatewayProcess
from tests.e2e.reliability.faultserver import FaultServer, blackhole, closed_port

SOAK = os.environ.get("SOAK", "") not in ("", "0")


def gateway_config(
    path: Path, fault_url: str, *, extra: str = "", storage: str = "", blackhole_port: int = 0
) -> Path:
    """Providers: `fault` (the fault server, 1 retry), `noretry` (same, 0 retries), `refused`
    (nobody listens), `blackhole` (connects hang). Windows large enough to send everything."""
    path.write_text(
        f"""default_provider = "fault"

[server]
body_timeout = 1
max_body_bytes = 1_000_000

[storage]
durability = "fsync"
lock_timeout = 20
{storage}

[context]
max_context_tokens = 10_000_000
max_history_messages = 100_000

[providers.fault]
kind = "openai"
base_url = "{fault_url}/v1"
timeout = 1.5
connect_timeout = 0.5
retries = 1

[providers.noretry]
kind = "openai"
base_url = "{fault_url}/v1"
timeout = 1.5
connect_timeout = 0.5
retries = 0

[providers.refused]
kind = "openai"
base_url = "http://127.0.0.1:{closed_port()}/v1"
connect_timeout = 0.5

[providers.blackhole]
kind = "openai"
base_url = "http://127.0.0.1:{blackhole_port or closed_port()}/v1"
connect_timeout = 0.4
retries = 1
{extra}
"""
    )
    return path


@pytest.fixture(scope="session")
def fault_server() -> Iterator[FaultServer]:
    server = FaultServer()
    with server.running():
        yield server


@pytest.fixture
def fault(fault_server: FaultServer) -> Iterator[FaultServer]:
    fault_server.reset()
    yield fault_server
    fault_server.reset()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, fault_server: FaultServer) -> Iterator[GatewayProcess]:
    """One `gateway serve` (1 worker) per test module; tests use their own conversation ids."""
    root = tmp_path_factory.mktemp("gw")
    with blackhole() as port:
        config = gateway_config(root / "gateway.toml", fault_server.url, blackhole_port=port)
        proc = GatewayProcess(config, root / "var").start()
        try:
            yield proc
        finally:
            proc.stop()


# -- what is on disk --------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def index_ids(data_dir: Path, cid: str) -> list[str]:
    path = data_dir / "logs" / "conversations" / f"{cid}.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")[:-1]  # an unterminated last line is torn: not part of the index
    return [line for line in lines if line and not line.startswith("{")]


def response_records(data_dir: Path, rid: str) -> list[dict[str, Any]]:
    return read_jsonl(data_dir / "logs" / "responses" / f"{rid}.jsonl")


def responses_of(data_dir: Path, cid: str) -> dict[str, list[dict[str, Any]]]:
    """Every response log (committed or not) whose request names the conversation."""
    out = {}
    for path in (data_dir / "logs" / "responses").glob("*.jsonl"):
        records = read_jsonl(path)
        if records and records[0].get("conversation_id") == cid:
            out[path.stem] = records
    return out


def wait_for(predicate: Any, timeout: float = 3.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def assert_history(data_dir: Path, cid: str, acked: list[str]) -> None:
    """The index names exactly the acknowledged responses, each committed; every other
    attempt on the conversation is marked incomplete."""
    index = index_ids(data_dir, cid)
    assert index == acked
    logs = responses_of(data_dir, cid)
    for rid in index:
        assert logs[rid][-1]["type"] == "commit", rid
    for rid, records in logs.items():
        if rid not in index:
            # Abandoning runs after the client got its answer: give it a moment.
            final = wait_for(lambda rid=rid: response_records(data_dir, rid)[-1]["type"] == "incomplete")
            assert final, (rid, records[-1])


# -- driving a conversation -------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    headers: httpx.Headers
    body: Any = None  # the JSON body (non-streaming or error)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None  # an in-band error event
    done: bool = False  # saw `data: [DONE]`

    @property
    def text(self) -> str:
        if self.body is not None and "choices" in self.body:
            return str(self.body["choices"][0]["message"]["content"])
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))

    @property
    def response_id(self) -> str | None:
        return self.headers.get("x-response-id")


def send(
    url: str,
    cid: str,
    text: str,
    *,
    model: str = "fault/m",
    stream: bool = False,
    timeout: float = 15.0,
    client: httpx.Client | None = None,
) -> Reply:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "conversation_id": cid,
    }
    if stream:
        body["stream"] = True
    own = client is None
    http = client or httpx.Client(timeout=timeout)
    try:
        with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200 or not stream:
                r.read()
                return Reply(r.status_code, r.headers, r.json() if r.content else None)
            reply = Reply(r.status_code, r.headers)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    reply.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    reply.error = event["error"]
                else:
                    reply.chunks.append(event)
            return reply
    finally:
        if own:
            http.close()


class Conversation:
    """A conversation driven over HTTP that remembers what the model should see next time."""

    def __init__(self, gateway: GatewayProcess, fault: FaultServer, cid: str) -> None:
        self.gw = gateway
        self.fault = fault
        self.cid = cid
        self.acked: list[str] = []
        self.transcript: list[dict[str, Any]] = []

    def send(self, text: str, **kwargs: Any) -> Reply:
        reply = send(self.gw.url, self.cid, text, **kwargs)
        complete = reply.status == 200 and reply.error is None and (reply.done or not kwargs.get("stream"))
        if complete:
            assert reply.response_id
            self.acked.append(reply.response_id)
            self.transcript += [
                {"role": "user", "content": text},
                {"role": "assistant", "content": reply.text},
            ]
        return reply

    def ok(self, text: str, **kwargs: Any) -> Reply:
        before = len(self.fault.requests)
        reply = self.send(text, **kwargs)
        assert reply.status == 200 and reply.error is None, (reply.status, reply.body, reply.error)
        if kwargs.get("stream"):
            assert reply.done
        sent = self.fault.requests[before:]
        assert sent, "the upstream was not called"
        # The model saw exactly the acknowledged history, then the new message.
        assert _plain(sent[-1].messages) == self.transcript[:-1]
        return reply

    def check(self) -> None:
        """Disk holds exactly the acknowledged turns, and a follow-up sees each exactly once."""
        assert_history(self.gw.data_dir, self.cid, self.acked)
        self.ok("And now?")
        assert_history(self.gw.data_dir, self.cid, self.acked)


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": m["role"], "content": m.get("content")} for m in messages]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
