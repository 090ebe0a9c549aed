"""Prompt-eval cost on a real model, this checkout against a baseline revision, in one run:
llama.cpp's server (xllamacpp, SmolLM2-135M) behind a real `gateway serve` for each.

    .venv/bin/python -m bench.realmodel [--turns 40] [--ctx 1024] [--baseline 94b79e9]
                                        [--strategy truncate|summarize] [--keep]

The baseline is another git revision, checked out with `git worktree add --detach` in a
temporary folder (removed at the end); its `gateway serve` runs from that checkout (cwd and
PYTHONPATH set to it, same venv). Before anything is measured the script checks that a Python
started that way imports the baseline's `gateway` package, and after the first turn that the
baseline's context records lack `window_from` (when the baseline's source has no such field)
while the current gateway's have it.

Each gateway gets its own fresh llama server (same n_ctx, one slot), so the two prompt caches
never meet, and holds one conversation: short user messages (~20 tokens, the same on both
sides), max_tokens 16, temperature 0. The two conversations advance turn by turn, alternately,
the side that goes first swapped every turn: on a noisy shared machine a burst of load then
falls on both sides alike, which is fairer than running one conversation after the other. After
each turn the script waits until that side's llama server is idle (with `summarize`, also for
the background summary calls the turn caused), so only one server computes at a time.

Per turn and side, from the completion that the gateway passes through: `usage.prompt_tokens`,
the cached tokens (`usage.prompt_tokens_details.cached_tokens`, else `timings.cache_n`), the
tokens evaluated (`timings.prompt_n`) and the server's prompt-eval time (`timings.prompt_ms`);
`^` marks a turn whose window head moved (its first message sent or its summary changed). Totals:
prompt-eval time, evaluated tokens, the cached share from the first turn either side dropped
history on, baseline/current ratios, and the server's prompt-eval time over all its requests
(summary calls included) read from its log. Everything goes to var/bench/realmodel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from openai import OpenAI

from tests.conftest import GatewayProcess, free_port
from tests.realmodel.helpers import write_llama_config
from tests.realmodel.llama import LlamaServer
from tests.realmodel.test_cache_real import short
from tests.realmodel.test_window_real import context_records

REPO = Path(__file__).resolve().parent.parent

CONVERSATION = "bench-realmodel"
MAX_TOKENS = 16
# llama.cpp's log line for every task: "... task 17 | prompt eval time =  305.85 ms /  21 tokens"
PROMPT_EVAL = re.compile(r"\| task \d+ \| prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


class CheckoutGateway(GatewayProcess):
    """`gateway serve` run from a given checkout: cwd and PYTHONPATH are that checkout, so
    `python -m gateway` imports its package (not this one's, nor the venv's editable install)."""

    def __init__(self, root: Path, config: Path, data_dir: Path) -> None:
        super().__init__(config, data_dir, env=checkout_env(root))
        self.root = root

    def spawn(self) -> CheckoutGateway:
        self.port = free_port()
        cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(self.config)]
        cmd += ["--data-dir", str(self.data_dir), "--port", str(self.port), "--workers", "1"]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self


def checkout_env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def imported_from(root: Path) -> Path:
    """Where `import gateway` resolves for a process started as the checkout's gateway is."""
    done = subprocess.run(
        [sys.executable, "-c", "import gateway; print(gateway.__file__)"],
        cwd=root,
        env=checkout_env(root),
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(done.stdout.strip()).resolve()


@dataclass
class Side:
    name: str
    root: Path
    llama: LlamaServer
    gateway: CheckoutGateway
    rows: list[dict[str, Any]] = field(default_factory=list)
    head: tuple[str | None, int | None] | None = None

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0, timeout=900)


def turn(side: Side, client: OpenAI, n: int, text: str) -> dict[str, Any]:
    """One turn through the official SDK; the server's usage and timings, and the window's record."""
    started = time.perf_counter()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="llama/smollm2",
            messages=[{"role": "user", "content": text}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"conversation_id": CONVERSATION},
        )
    except openai.APIError as exc:
        return {"turn": n, "error": str(exc)[:500]}
    wall_ms = (time.perf_counter() - started) * 1000
    body = json.loads(raw.text)
    usage = body.get("usage") or {}
    timings = body.get("timings") or {}
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n")
    evaluated = timings.get("prompt_n")
    if evaluated is None and prompt is not None and cached is not None:
        evaluated = prompt - cached
    context = context_records(side.gateway.data_dir, body["id"])[-1]
    included = context.get("included_response_ids") or []
    head = (included[0] if included else None, context.get("summary_version"))
    # The head moved: the history no longer starts where it did (turn 2 starts from nothing).
    moved = side.head is not None and side.head[0] is not None and head != side.head
    side.head = head
    return {
        "turn": n,
        "id": body["id"],
        "prompt": prompt,
        "cached": cached,
        "evaluated": evaluated,
        "prompt_ms": timings.get("prompt_ms"),
        "predicted_ms": timings.get("predicted_ms"),
        "wall_ms": round(wall_ms, 1),
        "context_window": context.get("context_window"),
        "sent_messages": context.get("sent_messages"),
        "truncated": context.get("truncated"),
        "summary_version": context.get("summary_version"),
        "summary_covers_messages": context.get("summary_covers_messages"),
        "head_moved": moved,
        "cut": context.get("cut"),  # the current gateway's own flag (absent in older ones)
        "has_window_from": "window_from" in context,
    }


def settle(llama: LlamaServer, grace: float, limit: float = 600.0) -> None:
    """Wait until the server has processed nothing for `grace` seconds: no slot busy and its
    log unchanged (a summary call the gateway makes after a turn may start a moment later)."""
    deadline = time.monotonic() + limit
    quiet_since: float | None = None
    last_size = -1
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{llama.url}/slots", timeout=30) as answer:
            busy = any(slot.get("is_processing") for slot in json.load(answer))
        size = llama.log_path.stat().st_size if llama.log_path.exists() else 0
        now = time.monotonic()
        if busy or size != last_size:
            quiet_since = None if busy else now
            last_size = size
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= grace:
            return
        time.sleep(0.05)
    print(f"warning: llama server {llama.url} still busy after {limit:.0f}s", file=sys.stderr)


def server_prompt_eval(llama: LlamaServer) -> dict[str, Any]:
    """Prompt eval over every task the server ran (turns and summary calls), from its log."""
    found = PROMPT_EVAL.findall(llama.log())
    return {
        "tasks": len(found),
        "prompt_ms": round(sum(float(ms) for ms, _ in found), 1),
        "evaluated": sum(int(n) for _, n in found),
    }


def first_dropping_turn(rows: list[dict[str, Any]]) -> int | None:
    """The first turn whose window left out some history (omitted or summarized)."""
    for row in rows:
        if "error" not in row and (row["truncated"] or row["summary_covers_messages"]):
            return int(row["turn"])
    return None


def totals(rows: list[dict[str, Any]], since: int | None) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    later = [r for r in ok if since is not None and r["turn"] >= since]
    prompt_later = sum(r["prompt"] for r in later)
    return {
        "turns": len(rows),
        "failed_turns": len(rows) - len(ok),
        "prompt_ms": round(sum(r["prompt_ms"] or 0 for r in ok), 1),
        "prompt_tokens": sum(r["prompt"] for r in ok),
        "evaluated": sum(r["evaluated"] or 0 for r in ok),
        "cached": sum(r["cached"] or 0 for r in ok),
        "predicted_ms": round(sum(r["predicted_ms"] or 0 for r in ok), 1),
        "first_dropping_turn": first_dropping_turn(rows),
        "head_moves": sum(1 for r in ok if r["head_moved"]),
        "largest_prompt": max((r["prompt"] for r in ok), default=None),
        "from_first_cut": {
            "turns": len(later),
            "prompt_ms": round(sum(r["prompt_ms"] or 0 for r in later), 1),
            "evaluated": sum(r["evaluated"] or 0 for r in later),
            "cached_share": (sum(r["cached"] or 0 for r in later) / prompt_later) if prompt_later else None,
        },
        "median_wall_ms": statistics.median(r["wall_ms"] for r in ok) if ok else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return f"{'':>6} {'':>6} {'':>8}  "
    if "error" in row:
        return f"{'error':>22}  "
    ms = f"{row['prompt_ms']:.0f}" if row["prompt_ms"] is not None else "-"
    return f"{row['prompt']:>6} {row['cached']:>6} {ms:>8}{'^' if row['head_moved'] else ' '} "


def print_report(result: dict[str, Any]) -> None:
    base, cur = result["baseline"], result["current"]
    by_turn = {side: {r["turn"]: r for r in result[side]["rows"]} for side in ("baseline", "current")}
    print(f"\n       {'baseline ' + base['revision']:<24}| {'current ' + cur['revision']:<24}")
    columns = f"{'prompt':>6} {'cached':>6} {'eval ms':>8}  "
    print(f"{'turn':>4} | {columns}| {columns}")
    for n in range(1, result["config"]["turns"] + 1):
        print(f"{n:>4} | {cell(by_turn['baseline'].get(n))}| {cell(by_turn['current'].get(n))}")
    print("(^: the window's head moved this turn, the server's prompt cache can only serve what precedes it)")
    b, c = base["totals"], cur["totals"]
    since = result["summary"]["first_cut_turn"] or "- (no cut)"
    share = [t["from_first_cut"]["cached_share"] for t in (b, c)]
    lines = [
        ("prompt-eval ms, all turns", b["prompt_ms"], c["prompt_ms"], result["summary"]["prompt_ms_ratio"]),
        ("evaluated prompt tokens", b["evaluated"], c["evaluated"], result["summary"]["evaluated_ratio"]),
        (
            f"prompt-eval ms from turn {since}",
            b["from_first_cut"]["prompt_ms"],
            c["from_first_cut"]["prompt_ms"],
            result["summary"]["prompt_ms_ratio_from_first_cut"],
        ),
        (
            f"cached share from turn {since}",
            f"{share[0]:.0%}" if share[0] is not None else "-",
            f"{share[1]:.0%}" if share[1] is not None else "-",
            None,
        ),
        ("head moves", b["head_moves"], c["head_moves"], None),
        ("first turn dropping history", b["first_dropping_turn"], c["first_dropping_turn"], None),
        (
            "server prompt-eval ms, all calls",
            base["server"]["prompt_ms"],
            cur["server"]["prompt_ms"],
            result["summary"]["server_prompt_ms_ratio"],
        ),
        ("server calls (turns + summaries)", base["server"]["tasks"], cur["server"]["tasks"], None),
        ("failed turns", b["failed_turns"], c["failed_turns"], None),
    ]
    print(f"\n{'':<36}{'baseline':>10}{'current':>10}  baseline/current")
    for label, x, y, r in lines:
        x, y = ("-" if v is None else v for v in (x, y))
        print(f"{label:<36}{x:>10}{y:>10}  {'' if r is None else f'x{r}'}")
    print(f"\n{result['summary']['seconds']} s; var/bench/realmodel.json")


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    base_rev = git("rev-parse", "--short", f"{args.baseline}^{{commit}}")
    head_rev = git("rev-parse", "--short", "HEAD") + (
        "+" if git("status", "--porcelain", "--", "gateway") else ""
    )
    checkout = tmp / "baseline-checkout"
    git("worktree", "add", "--detach", str(checkout), base_rev)
    try:
        for root in (checkout, REPO):
            where = imported_from(root)
            if root.resolve() not in where.parents:
                raise SystemExit(f"a gateway started from {root} would import {where}")
        grep = ["git", "grep", "-q", '"window_from"', base_rev, "--", "gateway"]
        baseline_has_field = subprocess.run(grep, cwd=REPO).returncode == 0
        extra = ""
        if args.strategy == "summarize":
            extra = f'[context]\nstrategy = "summarize"\nsummary_max_tokens = {args.summary_max_tokens}\n'
        current_extra = extra
        if args.cut_to is not None:  # a setting the baseline may not know: the current side only
            current_extra = (current_extra or "[context]\n") + f"cut_to = {args.cut_to}\n"
        return measure(args, tmp, checkout, base_rev, head_rev, extra, current_extra, baseline_has_field)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=REPO, capture_output=True)


def measure(
    args: argparse.Namespace,
    tmp: Path,
    checkout: Path,
    base_rev: str,
    head_rev: str,
    extra: str,
    current_extra: str,
    baseline_has_field: bool,
) -> dict[str, Any]:
    started = time.perf_counter()
    grace = 0.5 if args.strategy == "summarize" else 0.0
    sides: list[Side] = []
    with ExitStack() as stack:
        for name, root, toml in (("baseline", checkout, extra), ("current", REPO, current_extra)):
            folder = tmp / name
            folder.mkdir()
            llama = stack.enter_context(LlamaServer(n_ctx=args.ctx, parallel=1, log_dir=folder))
            config = write_llama_config(folder / "gateway.toml", llama, toml)
            gateway = CheckoutGateway(root, config, folder / "var").start(timeout=120)
            stack.callback(gateway.stop)
            sides.append(Side(name, root, llama, gateway))
        clients = {side.name: side.client() for side in sides}
        checked = False
        rng = random.Random(args.seed)
        texts = [short(rng, n) for n in range(1, args.turns + 1)]  # the same messages on both sides
        for n, text in enumerate(texts, start=1):
            for side in sides if n % 2 else sides[::-1]:
                row = turn(side, clients[side.name], n, text)
                side.rows.append(row)
                settle(side.llama, grace)
                print(f"turn {n:>3} {side.name:<8} {cell(row)}", file=sys.stderr, flush=True)
            if not checked and all("error" not in s.rows[-1] for s in sides):
                check_imports(sides, baseline_has_field)
                checked = True
        for side in sides:
            settle(side.llama, grace)
        servers = {side.name: server_prompt_eval(side.llama) for side in sides}
        logs = {side.name: side.gateway.log() for side in sides}
    seconds = round(time.perf_counter() - started, 1)
    by_name = {side.name: side for side in sides}
    first_cuts = [t for t in (first_dropping_turn(s.rows) for s in sides) if t is not None]
    since = min(first_cuts) if first_cuts else None
    result: dict[str, Any] = {
        "config": {
            "turns": args.turns,
            "ctx": args.ctx,
            "strategy": args.strategy,
            "max_tokens": MAX_TOKENS,
            "seed": args.seed,
            "cut_to": args.cut_to,
            "summary_max_tokens": args.summary_max_tokens if args.strategy == "summarize" else None,
            "order": "alternating turn by turn, the first side swapped every turn",
        },
        "imports_checked": checked,
    }
    for name, rev in (("baseline", base_rev), ("current", head_rev)):
        side = by_name[name]
        result[name] = {
            "revision": rev,
            "checkout": str(side.root),
            "totals": totals(side.rows, since),
            "server": servers[name],
            "gateway_log_other": other_lines(logs[name]),
            "rows": side.rows,
        }
    b, c = result["baseline"]["totals"], result["current"]["totals"]
    b_server, c_server = result["baseline"]["server"], result["current"]["server"]
    result["summary"] = {
        "first_cut_turn": since,
        "prompt_ms_ratio": ratio(b["prompt_ms"], c["prompt_ms"]),
        "evaluated_ratio": ratio(b["evaluated"], c["evaluated"]),
        "prompt_ms_ratio_from_first_cut": ratio(
            b["from_first_cut"]["prompt_ms"], c["from_first_cut"]["prompt_ms"]
        ),
        "server_prompt_ms_ratio": ratio(b_server["prompt_ms"], c_server["prompt_ms"]),
        "seconds": seconds,
    }
    return result


def other_lines(log: str) -> list[str]:
    """What the gateway logged besides its start line and access log (the first 20)."""
    routine = ('{"event":"http.request"', '{"event":"chat.completion"', "gateway listening on ")
    return [line for line in log.splitlines() if line.strip() and not line.startswith(routine)][:20]


def check_imports(sides: list[Side], baseline_has_field: bool) -> None:
    """The context records say which code wrote them: the current one writes `window_from`."""
    fields = {side.name: side.rows[-1]["has_window_from"] for side in sides}
    if not fields["current"]:
        raise SystemExit("the current gateway's context records lack window_from: not this checkout's code")
    if not baseline_has_field and fields["baseline"]:
        raise SystemExit(
            "the baseline gateway wrote window_from: it ran this checkout's code, not the baseline's"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--ctx", type=int, default=1024, help="the llama servers' n_ctx (one slot each)")
    parser.add_argument("--baseline", default="94b79e9", help="git revision to compare with")
    parser.add_argument("--strategy", choices=("truncate", "summarize"), default="truncate")
    parser.add_argument("--summary-max-tokens", type=int, default=64)
    parser.add_argument("--cut-to", type=float, help="[context] cut_to, for the current side only")
    parser.add_argument("--seed", type=int, default=7, help="seed of the user messages")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, data dirs)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gateway-realmodel-"))
    try:
        result = run(args, tmp)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out = REPO / "var" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "realmodel.json").write_text(json.dumps(result, indent=2))
    print_report(result)
    failed = result["baseline"]["totals"]["failed_turns"] + result["current"]["totals"]["failed_turns"]
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
