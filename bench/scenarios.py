"""The benchmark's scenarios: what is sent to which target, and what is recorded.

`Bench` holds the targets' ports and collects raw samples (seconds) into `results`, which
bench/report.py turns into statistics and tables.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gateway.store.jsonl.layout import DataDir

from .client import Connection, Response
from .procs import HOST, cpu_seconds
from .seed import user_text

MODEL = "bench-model"
CHAT = "/v1/chat/completions"
CONCURRENCY = 32
SCALING_CLIENTS = (1, 8, 32, 128)
SCALING_ROUNDS = 4
# The targets of the scaling table, in its order (those the run started).
SCALING_TARGETS = (
    "forwarder_aiohttp",
    "forwarder_aiohttp_2w",
    "floor",
    "gateway",
    "gateway_2w",
    "gateway_base",
)
# Targets that get a new conversation per request in the scaling table (the others forward).
_TURN_TARGETS = ("gateway", "floor")


@dataclass(frozen=True)
class Plan:
    """Iteration counts (warmup, measured). Sized so the full run stays under 3 minutes."""

    single: tuple[int, int] = (300, 3000)
    nosync: tuple[int, int] = (200, 1500)
    # (stored messages, seeded conversations, warmup and measured turns per conversation):
    # every turn adds 2 messages, so each copy only grows by a few percent while measured.
    grown: tuple[tuple[int, int, int, int], ...] = (
        (200, 30, 1, 10),
        (1_000, 6, 2, 50),
        (10_000, 1, 5, 300),
    )
    stream: tuple[int, int] = (100, 1000)
    template_turns: int = 150  # real turns the gateway serves first; seeded turns copy them
    throughput_warmup: int = 500
    throughput_stateless: int = 3_000
    conversations_total: int = 10_000  # served before the idle RSS reading
    # requests per (target, clients) cell of the scaling table, after a warmup of a fifth
    scaling: tuple[int, ...] = (200, 1_200, 2_400, 4_000)
    # (stored messages, conversations per gateway): the cold-load comparison (`Bench.cold`).
    cold: tuple[int, int] = (10_000, 5)
    # (warmup, measured) turns per gateway in the tracing-cost comparison (`Bench.tracing`).
    tracing: tuple[int, int] = (100, 1_000)

    @classmethod
    def quick(cls) -> Plan:
        grown = ((200, 3, 1, 10), (1_000, 2, 1, 10), (10_000, 1, 1, 10))
        return cls(
            (20, 200),
            (20, 100),
            grown,
            (10, 100),
            150,
            50,
            500,
            1_000,
            (100, 300, 500, 500),
            cold=(10_000, 2),
            tracing=(10, 100),
        )


@dataclass
class _Cell:
    """One (target, clients) cell of the scaling table, over its rounds."""

    seconds: float = 0.0
    cpu: float = 0.0
    others_cpu: float = 0.0  # the mock upstream's and this load generator's, the same rounds
    rates: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)


def _body(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload)


def one_message(i: int, **extra: Any) -> bytes:
    return _body({"model": MODEL, "messages": [{"role": "user", "content": user_text(i)}], **extra})


class Bench:
    def __init__(
        self, plan: Plan, ports: dict[str, int], data_dirs: dict[str, Path], litellm_key: str | None
    ) -> None:
        self.plan = plan
        self.ports = ports
        self.data_dirs = data_dirs
        self.litellm_key = litellm_key
        self.results: dict[str, Any] = {
            "latency": [],
            "stream": [],
            "throughput": [],
            "scaling": [],
            "cold": [],
            "tracing": [],
        }
        self.pids: dict[str, int] = {}  # target -> server pid, for CPU per request
        self.served_conversations = 0
        self._seq = 0
        self._control: Connection | None = None

    # -- helpers ------------------------------------------------------------------------------
    def conn(self, target: str) -> Connection:
        return Connection(HOST, self.ports[target])

    def headers(self, target: str) -> dict[str, str] | None:
        if target == "litellm" and self.litellm_key:
            return {"Authorization": f"Bearer {self.litellm_key}"}
        return None

    def stateless_targets(self) -> list[str]:
        return [t for t in ("direct", "forwarder", "forwarder_aiohttp", "litellm") if t in self.ports]

    def new_cid(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{self._seq:06d}"

    async def post(self, conn: Connection, target: str, body: bytes) -> Response:
        r = await conn.request("POST", CHAT, body, self.headers(target))
        if r.status != 200:
            raise RuntimeError(f"{target}: HTTP {r.status}: {r.body[:300]!r}")
        return r

    async def last_upstream_body(self) -> bytes:
        """The exact body of the last chat request the mock received (untimed)."""
        if self._control is None:
            self._control = self.conn("direct")
        r = await self._control.request("GET", "/_bench/last")
        return r.body

    def record(self, kind: str, **row: Any) -> None:
        self.results[kind].append(row)

    # -- scenarios ------------------------------------------------------------------------------
    async def sequential(self, target: str, make_body: Any, warmup: int, n: int) -> list[float]:
        conn = self.conn(target)
        out: list[float] = []
        for i in range(warmup + n):
            r = await self.post(conn, target, make_body(i))
            if i >= warmup:
                out.append(r.latency)
        conn.close()
        return out

    async def interleaved(
        self, cells: list[tuple[str, Any, int, int]], rounds: int = 10
    ) -> list[list[float]]:
        """Sequential requests to several targets, measured in turns: each cell (target, body
        maker, warmup, measured) runs its warmup, then its measured requests are spread over
        `rounds` rounds, the order of the cells reversed every other round. Drift on the
        machine (other load, the disk) then falls on every target alike, and so does the edge
        of being first in a round (about 0.03 ms here). The samples, per cell."""
        conns = [self.conn(target) for target, _, _, _ in cells]
        counters = [0] * len(cells)

        async def run(k: int, count: int, out: list[float] | None) -> None:
            target, make_body = cells[k][0], cells[k][1]
            for _ in range(count):
                r = await self.post(conns[k], target, make_body(counters[k]))
                counters[k] += 1
                if out is not None:
                    out.append(r.latency)

        for k, cell in enumerate(cells):
            await run(k, cell[2], None)
        samples: list[list[float]] = [[] for _ in cells]
        order = list(range(len(cells)))
        for r in range(rounds):
            for k in order if r % 2 == 0 else order[::-1]:
                n = cells[k][3]
                await run(k, n // rounds + (1 if r < n % rounds else 0), samples[k])
        for conn in conns:
            conn.close()
        return samples

    async def single_message(self) -> None:
        warmup, n = self.plan.single

        def new_conversation(prefix: str) -> Any:
            return lambda i: one_message(i, conversation_id=self.new_cid(prefix))

        cells: list[tuple[str, Any, int, int]] = [
            (t, one_message, warmup, n) for t in self.stateless_targets()
        ]
        labels: list[str | None] = [None] * len(cells)
        cells.append(("gateway", new_conversation("bench-new"), warmup, n))
        labels.append("gateway, new conversation")
        if "gateway_base" in self.ports:  # another version, same iterations: before/after
            cells.append(("gateway_base", new_conversation("bench-base"), warmup, n))
            labels.append("gateway (baseline checkout), new conversation")
        # The other gateways (when started): the same scenario, fewer iterations.
        w, n2 = self.plan.nosync
        for target, label in (
            ("gateway_nosync", "gateway, new conversation, durability=none"),
            ("gateway_pg", "gateway, new conversation, postgres (fsync on)"),
        ):
            if target in self.ports:
                cells.append((target, new_conversation(f"bench-{target}"), w, n2))
                labels.append(label)
        samples = await self.interleaved(cells)
        self.served_conversations += warmup + n
        for (target, _, _, _), label, lat in zip(cells, labels, samples, strict=True):
            extra = {"label": label} if label is not None else {}
            self.record("latency", group="1 message", target=target, sent_messages=1, samples=lat, **extra)

    async def tracing(self, rounds: int = 10) -> None:
        """What tracing costs a turn: the same sequential turns (a new conversation, 1 message)
        through the gateway without tracing and one exporting its spans and metrics over OTLP/HTTP
        to a loopback receiver, in `rounds` rounds, the order reversed every other round. Per
        gateway: every turn's latency, and the CPU its process (the SDK's export thread
        included) spent on its rounds."""
        targets = [t for t in ("gateway", "gateway_traced") if t in self.ports]
        if len(targets) < 2:
            return
        warmup, n = self.plan.tracing
        conns = {t: self.conn(t) for t in targets}
        samples: dict[str, list[float]] = {t: [] for t in targets}
        cpu = dict.fromkeys(targets, 0.0)

        def body(target: str, i: int) -> bytes:
            return one_message(i, conversation_id=self.new_cid(f"bench-tr-{target}"))

        for target in targets:
            for i in range(warmup):
                await self.post(conns[target], target, body(target, i))
        for r in range(rounds):
            for target in targets if r % 2 == 0 else targets[::-1]:
                pid = self.pids[target]
                before = cpu_seconds(pid)
                for i in range(n // rounds):
                    samples[target].append((await self.post(conns[target], target, body(target, i))).latency)
                cpu[target] += cpu_seconds(pid) - before
        for conn in conns.values():
            conn.close()
        for target in targets:
            self.served_conversations += warmup + len(samples[target]) if target == "gateway" else 0
            traced = target == "gateway_traced"
            self.record(
                "tracing", target=target, tracing=traced, cpu_seconds=cpu[target], samples=samples[target]
            )

    async def cold(self, size: int, cids: dict[str, list[str]]) -> None:
        """The first request on stored conversations of `size` messages that the gateway has
        not loaded yet (it reads them from disk), on each gateway target in turn: the gateway
        and, with --baseline, the baseline checkout, interleaved so that noise hits both alike."""
        conns = {target: self.conn(target) for target in cids}
        samples: dict[str, list[float]] = {target: [] for target in cids}
        for k in range(max(len(ids) for ids in cids.values())):
            for target, ids in cids.items():
                if k < len(ids):
                    r = await self.post(conns[target], target, one_message(size // 2, conversation_id=ids[k]))
                    samples[target].append(r.latency)
        for conn in conns.values():
            conn.close()
        for target, lat in samples.items():
            self.record("cold", size=size, target=target, samples=lat)

    async def grown(self, size: int, cids: list[str], warmup: int, n: int) -> None:
        """Conversations pre-grown to `size` messages. Each iteration sends one new message to
        the gateway, then the exact body the gateway sent upstream to every stateless target.
        Several seeded copies keep the drift small: each takes `warmup + n` turns only."""
        gw = self.conn("gateway")
        conns = {t: self.conn(t) for t in self.stateless_targets()}
        samples: dict[str, list[float]] = {t: [] for t in ["gateway", *conns]}
        sent: list[int] = []
        cold: list[float] = []
        for cid in cids:
            i0 = size // 2
            first = await self.post(gw, "gateway", one_message(i0, conversation_id=cid))
            cold.append(first.latency)
            stored = self._stored_messages(first)
            if stored is not None and stored != size:
                raise RuntimeError(
                    f"seeded conversation {cid}: gateway saw {stored} stored messages, not {size}"
                )
            for k in range(1, warmup + n + 1):
                r = await self.post(gw, "gateway", one_message(i0 + k, conversation_id=cid))
                body = await self.last_upstream_body()
                measured = k > warmup
                if measured:
                    samples["gateway"].append(r.latency)
                    sent.append(len(orjson.loads(body)["messages"]))
                for target, conn in conns.items():
                    rr = await self.post(conn, target, body)
                    if measured:
                        samples[target].append(rr.latency)
        for c in (gw, *conns.values()):
            c.close()
        if self._control is not None:
            self._control.close()
            self._control = None
        group = f"{size:,} stored"
        cold.sort()
        for target, lat in samples.items():
            extra: dict[str, Any] = {}
            if target == "gateway":
                extra = {
                    "label": f"gateway, conversation of {size:,} msgs",
                    "conversations": len(cids),
                    "cold_first_request_ms": cold[len(cold) // 2] * 1000,
                }
            self.record(
                "latency",
                group=group,
                target=target,
                stored_messages=size,
                sent_messages=sorted(sent)[len(sent) // 2],
                sent_messages_range=[min(sent), max(sent)],
                samples=lat,
                **extra,
            )

    def _stored_messages(self, r: Response) -> int | None:
        """What the gateway's own context snapshot says it loaded (checks the seeded files)."""
        rid = r.headers.get(b"x-response-id", b"").decode()
        path = DataDir(self.data_dirs["gateway"]).response_path(rid)
        try:
            for line in path.read_bytes().splitlines():
                rec = orjson.loads(line)
                if rec.get("type") == "context" and isinstance(rec.get("stored_messages"), int):
                    return int(rec["stored_messages"])
        except (OSError, orjson.JSONDecodeError):
            pass
        print(f"  note: could not read the context snapshot of {rid}; seeded size not verified")
        return None

    async def streaming(self) -> None:
        warmup, n = self.plan.stream
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        for target in [*self.stateless_targets(), "gateway"]:
            conn = self.conn(target)
            ttfc: list[float] = []
            total: list[float] = []
            for i in range(warmup + n):
                extra = dict(opts)
                if target == "gateway":
                    extra["conversation_id"] = self.new_cid("bench-stream")
                r = await self.post(conn, target, one_message(i, **extra))
                if not r.body.rstrip().endswith(b"data: [DONE]"):
                    raise RuntimeError(f"{target}: stream did not end with [DONE]: {r.body[-200:]!r}")
                if i >= warmup:
                    ttfc.append(r.ttfb)
                    total.append(r.latency)
            conn.close()
            if target == "gateway":
                self.served_conversations += warmup + n
            self.record("stream", target=target, samples=ttfc, total_samples=total)

    async def _burst(
        self, target: str, total: int, make_body: Any, clients: int = CONCURRENCY
    ) -> tuple[float, list[float]]:
        elapsed, lat, _ = await self._timed_burst(target, total, make_body, clients)
        return elapsed, lat

    async def _timed_burst(
        self, target: str, total: int, make_body: Any, clients: int = CONCURRENCY
    ) -> tuple[float, list[float], float]:
        """`total` requests from `clients` concurrent clients: the seconds taken, the
        latencies, and the steady rate (req/s between the 10th and the 90th percentile of the
        completion times: the clients' start and the last stragglers left out; with fewer than
        4 requests per client, the whole burst's rate)."""
        conns = [self.conn(target) for _ in range(clients)]
        for c in conns:  # connect before the clock starts
            await c.request("GET", "/readyz" if target != "litellm" else "/health/liveliness")
        counter = 0
        lat: list[float] = []
        ends: list[float] = []

        async def worker(conn: Connection) -> None:
            nonlocal counter
            while counter < total:
                i = counter
                counter += 1
                r = await self.post(conn, target, make_body(i))
                lat.append(r.latency)
                ends.append(time.perf_counter())

        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        elapsed = time.perf_counter() - start
        for c in conns:
            c.close()
        overall = len(lat) / elapsed if elapsed else 0.0
        if len(ends) < 4 * clients:  # too few per client for a steady part: the whole burst
            return elapsed, lat, overall
        low, high = len(ends) // 10, len(ends) - 1 - len(ends) // 10
        steady = (high - low) / (ends[high] - ends[low]) if ends[high] > ends[low] else 0.0
        return elapsed, lat, steady or overall

    async def throughput(self) -> None:
        plan = self.plan
        for target in self.stateless_targets():
            await self._burst(target, plan.throughput_warmup, one_message)
            elapsed, lat = await self._burst(target, plan.throughput_stateless, one_message)
            self.record("throughput", target=target, requests=len(lat), seconds=elapsed, samples=lat)

        def fresh(i: int) -> bytes:
            return one_message(i, conversation_id=self.new_cid("bench-tp"))

        await self._burst("gateway", plan.throughput_warmup, fresh)
        self.served_conversations += plan.throughput_warmup
        remaining = max(plan.throughput_stateless, plan.conversations_total - self.served_conversations)
        elapsed, lat = await self._burst("gateway", remaining, fresh)
        self.served_conversations += remaining
        self.record(
            "throughput",
            target="gateway",
            label="gateway, new conversations",
            requests=len(lat),
            seconds=elapsed,
            samples=lat,
        )

    def _others_cpu(self) -> float:
        """CPU seconds of what shares the machine with a target: the mock upstream and this
        load generator (both do work in proportion to the requests)."""
        mock = self.pids.get("mock")
        return (cpu_seconds(mock) if mock else 0.0) + time.process_time()

    async def scaling(self) -> None:
        """Throughput at 1/8/32/128 clients; gateways get a new conversation per request. At
        each count every target runs a warmup, then its requests in SCALING_ROUNDS rounds, the
        order of the targets reversed every other round (as `interleaved` does), so that drift
        on the machine falls on every target alike. A cell's req/s is the median of its rounds'
        steady rates; its CPU per request, all its rounds' CPU over all their requests."""
        targets = [t for t in SCALING_TARGETS if t in self.ports]
        for clients, total in zip(SCALING_CLIENTS, self.plan.scaling, strict=True):
            bodies: dict[str, Any] = {}
            for target in targets:
                if target.startswith(_TURN_TARGETS):

                    def body(i: int, target: str = target) -> bytes:
                        return one_message(i, conversation_id=self.new_cid(f"bench-sc-{target}"))

                    bodies[target] = body
                else:
                    bodies[target] = one_message
                warmup = max(clients, total // 5)
                await self._burst(target, warmup, bodies[target], clients)
                if target == "gateway":
                    self.served_conversations += warmup
            cells = {t: _Cell() for t in targets}
            per_round = max(clients, total // SCALING_ROUNDS)
            for r in range(SCALING_ROUNDS):
                for target in targets if r % 2 == 0 else targets[::-1]:
                    cell = cells[target]
                    pid = self.pids.get(target)
                    cpu = cpu_seconds(pid) if pid else 0.0
                    others = self._others_cpu()
                    elapsed, lat, rate = await self._timed_burst(target, per_round, bodies[target], clients)
                    cell.cpu += cpu_seconds(pid) - cpu if pid else 0.0
                    cell.others_cpu += self._others_cpu() - others
                    cell.seconds += elapsed
                    cell.rates.append(rate)
                    cell.samples.extend(lat)
                    if target == "gateway":
                        self.served_conversations += len(lat)
            for target, cell in cells.items():
                self.record(
                    "scaling",
                    target=target,
                    clients=clients,
                    requests=len(cell.samples),
                    seconds=cell.seconds,
                    cpu_seconds=cell.cpu,
                    others_cpu_seconds=cell.others_cpu,
                    req_per_s=statistics.median(cell.rates),
                    round_req_per_s=[round(x, 1) for x in cell.rates],
                    samples=cell.samples,
                )
