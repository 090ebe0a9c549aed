"""Anthropic's Messages API on a real model: the official `anthropic` SDK against `gateway serve`
in front of llama.cpp (SmolLM2), whole and streamed, count_tokens, and a conversation begun with
the `openai` SDK continued through Messages with the whole history given to the model."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
from openai import OpenAI

from tests.realmodel.helpers import gateway_for
from tests.realmodel.llama import LlamaServer
from tests.realmodel.test_window_real import context_records


def test_the_anthropic_sdk_on_a_real_model(tmp_path: Path, llama: LlamaServer) -> None:
    gateway = gateway_for(tmp_path, llama)
    try:
        openai = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
        first = openai.chat.completions.create(
            model="llama/smollm2",
            messages=[{"role": "user", "content": "My name is Ada. Say hello."}],
            max_tokens=12,
            temperature=0,
            extra_body={"conversation_id": "claude-real"},
        )
        client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120)
        extra = {"conversation_id": "claude-real"}
        asked = [{"role": "user", "content": "What is my name?"}]
        counted = client.messages.count_tokens(model="llama/smollm2", messages=asked, extra_body=extra)
        whole = client.messages.create(
            model="llama/smollm2", max_tokens=12, messages=asked, extra_body={**extra, "temperature": 0}
        )
        assert whole.type == "message" and whole.content and whole.content[0].type == "text"
        assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.input_tokens > 0
        # The server's own count of what was sent: Anthropic's input_tokens leave out cache reads.
        usage = whole.usage
        whole_prompt = (
            usage.input_tokens
            + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0)
        )
        assert counted.input_tokens == whole_prompt and (usage.cache_read_input_tokens or 0) > 0
        with client.messages.stream(
            model="llama/smollm2",
            max_tokens=12,
            messages=[{"role": "user", "content": "Thanks."}],
            extra_body={**extra, "temperature": 0},
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.content[0].type == "text" and final.content[0].text == text
    finally:
        gateway.stop()
    # The model was given the whole conversation each time: the first turn's words included.
    sent = context_records(gateway.data_dir, whole.id)[-1]["messages"]
    assert "My name is Ada. Say hello." in json.dumps(sent)
    assert any(m["role"] == "assistant" for m in sent) and first.id in json.dumps(
        context_records(gateway.data_dir, whole.id)[-1]["included_response_ids"]
    )
