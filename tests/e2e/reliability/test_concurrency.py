"""Many clients on `gateway serve --workers 2`, half of them sharing a few conversations:
0 lost, 0 duplicated, every index equals the set of acknowledged ids, and each turn's upstream
history is exactly the previous turn's plus its reply and the new message (a strict prefix chain).
Fast: 16 clients x 10 turns, 4 shared conversations. SOAK=1: 64 x 50, 8 shared."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.conftest import GatewayProcess
from tests.e2e.reliability.conftest import SOAK, gateway_config, index_ids, send
from tests.e2e.reliability.faultserver import FaultRequest, FaultServer, answer

CLIENTS, TURNS, SHARED = (64, 50, 8) if SOAK else (16, 10, 4)


async def jitter(req: FaultRequest) -> None:
    await asyncio.sleep(random.uniform(0, 0.005))
    await answer()(req)


def plain(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in messages]


def test_concurrent_clients_on_two_workers(tmp_path: Path, fault_server: FaultServer) -> None:
    fault_server.reset()
    fault_server.default = jitter
    config = gateway_config(tmp_path / "gateway.toml", fault_server.url)
    proc = GatewayProcess(config, tmp_path / "var", workers=2).start()
    acks: dict[str, list[tuple[str, str, str]]] = defaultdict(list)  # cid -> (rid, text, reply)
    errors: list[Any] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client(n: int) -> None:
        half = CLIENTS // 2
        cid = f"own-{n}" if n < half else f"shared-{n % SHARED}"
        with httpx.Client(timeout=60.0) as http:
            start.wait()
            for t in range(TURNS):
                text = f"{cid}|c{n}|t{t}"
                try:
                    reply = send(proc.url, cid, text, stream=(n + t) % 2 == 1, client=http)
                except httpx.HTTPError as exc:
                    with lock:
                        errors.append((text, repr(exc)))
                    continue
                ok = reply.status == 200 and reply.error is None and (reply.done or not reply.chunks)
                with lock:
                    if ok and reply.response_id:
                        acks[cid].append((reply.response_id, text, reply.text))
                    else:
                        errors.append((text, reply.status, reply.body, reply.error))

    try:
        assert proc.proc is not None
        children = Path(f"/proc/{proc.proc.pid}/task/{proc.proc.pid}/children").read_text().split()
        assert len(children) >= 2, "expected two worker processes"
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
        assert not any(th.is_alive() for th in threads)
    finally:
        proc.stop()

    assert errors == []
    assert sum(len(v) for v in acks.values()) == CLIENTS * TURNS  # 0 lost
    # Each worker writes its access lines like a single process does: one per answered turn.
    logged = {
        line["response_id"]
        for line in map(orjson.loads, (x for x in proc.log().splitlines() if x.startswith("{")))
        if line.get("event") == "chat.completion" and line.get("outcome") == "complete"
    }
    assert logged == {rid for turns in acks.values() for rid, _, _ in turns}
    by_text: dict[str, list[FaultRequest]] = defaultdict(list)
    for req in fault_server.requests:
        by_text[req.messages[-1]["content"]].append(req)
    for cid, turns in acks.items():
        ids = index_ids(tmp_path / "var", cid)
        assert len(ids) == len(set(ids)), f"duplicated turn in {cid}"
        assert set(ids) == {rid for rid, _, _ in turns} and len(ids) == len(turns), cid
        info = {rid: (text, reply) for rid, text, reply in turns}
        previous: list[tuple[str, Any]] = []
        for rid in ids:
            text, reply = info[rid]
            (req,) = by_text[text]  # sent upstream once
            sent = plain(req.messages)
            assert sent == [*previous, ("user", text)], f"{cid}: {rid} did not extend the history"
            previous = [*sent, ("assistant", reply)]
    fault_server.reset()
