"""Streamed turns through the gateway to llama.cpp's server, with the official SDK: what the
client read is what was stored, and the next turn sends it back as history."""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from tests.realmodel.helpers import gateway_for
from tests.realmodel.llama import LlamaServer
from tests.realmodel.test_window_real import context_records


def test_streamed_turns_are_stored_as_read_and_sent_back(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, llama)
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
    read: list[tuple[str, str]] = []
    try:
        for text in ("My name is Ada. Say hello.", "What is my name?"):
            stream = client.chat.completions.create(
                model="llama/smollm2",
                messages=[{"role": "user", "content": text}],
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"conversation_id": "streamed"},
            )
            chunks = list(stream)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content and chunks[0].id == chunks[-1].id
            read.append((chunks[0].id, content))
    finally:
        gateway.stop()
    (first_id, first_text), (second_id, _) = read
    stored = context_records(gateway.data_dir, second_id)[-1]["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user"]
    assert stored[1]["content"] == first_text and stored[0]["content"].startswith("My name is Ada")
    assert first_id != second_id
