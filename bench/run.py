"""`make bench`: the gateway's overhead against a bare forwarder, side by side, in one run.

    .venv/bin/python -m bench.run [--quick] [--keep]
    .venv/bin/python -m bench.run --scenario streams [--streams 100,300,1000]

Starts the mock upstream, the bare forwarder and the real `gateway serve` as subprocesses on
loopback, measures every scenario with one keep-alive client (bench/client.py), prints a
table and writes var/bench/result-<timestamp>.json and var/bench/latest.json. Then N concurrent
long streams (bench/streams.py; N = 100, 300 and 1,000 here, `--scenario streams` for 100 and
300 alone) and the lists at 100,000 conversations (bench/listing.py).
Set LITELLM_BIN to a `litellm` executable to add a LiteLLM proxy column. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

if __name__ == "__main__" and not __package__:  # `python bench/run.py`: as `python -m bench.run`
    _root = str(Path(__file__).resolve().parent.parent)
    _path = os.pathsep.join(filter(None, (_root, os.environ.get("PYTHONPATH"))))
    _argv = [sys.executable, "-m", "bench.run", *sys.argv[1:]]
    os.execve(sys.executable, _argv, {**os.environ, "PYTHONPATH": _path})

from .client import Connection  # noqa: E402 - (after the script form's re-exec)
from .harness import OtlpReceiver, write_config  # noqa: E402
from .procs import HOST, Processes, Server, clean_env, free_port, rss_kib, write_result  # noqa: E402
from .report import print_report  # noqa: E402
from .scenarios import CHAT, CONCURRENCY, MODEL, Bench, Plan, one_message  # noqa: E402
from .seed import clone_conversation, probe_filesystem, read_conversation  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def context_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The gateway [context] keys given on the command line (--max-history-messages, ...)."""
    return {
        k: v
        for k, v in (
            ("max_history_messages", args.max_history_messages),
            ("max_context_tokens", args.max_context_tokens),
        )
        if v is not None
    }


def write_gateway_config(
    path: Path,
    *,
    port: int,
    upstream_port: int,
    data_dir: Path,
    durability: str,
    context: dict[str, int] | None = None,
    dsn: str = "",
    tracing: str = "",
) -> None:
    """A bench gateway's config: the mock upstream, the store (JSONL, or PostgreSQL at `dsn`);
    `tracing`: an OTLP/HTTP endpoint to export spans and metrics to."""
    storage: dict[str, object] = {"backend": "postgres", "dsn": dsn} if dsn else {"backend": "jsonl"}
    sections = {
        "server": {"host": HOST, "port": port},
        "storage": {**storage, "data_dir": str(data_dir), "durability": durability},
        "context": context,
        "tracing": {"endpoint": tracing} if tracing else None,
        "providers.mock": {"kind": "openai", "base_url": f"http://{HOST}:{upstream_port}/v1"},
    }
    write_config(path, "mock", sections, header="written by bench/run.py")


def start_postgres() -> tuple[Any, str]:
    """A throwaway PostgreSQL cluster with fsync on (the tests' helper), or why there is none."""
    from tests.postgres.cluster import PostgresCluster, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        return None, "skipped (no initdb/pg_ctl; apt-get install postgresql)"
    try:
        cluster = PostgresCluster(bin_dir, durable=True).start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return None, f"skipped (could not start PostgreSQL: {exc})"
    return cluster, f"PostgreSQL on 127.0.0.1:{cluster.port}, fsync on"


def start_litellm(procs: Processes, tmp: Path, upstream_port: int) -> tuple[Server | None, str | None, str]:
    binary = os.environ.get("LITELLM_BIN", "")
    if not binary:
        return None, None, "skipped (LITELLM_BIN is not set)"
    key = os.environ.get("LITELLM_MASTER_KEY") or "sk-bench-master"
    port = free_port()
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://{HOST}:{upstream_port}/v1
      api_key: sk-mock
general_settings:
  master_key: {key}
"""
    )
    env = clean_env({"LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    argv = [binary, "--config", str(cfg), "--host", HOST, "--port", str(port), "--num_workers", "1"]
    server = procs.start(Server("litellm", argv, port, tmp / "litellm.log", env), REPO)
    try:
        server.wait_ready("/health/liveliness", timeout=120)
    except RuntimeError as exc:
        server.stop()
        print(f"warning: LiteLLM proxy did not start; column skipped\n{exc}")
        return None, None, "failed to start (see warning)"
    return server, key, "measured"


def git_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "gateway"))}


def seed_conversations(
    port: int, data_dir: Path, template_turns: int, sizes: list[tuple[int, int]]
) -> tuple[dict[int, list[str]], dict[str, Any]]:
    """Have the gateway grow a short template conversation, then clone it into every seeded
    conversation (see bench/seed.py): the files are the gateway's own format by construction."""
    template_cid = "bench-template"

    async def grow_template() -> None:
        conn = Connection(HOST, port)
        for i in range(template_turns):
            r = await conn.request("POST", CHAT, one_message(i, conversation_id=template_cid))
            if r.status != 200:
                raise RuntimeError(f"gateway: HTTP {r.status} while growing the template: {r.body[:300]!r}")
        conn.close()

    t = time.perf_counter()
    run_async(grow_template())
    template = read_conversation(data_dir, template_cid)
    template_seconds = time.perf_counter() - t
    ids: dict[int, list[str]] = {}
    for size, copies in sizes:
        ids[size] = [f"bench-grown-{size}-{c:03d}" for c in range(copies)]
        for cid in ids[size]:
            clone_conversation(data_dir, cid, size, template)
    return ids, {
        "template_turns": len(template),
        "template_seconds": round(template_seconds, 2),
        "clone_seconds": round(time.perf_counter() - t - template_seconds, 2),
        "seeded_files": sum(size // 2 * copies for size, copies in sizes),
    }


async def first_request(port: int) -> float:
    """Latency (ms) of the very first chat request after /readyz (lazy imports, tokenizer)."""
    conn = Connection(HOST, port)
    r = await conn.request("POST", CHAT, one_message(0, conversation_id="bench-first"))
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"gateway: first request failed: HTTP {r.status}: {r.body[:300]!r}")
    return r.latency * 1000


def scan_gateway_log(path: Path) -> dict[str, Any]:
    """Count the gateway's log lines other than the per-request access line: warnings on the
    request path (e.g. a suspected upstream truncation) would skew the numbers."""
    other: list[str] = []
    access = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"access_lines": 0, "other_lines": 0, "examples": []}
    for line in lines:
        if line.startswith(('{"event":"chat.completion"', '{"event":"http.request"')):  # one per request
            access += 1
        elif not line.startswith("gateway listening on"):
            other.append(line)
    return {"access_lines": access, "other_lines": len(other), "examples": other[:5]}


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="measure the gateway's overhead against a bare forwarder")
    parser.add_argument("--quick", action="store_true", help="tiny iteration counts (smoke test)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data dirs and logs")
    parser.add_argument("--no-nosync", action="store_true", help="skip the durability=none gateway row")
    parser.add_argument(
        "--no-workers", action="store_true", help="skip the --workers 2 gateway (scaling table)"
    )
    parser.add_argument(
        "--no-postgres",
        action="store_true",
        help="skip the postgres gateway row (it runs when initdb/pg_ctl are installed)",
    )
    parser.add_argument(
        "--tmp-dir",
        default=None,
        help="where the gateways' data dirs go (default: $TMPDIR or /tmp); its file-creation and "
        "fsync costs are part of the gateway's numbers and are reported",
    )
    parser.add_argument(
        "--max-history-messages",
        type=int,
        default=None,
        help="gateway [context] max_history_messages (default: the gateway's own default)",
    )
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=None,
        help="gateway [context] max_context_tokens (default: the gateway's own default)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="a checkout of another version of the gateway (e.g. a `git worktree` of the previous "
        "commit): its `gateway serve` gets a row of its own (new conversation, 1 message), measured "
        "in the same run with the same iterations, so before/after is compared on equal terms",
    )
    parser.add_argument(
        "--no-tracing",
        action="store_true",
        help="skip the tracing-cost rows (a gateway exporting OTLP/HTTP to a loopback receiver)",
    )
    parser.add_argument(
        "--no-listing",
        action="store_true",
        help="skip bench/listing.py (lists with 100,000 conversations; run after the rest)",
    )
    parser.add_argument(
        "--scenario",
        choices=("all", "streams"),
        default="all",
        help="streams: only N concurrent long streams (bench/streams.py, N = 100 and 300 unless "
        "--streams says otherwise); all (default): every scenario, the streams at N = 100, 300 and 1000",
    )
    parser.add_argument(
        "--streams",
        default=None,
        help="stream counts of the streams scenario, comma-separated (e.g. 100,300,1000)",
    )
    parser.add_argument(
        "--stream-rounds", type=int, default=3, help="rounds per stream count in the streams scenario"
    )
    parser.add_argument(
        "--no-streams", action="store_true", help="skip the streams scenario in the default run"
    )
    args = parser.parse_args(argv)
    if args.scenario == "streams":
        return run_streams(args, args.streams or "100,300")
    rc = run(args)
    if rc == 0 and not args.no_streams:
        print("\nbench: concurrent long streams (bench/streams.py)", flush=True)
        rc = run_streams(args, args.streams or "100,300,1000")
    if rc == 0 and not args.no_listing:
        from . import listing

        extra = ["--quick"] if args.quick else ["--repeat", "20", "--cli-repeat", "1", "--create", "500"]
        extra += ["--no-postgres"] if args.no_postgres else []
        extra += ["--baseline", args.baseline] if args.baseline else []
        print("\nbench: listing (bench/listing.py)", flush=True)
        rc = listing.main(extra)
    return rc


def run_streams(args: argparse.Namespace, streams: str) -> int:
    """N concurrent long streams through the aiohttp forwarder and the gateways (bench/streams.py),
    with processes of its own: var/bench/streams-latest.json."""
    from . import streams as streams_bench

    extra = ["--quick"] if args.quick else ["--streams", streams, "--stream-rounds", str(args.stream_rounds)]
    extra += ["--keep"] if args.keep else []
    extra += ["--tmp-dir", args.tmp_dir] if args.tmp_dir else []
    return int(streams_bench.main(extra))


def start_references(
    procs: Processes, args: argparse.Namespace, tmp: Path, env: dict[str, str], ports: dict[str, int]
) -> tuple[Server, list[Server]]:
    """Start the mock upstream and the references (forwarders, the durable-turn floor), ready."""
    python = sys.executable
    up = f"http://{HOST}:{ports['direct']}"
    bench_dir = REPO / "bench"
    mock = procs.start(
        Server(
            "mock",
            [python, str(bench_dir / "mock_upstream.py"), "--port", str(ports["direct"])],
            ports["direct"],
            tmp / "mock.log",
            env,
        ),
        REPO,
    )
    forwarders = [
        procs.start(
            Server(
                name,
                [
                    python,
                    str(bench_dir / "forwarder.py"),
                    "--port",
                    str(ports[name]),
                    "--upstream",
                    up,
                    "--client",
                    client,
                ],
                ports[name],
                tmp / f"{name}.log",
                env,
            ),
            REPO,
        )
        for name, client in (("forwarder", "httpx"), ("forwarder_aiohttp", "aiohttp"))
    ]
    references = {"floor": [python, "-m", "bench.floor", "--data-dir", str(tmp / "data-floor")]}
    if not args.no_workers:  # what a second worker gives a server that only forwards
        references["forwarder_aiohttp_2w"] = [
            python,
            str(bench_dir / "forwarder.py"),
            "--client",
            "aiohttp",
            "--workers",
            "2",
        ]
    for name, argv_ref in references.items():
        ports[name] = free_port()
        argv_ref += ["--port", str(ports[name]), "--upstream", up]
        forwarders.append(procs.start(Server(name, argv_ref, ports[name], tmp / f"{name}.log", env), REPO))
    mock.wait_ready("/healthz", 30)
    for server in forwarders:
        server.wait_ready("/readyz", 30)
    return mock, forwarders


@dataclass
class Targets:
    """The gateways to measure: each one's durability, data dir and database."""

    durability: dict[str, str]
    data_dirs: dict[str, Path]
    dsns: dict[str, str]
    postgres_status: str
    receiver: OtlpReceiver | None


def gateway_targets(args: argparse.Namespace, tmp: Path, cleanup: list[Any]) -> Targets:
    """The gateways this run measures (a PostgreSQL cluster and an OTLP receiver started for
    theirs, their stops added to `cleanup`)."""
    data_dirs = {"gateway": tmp / "data-fsync", "gateway_nosync": tmp / "data-nosync"}
    gateways = {"gateway": "fsync"} if args.no_nosync else {"gateway": "fsync", "gateway_nosync": "none"}
    dsns: dict[str, str] = {}
    postgres_status = "skipped (--no-postgres)"
    if not args.no_postgres:
        cluster, postgres_status = start_postgres()
        if cluster is not None:
            cleanup.append(cluster.stop)
            dsns["gateway_pg"] = cluster.create_database("bench")
            gateways["gateway_pg"] = "fsync"
            data_dirs["gateway_pg"] = tmp / "data-pg"
    if not args.no_workers:
        gateways["gateway_2w"] = "fsync"  # the same, with --workers 2 on one data dir
        data_dirs["gateway_2w"] = tmp / "data-2w"
    if args.baseline:
        gateways["gateway_base"] = "fsync"
        data_dirs["gateway_base"] = tmp / "data-base"
    receiver = None
    if not args.no_tracing:  # the same gateway, exporting its spans and metrics
        receiver = OtlpReceiver(keep=False).__enter__()
        cleanup.append(receiver.__exit__)
        gateways["gateway_traced"] = "fsync"
        data_dirs["gateway_traced"] = tmp / "data-traced"
    return Targets(gateways, data_dirs, dsns, postgres_status, receiver)


def start_gateways(
    procs: Processes,
    args: argparse.Namespace,
    tmp: Path,
    env: dict[str, str],
    ports: dict[str, int],
    targets: Targets,
    context: dict[str, Any],
) -> dict[str, Server]:
    """Start every gateway target, one at a time, each ready before the next starts."""
    python = sys.executable
    gateway_bin = REPO / ".venv" / "bin" / "gateway"
    gateway_cmd = [str(gateway_bin)] if gateway_bin.exists() else [python, "-m", "gateway"]
    data_dirs, dsns, receiver = targets.data_dirs, targets.dsns, targets.receiver
    servers: dict[str, Server] = {}
    for name, durability in targets.durability.items():
        ports[name] = free_port()
        cfg = tmp / f"{name}.toml"
        write_gateway_config(
            cfg,
            port=ports[name],
            upstream_port=ports["direct"],
            data_dir=data_dirs[name],
            durability=durability,
            context=context,
            dsn=dsns.get(name, ""),
            tracing=receiver.url if receiver is not None and name == "gateway_traced" else "",
        )
        base = Path(args.baseline).resolve() if name == "gateway_base" else None
        argv_gw = [
            *([python, "-m", "gateway"] if base else gateway_cmd),
            "serve",
            "--config",
            str(cfg),
            "--data-dir",
            str(data_dirs[name]),
            "--port",
            str(ports[name]),
            *(["--workers", "2"] if name == "gateway_2w" else []),
        ]
        gw_env = {**env, "PYTHONPATH": str(base)} if base else env
        if name == "gateway_traced":  # spans exported while measured, not only every 5 s
            gw_env = {**env, "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
        servers[name] = procs.start(
            Server(name, argv_gw, ports[name], tmp / f"{name}.log", gw_env), base or REPO
        )
        # One at a time, so the startup time is not inflated by a sibling starting on 2 cores.
        servers[name].wait_ready("/readyz", 60)
    return servers


def save(result: dict[str, Any], summary: dict[str, Any]) -> None:
    """Write the run's result and summary to var/bench/ (dated, and as latest.json)."""
    payload = orjson.dumps({**result, "summary": summary}, option=orjson.OPT_INDENT_2)
    name = write_result(payload, "result", "latest.json")
    print(f"\nwrote var/bench/{name} and var/bench/latest.json ({result['wall_seconds']} s)")


def run(args: argparse.Namespace) -> int:
    plan = Plan.quick() if args.quick else Plan()
    context = context_overrides(args)

    # SIGTERM/SIGHUP become SystemExit so the finally below still stops every server.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))

    tmp = Path(tempfile.mkdtemp(prefix="gateway-bench-", dir=args.tmp_dir))
    procs = Processes()
    cleanup: list[Any] = []
    wall = time.perf_counter()
    try:
        env = clean_env()
        ports = {"direct": free_port(), "forwarder": free_port(), "forwarder_aiohttp": free_port()}
        mock, forwarders = start_references(procs, args, tmp, env, ports)
        fs_probe = {"data_dir_parent": str(tmp), **probe_filesystem(tmp / "probe")}
        targets = gateway_targets(args, tmp, cleanup)
        data_dirs = targets.data_dirs
        servers = start_gateways(procs, args, tmp, env, ports, targets, context)
        gw = servers["gateway"]
        rss_ready = rss_kib(gw.pid)
        first_request_ms = run_async(first_request(ports["gateway"]))
        rss_first = rss_kib(gw.pid)

        litellm, litellm_key, litellm_status = start_litellm(procs, tmp, ports["direct"])
        if litellm is not None:
            ports["litellm"] = litellm.port

        print(f"bench: servers up (gateway ready in {gw.ready_seconds * 1000:.0f} ms); seeding", flush=True)
        sizes = [(size, copies) for size, copies, _, _ in plan.grown]
        grown_ids, seeding = seed_conversations(
            ports["gateway"], data_dirs["gateway"], plan.template_turns, sizes
        )
        # Conversations for the cold-load comparison, in each gateway's own data dir.
        cold_size, cold_copies = plan.cold
        template = read_conversation(data_dirs["gateway"], "bench-template")
        cold_ids = {
            name: [f"bench-cold-{cold_size}-{c:03d}" for c in range(cold_copies)]
            for name in ("gateway", "gateway_base")
            if name in servers
        }
        for name, ids in cold_ids.items():
            for cid in ids:
                clone_conversation(data_dirs[name], cid, cold_size, template)
        bench = Bench(plan, ports, data_dirs, litellm_key)
        bench.served_conversations = 2  # the first request and the template
        bench.pids = {name: server.pid for name, server in servers.items()}
        bench.pids.update({server.name: server.pid for server in forwarders})
        bench.pids["mock"] = mock.pid
        steps: dict[str, float] = {}

        async def run_all() -> None:
            for name, coro in (
                ("single_message", bench.single_message),
                *(
                    (
                        (f"grown_{s}", lambda s=s, w=w, n=n: bench.grown(s, grown_ids[s], w, n))
                        for s, _, w, n in plan.grown
                    )
                ),
                ("cold", lambda: bench.cold(cold_size, cold_ids)),
                ("tracing", bench.tracing),
                ("streaming", bench.streaming),
                ("throughput", bench.throughput),
                ("scaling", bench.scaling),
            ):
                t0 = time.perf_counter()
                print(f"  {name} ...", flush=True)
                await coro()
                steps[name] = round(time.perf_counter() - t0, 2)

        print(
            f"bench: seeded {seeding['seeded_files']} turns in {seeding['clone_seconds']} s; measuring",
            flush=True,
        )
        run_async(run_all())

        time.sleep(1.0)  # let the gateway go idle before reading its memory
        rss_idle = rss_kib(gw.pid)
        result = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "gateway": {
                **git_info(),
                "durability": "fsync",
                "context_overrides": context,
                "startup_to_readyz_ms": round(gw.ready_seconds * 1000, 1),
                "rss_at_ready_mib": round(rss_ready / 1024, 1),
                "rss_after_first_request_mib": round(rss_first / 1024, 1),
                "rss_idle_mib": round(rss_idle / 1024, 1),
                "first_request_after_ready_ms": round(first_request_ms, 1),
                "conversations_served": bench.served_conversations,
                "log": scan_gateway_log(gw.log_path),
            },
            "litellm": litellm_status,
            "postgres": targets.postgres_status,
            "plan": plan.__dict__,
            "concurrency": CONCURRENCY,
            "filesystem": fs_probe,
            "seeding": seeding,
            "step_seconds": steps,
            **bench.results,
        }
        result["wall_seconds"] = round(time.perf_counter() - wall, 1)
        summary = print_report(result)
        save(result, summary)
        return 0
    except BaseException:
        procs.tell_exited()
        raise
    finally:
        procs.stop_all()
        for stop in cleanup:
            stop()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
