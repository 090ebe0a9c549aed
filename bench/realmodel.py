"""Counting and window use on a real model: llama.cpp's server (SmolLM2-135M, n_ctx 512) behind a
real `gateway serve` with no window configured.

    .venv/bin/python bench/realmodel.py [--turns 20] [--conversations 3]

Each conversation sends ~100-token user messages with max_tokens 16. For every answered turn it
reads the response log: the gateway's own count of the prompt (tiktoken), the calibration it
planned with, and the server's `prompt_tokens`. It prints, over all turns: the server's count
against the gateway's raw count (before calibration) and against the calibrated estimate
(after), as median and worst ratio, and the share of the window the prompts used once the
history no longer fit. Figures go to var/bench/realmodel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.realmodel.helpers import gateway_for  # noqa: E402
from tests.realmodel.llama import LlamaServer  # noqa: E402
from tests.realmodel.test_window_real import N_CTX, converse  # noqa: E402


def records(data_dir: Path, response_id: str) -> list[dict[str, Any]]:
    path = data_dir / "logs" / "responses" / f"{response_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--conversations", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    failed = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gateway-realmodel-") as tmp, LlamaServer(n_ctx=N_CTX) as llama:
        gateway = gateway_for(Path(tmp), llama)
        try:
            for c in range(args.conversations):
                for r in converse(gateway.url, f"measure-{c}", args.turns, seed=100 + c):
                    if "error" in r:
                        failed += 1
                        continue
                    recs = records(gateway.data_dir, r["id"])
                    context = [x for x in recs if x.get("type") == "context"][-1]
                    calibration = context["calibration"]
                    ours = context["tokens"]["total"]
                    theirs = r["prompt_tokens"]
                    estimate = calibration["ratio"] * ours + calibration["overhead"]
                    rows.append(
                        {
                            "conversation": c,
                            "turn": r["turn"],
                            "ours": ours,
                            "theirs": theirs,
                            "calibrated_estimate": round(estimate, 1),
                            "calibration_samples": calibration["samples"],
                            "margin": calibration["margin"],
                            "truncated": context["truncated"],
                            "window": context["context_window"],
                            "window_source": context["context_window_source"],
                        }
                    )
        finally:
            gateway.stop()
    raw = [row["theirs"] / row["ours"] for row in rows]
    calibrated = [row["theirs"] / row["calibrated_estimate"] for row in rows if row["calibration_samples"]]
    with_margin = [
        row["theirs"] / (row["calibrated_estimate"] + row["margin"])
        for row in rows
        if row["calibration_samples"]
    ]
    used = [row["theirs"] / N_CTX for row in rows if row["truncated"]]
    summary = {
        "turns": len(rows) + failed,
        "failed_turns": failed,
        "server_window": N_CTX,
        "window_sources": sorted({row["window_source"] for row in rows}),
        "before_calibration": {"median": statistics.median(raw), "worst": max(raw)},
        "after_calibration": {"median": statistics.median(calibrated), "worst": max(calibrated)},
        "after_calibration_with_margin_worst": max(with_margin),
        "largest_prompt": max(row["theirs"] for row in rows),
        "window_used_once_truncating": {
            "turns": len(used),
            "median": statistics.median(used) if used else None,
            "min": min(used) if used else None,
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    out = REPO / "var" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "realmodel.json").write_text(json.dumps({"summary": summary, "turns": rows}, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
