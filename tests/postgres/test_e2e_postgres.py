"""End to end on PostgreSQL: real `gateway serve` processes on one database, the official SDK,
the real HTTP mock upstream. One replica recalls; three replicas lose, duplicate and fork
nothing, also when one of them is killed with SIGKILL in the middle of the load."""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from gateway.redact import redact_dsn
from gateway.store.postgres import PostgresStore
from tests.conftest import GatewayProcess, write_config
from tests.mockserver import MockServer
from tests.views import load

TURNS = ["Hello, my name is Bob.", "I like trains.", "What is my name?"]


def start_replicas(tmp_path: Path, upstream: MockServer, dsn: str, count: int) -> list[GatewayProcess]:
    config = write_config(tmp_path / "gateway.toml", upstream.url)
    env = {"GATEWAY_STORAGE__BACKEND": "postgres", "GATEWAY_STORAGE__DSN": dsn}
    procs = [GatewayProcess(config, tmp_path / f"var{i}", env=env) for i in range(count)]
    started: list[GatewayProcess] = []
    try:
        with ThreadPoolExecutor(count) as pool:  # start together: migrations race, on purpose
            started = list(pool.map(lambda p: p.start(), procs))
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return started


@pytest.fixture
def replicas(tmp_path: Path, upstream: MockServer, pg_dsn: str) -> Iterator[list[GatewayProcess]]:
    procs = start_replicas(tmp_path, upstream, pg_dsn, 3)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def read_store(dsn: str, work: Any) -> Any:
    async def run() -> Any:
        store = PostgresStore(dsn)
        try:
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(run())


def test_three_turn_recall_on_postgres(tmp_path: Path, upstream: MockServer, pg_dsn: str) -> None:
    """Only new messages sent, streaming (c-stream) and not (c-plain): the model sees it all."""
    (gateway,) = start_replicas(tmp_path, upstream, pg_dsn, 1)
    ids: dict[str, list[str]] = {"c-plain": [], "c-stream": []}
    try:
        # Its start line says where the conversations are (it named only the data dir).
        assert f"(PostgreSQL {redact_dsn(pg_dsn)}, 1 worker)" in gateway.log()
        client = OpenAI(base_url=f"{gateway.url}/v1", api_key="k", max_retries=0)
        for cid in ids:
            upstream.reset()
            replies = []
            for text in TURNS:
                kwargs: dict[str, Any] = {
                    "model": "mock/tiny",
                    "messages": [{"role": "user", "content": text}],
                    "extra_body": {"conversation_id": cid},
                }
                if cid == "c-stream":
                    chunks = list(client.chat.completions.create(stream=True, **kwargs))
                    ids[cid].append(chunks[0].id)
                    replies.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                else:
                    completion = client.chat.completions.create(**kwargs)
                    ids[cid].append(completion.id)
                    replies.append(completion.choices[0].message.content)
            assert replies[-1] == "Your name is Bob."
            last = upstream.requests[-1]["messages"]
            assert [(m["role"], m["content"]) for m in last] == [
                ("user", TURNS[0]),
                ("assistant", replies[0]),
                ("user", TURNS[1]),
                ("assistant", replies[1]),
                ("user", TURNS[2]),
            ]
        # The CLI reads the configured backend (here: the database), not a data dir.
        import subprocess
        import sys

        def cli(*args: str) -> str:
            out = subprocess.run(
                [sys.executable, "-m", "gateway", *args, "--config", str(gateway.config)],
                capture_output=True,
                text=True,
                timeout=60,
                env=gateway.env,
            )
            assert out.returncode == 0, out.stderr
            return out.stdout

        assert any(line.split()[:3] == ["c-plain", "3", "6"] for line in cli("conversations").splitlines())
        assert "Your name is Bob." in cli("show", "c-plain")
        assert "committed" in cli("context", ids["c-plain"][-1])
    finally:
        gateway.stop()

    async def check(store: PostgresStore) -> None:
        for cid, rids in ids.items():
            assert await store.read_index(cid) == rids
            for rid in rids:
                records = await store.read_response(rid)
                assert [r["type"] for r in records] == ["request", "context", "response", "commit"]
            assert (await load(store, cid)).turns == 3

    read_store(pg_dsn, check)
    # Nothing of the conversations went to the replica's data dir.
    assert not list((tmp_path / "var0").rglob("*.jsonl"))


class Load:
    """Clients spread round-robin over the replicas; records what was acknowledged."""

    def __init__(self, replicas: list[GatewayProcess]) -> None:
        self.urls = [p.url for p in replicas]
        self.dead: set[str] = set()
        self.acked: dict[str, list[str]] = {}
        self.failed: dict[str, int] = {}
        self.lock = threading.Lock()
        self.counter = itertools.count()

    def client_run(self, cid: str, name: str, turns: int) -> None:
        clients = {
            url: OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=20) for url in self.urls
        }
        done = 0
        while done < turns:
            url = self.urls[next(self.counter) % len(self.urls)]
            if url in self.dead:
                continue
            try:
                r = clients[url].chat.completions.create(
                    model="mock/t",
                    messages=[{"role": "user", "content": f"{cid} {name} turn {done}"}],
                    extra_body={"conversation_id": cid},
                )
            except (openai.APIConnectionError, openai.InternalServerError) as exc:
                # The replica died under us: the outcome of this request is unknown.
                assert url in self.dead or isinstance(exc, openai.APIConnectionError), exc
                with self.lock:
                    self.failed[cid] = self.failed.get(cid, 0) + 1
                continue
            with self.lock:
                self.acked.setdefault(cid, []).append(r.id)
            done += 1

    def run(self, jobs: list[tuple[str, str, int]], during: Any = None) -> None:
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(self.client_run, *job) for job in jobs]
            if during is not None:
                during()
            for f in futures:
                f.result()


def jobs(shared_clients: int = 10, shared_turns: int = 4, solo: int = 5, solo_turns: int = 5) -> list[Any]:
    return [("shared", f"client-{i}", shared_turns) for i in range(shared_clients)] + [
        (f"solo-{i}", "client", solo_turns) for i in range(solo)
    ]


def committed_chain(dsn: str, cids: list[str]) -> dict[str, tuple[list[str], list[list[dict[str, Any]]]]]:
    """Per conversation: the index, and what each indexed response sent upstream."""

    async def collect(store: PostgresStore) -> dict[str, Any]:
        out = {}
        for cid in cids:
            index = await store.read_index(cid)
            sent = []
            for rid in index:
                assert isinstance(rid, str)
                context = next(r for r in await store.read_response(rid) if r["type"] == "context")
                sent.append(context["messages"])
            out[cid] = (index, sent)
        return out

    return dict(read_store(dsn, collect))


def assert_linear(index: list[str], sent: list[list[dict[str, Any]]]) -> None:
    """No fork: every turn was built on exactly the turns committed before it."""
    assert len(index) == len(set(index)), "a response is indexed twice"
    for before, after in zip(sent, sent[1:], strict=False):
        assert len(after) == len(before) + 2
        assert after[: len(before)] == before


def test_three_replicas_lose_duplicate_and_fork_nothing(
    replicas: list[GatewayProcess], upstream: MockServer, pg_dsn: str
) -> None:
    load = Load(replicas)
    work = jobs()
    started = time.monotonic()
    load.run(work)
    took = time.monotonic() - started
    cids = sorted({cid for cid, _, _ in work})
    chains = committed_chain(pg_dsn, cids)
    for cid in cids:
        index, sent = chains[cid]
        assert sorted(index) == sorted(load.acked[cid]), cid  # 0 lost, nothing unacknowledged
        assert_linear(index, sent)
    assert len(chains["shared"][0]) == 40 and not load.failed
    # The upstream saw each conversation grow by exactly one exchange per request.
    by_conv: dict[str, list[list[dict[str, Any]]]] = {}
    for body in upstream.requests:
        by_conv.setdefault(body["messages"][-1]["content"].split()[0], []).append(body["messages"])
    for histories in by_conv.values():
        histories.sort(key=len)
        for before, after in zip(histories, histories[1:], strict=False):
            assert len(after) == len(before) + 2 and after[: len(before)] == before
    assert took < 60


def test_sigkill_of_a_replica_mid_load_loses_no_acknowledged_turn(
    replicas: list[GatewayProcess], upstream: MockServer, pg_dsn: str
) -> None:
    load = Load(replicas)
    upstream.mode = "normal"
    victim = replicas[1]

    def kill_soon() -> None:
        deadline = time.monotonic() + 10
        while sum(len(v) for v in load.acked.values()) < 15 and time.monotonic() < deadline:
            time.sleep(0.01)
        load.dead.add(victim.url)
        victim.stop(signal.SIGKILL)

    work = jobs(shared_turns=6, solo_turns=8)
    load.run(work, during=kill_soon)
    assert victim.proc is not None and victim.proc.returncode == -signal.SIGKILL
    cids = sorted({cid for cid, _, _ in work})
    chains = committed_chain(pg_dsn, cids)
    for cid in cids:
        index, sent = chains[cid]
        acked = load.acked[cid]
        assert set(acked) <= set(index), f"{cid}: an acknowledged turn was lost"
        # Extra entries can only be turns the dead replica committed but could not answer.
        assert len(index) - len(acked) <= load.failed.get(cid, 0)
        assert_linear(index, sent)
    assert len(load.acked["shared"]) == 60
    # The survivors still serve the conversation the dead replica was in the middle of.
    client = OpenAI(base_url=f"{replicas[0].url}/v1", api_key="k", max_retries=0)
    r = client.chat.completions.create(
        model="mock/t",
        messages=[{"role": "user", "content": "shared after the crash"}],
        extra_body={"conversation_id": "shared"},
    )
    assert r.id == read_store(pg_dsn, lambda s: s.read_index("shared"))[-1]
