"""Crash safety: `kill -9` the gateway at random moments under concurrent load, restart, repeat.

Every acknowledged turn (200 with an id, or a stream that reached `[DONE]`) is in its
conversation's index; the index names only committed responses, each once, with no torn lines;
and after the last restart every conversation continues with each turn sent upstream exactly once.
Rounds: CRASH_ROUNDS (default 10; 200 with SOAK=1). Seed: CRASH_SEED (printed on failure).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import GatewayProcess
from tests.e2e.reliability.conftest import (
    SOAK,
    gateway_config,
    index_ids,
    response_records,
    send,
)
from tests.e2e.reliability.faultserver import FaultRequest, FaultServer, answer

ROUNDS = int(os.environ.get("CRASH_ROUNDS", "200" if SOAK else "10"))
CONVERSATIONS = [f"crash-{i}" for i in range(4)]
CLIENTS = 6
RESPONSE_ID = re.compile(r"^[A-Za-z0-9._-]+-[0-9a-f]{12}$")


@dataclass(frozen=True)
class Ack:
    cid: str
    response_id: str
    text: str
    reply: str


def jittery(rng: random.Random) -> object:
    """Answers after 0-20 ms, so kills land before, during and after the provider call."""
    lock = threading.Lock()

    async def run(req: FaultRequest) -> None:
        with lock:
            delay = rng.uniform(0, 0.02)
        await asyncio.sleep(delay)
        await answer()(req)

    return run


def client_loop(url: str, worker: int, rnd: int, stop: threading.Event, acks: list[Ack], seed: int) -> None:
    rng = random.Random(seed * 1000 + rnd * 100 + worker)
    i = 0
    with httpx.Client(timeout=10.0) as client:
        while not stop.is_set():
            cid = rng.choice(CONVERSATIONS)
            text = f"r{rnd}-w{worker}-t{i}"
            i += 1
            stream = rng.random() < 0.5
            try:
                reply = send(url, cid, text, stream=stream, client=client)
            except httpx.HTTPError:
                time.sleep(0.005)
                continue
            if reply.status == 200 and reply.error is None and (reply.done or not stream):
                assert reply.response_id
                acks.append(Ack(cid, reply.response_id, text, reply.text))


def test_kill_9_under_load_loses_nothing(tmp_path: Path, fault_server: FaultServer) -> None:
    seed = int(os.environ.get("CRASH_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    fault_server.reset()
    fault_server.default = jittery(rng)  # type: ignore[assignment]
    config = gateway_config(tmp_path / "gateway.toml", fault_server.url)
    data_dir = tmp_path / "var"
    acks: list[Ack] = []
    kills_mid_request = 0
    try:
        for rnd in range(ROUNDS):
            proc = GatewayProcess(config, data_dir).start()
            stop = threading.Event()
            acked_before = len(acks)
            threads = [
                threading.Thread(target=client_loop, args=(proc.url, w, rnd, stop, acks, seed), daemon=True)
                for w in range(CLIENTS)
            ]
            for t in threads:
                t.start()
            if rng.random() < 0.8:
                # Mostly wait for this round's first acknowledged turn (the first request loads
                # the tokenizer, ~0.3 s), so kills land among turns; sometimes kill before it.
                deadline = time.monotonic() + 5
                while len(acks) == acked_before and time.monotonic() < deadline:
                    time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
            in_flight = sum(1 for r in fault_server.requests if r.closed_at is None)
            kills_mid_request += in_flight > 0
            assert proc.proc is not None
            os.killpg(proc.proc.pid, signal.SIGKILL)
            proc.proc.wait(timeout=10)
            stop.set()
            for t in threads:
                t.join(timeout=15)
            proc.stop()
        context = f"(seed {seed}, {ROUNDS} rounds, {len(acks)} acknowledged turns)"
        assert len(acks) >= ROUNDS // 2, f"too little load to mean anything {context}"

        # 1. Indexes: well-formed, no duplicates, only committed responses, every ack present.
        for cid in CONVERSATIONS:
            raw = (data_dir / "logs" / "conversations" / f"{cid}.jsonl").read_bytes()
            assert raw.endswith(b"\n"), f"torn last index line in {cid} {context}"
            ids = index_ids(data_dir, cid)
            assert all(RESPONSE_ID.match(rid) for rid in ids), context
            assert len(ids) == len(set(ids)), f"duplicated turn in {cid} {context}"
            for rid in ids:
                assert response_records(data_dir, rid)[-1]["type"] == "commit", f"{rid} {context}"
            acked = [a.response_id for a in acks if a.cid == cid]
            missing = set(acked) - set(ids)
            assert not missing, f"acknowledged turns lost from {cid}: {sorted(missing)} {context}"

        # 2. A crash mid-write of the index leaves a torn line; the next start repairs it.
        torn = data_dir / "logs" / "conversations" / f"{CONVERSATIONS[0]}.jsonl"
        intact = torn.read_bytes()
        with open(torn, "ab") as f:
            f.write(b"fault-m-0123")

        # 3. Every conversation continues, each stored turn sent upstream exactly once, in order.
        fault_server.default = answer()
        proc = GatewayProcess(config, data_dir).start()
        try:
            for cid in CONVERSATIONS:
                ids = index_ids(data_dir, cid)
                expected = []
                for rid in ids:
                    records = response_records(data_dir, rid)
                    request = records[0]
                    response = next(r for r in records if r["type"] == "response")
                    expected += [m["content"] for m in request["input"]]
                    expected.append(response["message"]["content"])
                before = len(fault_server.requests)
                reply = send(proc.url, cid, f"final-{cid}")
                assert reply.status == 200, (reply.body, context)
                sent = [m["content"] for m in fault_server.requests[before:][-1].messages]
                assert sent == [*expected, f"final-{cid}"], f"{cid} {context}"
                for ack in (a for a in acks if a.cid == cid):
                    assert sent.count(ack.text) == 1, f"{ack} {context}"
                    assert sent[sent.index(ack.text) + 1] == ack.reply, f"{ack} {context}"
                assert index_ids(data_dir, cid) == [*ids, reply.response_id]
                if cid == CONVERSATIONS[0]:  # repaired, not kept (an id may begin "0123")
                    # Exactly the intact lines, then those the start replayed from the killed
                    # process's journal (a turn synced there, not yet indexed: it may have been
                    # acknowledged to no one), then this turn's: the torn bytes are gone.
                    repaired = torn.read_bytes()
                    assert repaired.startswith(intact), context
                    assert repaired == "".join(f"{rid}\n" for rid in [*ids, reply.response_id]).encode(), (
                        context
                    )
        finally:
            proc.stop()
    finally:
        fault_server.reset()
    print(f"crash harness: {context}, {kills_mid_request} kills with a provider call in flight")
    # The harness claims kills land during provider calls: some must have (about half do).
    assert kills_mid_request >= max(1, ROUNDS // 10), (kills_mid_request, context)
