"""The provider's prompt cache survives the window, on a real model: llama.cpp (SmolLM2, 512
tokens a slot) reports per answer how much of the prompt came from its cache
(`usage.prompt_tokens_details.cached_tokens`); once a conversation outgrows the window, the
gateway cuts in steps and most of every prompt is still read from that cache."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.realmodel.helpers import gateway_for
from tests.realmodel.llama import LlamaServer
from tests.realmodel.test_window_real import N_CTX, WORDS, context_records

TURNS = 24


def short(rng: random.Random, turn: int) -> str:
    """A short user message (about 20 tokens)."""
    return f"Note {turn}: I like the {rng.choice(WORDS)} and the {rng.choice(WORDS)} a lot. Reply briefly."


def converse(base_url: str, cid: str, turns: range, seed: int) -> Iterator[dict[str, Any]]:
    """Turns through the official SDK; per turn the server's own usage and the window's record."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    rng = random.Random(seed)
    for turn in turns:
        raw = client.chat.completions.with_raw_response.create(
            model="llama/smollm2",
            messages=[{"role": "user", "content": short(rng, turn)}],
            max_tokens=16,
            temperature=0,
            extra_body={"conversation_id": cid},
        )
        body = json.loads(raw.text)
        usage = body["usage"]
        yield {
            "id": body["id"],
            "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        }


def after_first_cut(data_dir: Path, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns from the first cut on, each with its context snapshot."""
    for r in results:
        r["context"] = context_records(data_dir, r["id"])[-1]
    first = next((i for i, r in enumerate(results) if r["context"]["cut"]), None)
    assert first is not None, "the conversation never outgrew the window: the test proves nothing"
    return results[first:]


def cached_share(turns: list[dict[str, Any]]) -> float:
    return sum(r["cached"] for r in turns) / sum(r["prompt"] for r in turns)


def test_truncation_keeps_the_prompt_cache(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, llama)
    try:
        results = list(converse(gateway.url, "cached", range(1, TURNS + 1), seed=7))
    finally:
        gateway.stop()
    later = after_first_cut(gateway.data_dir, results)
    cuts = [r for r in later if r["context"]["cut"]]
    assert len(later) >= 10 and 1 <= len(cuts) <= len(later) // 3, [r["prompt"] for r in later]
    assert cached_share(later) >= 0.6, [(r["prompt"], r["cached"]) for r in later]
    assert min(r["prompt"] for r in later) >= 0.45 * N_CTX
    assert max(r["prompt"] for r in results) + 16 <= N_CTX


def test_summaries_enter_at_cuts_and_leave_no_gap(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, llama, '[context]\nstrategy = "summarize"\nsummary_max_tokens = 64\n')
    try:
        results = list(converse(gateway.url, "summarized-cache", range(1, 21), seed=8))
    finally:
        gateway.stop()
    later = after_first_cut(gateway.data_dir, results)
    # No message in neither the summary nor the window: nothing omitted beyond what it covers.
    assert [r["context"]["truncated"] for r in results] == [0] * len(results)
    assert any(r["context"]["summary_version"] for r in later)
    for before, after in zip(later, later[1:], strict=False):  # a new summary only at a cut
        if after["context"]["summary_version"] != before["context"]["summary_version"]:
            assert after["context"]["cut"], after["context"]
    assert cached_share(later) >= 0.4, [(r["prompt"], r["cached"]) for r in later]


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with LlamaServer(n_ctx=2 * N_CTX, parallel=2, log_dir=tmp_path_factory.mktemp("llama2")) as server:
        yield server


def test_two_conversations_on_two_slots_keep_their_caches(tmp_path: Path, two_slots: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, two_slots)
    try:
        a = converse(gateway.url, "left", range(1, 21), seed=9)  # (a first cut near turn 11)
        b = converse(gateway.url, "right", range(1, 21), seed=10)
        results: dict[str, list[dict[str, Any]]] = {"left": [], "right": []}
        for left, right in zip(a, b, strict=True):  # interleaved, one turn each
            results["left"].append(left)
            results["right"].append(right)
    finally:
        gateway.stop()
    for name, turns in results.items():
        later = after_first_cut(gateway.data_dir, turns)
        assert cached_share(later) >= 0.6, (name, [(r["prompt"], r["cached"]) for r in later])
