"""Memory over a long run: one `gateway serve` (1 worker) against the bench mock upstream,
driven with many conversations of many turns, RSS sampled from /proc/PID/status.

    .venv/bin/python -m bench.memory --requests 50000            # 3-5 min on 2 cores
    .venv/bin/python -m bench.memory --requests 20000 --tracemalloc   # about 4x slower
    .venv/bin/python -m bench.memory --gateway-src /tmp/other-checkout   # another version

The load (`--concurrency` keep-alive clients, default 8): each client talks in a conversation
of its own for `--turns` turns (default 20) and then starts a new one, so a run of 50,000
requests leaves about 2,000 conversations behind; besides chat turns (a fifth streamed,
some with `user`, some stateless), clients read responses, items, lists and the inspector's
view and post Responses API turns, and the lifecycle processor visits the idle ones
(`--idle-after`, default 20s). RSS is sampled every `--sample-every` seconds; the figures are
RSS after `--warmup` requests (default 5,000) and at the end, and their difference.
`--tracemalloc` runs the gateway with tracemalloc on and prints the allocation sites that
grew most between the warm-up and the end. `--storage` and `--env` change the gateway's
[storage] section and environment for experiments (e.g. 'cache_conversations = 64',
MALLOC_ARENA_MAX=2). See docs/memory.md.
Writes the figures to var/bench/memory-<timestamp>.json and var/bench/memory-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import orjson

from . import harness
from .client import Connection
from .procs import HOST, Processes, Server, clean_env, free_port, write_result

REPO = Path(__file__).resolve().parent.parent
MODEL = "bench-model"


def rss_kib(pid: int) -> int:
    """VmRSS of one process (the gateway serves in the process it started with 1 worker)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def write_config(
    path: Path, *, port: int, upstream_port: int, data_dir: Path, idle_after: str, storage: list[str]
) -> None:
    """The measured gateway's config: the mock upstream, fsync; `storage`: more `[storage]`
    lines (`key = value`)."""
    more = tomllib.loads("\n".join(storage))
    sections = {
        "server": {"host": HOST, "port": port},
        "storage": {"data_dir": str(data_dir), "durability": "fsync", **more},
        "sessions": {"idle_after": idle_after},
        "providers.mock": {"kind": "openai", "base_url": f"http://{HOST}:{upstream_port}/v1"},
    }
    harness.write_config(path, "mock", sections, header="written by bench/memory.py")


class Load:
    """The clients' shared counters and the mix of requests."""

    def __init__(self, total: int, turns: int, seed: int) -> None:
        self.total = total
        self.turns = turns
        self.sent = 0
        self.done = 0
        self.errors: dict[str, int] = {}
        self.seed = seed

    def take(self) -> bool:
        if self.sent >= self.total:
            return False
        self.sent += 1
        return True

    def chat(self, cid: str | None, text: str, *, stream: bool = False, user: str | None = None) -> bytes:
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        if cid is not None:
            body["conversation_id"] = cid
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if user is not None:
            body["user"] = user
        return orjson.dumps(body)

    def pick(
        self, roll: float, rng: random.Random, cid: str, text: str, last_rid: str | None
    ) -> tuple[str, str, bytes]:
        """The request of the mix that `roll` (in [0, 1)) falls on: (method, path, body)."""
        chats = "/v1/chat/completions"
        if roll < 0.55:
            return "POST", chats, self.chat(cid, text)
        if roll < 0.75:
            return "POST", chats, self.chat(cid, text, stream=True)
        if roll < 0.80:
            return "POST", chats, self.chat(cid, text, user=f"user-{rng.randrange(200)}")
        if roll < 0.83:
            return "POST", chats, self.chat(None, text)
        if roll < 0.86:
            return "POST", "/v1/responses", orjson.dumps({"model": MODEL, "input": text, "conversation": cid})
        if roll < 0.90 and last_rid:
            return "GET", f"/v1/responses/{last_rid}", b""
        reads = [
            (0.94, f"/v1/conversations/{cid}/items?limit=20"),
            (0.96, "/v1/conversations?limit=20"),
            (0.98, f"/ui/api/conversations/{cid}"),
        ]
        return "GET", next((path for under, path in reads if roll < under), "/metrics"), b""

    async def client(self, n: int, port: int) -> None:
        rng = random.Random(self.seed * 1000 + n)
        conn = Connection(HOST, port)
        generation = turns = 0
        last_rid: str | None = None
        try:
            while self.take():
                cid = f"mem-{n}-{generation}"
                roll = rng.random()
                text = f"turn {turns} of {cid}: my number is {rng.randrange(10_000)} " + "words " * 20
                method, path, body = self.pick(roll, rng, cid, text, last_rid)
                try:
                    reply = await conn.request(method, path, body, timeout=60)
                    status = reply.status
                except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                    status = 0
                    self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
                    conn.close()
                    conn = Connection(HOST, port)
                self.done += 1
                if method == "POST" and status == 200:
                    rid = reply.headers.get(b"x-response-id")
                    last_rid = rid.decode() if rid else last_rid
                    if path.endswith("completions") and b'"conversation_id"' in body:
                        turns += 1
                        if turns % self.turns == 0:
                            generation += 1
                elif status not in (200, 404):  # 404: a conversation not created yet
                    key = f"{method} {path.split('/')[2] if path.count('/') > 1 else path} {status}"
                    self.errors[key] = self.errors.get(key, 0) + 1
        finally:
            conn.close()


async def drive(args: argparse.Namespace, port: int, pid: int, snapshot: Any) -> dict[str, Any]:
    load = Load(args.requests, args.turns, args.seed)
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    marks: dict[str, dict[str, float]] = {}

    async def sampler() -> None:
        while True:
            point = {
                "t": round(time.monotonic() - started, 1),
                "requests": load.done,
                "rss_kib": rss_kib(pid),
            }
            samples.append(point)
            if "warmup" not in marks and load.done >= args.warmup:
                marks["warmup"] = point
                snapshot("warmup")
            if args.verbose:
                rss = point["rss_kib"] / 1024
                print(f"  {point['t']:>7.1f}s {load.done:>7} requests  RSS {rss:7.1f} MiB")
            await asyncio.sleep(args.sample_every)

    task = asyncio.create_task(sampler())
    clients = [asyncio.create_task(load.client(n, port)) for n in range(args.concurrency)]
    try:
        await asyncio.gather(*clients)
    finally:
        task.cancel()
    await asyncio.sleep(args.settle)  # in-flight background work (summaries) settles
    end = {"t": round(time.monotonic() - started, 1), "requests": load.done, "rss_kib": rss_kib(pid)}
    samples.append(end)
    snapshot("end")
    warm = marks.get("warmup", samples[0])
    after = [s for s in samples if s["requests"] >= warm["requests"]]
    return {
        "requests": load.done,
        "seconds": end["t"],
        "errors": load.errors,
        "rss_mib": {
            "first_sample": round(samples[0]["rss_kib"] / 1024, 1),
            "after_warmup": round(warm["rss_kib"] / 1024, 1),
            "end": round(end["rss_kib"] / 1024, 1),
            "growth_after_warmup": round((end["rss_kib"] - warm["rss_kib"]) / 1024, 1),
            "max_after_warmup": round(max(s["rss_kib"] for s in after) / 1024, 1),
        },
        "warmup_requests": warm["requests"],
        "samples": samples,
    }


def print_tracemalloc(folder: Path, top: int = 25) -> None:
    """The allocation sites (innermost frame) that grew most from the warm-up to the end, then
    the call paths (innermost first) of the biggest growths."""
    import tracemalloc

    first, last = folder / "warmup.snapshot", folder / "end.snapshot"
    if not (first.exists() and last.exists()):
        print("tracemalloc: snapshots missing")
        return
    before = tracemalloc.Snapshot.load(str(first))
    after = tracemalloc.Snapshot.load(str(last))

    def where(frame: tracemalloc.Frame) -> str:
        return f"{frame.filename.replace(str(REPO) + '/', '')}:{frame.lineno}"

    total = [sum(s.size for s in snap.statistics("filename")) / 2**20 for snap in (before, after)]
    print(f"\ntracemalloc: traced memory {total[0]:.1f} -> {total[1]:.1f} MiB; growth by line:")
    for stat in after.compare_to(before, "lineno")[:top]:
        site = where(stat.traceback[-1])
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks  {site}")
    print("growth by call path (innermost first):")
    for stat in after.compare_to(before, "traceback")[: top // 2]:
        frames = [where(f) for f in reversed(stat.traceback)]
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+8d} blocks  {' <- '.join(frames)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--warmup", type=int, default=5_000, help="requests before the warm-up reading")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20, help="turns per conversation before a new one")
    parser.add_argument("--idle-after", default="20s", help="sessions.idle_after of the gateway")
    parser.add_argument("--sample-every", type=float, default=3.0)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait before the last reading")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--frames", type=int, default=1, help="frames per traceback with --tracemalloc")
    parser.add_argument(
        "--storage", action="append", default=[], help="a [storage] line, e.g. 'cache_conversations = 64'"
    )
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway's environment")
    parser.add_argument("--gateway-src", type=Path, default=REPO, help="checkout whose gateway to run")
    parser.add_argument("--tmp-dir", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the data dir and logs")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every sample")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="gateway-memory-", dir=args.tmp_dir))
    procs = Processes()
    python = sys.executable
    try:
        up_port, gw_port = free_port(), free_port()
        procs.start(
            Server(
                "mock",
                [python, str(REPO / "bench" / "mock_upstream.py"), "--port", str(up_port)],
                up_port,
                tmp / "mock.log",
                clean_env(),
            ),
            REPO,
        ).wait_ready("/healthz", 20)
        config = tmp / "gateway.toml"
        write_config(
            config,
            port=gw_port,
            upstream_port=up_port,
            data_dir=tmp / "var",
            idle_after=args.idle_after,
            storage=args.storage,
        )
        serve = [
            "serve",
            "--config",
            str(config),
            "--port",
            str(gw_port),
            "--workers",
            "1",
            "--log-level",
            "warning",
        ]
        extra = dict(item.split("=", 1) for item in args.env)
        path = os.pathsep.join(p for p in (extra.pop("PYTHONPATH", ""), str(args.gateway_src)) if p)
        trace = {"GATEWAY_TRACE_DIR": str(tmp), "GATEWAY_TRACE_FRAMES": str(args.frames)}
        env = clean_env({**extra, "PYTHONPATH": path, **trace})
        if args.tracemalloc:
            # A file with no imports of bench/, run from the checkout measured (`--gateway-src`).
            argv_gw = [python, str(Path(__file__).resolve().parent / "tracemalloc_serve.py"), *serve]
        else:
            argv_gw = [python, "-m", "gateway", *serve]
        gateway = procs.start(Server("gateway", argv_gw, gw_port, tmp / "gateway.log", env), args.gateway_src)
        gateway.wait_ready("/readyz", 60)

        def snapshot(name: str) -> None:
            if not args.tracemalloc:
                return
            (tmp / "next").write_text(name)
            os.kill(gateway.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 120
            while not (tmp / f"{name}.snapshot").exists() and time.monotonic() < deadline:
                time.sleep(0.2)

        print(
            f"gateway pid {gateway.pid}: {args.requests} requests, {args.concurrency} clients, "
            f"{args.turns} turns per conversation, warm-up reading after {args.warmup}"
        )
        figures = asyncio.run(drive(args, gw_port, gateway.pid, snapshot))
        rss = figures["rss_mib"]
        errors = figures["errors"] or "none"
        print(f"requests {figures['requests']} in {figures['seconds']:.0f} s, errors {errors}")
        print(f"RSS at the first sample      {rss['first_sample']:7.1f} MiB")
        print(f"RSS after {figures['warmup_requests']:>6} requests   {rss['after_warmup']:7.1f} MiB")
        print(f"RSS at the end               {rss['end']:7.1f} MiB")
        print(
            f"growth after warm-up         {rss['growth_after_warmup']:+7.1f} MiB "
            f"(highest after warm-up {rss['max_after_warmup']:.1f})"
        )
        if args.tracemalloc:
            print_tracemalloc(tmp)
        figures["args"] = {k: str(v) for k, v in vars(args).items()}
        write_result(orjson.dumps(figures, option=orjson.OPT_INDENT_2), "memory", "memory-latest.json")
        warnings = [line for line in gateway.log_tail(200).splitlines() if line.strip()]
        if warnings:
            print(f"gateway log ({len(warnings)} lines, last 5):", *warnings[-5:], sep="\n  ")
    finally:
        procs.stop_all()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
