"""Profile the gateway's request path with py-spy while the benchmark client drives it.

    .venv/bin/pip install py-spy        # not a project dependency
    .venv/bin/python -m bench.profile --messages 0       # 1-message requests, new conversations
    .venv/bin/python -m bench.profile --messages 10000   # one conversation seeded to 10,000 msgs

Starts the mock upstream and `gateway serve` (as bench/run.py does), samples the gateway
process with `py-spy record --format raw` for the whole run, and prints the functions that
take the most of the gateway's busy time: inclusive (anywhere on the stack) and self (leaf).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .client import Connection
from .procs import HOST, Processes, Server, clean_env, cpu_seconds, free_port
from .run import REPO, context_overrides, seed_conversations, write_gateway_config
from .scenarios import CHAT, one_message

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    """`func (path/to/module.py:12)` -> `func (module.py)` with site-packages/stdlib trimmed."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/lib/python3.", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/lib/python3.":
                path = "stdlib:" + path.split("/", 1)[-1]
            break
    return f"{m.group('func')} ({path})"


# The entry chain (CLI, uvicorn's runner, thread bootstrap) is on every stack: not informative.
_ROOT_FRAMES = re.compile(
    r"^(<module>|Command\.|Group\.|Context\.|_common\.|serve \(gateway/|run \(uvicorn/|Server\.run |"
    r"asyncio_run |Runner\.run |Thread\._bootstrap|Thread\.run |_worker |_WorkItem\.run |run \(asyncio)"
)


# A turn's steps, for `--steps`: each sample goes to the step of the innermost frame that
# matches one (a step's patterns are tried in this order at each frame); the rest is the loop's.
STEPS: list[tuple[str, list[str]]] = [
    (
        "log line and metrics",
        [
            "log_line (",
            "observe (gateway/api/observe",
            "logging/__init__",
            "prometheus_client",
            "Metrics.",
            "redact.py",
        ],
    ),
    ("the conversation's list row", ["Listing.", "listing.py"]),
    ("usage learning (token-count calibration)", ["UsageLearning", "usage.py"]),
    ("catalog line (list order, rows)", ["catalog.py"]),
    (
        "journal append + fdatasync, response file's rest, index written",
        [
            "journal.py",
            "durability.py",
            "JsonlLog.commit",
            "JsonlLog._commit",
            "JsonlLog.finish",
            "JsonlLog.check_commit",
            "_commit_and_note",
            "files.py",
            "aio.py",
            "run_to_end",
            "await_commit",
        ],
    ),
    (
        "response file created while the provider answers",
        ["spares.py", "JsonlLog.meanwhile", "JsonlLog._open"],
    ),
    (
        "tokens counted, reconciled, window planned",
        [
            "ChatService._planned",
            "planning.py",
            "draw.py",
            "window.py",
            "tokens.py",
            "tiktoken",
            "reconcile",
            "split_system",
            "check_size",
            "models.py",
            "counting.py",
        ],
    ),
    (
        "conversation loaded (its missing index looked up)",
        ["ChatService._load", "cache.py", "tail.py", "reading.py", "read_entries", "_locked_view"],
    ),
    ("conversation lock (OFD byte-range calls)", ["lock_conversation", "locks.py", "JsonlStore.lock"]),
    (
        "request record, context snapshot, provider body, response log opened",
        [
            "request_record",
            "context_snapshot",
            "note_context",
            "JsonlStore.start",
            "JsonlLog.__init__",
            "_upstream_body",
            "cache_key",
            "mint_response_id",
            "ids.py",
            "PreparedTurn.__init__",
            "client_params",
            "ChatService.prepare",
            "Router.resolve",
            "StartGate",
            "check_timezone",
            "StoreRegistry",
        ],
    ),
    (
        "provider call (request written, answer read)",
        ["openai.py", "http1.py", "upstream/base.py", "while_waiting"],
    ),
    (
        "answer parsed, response record, commit prepared",
        [
            "response_record",
            "output_message",
            "first_choice",
            "ChatService.complete",
            "ChatService._commit",
            "stored_turn",
            "JsonlLog.append",
            "stream.py",
        ],
    ),
    (
        "turn closed (unlock, model facts, outcome)",
        [
            "ChatService.close",
            "close_outcome",
            "ModelFacts.save",
            "ChatService.closing",
            "AsyncExitStack",
            "exit_stack",
        ],
    ),
    (
        "body read and validated",
        [
            "read_json",
            "parse_chat",
            "validation.py",
            "pydantic",
            "read_body",
            "json_depth",
            "requests.py",
            "schemas.py",
        ],
    ),
    (
        "JSON answer sent",
        ["responses.py", "RequestResponseCycle.send", "OneSendTransport", "JSONBody", "turn_headers"],
    ),
    (
        "HTTP: uvicorn protocol, middlewares, endpoint",
        [
            "httptools_impl",
            "protocol.py",
            "direct.py",
            "starlette/",
            "tenants.py",
            "metrics.py",
            "chat.py",
            "http.py",
            "listener.py",
            "proxy_headers",
        ],
    ),
]
LOOP_STEP = "event loop (uvloop's C code: polling, socket reads and writes)"


def samples(raw: str) -> Iterator[tuple[str, list[str], int]]:
    """py-spy's raw lines: each one's thread group ("event loop" = MainThread, "workers" = the
    rest), its frames (outermost first) and its sample count."""
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        fields = stack.split(";")
        group = "event loop" if fields[0].endswith(": MainThread") else "workers"
        yield group, fields[1:], int(count_text)


def steps(raw: str) -> dict[str, int]:
    """The event loop's busy samples by step of a turn (STEPS), in STEPS' order."""
    counts = dict.fromkeys([name for name, _ in STEPS] + [LOOP_STEP], 0)
    for group, frames, count in samples(raw):
        if group != "event loop":
            continue
        step = LOOP_STEP
        for frame in reversed(frames):
            found = next((name for name, patterns in STEPS if any(p in frame for p in patterns)), None)
            if found is not None:
                step = found
                break
        counts[step] += count
    return counts


def summarize(raw: str, top: int) -> dict[str, object]:
    """Per thread group ("event loop" = MainThread, "workers" = the rest): samples, and the
    top functions by inclusive and self share of that group's busy samples."""
    groups: dict[str, dict[str, Counter[str]]] = {}
    totals: Counter[str] = Counter()
    for group, fields, count in samples(raw):
        frames = [_short(f) for f in fields]
        frames = [f for f in frames if not _ROOT_FRAMES.match(f)] or [
            "(no Python frame: uvloop/httptools C code, I/O)"
        ]
        g = groups.setdefault(group, {"inclusive": Counter(), "self": Counter()})
        totals[group] += count
        for name in set(frames):
            g["inclusive"][name] += count
        g["self"][frames[-1]] += count
    out: dict[str, object] = {"samples": dict(totals)}
    for group, g in groups.items():
        total = totals[group]
        out[group] = {
            kind: [(n, round(100.0 * c / total, 1)) for n, c in g[kind].most_common(top)]
            for kind in ("inclusive", "self")
        }
    return out


async def drive(port: int, messages: int, seconds: float, cid: str | None, concurrency: int = 1) -> int:
    """Send requests for `seconds` from `concurrency` clients; new conversations unless `cid`."""
    deadline = time.perf_counter() + seconds
    n = 0

    async def client() -> None:
        nonlocal n
        conn = Connection(HOST, port)
        while time.perf_counter() < deadline and n < 1_000_000:
            i = n
            n += 1
            body = one_message(messages // 2 + i, conversation_id=cid or f"profile-{i:07d}")
            r = await conn.request("POST", CHAT, body)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.body[:200]!r}")
        conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="profile the gateway's request path with py-spy")
    parser.add_argument(
        "--messages", type=int, default=0, help="seeded conversation size (0 = new conversations)"
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=1, help="concurrent clients (1 = sequential)")
    parser.add_argument("--durability", choices=("fsync", "none"), default="fsync")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tmp-dir", default=None)
    parser.add_argument("--save", default=None, help="also write the raw collapsed stacks here")
    parser.add_argument("--max-history-messages", type=int, default=None)
    parser.add_argument("--max-context-tokens", type=int, default=None)
    parser.add_argument(
        "--steps", action="store_true", help="also the loop's time by step of a turn (docs/performance.md)"
    )
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="gateway-profile-", dir=args.tmp_dir))
    procs = Processes()
    spy: subprocess.Popen[bytes] | None = None
    try:
        env = clean_env()
        up = free_port()
        procs.start(
            Server(
                "mock",
                [sys.executable, str(REPO / "bench" / "mock_upstream.py"), "--port", str(up)],
                up,
                tmp / "mock.log",
                env,
            ),
            REPO,
        ).wait_ready("/healthz", 30)
        data = tmp / "data"
        port = free_port()
        cfg = tmp / "gateway.toml"
        context = context_overrides(args)
        write_gateway_config(
            cfg, port=port, upstream_port=up, data_dir=data, durability=args.durability, context=context
        )
        gateway_bin = REPO / ".venv" / "bin" / "gateway"
        argv_gw = [
            *([str(gateway_bin)] if gateway_bin.exists() else [sys.executable, "-m", "gateway"]),
            "serve",
            "--config",
            str(cfg),
            "--data-dir",
            str(data),
            "--port",
            str(port),
        ]
        gw = procs.start(Server("gateway", argv_gw, port, tmp / "gateway.log", env), REPO)
        gw.wait_ready("/readyz", 60)
        cid = None
        if args.messages:
            ids, _ = seed_conversations(port, data, 150, [(args.messages, 1)])
            cid = ids[args.messages][0]

        async def warm() -> None:
            await drive(port, args.messages, 1.0, cid)  # imports, caches, the seeded conversation's cold load

        asyncio.run(warm())
        raw_path = tmp / "stacks.txt"
        spy = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(gw.pid),
                "--rate",
                str(args.rate),
                "--format",
                "raw",
                "--output",
                str(raw_path),
                "--duration",
                str(int(args.seconds) + 1),
                "--nonblocking",
                "--threads",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(0.5)
        cpu_before = cpu_seconds(gw.pid)
        requests = asyncio.run(drive(port, args.messages, args.seconds, cid, args.concurrency))
        cpu = cpu_seconds(gw.pid) - cpu_before
        _, err = spy.communicate(timeout=args.seconds + 30)
        if not raw_path.exists():
            print(f"py-spy failed: {err.decode(errors='replace')}", file=sys.stderr)
            return 1
        raw = raw_path.read_text()
        if args.save:
            Path(args.save).write_text(raw)
        summary = summarize(raw, args.top)
        samples: dict[str, int] = summary["samples"]  # type: ignore[assignment]
        what = f"conversation of {args.messages:,} msgs" if args.messages else "new conversations, 1 message"
        mode = "sequential" if args.concurrency == 1 else f"{args.concurrency} concurrent clients"
        print(
            f"gateway profile: {what}, durability={args.durability}: {requests} requests ({mode}) in "
            f"{args.seconds:.0f}s ({requests / args.seconds:.0f}/s), "
            f"{1000 * cpu / max(requests, 1):.2f} ms of the process's CPU per request"
        )
        wall = args.rate * args.seconds
        for group in ("event loop", "workers"):
            if group not in summary:
                continue
            share = 100 * samples[group] / wall
            print(f"\n== {group}: {samples[group]} busy samples ({share:.0f}% of wall time)")
            for kind in ("self", "inclusive"):
                print(f"-- {kind} % of {group} busy samples")
                for name, pct in summary[group][kind]:  # type: ignore[index]
                    print(f"{pct:6.1f}%  {name}")
        if args.steps:
            by_step = steps(raw)
            busy = sum(by_step.values())
            per_turn = 1000 * busy / args.rate / max(requests, 1)  # ms of the loop's busy time per turn
            print(f"\n== the event loop's busy time by step: {per_turn:.2f} ms per request")
            print("| step | share | ms per turn |\n| --- | ---: | ---: |")
            for name, n in by_step.items():
                print(f"| {name} | {100 * n / max(busy, 1):.1f}% | {per_turn * n / max(busy, 1):.2f} |")
        return 0
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait(timeout=5)
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
