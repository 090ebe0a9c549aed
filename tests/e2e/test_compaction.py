"""Compaction through the official SDK against `gateway serve`: `client.responses.compact`,
its output sent back in `input`, and `context_management` on `client.responses.create` and
`.stream`. The mock upstream answers with the demo model's logic (its summarizer keeps the
facts it is given; it refuses message fields OpenAI does not know, so the gateway's own mark on
a compaction's summary is seen never to reach it)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.conftest import GatewayProcess, sdk
from tests.mockserver import MockServer

SUMMARIZER = "You maintain the running summary"


def prompts(upstream: MockServer) -> list[list[dict[str, Any]]]:
    """The turns' prompts the provider was sent (the summarizer's calls left out)."""
    return [
        r["messages"]
        for r in upstream.requests
        if not str(r["messages"][0].get("content", "")).startswith(SUMMARIZER)
    ]


def as_input(items: list[Any]) -> list[dict[str, Any]]:
    """Output items sent back as input (the SDK types the kept user messages as output
    messages, and would warn that their `input_text` parts are not `output_text`)."""
    return [item.to_dict(warnings=False) for item in items]


@pytest.mark.parametrize("model", ["mock/m", "demo"])
def test_compact_then_create_with_the_compacted_output_recalls_its_facts(
    gateway: GatewayProcess, upstream: MockServer, model: str
) -> None:
    client = sdk(gateway)
    r1 = client.responses.create(model=model, input="Hi, my name is Bob.")
    r2 = client.responses.create(model=model, input="my city is Oslo", previous_response_id=r1.id)
    compacted = client.responses.compact(model=model, previous_response_id=r2.id)
    assert compacted.object == "response.compaction"
    *kept, item = compacted.output
    assert [(m.type, m.role) for m in kept] == [("message", "user"), ("message", "user")]  # type: ignore[union-attr]
    assert item.type == "compaction" and "Bob" not in item.encrypted_content  # type: ignore[union-attr]
    assert compacted.usage.total_tokens == compacted.usage.input_tokens + compacted.usage.output_tokens
    answer = client.responses.create(
        model=model, input=[*as_input(compacted.output), {"role": "user", "content": "what is my city?"}]
    )
    assert answer.output_text == "Your city is Oslo."
    if model == "mock/m":
        sent = prompts(upstream)[-1]
        summary = [m for m in sent if m["role"] == "system"]
        assert len(summary) == 1 and "my name is Bob" in summary[0]["content"]
    # Only the new message after it, with previous_response_id: the compacted summary is stored.
    more = client.responses.create(model=model, input="what is my name?", previous_response_id=answer.id)
    assert more.output_text == "Your name is Bob."


def test_a_forged_or_foreign_encrypted_content_is_a_400(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    client = sdk(gateway)
    made = client.responses.compact(model="mock/m", input="my name is Bob")
    real = made.output[-1].encrypted_content  # type: ignore[union-attr]
    sent = len(upstream.requests)
    altered = real[:-3] + ("A" if real[-3] != "A" else "B") + real[-2:]
    for forged in ("gAAAAABfake-content-from-elsewhere==", altered):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model="mock/m",
                input=[
                    {"type": "compaction", "encrypted_content": forged},
                    {"role": "user", "content": "hi"},
                ],
            )
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "invalid_encrypted_content"
        assert error["type"] == "invalid_request_error" and "could not be verified" in error["message"]
    assert len(upstream.requests) == sent


@pytest.mark.parametrize("streaming", [False, True])
def test_context_management_compacts_past_the_threshold(
    gateway: GatewayProcess, upstream: MockServer, streaming: bool
) -> None:
    client = sdk(gateway)
    manage = [{"type": "compaction", "compact_threshold": 60}]
    previous = None
    kinds = []
    for text in ["Hi, my name is Bob.", "my city is Oslo", "I like trains a lot."]:
        kwargs: dict[str, Any] = {
            "model": "mock/m",
            "input": text,
            "previous_response_id": previous,
            "context_management": manage,
        }
        if streaming:
            with client.responses.stream(**kwargs) as stream:
                for _ in stream:
                    pass
                response = stream.get_final_response()
        else:
            response = client.responses.create(**kwargs)
        kinds.append([item.type for item in response.output])
        previous = response.id
    assert kinds[0] == ["message"] and ["compaction", "message"] in kinds[1:]
    compaction = next(item for item in response.output if item.type == "compaction")
    assert compaction.encrypted_content  # type: ignore[union-attr]
    # A later turn's prompt holds the fact from before the compaction (its summary), not the turn.
    later = client.responses.create(model="mock/m", input="what is my name?", previous_response_id=previous)
    assert later.output_text == "Your name is Bob."
    prompt = prompts(upstream)[-1]
    assert any(m["role"] == "system" and "my name is Bob" in m["content"] for m in prompt)
    assert "Hi, my name is Bob." not in [m["content"] for m in prompt]
    stored = client.responses.retrieve(previous)
    assert [item.type for item in stored.output] == kinds[-1]


def test_the_compact_operation_is_documented(gateway: GatewayProcess) -> None:
    import httpx

    paths = httpx.get(f"{gateway.url}/openapi.json").json()["paths"]
    assert "post" in paths["/v1/responses/compact"]


def test_gateway_show_marks_where_a_compaction_happened(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    client: OpenAI = sdk(gateway)
    conv = client.conversations.create()
    client.responses.create(model="mock/m", input="my name is Bob", conversation=conv.id)
    client.responses.compact(model="mock/m", extra_body={"conversation": conv.id})
    show = [sys.executable, "-m", "gateway", "show", conv.id, "--config", str(gateway.config)]
    done = subprocess.run(
        [*show, "--data-dir", str(gateway.data_dir)], capture_output=True, text=True, timeout=60
    )
    out = done.stdout
    assert "compaction cmp_" in out and "POST /v1/responses/compact" in out
    assert "my name is Bob" in out  # the full history stays readable
