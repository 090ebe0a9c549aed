"""Every per-process map that is keyed by something clients choose (conversations, models,
responses) stays bounded however many of them a long run brings (docs/memory.md)."""

from __future__ import annotations

import pytest

from gateway.jobs import summarizer as summarizer_module
from gateway.metrics import ACTIVE_LIMIT, Metrics
from gateway.services.cache import ConversationCache
from gateway.services.models import MAX_MODELS, ModelFacts
from gateway.services.usage import WARNED_LIMIT, UsageLearning
from gateway.store.base import LRU
from gateway.store.jsonl import JsonlStore
from gateway.store.memory import MemoryStore
from gateway.upstream import Route
from gateway.upstream.mock import MockUpstream
from tests.app.test_summarizer import FlakySummaries, job
from tests.conftest import make_settings
from tests.helpers import commit_turn


def test_lru_keeps_count_and_weight_within_bounds() -> None:
    lru: LRU[str, list[int]] = LRU(4, weigh=len, budget=10)
    for n in range(100):
        lru[f"k{n}"] = [0] * (n % 7)
        assert len(lru) <= 4 and lru.weight <= max(10, n % 7)
        assert lru.weight == sum(len(v) for v in lru.values())
    grown = lru["k99"]
    grown.extend([0] * 30)  # changed in place, then stored again: weighed again
    lru["k99"] = grown
    assert list(lru) == ["k99"] and lru.weight == 31  # the entry just stored is kept, alone
    assert lru.pop("k99") is grown and lru.weight == 0 and lru.pop("nothing", None) is None
    lru["a"], lru["b"] = [1], [2, 3]
    del lru["a"]
    assert lru.weight == 2
    lru.popitem()
    assert lru.weight == 0 and not lru


async def test_conversation_cache_holds_at_most_its_message_budget() -> None:
    store = MemoryStore()
    cache = ConversationCache(size=1000, messages=100)
    for c in range(40):
        for t in range(5):
            await commit_turn(store, f"c{c}", f"turn {t}")
        await cache.load(store, f"c{c}")  # 10 messages each
        assert cache._views.weight <= 100
    assert len(cache._views) == 9  # 9 x (10 + 1)
    for t in range(100):  # one conversation outgrows the budget: it is kept, alone
        await commit_turn(store, "big", f"turn {t}")
    assert len((await cache.load(store, "big")).history) == 200
    assert list(cache._views) == [(id(store), "big")]


async def test_readers_that_scan_do_not_fill_the_cache(tmp_path: object) -> None:
    store = MemoryStore()
    cache = ConversationCache(size=1000, messages=10_000)
    await commit_turn(store, "talking", "hello")
    await cache.load(store, "talking")
    for c in range(50):
        await commit_turn(store, f"idle{c}", "hello")
        await cache.load(store, f"idle{c}", keep=False)
    assert list(cache._views) == [(id(store), "talking")]
    await commit_turn(store, "talking", "again")
    assert len((await cache.load(store, "talking", keep=False)).history) == 4  # kept up to date


def test_active_conversations_gauge_remembers_at_most_its_limit() -> None:
    metrics = Metrics(active_window=3600)
    for n in range(ACTIVE_LIMIT + 5000):
        metrics.conversation_touched(f"conversation-{n}")
    assert len(metrics._last_turn) == ACTIVE_LIMIT
    assert metrics._count_active() == ACTIVE_LIMIT
    metrics.conversation_touched("conversation-0")  # dropped as least recent: counted anew
    assert len(metrics._last_turn) == ACTIVE_LIMIT


def test_labelled_metric_children_are_looked_up_once_and_bounded() -> None:
    metrics = Metrics()
    first = metrics.child(metrics.requests, "chat_completions", "200")
    assert metrics.child(metrics.requests, "chat_completions", "200") is first
    first.inc()
    metrics.child(metrics.requests, "chat_completions", "200").inc()
    assert b'route="chat_completions",status="200"} 2.0' in metrics.render()
    for n in range(5000):  # label values a client could choose: the lookup table stops growing
        metrics.child(metrics.upstream, f"provider-{n}")
    assert len(metrics._children) == 4096
    metrics.child(metrics.upstream, "provider-4999").observe(1.0)
    assert b'gateway_upstream_seconds_count{provider="provider-4999"} 1.0' in metrics.render()


def test_model_facts_of_client_chosen_models_are_bounded() -> None:
    facts = ModelFacts(make_settings())
    upstream = MockUpstream()
    for n in range(MAX_MODELS * 3):
        facts.calibration(Route("mock", upstream, f"model-{n}"))
    assert len(facts._entries) == MAX_MODELS


def test_suspected_truncation_warnings_are_remembered_for_a_bounded_set() -> None:
    usage = UsageLearning(ModelFacts(make_settings()))
    for n in range(WARNED_LIMIT * 2):
        usage._warned_truncation[f"c{n}"] = True
    assert len(usage._warned_truncation) == WARNED_LIMIT


async def test_summarizer_failure_counts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summarizer_module, "FAILURES_KEPT", 8)
    summaries = FlakySummaries(failures=10_000)
    summarizer, _, _ = job(summaries)
    for c in range(30):
        summarizer.schedule("", f"c{c}", "resp-1", "m")
    await summarizer.wait_idle()
    assert len(summarizer.failures) == 8
    assert list(summarizer.failures) == [("", f"c{c}") for c in range(22, 30)]


async def test_jsonl_side_log_cache_is_bounded_by_records(tmp_path: object) -> None:
    from pathlib import Path

    store = JsonlStore(Path(str(tmp_path)) / "var", durability="none", cache_size=16)
    await store.open()
    for n in range(200):
        for k in range(3):
            await store.append_side("summaries", f"c{n}", {"type": "summary", "k": k})
        await store.read_side("summaries", f"c{n}")
    assert len(store._side) <= 4 * 16 and store._side.weight <= 4 * 16
