"""The provider's prompt cache, accounted for: how much of each prompt it served (OpenAI's and
llama.cpp's shapes, Anthropic's through litellm), kept per turn in the response log, the log
line, the metrics and the inspector."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.context.accounting import prompt_accounting
from gateway.store.memory import MemoryStore
from gateway.upstream.base import approx_tokens, completion_from_text
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

# -- reading what a provider said --------------------------------------------------------------------


def test_openai_usage_gives_the_whole_prompt_and_its_cached_part() -> None:
    usage = {
        "prompt_tokens": 2006,
        "completion_tokens": 300,
        "prompt_tokens_details": {"cached_tokens": 1920},
    }
    assert prompt_accounting(usage) == {"prompt_tokens": 2006, "cached_tokens": 1920, "source": "usage"}
    # A provider that says nothing of its cache: the prompt only, no cached figure made up.
    assert prompt_accounting({"prompt_tokens": 80, "completion_tokens": 1}) == {"prompt_tokens": 80}
    assert prompt_accounting(None) is None and prompt_accounting({}) is None


def test_llamacpp_timings_give_the_cache_where_the_usage_does_not() -> None:
    timings = {"cache_n": 236, "prompt_n": 12, "prompt_ms": 30.1, "predicted_n": 9, "predicted_ms": 80.0}
    # A stream's last chunk without usage (not asked for): the timings alone.
    assert prompt_accounting(None, timings) == {
        "prompt_tokens": 248,
        "cached_tokens": 236,
        "source": "llama.cpp timings",
    }
    # An older server's usage without details: its prompt_tokens, the timings' cache.
    usage = {"prompt_tokens": 248, "completion_tokens": 9, "total_tokens": 257}
    assert prompt_accounting(usage, timings) == {
        "prompt_tokens": 248,
        "cached_tokens": 236,
        "source": "llama.cpp timings",
    }
    # A newer server says it in the usage too: the same figures.
    detailed = {**usage, "prompt_tokens_details": {"cached_tokens": 236}}
    assert prompt_accounting(detailed, timings) == {
        "prompt_tokens": 248,
        "cached_tokens": 236,
        "source": "usage",
    }


def test_anthropic_counts_cache_reads_and_writes_outside_input_tokens() -> None:
    raw = {
        "input_tokens": 12,
        "output_tokens": 5,
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 300,
    }
    assert prompt_accounting(raw) == {
        "prompt_tokens": 2312,
        "cached_tokens": 2000,
        "cache_creation_tokens": 300,
        "source": "anthropic",
    }
    # litellm's translation (recent versions): prompt_tokens is the whole prompt already.
    litellm_usage = {
        "prompt_tokens": 2312,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2000, "cache_creation_tokens": 300, "text_tokens": 12},
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 300,
    }
    assert prompt_accounting(litellm_usage) == prompt_accounting(raw)
    # Versions that counted the cache reads only in prompt_tokens, saying the uncached part.
    reads_only = {
        "prompt_tokens": 2012,
        "prompt_tokens_details": {"cached_tokens": 2000, "text_tokens": 12},
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 300,
    }
    assert prompt_accounting(reads_only) == prompt_accounting(raw)
    # A cache write from a version that says nothing to tell them apart: the whole is unknown.
    unclear = {"prompt_tokens": 2012, "cache_read_input_tokens": 2000, "cache_creation_input_tokens": 300}
    assert prompt_accounting(unclear) == {
        "cached_tokens": 2000,
        "cache_creation_tokens": 300,
        "source": "anthropic",
    }
    # No cache write: every version counts the reads in prompt_tokens.
    read = {"prompt_tokens": 2012, "cache_read_input_tokens": 2000, "cache_creation_input_tokens": 0}
    assert prompt_accounting(read) == {
        "prompt_tokens": 2012,
        "cached_tokens": 2000,
        "cache_creation_tokens": 0,
        "source": "anthropic",
    }


def test_anthropic_usage_as_the_installed_litellm_translates_it() -> None:
    pytest.importorskip("litellm")
    from gateway.upstream.litellm import import_litellm

    import_litellm()  # (with its bundled model map: no network)
    from litellm.llms.anthropic.chat.transformation import AnthropicConfig

    anthropic = {
        "input_tokens": 12,
        "output_tokens": 5,
        "cache_read_input_tokens": 2000,
        "cache_creation_input_tokens": 300,
    }
    usage = AnthropicConfig().calculate_usage(usage_object=anthropic, reasoning_content=None)
    dumped = orjson.loads(orjson.dumps(usage.model_dump(exclude_none=False)))
    assert prompt_accounting(dumped) == {
        "prompt_tokens": 2312,
        "cached_tokens": 2000,
        "cache_creation_tokens": 300,
        "source": "anthropic",
    }


def test_malformed_figures_are_left_out() -> None:
    for bad in (True, -1, "12", None, [3], 1.5):
        usage = {"prompt_tokens": bad, "prompt_tokens_details": {"cached_tokens": bad}}
        assert prompt_accounting(usage, {"cache_n": bad, "prompt_n": bad}) is None
    assert prompt_accounting({"prompt_tokens": 10, "prompt_tokens_details": "x"}, "y") == {
        "prompt_tokens": 10
    }


# -- kept per turn -----------------------------------------------------------------------------------


def cached_answer(cached: int) -> Any:
    """An OpenAI-compatible provider whose cache served `cached` tokens of every prompt."""

    def handler(body: dict[str, Any]) -> Any:
        completion = completion_from_text("m", "ok", prompt_tokens=approx_tokens(body["messages"]) + cached)
        completion["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return completion

    return handler


def samples(metrics: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }


async def test_the_cached_tokens_of_each_turn_are_logged_counted_and_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    upstream = MockUpstream(cached_answer(1024))
    caplog.set_level(logging.INFO, logger="gateway.access")
    async with build_client(make_settings(), store, upstream) as client:
        body = {"model": "mock/m", "conversation_id": "c", "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/chat/completions", json=streamed)
        assert r.status_code == 200, r.text
        metrics = (await client.get("/metrics")).text
        inspected = (await client.get("/ui/api/conversations/c")).json()
    whole = usage["prompt_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 1024}  # the provider's, as it said it
    records = [r for rid in store.indexes["c"] for r in store.responses[rid]]
    caches = [r["cache"] for r in records if r["type"] == "response"]
    assert caches[0] == {"prompt_tokens": whole, "cached_tokens": 1024, "source": "usage"}
    assert caches[1]["cached_tokens"] == 1024  # streamed: from the usage chunk
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [line["cache"] for line in lines if line.get("event") == "chat.completion"] == caches
    uncached = sum(c["prompt_tokens"] for c in caches) - 2048
    counted = samples(metrics)
    assert counted[("gateway_prompt_tokens_total", (("kind", "cached"), ("provider", "mock")))] == 2048
    assert counted[("gateway_prompt_tokens_total", (("kind", "uncached"), ("provider", "mock")))] == uncached
    assert [turn["cache"] for turn in inspected["turns"]] == caches


async def test_a_streamed_llamacpp_answer_keeps_its_timings_cache_figures() -> None:
    """llama.cpp says its cache in the `timings` of a stream's last chunk, usage asked for or
    not: the stream's accumulator keeps them, and the client still gets them as they came."""

    def llama(body: dict[str, Any]) -> Any:
        completion = completion_from_text("m", "hello there", prompt_tokens=0)
        del completion["usage"]
        completion["timings"] = {"cache_n": 300, "prompt_n": 17, "predicted_n": 3, "predicted_ms": 9.5}
        return completion

    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream(llama)) as client:
        body = {"model": "mock/m", "conversation_id": "l", "stream": True}
        r = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 200, r.text
        metrics = samples((await client.get("/metrics")).text)
    events = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["timings"]["cache_n"] == 300  # passed on to the client
    (response,) = [r for records in store.responses.values() for r in records if r["type"] == "response"]
    assert response["cache"] == {"prompt_tokens": 317, "cached_tokens": 300, "source": "llama.cpp timings"}
    assert metrics[("gateway_prompt_tokens_total", (("kind", "cached"), ("provider", "mock")))] == 300
    assert metrics[("gateway_prompt_tokens_total", (("kind", "uncached"), ("provider", "mock")))] == 17
