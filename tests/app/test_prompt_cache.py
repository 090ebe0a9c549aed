"""The provider's prompt cache, accounted for: how much of each prompt it served (OpenAI's and
llama.cpp's shapes, Anthropic's through litellm), kept per turn in the response log, the log
line, the metrics and the inspector; and calibration, which learns from the whole prompt and
never from a count no real tokenizer gives."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.context.accounting import prompt_accounting
from gateway.context.calibration import UNCALIBRATED, fit, plausible
from gateway.services.models import ModelFacts
from gateway.store.memory import MemoryStore
from gateway.upstream import Route
from gateway.upstream.base import approx_tokens, completion_from_text
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings

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


async def test_calibration_learns_from_the_whole_prompt_cache_included() -> None:
    """Anthropic leaves its cache out of `input_tokens`, and some litellm versions left cache
    writes out of `prompt_tokens`: calibrated on that, a conversation whose every turn writes
    its new part to the cache looked like a model counting fewer tokens than it does (and the
    next, larger prompt was planned too big)."""
    cached = [0]  # what the previous turn wrote: the head of this prompt, read from the cache

    def anthropic_through_litellm(body: dict[str, Any]) -> Any:
        whole = approx_tokens(body["messages"])  # this model's own count
        read, uncached = cached[0], 3
        written = whole - read - uncached
        cached[0] = whole - uncached
        completion = completion_from_text("m", "ok", prompt_tokens=0)
        completion["usage"] = {
            "prompt_tokens": uncached + read,  # (cache writes left out, as such a version did)
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": read, "text_tokens": uncached},
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        }
        return completion

    upstream = MockUpstream(anthropic_through_litellm)
    upstream.reports_real_usage = True
    store = MemoryStore()
    async with build_client(make_settings(), store, upstream) as client:
        for i in range(8):
            text = f"{i}: " + "the river runs past the old mill " * 6
            body = {
                "model": "mock/claude",
                "conversation_id": "a",
                "messages": [{"role": "user", "content": text}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        route = app_of(client).state.services.router.resolve("mock/claude")
        calibration = app_of(client).state.services.facts.calibration(route)
    records = [r for rid in store.indexes["a"] for r in store.responses[rid]]
    planned = [r["tokens"]["total"] for r in records if r["type"] == "context"]
    counted = [r["cache"]["prompt_tokens"] for r in records if r["type"] == "response"]
    assert counted[-1] == approx_tokens(upstream.requests[-1]["messages"])  # the whole prompt
    assert not any(r.get("upstream_truncation_suspected") for r in records)
    assert all(
        calibration.provider_tokens(ours) >= theirs for ours, theirs in zip(planned, counted, strict=True)
    )


# -- readings no real tokenizer gives ------------------------------------------------------------------


def test_plausible_counts_are_those_of_real_tokenizers() -> None:
    assert plausible(1000, 500) and plausible(1000, 3000) and plausible(1000, 1130)
    assert not plausible(1000, 499) and not plausible(1000, 3100)
    assert plausible(8, 30)  # a short prompt under a chat template's own system prompt
    assert not plausible(0, 10)
    # The fit leaves such readings out (a cached prompt's evaluated part, a made-up figure).
    assert fit([(1000, 100), (2000, 9000)]) == UNCALIBRATED
    assert fit([(1000, 1100), (1000, 100)]).ratio == pytest.approx(1.1)


def test_a_rejected_reading_is_not_learned_is_counted_and_logged_once_per_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream = MockUpstream()
    upstream.reports_real_usage = True
    facts = ModelFacts(make_settings())
    rejected: list[str] = []
    facts.on_rejected = rejected.append
    smol, other = Route("mock", upstream, "smol"), Route("mock", upstream, "other")
    for ours in (300, 400, 500):
        facts.observe(smol, ours, ours // 10)  # a tenth: the uncached part of a cached prompt
        facts.observe(other, ours, ours * 4)
    assert facts.calibration(smol) == UNCALIBRATED and facts.calibration(other) == UNCALIBRATED
    assert rejected == ["mock"] * 6
    warnings = [
        orjson.loads(r.getMessage())
        for r in caplog.records
        if "calibration_reading_rejected" in r.getMessage()
    ]
    assert [(w["provider"], w["model"]) for w in warnings] == [("mock", "smol"), ("mock", "other")]
    assert warnings[0]["prompt_tokens"] == 30 and warnings[0]["our_count"] == 300
    facts.observe(smol, 300, 340)
    assert facts.calibration(smol).samples == 1  # an ordinary reading is learned from as before


async def test_rejected_readings_are_counted_in_the_metrics(caplog: pytest.LogCaptureFixture) -> None:
    def inflated(body: dict[str, Any]) -> Any:
        return completion_from_text("m", "ok", prompt_tokens=5 * approx_tokens(body["messages"]) + 100)

    upstream = MockUpstream(inflated)
    upstream.reports_real_usage = True
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        for i in range(3):
            body = {
                "model": "mock/m",
                "conversation_id": "r",
                "messages": [{"role": "user", "content": f"hi {i}"}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        metrics = samples((await client.get("/metrics")).text)
        route = app_of(client).state.services.router.resolve("mock/m")
        assert app_of(client).state.services.facts.calibration(route).samples == 0
    assert metrics[("gateway_calibration_rejected_total", (("provider", "mock"),))] == 3
    assert caplog.text.count("calibration_reading_rejected") == 1
