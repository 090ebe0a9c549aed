"""Listing at scale: `GET /v1/conversations`, the inspector's list and search, and
`gateway conversations`, with 100,000 stored conversations, against the same at 1,000 (and,
with `--baseline DIR`, another version of the gateway at 1,000), in one run.

    .venv/bin/python -m bench.listing [--quick] [--conversations N] [--baseline DIR] [--no-postgres]

JSONL: the data dir is seeded once and kept (var/bench/listing-<N>/, reused by later runs:
100,000 files take ~30 s to write and longer to delete on this disk): N - T conversations made
as `POST /v1/conversations` makes them (one creation marker), written directly, oldest first,
then T conversations with one chat turn each, made by the gateway itself (built-in `demo`
model) so they are the newest. PostgreSQL: the same rows inserted with one statement each.

Measured per target: time to /readyz (with the catalog, and for JSONL also without it: a data
dir older than the catalog, rebuilt at start), the first page cold (the first request after
start) and warm (p50 of `--repeat`), `limit=100`, the second page (`after`), the inspector's
list (200 rows) and a search (bounded: at most 500 conversations read), `gateway conversations`
wall time (a new process: imports + catalog load + the page), and RSS after listing and after
creating `--create` more conversations over HTTP. Then a list page with a conversation of
10,000 messages on it, and the cold first request on that conversation (bench/listing_long.py;
`--no-long` skips it). Writes var/bench/listing-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.store.jsonl.layout import DataDir

from . import harness
from .client import Connection
from .procs import HOST, Processes, Server, clean_env, free_port, rss_kib
from .seed import insert_created, write_created

REPO = Path(__file__).resolve().parent.parent
SEED_VERSION = 1
NEEDLE_EVERY = 50  # one turned conversation in this many mentions "needle" (the search's target)


def write_config(path: Path, port: int, data_dir: Path, dsn: str = "") -> None:
    """A listing gateway's config: the demo provider, the store (JSONL, or PostgreSQL at `dsn`)."""
    storage: dict[str, object] = {"backend": "postgres", "dsn": dsn} if dsn else {"backend": "jsonl"}
    sections = {
        "server": {"host": HOST, "port": port},
        "storage": {**storage, "data_dir": str(data_dir), "durability": "none"},
        "providers.demo": {"kind": "demo"},
    }
    harness.write_config(path, "demo", sections, header="written by bench/listing.py")


class Target:
    """One gateway version on one store: started, stopped, measured."""

    def __init__(
        self, name: str, tmp: Path, data_dir: Path, *, dsn: str = "", code: Path | None = None
    ) -> None:
        self.name, self.data_dir, self.dsn, self.code = name, data_dir, dsn, code
        self.port = free_port()
        self.config = tmp / f"{name}.toml"
        self.log = tmp / f"{name}.log"
        write_config(self.config, self.port, data_dir, dsn)
        self.procs = Processes()
        self.server: Server | None = None

    def env(self) -> dict[str, str]:
        path = str(self.code) if self.code else os.environ.get("PYTHONPATH", str(REPO))
        return clean_env({"PYTHONPATH": path})

    def start(self) -> float:
        argv = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(self.config),
            "--port",
            str(self.port),
        ]
        # `python -m` puts the working directory first on sys.path: run from the code measured.
        self.server = self.procs.start(
            Server(self.name, argv, self.port, self.log, self.env()), self.code or REPO
        )
        return self.server.wait_ready("/readyz", 300)

    def stop(self) -> None:
        self.procs.stop_all()
        self.procs = Processes()
        self.server = None

    def cli_ms(self, repeat: int) -> float:
        argv = [
            sys.executable,
            "-m",
            "gateway",
            "conversations",
            "--config",
            str(self.config),
            "--limit",
            "20",
        ]
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            done = subprocess.run(
                argv, env=self.env(), cwd=self.code or REPO, capture_output=True, timeout=600
            )
            times.append((time.perf_counter() - t) * 1000)
            if done.returncode != 0:
                raise RuntimeError(f"{self.name}: gateway conversations failed: {done.stderr[-500:]!r}")
        return statistics.median(times)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(pid: int, timeout: float = 30.0) -> None:
    """Until the process used (almost) no CPU for 0.3 s."""
    deadline = time.perf_counter() + timeout
    last = cpu_seconds(pid)
    while time.perf_counter() < deadline:
        time.sleep(0.3)
        now = cpu_seconds(pid)
        if now - last < 0.02:
            return
        last = now


async def get(conn: Connection, path: str) -> tuple[float, Any]:
    r = await conn.request("GET", path, timeout=600)
    if r.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {r.status}: {r.body[:300]!r}")
    return r.latency * 1000, orjson.loads(r.body)


async def chat_turns(port: int, count: int) -> None:
    """`count` new conversations of one turn each, made by the gateway (the `demo` model)."""
    conn = Connection(HOST, port)
    for i in range(count):
        word = "needle" if i % NEEDLE_EVERY == 0 else "hay"
        body = {
            "model": "demo",
            "conversation_id": f"turned-{i:06d}",
            "user": f"user-{i % 97}",
            "messages": [{"role": "user", "content": f"Turn {i}: remember the {word} number {i}."}],
        }
        r = await conn.request("POST", "/v1/chat/completions", orjson.dumps(body))
        if r.status != 200:
            raise RuntimeError(f"seeding: HTTP {r.status}: {r.body[:300]!r}")
    conn.close()


def seed_jsonl(data_dir: Path, total: int, turned: int, tmp: Path) -> dict[str, Any]:
    """A data dir of `total` conversations, kept between runs (see the module's docstring)."""
    stamp = data_dir / "seeded.json"
    want = {"version": SEED_VERSION, "total": total, "turned": turned}
    if stamp.exists() and orjson.loads(stamp.read_bytes()) == want:
        return {"reused": True, "seconds": 0.0}
    shutil.rmtree(data_dir, ignore_errors=True)
    layout = DataDir(data_dir)
    layout.create()
    t = time.perf_counter()
    start = time.time() - 86400 * 30
    write_created(layout, start, total - turned)
    target = Target("seeding", tmp, data_dir)
    target.start()
    try:
        asyncio.run(chat_turns(target.port, turned))
    finally:
        target.stop()
    stamp.write_bytes(orjson.dumps(want))
    return {"reused": False, "seconds": round(time.perf_counter() - t, 1)}


async def seed_postgres(dsn: str, total: int) -> float:
    """`total` conversations of one creation marker each, oldest first (the namespace "")."""
    import asyncpg

    t = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        start = time.time() - 86400 * 30
        await insert_created(conn, start, total)
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - t


async def measure_http(port: int, repeat: int) -> dict[str, Any]:
    conn = Connection(HOST, port)
    out: dict[str, Any] = {}
    cold, first = await get(conn, "/v1/conversations")
    out["first_page_cold_ms"] = round(cold, 2)
    if len(first["data"]) != 20:
        raise RuntimeError(f"first page has {len(first['data'])} rows, not 20")
    after = first["last_id"]
    paths = {
        "first_page": "/v1/conversations",
        "first_page_limit20": "/v1/conversations?limit=20",
        "first_page_limit100": "/v1/conversations?limit=100",
        "second_page": f"/v1/conversations?after={after}",
        "inspector_list": "/ui/api/conversations",
        "inspector_search": "/ui/api/conversations?q=needle",
    }
    for name, path in paths.items():
        # The inspector's reads are 10-25 times bigger (200 rows, up to 500 read): fewer repeats.
        n = repeat if name.startswith(("first", "second")) else max(3, repeat // 5)
        times = [(await get(conn, path))[0] for _ in range(n)]
        out[f"{name}_p50_ms"] = round(statistics.median(times), 2)
    _, found = await get(conn, "/ui/api/conversations?q=needle")
    out["search_matches"] = len(found["data"])
    out["search_next"] = found.get("next")
    conn.close()
    return out


async def create_conversations(port: int, count: int) -> tuple[float, list[str]]:
    conn = Connection(HOST, port)
    t = time.perf_counter()
    made = []
    for i in range(count):
        body = orjson.dumps({"metadata": {"made": str(i)}})
        r = await conn.request("POST", "/v1/conversations", body)
        if r.status != 200:
            raise RuntimeError(f"POST /v1/conversations: HTTP {r.status}: {r.body[:300]!r}")
        made.append(orjson.loads(r.body)["id"])
    conn.close()
    return time.perf_counter() - t, made


async def delete_conversations(port: int, ids: list[str]) -> float:
    """Delete them again (the seeded data dir is kept for the next run); p50 ms of a delete."""
    conn = Connection(HOST, port)
    times = []
    for cid in ids:
        r = await conn.request("DELETE", f"/v1/conversations/{cid}")
        if r.status != 200:
            raise RuntimeError(f"DELETE /v1/conversations/{cid}: HTTP {r.status}: {r.body[:300]!r}")
        times.append(r.latency * 1000)
    conn.close()
    return statistics.median(times)


def run_target(target: Target, args: argparse.Namespace, *, rebuild: bool, create: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    catalog = target.data_dir / "catalog" / "conversations.jsonl"
    if rebuild and catalog.exists():
        catalog.unlink()  # as a data dir written before the catalog: rebuilt at start
        out["ready_rebuilding_catalog_ms"] = round(target.start() * 1000, 1)
        target.stop()
    out["ready_ms"] = round(target.start() * 1000, 1)
    assert target.server is not None
    try:
        wait_idle(target.server.pid)  # startup work (the tokenizer's warm-up) is not the list's
        out.update(asyncio.run(measure_http(target.port, args.repeat)))
        out["rss_after_listing_mib"] = round(rss_kib(target.server.pid) / 1024, 1)
        if create:
            seconds, made = asyncio.run(create_conversations(target.port, create))
            out[f"created_{create}_seconds"] = round(seconds, 2)
            out[f"rss_after_creating_{create}_mib"] = round(rss_kib(target.server.pid) / 1024, 1)
            t, page = asyncio.run(first_page(target.port))
            out["first_page_after_creating_ms"] = round(t, 2)
            out["delete_p50_ms"] = round(asyncio.run(delete_conversations(target.port, made)), 2)
    finally:
        target.stop()
    if not target.dsn:
        out["cli_conversations_ms"] = round(target.cli_ms(args.cli_repeat), 1)
    return out


async def first_page(port: int) -> tuple[float, Any]:
    conn = Connection(HOST, port)
    try:
        return await get(conn, "/v1/conversations")
    finally:
        conn.close()


def start_postgres() -> tuple[Any, str]:
    from tests.postgres.cluster import PostgresCluster, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        return None, "skipped (no initdb/pg_ctl)"
    cluster = PostgresCluster(bin_dir, durable=True).start()
    return cluster, f"PostgreSQL on 127.0.0.1:{cluster.port}"


def run_postgres(tmp: Path, args: argparse.Namespace, results: dict[str, Any]) -> str:
    cluster, status = start_postgres()
    if cluster is None:
        return status
    try:
        for total in (args.small, args.conversations):
            dsn = cluster.create_database("listing")
            target = Target(f"pg_{total}", tmp, tmp / f"pg-{total}", dsn=dsn)
            target.start()  # creates the schema
            try:
                asyncio.run(chat_turns(target.port, args.turned_pg))
            finally:
                target.stop()
            seconds = asyncio.run(seed_postgres(dsn, total - args.turned_pg))
            print(f"  postgres {total}: seeded in {seconds:.1f} s; measuring", flush=True)
            results[f"postgres_{total}"] = run_target(target, args, rebuild=False, create=0)
    finally:
        cluster.stop()
    return status


def ratios(results: dict[str, Any], big: str, small: str) -> dict[str, float]:
    a, b = results.get(big, {}), results.get(small, {})
    return {
        k: round(a[k] / b[k], 2)
        for k in a
        if k.endswith("_ms") and isinstance(b.get(k), int | float) and b[k]
    }


def main(argv: list[str] | None = None) -> int:
    from . import listing_long  # (it builds on this module)

    parser = argparse.ArgumentParser(description="listing at 100,000 conversations")
    parser.add_argument("--quick", action="store_true", help="10,000 conversations, few repeats")
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=1_000, help="the same-run comparison size")
    parser.add_argument("--turned", type=int, default=1_000, help="conversations with a chat turn (JSONL)")
    parser.add_argument(
        "--turned-pg", type=int, default=200, help="conversations with a chat turn (PostgreSQL)"
    )
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--cli-repeat", type=int, default=3)
    parser.add_argument(
        "--create", type=int, default=2_000, help="conversations created over HTTP at the end"
    )
    parser.add_argument("--baseline", default=None, help="another version's checkout, measured at --small")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--no-jsonl", action="store_true")
    parser.add_argument("--no-long", action="store_true", help="skip listing_long.py")
    listing_long.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.repeat, args.cli_repeat, args.create = 10_000, 10, 1, 200
        args.long_copies, args.long_repeat = 2, 5
    args.turned = min(args.turned, args.small)
    args.turned_pg = min(args.turned_pg, args.small)
    tmp = Path(tempfile.mkdtemp(prefix="gateway-listing-"))
    results: dict[str, Any] = {}
    wall = time.perf_counter()
    try:
        seeds = {}
        for total in () if args.no_jsonl else (args.small, args.conversations):
            data_dir = REPO / "var" / "bench" / f"listing-{total}"
            seeds[str(total)] = seed_jsonl(data_dir, total, args.turned, tmp)
            print(f"bench listing: jsonl {total}: seed {seeds[str(total)]}; measuring", flush=True)
            target = Target(f"jsonl_{total}", tmp, data_dir)
            create = args.create if total == args.conversations else 50
            results[f"jsonl_{total}"] = run_target(target, args, rebuild=True, create=create)
        if args.baseline and not args.no_jsonl:
            data_dir = REPO / "var" / "bench" / f"listing-{args.small}"
            base = Target("baseline", tmp, data_dir, code=Path(args.baseline).resolve())
            print(f"bench listing: baseline {args.baseline} at {args.small}", flush=True)
            results[f"baseline_{args.small}"] = run_target(base, args, rebuild=False, create=50)
        postgres = "skipped (--no-postgres)"
        if not args.no_postgres:
            postgres = run_postgres(tmp, args, results)
        long = {} if args.no_long else listing_long.run(args, tmp)
        summary = {
            "jsonl_ratio_big_to_small": ratios(results, f"jsonl_{args.conversations}", f"jsonl_{args.small}"),
            "postgres_ratio_big_to_small": ratios(
                results, f"postgres_{args.conversations}", f"postgres_{args.small}"
            ),
        }
        if args.baseline:
            summary["jsonl_small_ratio_to_baseline"] = ratios(
                results, f"jsonl_{args.small}", f"baseline_{args.small}"
            )
        result = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "conversations": args.conversations,
            "small": args.small,
            "postgres": postgres,
            "seeding": seeds,
            "results": results,
            "long": long,
            "summary": summary,
            "wall_seconds": round(time.perf_counter() - wall, 1),
        }
        print_table(result)
        if long:
            listing_long.print_table(long)
        out_dir = REPO / "var" / "bench"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "listing-latest.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        print(f"wrote var/bench/listing-latest.json ({result['wall_seconds']} s)")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(result: dict[str, Any]) -> None:
    results = result["results"]
    names = list(results)
    keys: list[str] = []
    for r in results.values():
        keys += [k for k in r if k not in keys]
    width = max(len(k) for k in keys) + 2
    print("\n" + "".ljust(width) + "".join(n.rjust(18) for n in names))
    for k in keys:
        cells = [results[n].get(k) for n in names]
        print(k.ljust(width) + "".join(("–" if c is None else str(c)).rjust(18) for c in cells))
    for name, row in result["summary"].items():
        print(f"{name}: {row}")


if __name__ == "__main__":
    sys.exit(main())
