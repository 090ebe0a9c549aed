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
from pathlib import Path

from .client import Connection
from .procs import HOST, Processes, Server, clean_env, free_port
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


def summarize(raw: str, top: int) -> dict[str, object]:
    """Per thread group ("event loop" = MainThread, "workers" = the rest): samples, and the
    top functions by inclusive and self share of that group's busy samples."""
    groups: dict[str, dict[str, Counter[str]]] = {}
    totals: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        fields = stack.split(";")
        group = "event loop" if fields[0].endswith(": MainThread") else "workers"
        frames = [_short(f) for f in fields[1:]]
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
        requests = asyncio.run(drive(port, args.messages, args.seconds, cid, args.concurrency))
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
            f"{args.seconds:.0f}s ({requests / args.seconds:.0f}/s)"
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
        return 0
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait(timeout=5)
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
