"""Long concurrent streams: N streams at once, each 100 chunks paced 20 ms apart by the mock,
through the aiohttp forwarder (the reference), the gateway and the gateway with `--workers 2`.

    .venv/bin/python bench/streams.py [--streams 100,300[,1000]] [--stream-rounds 3] [--quick] [--keep]
    .venv/bin/python bench/run.py --scenario streams [--streams ...]      # the same, from run.py
    .venv/bin/python -m bench.streams --no-2w --baseline DIR [--baseline-workers 2]  # before/after

Every stream is a new conversation on the gateways (`durability = "fsync"`). The client
(this process, one uvloop event loop, raw asyncio sockets + httptools) connects N sockets
first, then writes the N requests in one go and timestamps every SSE event in the protocol
callback that receives it. For every N the targets' servers are started afresh and warmed up
(and each gateway lists its conversations once, which writes its catalog: see
`list_conversations`); then the targets run one after the other, `--stream-rounds` times, the
order reversed every other round, so that drift on the shared machine falls on every target
alike. A figure is the median over the rounds; "xR" is R times the forwarder's median of the
same run. "direct" (the client on the mock itself) is the floor of the gaps and of the time to
first chunk: the mock's timers and this client. The client and the mock share the cores with
the server measured: their CPU is reported, and so is the time the server's threads waited for
a core while runnable.

Server CPU is the sum of `/proc/<pid>/task/*/schedstat` (run time in ns, user + system) over
the server's process and its children, read every 50 ms and at three moments: the requests
written (`start`), every stream's first event in (`all_first`), the first stream ended. CPU
per chunk: a least-squares fit over the readings (`_fit_per_chunk`). CPU per stream: the
round's CPU less its events at that rate, over N. It is split at `all_first` (a stream costs
its start before its first event, so after it the CPU is chunks and the ends of the streams
still open): their CPU less the chunks', over their number, is the CPU per stream end (for the
gateway, its turn committed; up to every server quiet again, client sockets closed); the CPU up
to `all_first` less its chunks and the ends already in it, over N, the CPU per stream start
(request, upstream connection; for the gateway, its turn prepared and written). No split when
over a tenth of the streams ended before the last one began.
RSS per open stream: the peak of the readings less the RSS just before the round, over N, from
the first round at each N (a process keeps what a round grew it by, so later rounds show less).
Writes var/bench/streams-<timestamp>.json and var/bench/streams-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import orjson

from .client import Connection
from .procs import HOST, Processes, Server, clean_env, cpu_seconds, free_port, process_tree, write_result
from .report import percentile
from .scenarios import CHAT, MODEL
from .seed import user_text

REPO = Path(__file__).resolve().parent.parent
CHUNKS = 100
INTERVAL_MS = 20.0
SAMPLE_SECONDS = 0.05
MIN_STEADY_SECONDS = 0.3  # every stream open this long: CPU per chunk there, a cross-check
MAX_ENDED_WHILE_OPENING = 0.1  # more streams ended before the last began: no start/end split
DEFAULT_STREAMS = (100, 300)
# Targets in the order of a round (reversed every other round); "direct" is the floor.
TARGETS = ("direct", "forwarder_aiohttp", "gateway", "gateway_2w")
REFERENCE = "forwarder_aiohttp"
# With --baseline DIR: the gateway of another checkout (--baseline-workers, default 1), measured
# in the same rounds.
BASELINE = "gateway_base"
LABELS = {
    "direct": "direct -> mock (floor)",
    "forwarder_aiohttp": "aiohttp forwarder",
    "gateway": "gateway, 1 worker",
    "gateway_2w": "gateway, --workers 2",
    BASELINE: "baseline gw, 1 worker",
}
ORDER = (*TARGETS, BASELINE)
perf = time.perf_counter
_PAGE = os.sysconf("SC_PAGE_SIZE") // 1024


# -- the server's CPU and memory from /proc -------------------------------------------------------
def tree_usage(pid: int) -> tuple[int, int, int]:
    """(run time in ns of every thread, time in ns its threads waited for a core while
    runnable, RSS in KiB) of `pid` and its live descendants."""
    ns = 0
    waited = 0
    kib = 0
    for p in process_tree(pid):
        try:
            for task in os.scandir(f"/proc/{p}/task"):
                with open(f"{task.path}/schedstat", "rb") as f:
                    fields = f.read().split()
                ns += int(fields[0])
                waited += int(fields[1])
            with open(f"/proc/{p}/statm", "rb") as f:
                kib += int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            continue
    return ns, waited, kib


@dataclass(slots=True)
class Sample:
    t: float
    cpu_ns: int
    waited_ns: int
    rss_kib: int
    events: int  # SSE events the client received so far
    firsts: int  # streams whose first event came
    ends: int  # streams ended


@dataclass
class Sampler:
    """The server's CPU and RSS over a round, with the client's event count at each reading."""

    pid: int | None
    counts: Round
    samples: list[Sample] = field(default_factory=list)

    def take(self) -> Sample:
        ns, waited, kib = tree_usage(self.pid) if self.pid else (0, 0, 0)
        run = self.counts
        sample = Sample(perf(), ns, waited, kib, run.events, run.first_in, run.ended)
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_SECONDS)
            self.take()


async def settle(pid: int | None, limit: float = 5.0) -> None:
    """Until the server used under 3% of a core in two readings 100 ms apart in a row."""
    if not pid:
        return
    deadline = perf() + limit
    quiet = 0
    last = tree_usage(pid)[0]
    while perf() < deadline and quiet < 2:
        await asyncio.sleep(0.1)
        now = tree_usage(pid)[0]
        quiet = quiet + 1 if now - last < 3_000_000 else 0
        last = now


# -- the client -----------------------------------------------------------------------------------
class Round:
    """N streams at once against one target: their events, counted and timestamped."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.events = 0
        self.first_in = 0
        self.ended = 0
        self.on_all_first: Callable[[], object] = lambda: None
        self.on_first_end: Callable[[], object] = lambda: None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class StreamProtocol(asyncio.Protocol):
    """One connection, one streaming request; every SSE event's arrival time."""

    def __init__(self, run: Round) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.buf = bytearray()
        self.scan = 0  # where the next event separator is looked for
        self.times: list[float] = []
        self.status = 0
        self.t_sent = 0.0
        self.t_done = 0.0
        self.error = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.t_done:
            self.error = self.error or f"connection lost: {exc!r}"
            self._finish()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"bad response: {exc}"
            if self.transport is not None:
                self.transport.close()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        now = perf()
        buf = self.buf
        buf += body
        found = buf.count(b"\n\n", self.scan)
        if not found:
            return
        self.scan = buf.rfind(b"\n\n") + 2
        if not self.times:
            run = self.run
            run.first_in += 1
            if run.first_in == run.n:
                run.on_all_first()
        self.times.extend([now] * found)
        self.run.events += found

    def on_message_complete(self) -> None:
        self._finish()

    def _finish(self) -> None:
        if self.t_done:
            return
        self.t_done = perf()
        run = self.run
        run.ended += 1
        if run.ended == 1:
            run.on_first_end()
        if run.ended == run.n and not run.done.done():
            run.done.set_result(None)

    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.t_sent = perf()
        self.transport.write(request)

    def content_times(self) -> tuple[list[float], bool]:
        """Arrival times of the events carrying content, and whether the stream ended in [DONE]."""
        events = bytes(self.buf).split(b"\n\n")
        out: list[float] = []
        done = False
        for event, t in zip(events, self.times, strict=False):
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                try:
                    choices = orjson.loads(data).get("choices") or []
                except (orjson.JSONDecodeError, AttributeError):
                    continue
                if choices and (choices[0].get("delta") or {}).get("content"):
                    out.append(t)
        return out, done


def request_bytes(port: int, i: int, cid: str) -> bytes:
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": user_text(i)}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "conversation_id": cid,
        }
    )
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


async def connect(port: int, run: Round) -> list[StreamProtocol]:
    loop = asyncio.get_running_loop()
    protos: list[StreamProtocol] = []
    for start in range(0, run.n, 100):  # in batches, so the accept queue never overflows
        batch = await asyncio.gather(
            *(
                loop.create_connection(lambda: StreamProtocol(run), HOST, port)
                for _ in range(min(100, run.n - start))
            )
        )
        protos.extend(p for _, p in batch)
    return protos


@dataclass
class Bench:
    ports: dict[str, int]
    pids: dict[str, int]  # the server of each target (none for direct)
    mock_pid: int
    chunks: int
    interval: float  # seconds between two chunks at the mock
    seq: int = 0

    def cid(self, target: str) -> str:
        self.seq += 1
        return f"bench-streams-{target}-{self.seq:07d}"

    async def round(self, target: str, n: int) -> dict[str, Any]:
        """N streams at once on `target`: the client's view and the server's cost."""
        pid = self.pids.get(target)
        port = self.ports[target]
        await settle(pid)
        run = Round(n)
        sampler = Sampler(pid, run)
        idle = sampler.take()
        protos = await connect(port, run)
        marks: dict[str, Sample] = {}
        run.on_all_first = lambda: marks.setdefault("all_first", sampler.take())
        run.on_first_end = lambda: marks.setdefault("first_end", sampler.take())
        requests = [request_bytes(port, i, self.cid(target)) for i in range(n)]
        mock0, client0 = tree_usage(self.mock_pid)[0], time.process_time()
        ticks0 = cpu_seconds(pid) if pid else 0.0
        start = sampler.take()
        for proto, request in zip(protos, requests, strict=True):
            proto.send(request)
        ticker = asyncio.ensure_future(sampler.run())
        try:
            await asyncio.wait_for(run.done, timeout=60 + n * self.chunks * self.interval / 10)
        finally:
            for proto in protos:
                if proto.transport is not None:
                    proto.transport.close()
        ended = perf()
        await settle(pid)
        ticker.cancel()
        end = sampler.take()
        ticks = cpu_seconds(pid) - ticks0 if pid else 0.0
        mock_cpu = (tree_usage(self.mock_pid)[0] - mock0) / 1e9
        client_cpu = time.process_time() - client0
        row = self._summarize(
            target, n, protos, sampler, idle, start, marks, end, ended, mock_cpu, client_cpu
        )
        if pid:  # the same from /proc/<pid>/stat (10 ms ticks; threads that ended included)
            row["cpu_s_stat"] = round(ticks, 3)
        return row

    def _summarize(
        self,
        target: str,
        n: int,
        protos: list[StreamProtocol],
        sampler: Sampler,
        idle: Sample,
        start: Sample,
        marks: dict[str, Sample],
        end: Sample,
        ended: float,
        mock_cpu: float,
        client_cpu: float,
    ) -> dict[str, Any]:
        gaps: list[float] = []
        ttfc: list[float] = []
        durations: list[float] = []
        behind: list[float] = []
        failures: list[str] = []
        for proto in protos:
            times, done = proto.content_times()
            if proto.error or proto.status != 200 or not done or len(times) != self.chunks:
                failures.append(
                    proto.error
                    or f"HTTP {proto.status}, {len(times)} content chunks, [DONE] "
                    f"{'in' if done else 'missing'}: {bytes(proto.buf[-200:])!r}"
                )
                continue
            ttfc.append(times[0] - proto.t_sent)
            durations.append(times[-1] - times[0])
            gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
            # against the pace: chunk k is due k intervals after the stream's least late chunk
            pace = self.interval
            due = [t - k * pace for k, t in enumerate(times)]
            best = min(due)
            behind.extend(d - best for d in due)
        if failures:
            raise RuntimeError(f"{target}: {len(failures)} of {n} streams failed; first: {failures[0]}")
        gaps.sort()
        ttfc.sort()
        durations.sort()
        behind.sort()
        row: dict[str, Any] = {
            "target": target,
            "streams": n,
            "chunks": n * self.chunks,
            "events": end.events,
            "seconds": round(ended - start.t, 3),
            "gap_ms": _ms(gaps, (0.5, 0.99, 1.0)),
            "ttfc_ms": _ms(ttfc, (0.5, 0.99, 1.0)),
            "stream_ms": _ms(durations, (0.5, 1.0)),
            # how late a chunk came against the mock's pace (from the stream's least late chunk)
            "behind_ms": _ms(behind, (0.5, 0.99, 1.0)),
            "mock_cpu_s": round(mock_cpu, 3),
            "client_cpu_s": round(client_cpu, 3),
            "idle_rss_mib": round(idle.rss_kib / 1024, 1),
            "samples": len(sampler.samples),
        }
        if target == "direct":
            return row
        row["series"] = [  # every reading: s since the requests, CPU s, waited s, RSS MiB, counts
            [
                round(x.t - start.t, 3),
                round((x.cpu_ns - start.cpu_ns) / 1e9, 4),
                round((x.waited_ns - start.waited_ns) / 1e9, 4),
                round(x.rss_kib / 1024, 1),
                x.events,
                x.firsts,
                x.ends,
            ]
            for x in sampler.samples
        ]
        row["waited_s"] = round((end.waited_ns - start.waited_ns) / 1e9, 3)
        peak = max(s.rss_kib for s in sampler.samples)
        row["peak_rss_mib"] = round(peak / 1024, 1)
        row["rss_kib_per_stream"] = round((peak - idle.rss_kib) / n, 1)
        cpu = (end.cpu_ns - start.cpu_ns) / 1e9
        row["cpu_s"] = round(cpu, 4)
        first, last = marks["all_first"], marks["first_end"]
        per_chunk = _fit_per_chunk([x for x in sampler.samples if start.t <= x.t <= end.t])
        per_stream = (cpu - per_chunk * (end.events - start.events)) / n
        row.update(
            cpu_us_per_chunk=round(per_chunk * 1e6, 2),
            cpu_ms_per_stream=round(per_stream * 1000, 3),
            opening_s=round(first.t - start.t, 3),
            ended_while_opening=first.ends,
        )
        steady = last.t - first.t
        # A cross-check: every stream open, only chunks flowing (a steady flow: N x 5 at least).
        if steady >= MIN_STEADY_SECONDS and last.events - first.events >= 5 * n:
            row["cpu_us_per_chunk_steady"] = round(
                (last.cpu_ns - first.cpu_ns) / 1e3 / (last.events - first.events), 2
            )
        if first.ends > n * MAX_ENDED_WHILE_OPENING:
            return row  # the split below would rest on the few streams still open
        # A stream's start costs before its first event: after `first` the CPU is chunks and the
        # ends of the streams still open; before it, the starts, chunks and the ends already in.
        per_end = ((end.cpu_ns - first.cpu_ns) / 1e9 - per_chunk * (end.events - first.events)) / (
            n - first.ends
        )
        opening = (first.cpu_ns - start.cpu_ns) / 1e9 - per_chunk * (first.events - start.events)
        row["cpu_ms_per_start"] = round((opening - per_end * first.ends) / n * 1000, 3)
        row["cpu_ms_per_end"] = round(per_end * 1000, 3)
        return row


def _fit_per_chunk(samples: list[Sample]) -> float:
    """CPU per event from a least-squares fit, over the intervals between readings, of the
    server's CPU on the events, the first events and the ends the client saw in each. (The
    other two coefficients are not used: a stream's start costs before its first event shows.)
    Where every stream is open long enough, it agrees with the CPU over the events there within
    a few percent; it stays right when a server takes longer to open the streams than one lasts,
    and when work other than chunks runs meanwhile (seen on the gateway: up to +70% there)."""
    rows = [
        (b.events - a.events, b.firsts - a.firsts, b.ends - a.ends, (b.cpu_ns - a.cpu_ns) / 1e9)
        for a, b in zip(samples, samples[1:], strict=False)
    ]
    k = 3
    m = [
        [sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * r[k] for r in rows)]
        for i in range(k)
    ]
    for i in range(k):  # Gauss-Jordan on the normal equations
        pivot = max(range(i, k), key=lambda q: abs(m[q][i]))
        m[i], m[pivot] = m[pivot], m[i]
        if abs(m[i][i]) < 1e-12:
            return float("nan")
        for q in range(k):
            if q != i:
                f = m[q][i] / m[i][i]
                m[q] = [x - f * y for x, y in zip(m[q], m[i], strict=True)]
    return m[0][k] / m[0][0]


def _ms(sorted_seconds: list[float], qs: tuple[float, ...]) -> dict[str, float]:
    names = {0.5: "p50", 0.99: "p99", 1.0: "max"}
    return {names[q]: round(percentile(sorted_seconds, q) * 1000, 2) for q in qs}


# -- the figures ----------------------------------------------------------------------------------
# (key in the summary, how a round's row gives it, printed format)
METRICS: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("cpu_s", lambda r: r.get("cpu_s")),
    ("cpu_us_per_chunk", lambda r: r.get("cpu_us_per_chunk")),
    ("cpu_ms_per_stream", lambda r: r.get("cpu_ms_per_stream")),
    ("cpu_ms_per_start", lambda r: r.get("cpu_ms_per_start")),
    ("cpu_ms_per_end", lambda r: r.get("cpu_ms_per_end")),
    # a process keeps the memory a round grew it by: the first round at each N (fresh servers)
    ("rss_kib_per_stream", lambda r: r.get("rss_kib_per_stream") if r["round"] == 0 else None),
    ("gap_p50_ms", lambda r: r["gap_ms"]["p50"]),
    ("gap_p99_ms", lambda r: r["gap_ms"]["p99"]),
    ("gap_max_ms", lambda r: r["gap_ms"]["max"]),
    ("ttfc_p50_ms", lambda r: r["ttfc_ms"]["p50"]),
    ("ttfc_p99_ms", lambda r: r["ttfc_ms"]["p99"]),
    ("behind_p99_ms", lambda r: r["behind_ms"]["p99"]),
    ("stream_max_ms", lambda r: r["stream_ms"]["max"]),
    ("waited_s", lambda r: r.get("waited_s")),
    ("mock_cpu_s", lambda r: r["mock_cpu_s"]),
    ("client_cpu_s", lambda r: r["client_cpu_s"]),
)


# Below these the forwarder's figure is within the noise of the decomposition (its stream ends
# cost next to nothing): no ratio is given, the two values speak for themselves.
_RATIO_FLOOR = {
    "cpu_ms_per_start": 0.05,
    "cpu_ms_per_end": float("inf"),  # the forwarder's is about 0
    "rss_kib_per_stream": 1.0,
    "gap_p50_ms": 1.0,  # 0 when most chunks came two in one read
    "behind_p99_ms": 1.0,
}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (N, target): the median of each metric over the rounds, and its ratio to the
    forwarder's median at that N."""
    out: list[dict[str, Any]] = []
    by_key: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault((row["streams"], row["target"]), []).append(row)
    for (n, target), group in by_key.items():
        entry: dict[str, Any] = {"streams": n, "target": target, "rounds": len(group)}
        entry["unsplit_rounds"] = sum(
            1 for r in group if "cpu_ms_per_stream" in r and "cpu_ms_per_end" not in r
        )
        for key, get in METRICS:
            values = [v for v in (get(r) for r in group) if v is not None]
            entry[key] = round(statistics.median(values), 3) if values else None
        out.append(entry)
    for entry in out:
        ref = next((e for e in out if e["streams"] == entry["streams"] and e["target"] == REFERENCE), None)
        entry["x_fwd"] = {
            key: round(entry[key] / ref[key], 2)
            for key, _ in METRICS
            if ref is not None
            and entry[key] is not None
            and ref.get(key) is not None
            and ref[key] >= _RATIO_FLOOR.get(key, 1e-9)
            and key not in ("mock_cpu_s", "client_cpu_s", "waited_s")
        }
    return out


def _cell(entry: dict[str, Any], key: str, fmt: str, ratio: bool = True) -> str:
    value = entry.get(key)
    if value is None:
        return "-"
    text = format(value, fmt)
    x = entry["x_fwd"].get(key)
    if ratio and x is not None and entry["target"] != REFERENCE:
        text += f" x{x:.2f}"
    return text


def print_tables(summary: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    for n in meta["streams"]:
        rows = [e for e in summary if e["streams"] == n]
        rows.sort(key=lambda e: ORDER.index(e["target"]))
        rounds = rows[0]["rounds"] if rows else 0
        print(
            f"\n{n} concurrent streams, {meta['chunks']} chunks {meta['interval_ms']:g} ms apart each "
            f"(gateways: a new conversation per stream, durability fsync); median of {rounds} "
            f"round(s); 'xR' = R times the aiohttp forwarder's median in the same run"
        )
        print(
            f"  {'server':<24}{'CPU s':>12}{'CPU us/chunk':>15}{'CPU ms/stream':>15}{'ms/start':>12}"
            f"{'ms/end':>8}{'RSS KiB/stream':>16}{'waited s':>10}"
        )
        for e in rows:
            if e["target"] == "direct":
                continue
            print(
                f"  {LABELS[e['target']]:<24}{_cell(e, 'cpu_s', '.2f'):>12}"
                f"{_cell(e, 'cpu_us_per_chunk', '.1f'):>15}{_cell(e, 'cpu_ms_per_stream', '.2f'):>15}"
                f"{_cell(e, 'cpu_ms_per_start', '.2f'):>12}{_cell(e, 'cpu_ms_per_end', '.2f'):>8}"
                f"{_cell(e, 'rss_kib_per_stream', '.1f'):>16}{_cell(e, 'waited_s', '.1f', False):>10}"
            )
        print(
            f"  {'client, ms':<24}{'gap p50':>12}{'gap p99':>14}{'gap max':>14}{'behind p99':>14}"
            f"{'1st chunk p50':>15}{'1st chunk p99':>15}"
        )
        for e in rows:
            print(
                f"  {LABELS[e['target']]:<24}{_cell(e, 'gap_p50_ms', '.1f'):>12}"
                f"{_cell(e, 'gap_p99_ms', '.0f'):>14}{_cell(e, 'gap_max_ms', '.0f'):>14}"
                f"{_cell(e, 'behind_p99_ms', '.0f'):>14}"
                f"{_cell(e, 'ttfc_p50_ms', '.0f'):>15}{_cell(e, 'ttfc_p99_ms', '.0f'):>15}"
            )
        unsplit = [
            f"{e['target']} {e['unsplit_rounds']}/{e['rounds']}" for e in rows if e.get("unsplit_rounds")
        ]
        if unsplit:
            print(
                "  no start/end split where over a tenth of the streams had ended before the last one "
                f"began (rounds of {', '.join(unsplit)}): those medians are over the other rounds"
            )
        others = ", ".join(f"{e['target']} {e['client_cpu_s']:.2f}/{e['mock_cpu_s']:.2f}" for e in rows)
        print(
            f"  the client (this process, one event loop) and the mock share the {os.cpu_count()} cores "
            f"with the server; their CPU s per round (client/mock): {others}"
        )


# -- processes ------------------------------------------------------------------------------------
class Servers:
    """The paced mock (for the whole run) and the targets' servers, started afresh for every
    stream count: a process keeps the memory a round grew it by, so only its first round of
    streams shows what they take."""

    def __init__(self, procs: Processes, tmp: Path, args: argparse.Namespace) -> None:
        self.procs = procs
        self.tmp = tmp
        self.env = clean_env()
        self.python = sys.executable
        gateway_bin = REPO / ".venv" / "bin" / "gateway"
        self.gateway_cmd = [str(gateway_bin)] if gateway_bin.exists() else [self.python, "-m", "gateway"]
        self.targets_run = targets_of(args)
        self.baseline = Path(args.baseline).resolve() if args.baseline else None
        self.baseline_workers = getattr(args, "baseline_workers", 1)
        if self.baseline_workers > 1:
            LABELS[BASELINE] = f"baseline gw, {self.baseline_workers} workers"
        self.ports = {target: free_port() for target in ORDER}
        self.targets: dict[str, Server] = {}
        self.logs: list[Path] = []
        mock = procs.start(
            Server(
                "mock",
                [
                    self.python,
                    str(REPO / "bench" / "mock_upstream.py"),
                    "--port",
                    str(self.ports["direct"]),
                    "--stream-chunks",
                    str(args.chunks),
                    "--stream-interval-ms",
                    str(args.interval_ms),
                ],
                self.ports["direct"],
                tmp / "mock.log",
                self.env,
            ),
            REPO,
        )
        mock.wait_ready("/healthz", 30)
        self.mock_pid = mock.pid

    def start_targets(self, tag: str) -> dict[str, int]:
        """Stop the targets' servers if running, start them again; their pids."""
        from .run import write_gateway_config

        for server in self.targets.values():
            server.stop()
        ports, tmp = self.ports, self.tmp
        upstream = f"http://{HOST}:{ports['direct']}"
        argv = [
            self.python,
            str(REPO / "bench" / "forwarder.py"),
            "--client",
            "aiohttp",
            "--max-connections",
            "0",  # no pool limit: the gateway's streams have none either
            "--port",
            str(ports[REFERENCE]),
            "--upstream",
            upstream,
        ]
        forwarder = self._start(REFERENCE, argv, tag)
        forwarder.wait_ready("/readyz", 30)
        for name, workers in (("gateway", 1), ("gateway_2w", 2), (BASELINE, self.baseline_workers)):
            if name not in self.targets_run:
                continue
            cfg = tmp / f"{name}.toml"
            data_dir = tmp / f"data-{name}"
            write_gateway_config(
                cfg, port=ports[name], upstream_port=ports["direct"], data_dir=data_dir, durability="fsync"
            )
            argv = [*self.gateway_cmd, "serve", "--config", str(cfg), "--data-dir", str(data_dir)]
            argv += ["--port", str(ports[name])]
            if workers > 1:
                argv += ["--workers", str(workers)]
            cwd = REPO
            if name == BASELINE:
                assert self.baseline is not None
                argv = [self.python, "-m", "gateway", *argv[len(self.gateway_cmd) :]]
                cwd = self.baseline  # (`-m` imports the package of the working directory)
            # One at a time: startup is not what is measured.
            self._start(name, argv, tag, cwd).wait_ready("/readyz", 60)
        return {name: server.pid for name, server in self.targets.items()}

    def _start(self, name: str, argv: list[str], tag: str, cwd: Path = REPO) -> Server:
        log = self.tmp / f"{name}-{tag}.log"
        self.logs.append(log)
        server = self.procs.start(Server(name, argv, self.ports[name], log, self.env), cwd)
        self.targets[name] = server
        return server


def targets_of(args: argparse.Namespace) -> list[str]:
    """The targets of a round, in its order."""
    targets = [t for t in TARGETS if not (t == "gateway_2w" and getattr(args, "no_2w", False))]
    return targets + [BASELINE] if getattr(args, "baseline", None) else targets


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def list_conversations(port: int) -> None:
    """One list page. A gateway started on an empty data dir writes its conversation catalog at
    the first list (not at a turn: until then a turn appends nothing to it); a data dir that has
    served has one, so every measured turn pays its catalog append, as in use."""
    conn = Connection(HOST, port)
    r = await conn.request("GET", "/v1/conversations?limit=1")
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"GET /v1/conversations on port {port}: HTTP {r.status}: {r.body[:200]!r}")


async def measure(
    servers: Servers, bench: Bench, streams: list[int], rounds: int, warmup: int
) -> list[dict[str, Any]]:
    targets = servers.targets_run
    rows: list[dict[str, Any]] = []
    for n in streams:
        bench.pids = servers.start_targets(f"n{n}")
        # Warm every target up (imports, pools, the gateways' first turns), all at once.
        await asyncio.gather(*(bench.round(t, warmup) for t in targets))
        for target in (t for t in targets if t.startswith("gateway")):
            await list_conversations(bench.ports[target])
        for r in range(rounds):
            for target in targets if r % 2 == 0 else targets[::-1]:
                t0 = perf()
                row = await bench.round(target, n)
                row["round"] = r
                rows.append(row)
                print(
                    f"  N={n} round {r + 1}/{rounds} {target}: {perf() - t0:.1f} s, gap p99 "
                    f"{row['gap_ms']['p99']:.1f} ms, first chunk p99 {row['ttfc_ms']['p99']:.1f} ms"
                    + (f", server CPU {row['cpu_s']:.2f} s" if "cpu_s" in row else ""),
                    flush=True,
                )
    return rows


def git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams",
        default=",".join(map(str, DEFAULT_STREAMS)),
        help="comma-separated stream counts (default 100,300; e.g. 100,300,1000)",
    )
    parser.add_argument("--stream-rounds", type=int, default=3, help="rounds per stream count (default 3)")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also measure the gateway of another checkout (e.g. `git archive main | tar -x -C DIR`)",
    )
    parser.add_argument(
        "--baseline-workers", type=int, default=1, help="workers of the --baseline gateway (default 1)"
    )
    parser.add_argument(
        "--no-2w", action="store_true", help="leave out the gateway with --workers 2 (a shorter run)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="N concurrent long streams: forwarder vs gateway")
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="N=50, one round (smoke test)")
    parser.add_argument("--chunks", type=int, default=CHUNKS, help="chunks per stream (default 100)")
    parser.add_argument(
        "--interval-ms", type=float, default=INTERVAL_MS, help="ms between chunks (default 20)"
    )
    parser.add_argument("--warmup", type=int, default=20, help="streams per target before measuring")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data dirs and logs")
    parser.add_argument(
        "--tmp-dir", default=None, help="where the gateways' data dirs go (default $TMPDIR or /tmp)"
    )
    args = parser.parse_args(argv)
    streams = [50] if args.quick else [int(x) for x in args.streams.split(",") if x.strip()]
    rounds = 1 if args.quick else max(1, args.stream_rounds)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    tmp = Path(tempfile.mkdtemp(prefix="gateway-streams-", dir=args.tmp_dir))
    procs = Processes()
    wall = perf()
    try:
        servers = Servers(procs, tmp, args)
        print(
            f"streams: servers up; N = {', '.join(map(str, streams))}, {rounds} round(s), "
            f"{args.chunks} chunks every {args.interval_ms:g} ms",
            flush=True,
        )
        bench = Bench(servers.ports, {}, servers.mock_pid, args.chunks, args.interval_ms / 1000)
        rows = run_async(measure(servers, bench, streams, rounds, args.warmup))
        summary = summarize(rows)
        meta = {"streams": streams, "chunks": args.chunks, "interval_ms": args.interval_ms}
        print_tables(summary, meta)
        from .run import scan_gateway_log

        logs = {log.stem: scan_gateway_log(log) for log in servers.logs if log.stem.startswith("gateway")}
        for name, log in logs.items():
            # (the catalog written at the first list, see `list_conversations`, is expected)
            other = [line for line in log["examples"] if "rebuilt the conversation catalog" not in line]
            if other:
                print(
                    f"  note: {name} logged {log['other_lines']} line(s) besides its access log: {other[0]}"
                )
        result = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "commit": git_commit(),
            **meta,
            "rounds": rounds,
            "targets": {t: LABELS[t] for t in servers.targets_run},
            "summary": summary,
            "rounds_raw": rows,
            "gateway_logs": logs,
            "wall_seconds": round(perf() - wall, 1),
        }
        name = write_result(
            orjson.dumps(result, option=orjson.OPT_INDENT_2), "streams", "streams-latest.json"
        )
        print(f"\nwrote var/bench/{name} and var/bench/streams-latest.json ({result['wall_seconds']} s)")
        return 0
    except BaseException:
        procs.tell_exited()
        raise
    finally:
        procs.stop_all()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
