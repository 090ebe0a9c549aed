"""Counting before sending on a real model: llama.cpp counts prompts itself, so what
`client.responses.input_tokens.count` says before a turn is the prompt that turn then sends, as
the server reports it (`usage.input_tokens`), also once the window cuts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import OpenAI

from tests.realmodel.helpers import gateway_for
from tests.realmodel.llama import LlamaServer
from tests.realmodel.test_window_real import WORDS

TURNS = 7  # ~90-token turns: the 512-token window cuts from about the sixth


def message(rng: random.Random, turn: int) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(40))
    return f"Note {turn}: remember these words, {words}. Reply with one word."


def test_the_count_is_the_prompt_the_next_turn_sends(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, llama)
    try:
        client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)
        rng = random.Random(11)
        previous: Any = openai.omit
        seen = []
        for turn in range(TURNS):
            ask: dict[str, Any] = {
                "model": "llama/smollm2",
                "input": message(rng, turn),
                "instructions": "Answer briefly.",
                "previous_response_id": previous,
            }
            # (max_output_tokens sizes the answer's reserve, so the window: sent with the count too)
            counted = client.responses.input_tokens.count(**ask, extra_body={"max_output_tokens": 8})
            r = client.responses.create(**ask, max_output_tokens=8, temperature=0)
            assert r.usage is not None
            gateway_view = counted.to_dict()["gateway"]
            context = httpx.get(f"{gateway.url}/v1/responses/{r.id}").json()["gateway"]["context"]
            assert gateway_view["tokens"] == context["tokens"]  # the window the turn sent
            assert gateway_view["counted_by"] == "server"
            assert counted.input_tokens == r.usage.input_tokens, (turn, counted, r.usage)  # exact
            seen.append((counted.input_tokens, r.usage.input_tokens, context["truncated"]))
            previous = r.id
    finally:
        gateway.stop()
    assert any(truncated for _, _, truncated in seen), seen  # the window cut, and the count with it
