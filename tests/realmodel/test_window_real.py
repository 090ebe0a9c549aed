"""The core promise on a real 512-token model: every turn of a long conversation fits the
server's real window, with no window configured, with a wrong one, and with rolling summaries.

Messages are ~100 tokens and answers 16 tokens, so the history outgrows the window by turn 5.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from openai import BadRequestError, OpenAI

from tests.realmodel.helpers import gateway_for
from tests.realmodel.llama import LlamaServer

N_CTX = 512
WORDS = (
    "river",
    "garden",
    "lantern",
    "copper",
    "violin",
    "meadow",
    "harbor",
    "pepper",
    "falcon",
    "marble",
    "orchard",
    "candle",
    "thunder",
    "willow",
    "saddle",
    "compass",
    "pebble",
    "velvet",
    "glacier",
    "walnut",
    "ember",
    "cobalt",
    "prairie",
    "ribbon",
    "quarry",
    "summit",
    "tunnel",
    "beacon",
    "anchor",
    "basket",
    "canyon",
    "dune",
    "feather",
    "hollow",
    "island",
    "jungle",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "oyster",
    "parrot",
    "quiver",
    "rocket",
    "shadow",
    "timber",
    "umbrella",
    "vessel",
)


def message(rng: random.Random, turn: int) -> str:
    """About 100 tokens of the server's tokenizer: a fact to keep and filler words."""
    words = " ".join(rng.choice(WORDS) for _ in range(62))
    return f"Note {turn}: my favourite word today is {rng.choice(WORDS)}. {words}. Please reply briefly."


def converse(base_url: str, cid: str, turns: int, seed: int) -> list[dict[str, Any]]:
    """`turns` turns through the official SDK; what each turn did (or the error it got)."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    for turn in range(1, turns + 1):
        try:
            reply = client.chat.completions.create(
                model="llama/smollm2",
                messages=[{"role": "user", "content": message(rng, turn)}],
                max_tokens=16,
                temperature=0,
                extra_body={"conversation_id": cid},
            )
        except BadRequestError as exc:
            results.append({"turn": turn, "error": str(exc)})
            continue
        assert reply.usage is not None
        results.append({"turn": turn, "id": reply.id, "prompt_tokens": reply.usage.prompt_tokens})
    return results


def context_records(data_dir: Path, response_id: str) -> list[dict[str, Any]]:
    path = data_dir / "logs" / "responses" / f"{response_id}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("type") == "context"]


def test_no_window_configured_8_turns_fit_and_fill_the_window(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, llama)
    try:
        results = converse(gateway.url, "auto-window", 8, seed=1)
    finally:
        gateway.stop()
    failed = [r for r in results if "error" in r]
    assert failed == []
    truncating = False
    for r in results:
        snapshot = context_records(gateway.data_dir, r["id"])[-1]
        assert snapshot["context_window"] == N_CTX
        assert snapshot["context_window_source"].startswith("llama.cpp")
        # The window was checked with llama.cpp's own count: exactly what it then reported.
        assert snapshot["server_prompt_tokens"] == r["prompt_tokens"], (r, snapshot["tokens"])
        truncating = truncating or snapshot["truncated"] > 0
        if truncating:
            # Once the history is larger than the window, every prompt uses at least 40% of it
            # (cut in steps down to cut_to = 0.6 of the budget, in whole turns of ~120 tokens).
            assert r["prompt_tokens"] >= 0.4 * N_CTX, (r, snapshot["tokens"])
        assert r["prompt_tokens"] + 16 <= N_CTX
    assert truncating, "the history never outgrew the window: the test proves nothing"


def test_a_declared_window_four_times_too_large_is_learned_from_the_first_refusal(
    tmp_path: Path, llama: LlamaServer
) -> None:
    gateway = gateway_for(tmp_path, llama, "[context]\nmax_context_tokens = 2048\n")
    try:
        results = converse(gateway.url, "declared-2048", 7, seed=2)
    finally:
        gateway.stop()
    assert [r for r in results if "error" in r] == []
    refits = [c for r in results for c in context_records(gateway.data_dir, r["id"]) if "after_refusal" in c]
    assert refits, "no turn was refused and retried: the declared window was never too large"
    assert all(c["context_window"] == N_CTX for c in refits)
    assert "exceed" in gateway.log() or "context_refused" in gateway.log()


def test_summarize_with_the_same_model_8_turns(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(
        tmp_path,
        llama,
        '[context]\nstrategy = "summarize"\nsummary_model = "llama/smollm2"\nsummary_max_tokens = 64\n',
    )
    try:
        results = converse(gateway.url, "summarized", 8, seed=3)
        deadline = time.monotonic() + 60
        summaries = tmp_path / "var" / "logs" / "summaries" / "summarized.jsonl"
        while time.monotonic() < deadline and not summaries.exists():
            time.sleep(0.5)
    finally:
        gateway.stop()
    assert [r for r in results if "error" in r] == []
    versions = [json.loads(line) for line in summaries.read_text().splitlines()]
    done = [v for v in versions if v.get("type") == "summary"]
    assert done, versions
    used = [c for r in results for c in context_records(gateway.data_dir, r["id"]) if c["summary_version"]]
    assert used, "no turn was sent with a summary"
    for c in used:
        assert 0 < c["tokens"]["summary"] <= N_CTX // 3
