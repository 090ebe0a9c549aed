"""OpenTelemetry GenAI spans and metrics of turns (`[tracing]`), read with the SDK's in-memory
exporter and reader: the GenAI attributes, the gateway's window facts as its context snapshot
says them, failures' `error.type`, content only when asked for, and summarizer calls."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.config import ModelSettings, Settings
from gateway.exceptions import UpstreamStatusError, UpstreamTimeout
from gateway.otel import OtelTracing
from gateway.services.summaries import SummaryCall
from gateway.store.memory import MemoryStore
from gateway.upstream.base import approx_tokens, completion_from_text
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings

SUMMARIZER_PROMPT = "You maintain the running summary"


class Traced:
    """A tracing that keeps what it records: finished spans and GenAI metric points."""

    def __init__(self, settings: Settings) -> None:
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.tracing = OtelTracing(settings, span_exporter=self.exporter, metric_reader=self.reader)

    def spans(self, operation: str = "turn") -> list[ReadableSpan]:
        self.tracing.flush()
        return [
            s
            for s in self.exporter.get_finished_spans()
            if (s.attributes or {}).get("gateway.operation") == operation
        ]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def close(self) -> None:
        self.tracing.shutdown()


@pytest.fixture
def traced() -> Iterator[Traced]:
    settings = make_settings()
    traced = Traced(settings)
    yield traced
    traced.close()


def answer(body: dict[str, Any]) -> Any:
    """A provider that names its model's version, counts the prompt and says what its cache served."""
    messages = body["messages"]
    if str(messages[0].get("content") or "").startswith(SUMMARIZER_PROMPT):
        return "The user counted turns."
    completion = completion_from_text(
        "m-2024-08", "ok " + "word " * 20, prompt_tokens=approx_tokens(messages)
    )
    completion["usage"]["prompt_tokens_details"] = {"cached_tokens": 128}
    return completion


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_turn_is_one_client_span_with_the_genai_attributes(traced: Traced) -> None:
    body = {
        "model": "mock/m",
        "conversation_id": "conv-1",
        "max_tokens": 50,
        "temperature": 0.2,
        "messages": [{"role": "user", "content": "hello"}],
    }
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(answer), tracing=traced.tracing
    ) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (span,) = traced.spans()
    assert span.name == "chat m" and span.kind is SpanKind.CLIENT
    assert span.status.status_code is StatusCode.UNSET
    usage = r.json()["usage"]
    assert attributes(span) | {"gateway.upstream.duration": 0} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "mock",
        "gen_ai.request.model": "m",  # as the provider was asked ("mock/m" routed to provider mock)
        "gen_ai.request.max_tokens": 50,
        "gen_ai.request.temperature": 0.2,
        "gen_ai.response.id": r.json()["id"],  # the response id the client got
        "gen_ai.response.model": "m-2024-08",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.conversation.id": "conv-1",
        "session.id": "conv-1",
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": 128,
        "server.address": "mock.invalid",
        "server.port": 80,
        "gateway.operation": "turn",
        "gateway.api": "chat.completion",
        "gateway.request.model": "mock/m",
        "gateway.outcome": "complete",
        "gateway.status": 200,
        "gateway.upstream.duration": 0,
        "gateway.messages.new": 1,
        "gateway.messages.sent": 1,
        "gateway.messages.stored": 0,
        "gateway.window.budget": attributes(span)["gateway.window.budget"],
        "gateway.window.tokens": attributes(span)["gateway.window.tokens"],
        "gateway.window.truncated": 0,
        "gateway.window.cut": False,
        "gateway.recap.sent": False,
        "gateway.upstream.truncation_suspected": False,
    }
    # The span is the turn's whole time: the provider's share is within it.
    assert span.end_time is not None and span.start_time is not None
    assert (span.end_time - span.start_time) / 1e9 >= attributes(span)["gateway.upstream.duration"] > 0
    # Never the message contents, unless capture_content says so.
    assert span.events == ()


async def test_the_window_facts_are_the_context_snapshots(traced: Traced) -> None:
    """Turn after turn into a small window with rolling summaries: each span says what its
    response's context snapshot says (stored vs sent, budget, tokens, the cut, the summary)."""
    settings = make_settings()
    settings = settings.model_copy(
        update={
            "models": {"mock/m": ModelSettings(context_window=1024)},
            "context": settings.context.model_copy(
                update={"strategy": "summarize", "summary_model": "mock/m"}
            ),
        }
    )
    store = MemoryStore()
    async with build_client(settings, store, MockUpstream(answer), tracing=traced.tracing) as client:
        for i in range(14):
            text = f"turn {i}: " + "some filler words to fill the window " * 12
            body = {
                "model": "mock/m",
                "conversation_id": "long",
                "messages": [{"role": "user", "content": text}],
            }
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            await app_of(client).state.summarizer.wait_idle()
    spans = traced.spans()
    assert len(spans) == 14
    for span in spans:
        facts = attributes(span)
        (context,) = [
            record for record in store.responses[facts["gen_ai.response.id"]] if record["type"] == "context"
        ]
        assert facts["gateway.messages.stored"] == context["stored_messages"]
        assert facts["gateway.messages.sent"] == context["sent_messages"]
        assert facts["gateway.window.budget"] == context["budget"]
        assert facts["gateway.window.tokens"] == context["tokens"]["total"]
        assert facts["gateway.window.truncated"] == context["truncated"]
        assert facts["gateway.window.cut"] == context["cut"]
        assert facts.get("gateway.summary.version") == context["summary_version"]
        assert facts.get("gateway.summary.covers_messages", 0) == context["summary_covers_messages"]
    cuts = [attributes(s) for s in spans if attributes(s)["gateway.window.cut"]]
    assert cuts, "the window was never cut"
    assert cuts[0]["gateway.summary.version"] >= 1 and cuts[0]["gateway.summary.covers_messages"] > 0
    assert cuts[0]["gateway.messages.sent"] < cuts[0]["gateway.messages.stored"]
    # The summarizer's calls are spans of their own, in the conversation.
    summaries = [attributes(s) for s in traced.spans("summary")]
    assert summaries and all(
        s["gen_ai.conversation.id"] == "long" and s["gen_ai.request.model"] == "m" and "error.type" not in s
        for s in summaries
    )


async def test_a_stream_says_it_is_one(traced: Traced) -> None:
    body = {
        "model": "mock/m",
        "conversation_id": "s",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hello"}],
    }
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(answer), tracing=traced.tracing
    ) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    (span,) = traced.spans()
    facts = attributes(span)
    assert facts["gen_ai.request.stream"] is True and facts["gen_ai.response.model"] == "m-2024-08"
    assert facts["gen_ai.response.finish_reasons"] == ("stop",) and facts["gen_ai.usage.output_tokens"] > 0
    assert facts["gen_ai.response.id"] == r.headers["x-response-id"]


async def test_a_stream_without_a_usage_chunk_has_the_input_tokens_the_metrics_count(traced: Traced) -> None:
    """The span had output tokens (ours) and no input tokens, while `gateway_tokens_total`
    counted the window's: the two exporters disagreed."""
    body = {
        "model": "mock/m",
        "conversation_id": "u",
        "stream": True,
        "messages": [{"role": "user", "content": "hello"}],
    }
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(answer), tracing=traced.tracing
    ) as c:
        r = await c.post("/v1/chat/completions", json=body)
        context = (await c.get("/v1/conversations/u/context")).json()
    assert r.status_code == 200 and '"usage"' not in r.text
    (span,) = traced.spans()
    assert attributes(span)["gen_ai.usage.input_tokens"] == context["tokens"]["total"]


@pytest.mark.parametrize(
    ("fault", "error_type", "status"),
    [
        (UpstreamTimeout("Provider 'mock' did not answer in 5 s"), "upstream_timeout", 504),
        (UpstreamStatusError("overloaded", upstream_status=503), "503", 502),
        (UpstreamStatusError("slow down", upstream_status=429, code="rate_limit_exceeded"), "429", 429),
    ],
)
async def test_a_failed_turn_has_its_error_type(
    traced: Traced, fault: Exception, error_type: str, status: int
) -> None:
    def failing(body: dict[str, Any]) -> Any:
        raise fault

    body = {"model": "mock/m", "conversation_id": "f", "messages": [{"role": "user", "content": "hello"}]}
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(failing), tracing=traced.tracing
    ) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == status
    (span,) = traced.spans()
    facts = attributes(span)
    assert facts["error.type"] == error_type
    assert facts["gateway.outcome"] == "error" and facts["gateway.status"] == status
    assert (
        facts["gen_ai.conversation.id"] == "f" and facts["gen_ai.response.id"] == r.headers["x-response-id"]
    )
    assert "gen_ai.usage.output_tokens" not in facts and "gen_ai.response.finish_reasons" not in facts
    assert span.status.status_code is StatusCode.ERROR
    (duration,) = traced.points("gen_ai.client.operation.duration")
    assert duration.attributes["error.type"] == error_type and duration.count == 1
    assert traced.points("gen_ai.client.token.usage") == []  # no answer, no usage


async def test_content_is_captured_only_when_configured() -> None:
    settings = make_settings()
    settings = settings.model_copy(
        update={"tracing": settings.tracing.model_copy(update={"capture_content": True})}
    )
    traced = Traced(settings)
    body = {
        "model": "mock/m",
        "conversation_id": "content",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "my dog is Rex"},
        ],
    }
    try:
        async with build_client(settings, MemoryStore(), MockUpstream(), tracing=traced.tracing) as c:
            r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        (span,) = traced.spans()
    finally:
        traced.close()
    (event,) = span.events
    assert event.name == "gen_ai.client.inference.operation.details"
    details = dict(event.attributes or {})
    assert json.loads(str(details["gen_ai.input.messages"])) == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "content": "my dog is Rex"}]},
    ]
    assert json.loads(str(details["gen_ai.output.messages"])) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": r.json()["choices"][0]["message"]["content"]}],
            "finish_reason": "stop",
        }
    ]


async def test_the_genai_metrics_count_tokens_by_type_and_time_each_turn(traced: Traced) -> None:
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(answer), tracing=traced.tracing
    ) as c:
        for i in range(3):
            body = {
                "model": "mock/m",
                "conversation_id": "m",
                "messages": [{"role": "user", "content": f"q{i}"}],
            }
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    spans = [attributes(s) for s in traced.spans()]
    usage = {p.attributes["gen_ai.token.type"]: p for p in traced.points("gen_ai.client.token.usage")}
    assert usage.keys() == {"input", "output"}
    assert usage["input"].count == 3 and usage["input"].sum == sum(
        s["gen_ai.usage.input_tokens"] for s in spans
    )
    assert usage["output"].sum == sum(s["gen_ai.usage.output_tokens"] for s in spans)
    assert usage["input"].explicit_bounds[:3] == (1, 4, 16)  # the conventions' advised buckets
    (duration,) = traced.points("gen_ai.client.operation.duration")
    assert duration.count == 3 and duration.explicit_bounds[0] == 0.01
    # Few values each: no conversation or response ids in a metric's attributes.
    assert dict(duration.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "mock",
        "gen_ai.request.model": "m",
        "gen_ai.response.model": "m-2024-08",
        "server.address": "mock.invalid",
        "server.port": 80,
    }


async def test_the_responses_api_turn_is_traced_too(traced: Traced) -> None:
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(answer), tracing=traced.tracing
    ) as c:
        conversation = (await c.post("/v1/conversations", json={})).json()["id"]
        body = {"model": "mock/m", "input": "hello", "conversation": conversation}
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    (span,) = traced.spans()
    facts = attributes(span)
    assert facts["gateway.api"] == "response" and facts["gen_ai.response.id"] == r.json()["id"]
    assert facts["gen_ai.conversation.id"] == conversation


def test_a_failed_summarizer_call_is_a_span_with_its_error(traced: Traced) -> None:
    timeout = UpstreamTimeout("Provider 'mock' did not answer in 600 s")
    traced.tracing.summary_call(SummaryCall("conv-9", "mock", "summ", 500, 0.25, None, timeout))
    traced.tracing.summary_call(SummaryCall("conv-9", "mock", "summ", 500, 0.5, None, ConnectionResetError()))
    failed, reset = traced.spans("summary")
    assert failed.name == "chat summ" and failed.kind is SpanKind.CLIENT
    assert failed.status.status_code is StatusCode.ERROR
    assert attributes(failed) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "mock",
        "gen_ai.request.model": "summ",
        "gen_ai.request.max_tokens": 500,
        "gen_ai.conversation.id": "conv-9",
        "session.id": "conv-9",
        "server.address": "mock.invalid",
        "server.port": 80,
        "error.type": "upstream_timeout",
        "gateway.operation": "summary",
    }
    assert failed.end_time is not None and failed.start_time is not None
    assert failed.end_time - failed.start_time == 250_000_000
    assert attributes(reset)["error.type"] == "ConnectionResetError"


def test_a_turn_logged_after_it_closed_keeps_its_own_start(traced: Traced) -> None:
    """A stream's turn closes when its chunks end, before its last events go out and its line is
    logged: the span starts when the turn began, not its elapsed time before the log line."""
    import time

    from gateway.services.turn import TurnOutcome
    from gateway.tracing import ProviderCall, TraceContext, current_trace

    began = time.time_ns() - 200_000_000  # began 200 ms ago, closed 100 ms later, logged now
    base = {
        **dict.fromkeys(["conversation_id", "message", "finish_reason", "created", "usage", "timings"]),
        **dict.fromkeys(["window_tokens", "budget", "truncated", "summary_version"]),
    }
    outcome = TurnOutcome(
        **base,
        response_id="m-late",
        model="m",
        provider="mock",
        stream=True,
        committed=True,
        new_messages=1,
        sent_messages=1,
        elapsed_ms=100.0,
        upstream_truncated=False,
        started_ns=began,
    )
    trace = TraceContext.of(None)
    trace.calls.append(ProviderCall(1, began + 10_000_000, began + 90_000_000, began + 30_000_000))
    token = current_trace.set(trace)
    try:
        traced.tracing.turn(outcome, 200, "complete", api="chat.completion")
    finally:
        current_trace.reset(token)
    (span,) = traced.spans()
    assert span.start_time == began
    first = (span.attributes or {})["gen_ai.response.time_to_first_chunk"]
    assert first == pytest.approx(0.030, abs=1e-6)  # (counted back from the log line: -0.07)


async def test_a_compaction_of_input_alone_names_no_conversation_in_its_summarizer_span(
    traced: Traced,
) -> None:
    """It named the compaction's own response id as the conversation, which does not exist."""
    async with build_client(
        make_settings(), MemoryStore(), MockUpstream(answer), tracing=traced.tracing
    ) as c:
        body = {"model": "mock/m", "input": [{"role": "user", "content": "fold this " * 20}] * 3}
        r = await c.post("/v1/responses/compact", json=body)
        conversation = (await c.post("/v1/conversations", json={})).json()["id"]
        await c.post(
            "/v1/responses", json={"model": "mock/m", "input": "hello", "conversation": conversation}
        )
        named = await c.post("/v1/responses/compact", json={"model": "mock/m", "conversation": conversation})
    assert r.status_code == 200 and named.status_code == 200, (r.text, named.text)
    alone, of_conversation = traced.spans("summary")
    assert "gen_ai.conversation.id" not in attributes(alone) and "session.id" not in attributes(alone)
    assert attributes(of_conversation)["gen_ai.conversation.id"] == conversation


async def test_a_compaction_before_a_turn_is_not_one_of_the_turns_provider_calls(traced: Traced) -> None:
    """The summarizer's call made for `context_management` was also counted as the turn's first
    provider call: a child span starting before its turn, and the provider was sent a
    `traceparent` of the request's trace."""
    upstream = MockUpstream(answer)
    async with build_client(make_settings(), MemoryStore(), upstream, tracing=traced.tracing) as c:
        previous = None
        for text in ["Hi, my name is Bob.", "my city is Oslo", "I like trains a lot."]:
            body = {"model": "mock/m", "input": text, "previous_response_id": previous}
            previous = (await c.post("/v1/responses", json=body)).json()["id"]
        manage = [{"type": "compaction", "compact_threshold": 40}]
        body = {
            "model": "mock/m",
            "input": "my dog is Rex",
            "previous_response_id": previous,
            "context_management": manage,
        }
        r = await c.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "compaction"
    turn = traced.spans()[-1]
    calls = [
        s
        for s in traced.exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == turn.context.span_id and s.name.startswith("upstream")
    ]
    assert len(calls) == 1 and calls[0].start_time >= turn.start_time
    summarized = [
        b
        for b, tp in zip(upstream.requests, upstream.traceparents, strict=True)
        if "running summary" in str(b["messages"][0].get("content"))
    ]
    assert summarized and traced.spans("summary")
    asked = [tp for b, tp in zip(upstream.requests, upstream.traceparents, strict=True) if b in summarized]
    assert asked == [None] * len(summarized)  # (its span is its own)


async def test_a_step_of_the_wall_clock_during_a_turn_leaves_its_calls_inside_its_span(
    traced: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's span began at its close's wall-clock time less its (monotonic) length, and its
    provider calls at their own wall-clock times: a step of that clock in between (NTP, a busy
    host) put a call's span before its turn's."""
    real = time.time_ns

    def stepping(body: dict[str, Any]) -> Any:
        monkeypatch.setattr(time, "time_ns", lambda: real() + 10_000_000_000)  # 10 s forward
        return answer(body)

    upstream = MockUpstream(stepping)
    async with build_client(make_settings(), MemoryStore(), upstream, tracing=traced.tracing) as c:
        r = await c.post("/v1/responses", json={"model": "mock/m", "input": "hello"})
    assert r.status_code == 200
    (turn,) = traced.spans()
    calls = [s for s in traced.exporter.get_finished_spans() if s.name.startswith("upstream")]
    assert len(calls) == 1 and calls[0].parent is not None and calls[0].parent.span_id == turn.context.span_id
    assert turn.start_time is not None and calls[0].start_time is not None
    assert turn.start_time <= calls[0].start_time


@pytest.mark.parametrize("sampler", ["always_off", "traceidratio"])
async def test_the_provider_is_told_sampled_only_of_traces_the_gateway_records(
    sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every provider call said "sampled" (`-01`), also in traces the gateway's own sampler
    dropped: a provider honouring it recorded spans under a parent never exported."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    traced = Traced(make_settings())
    upstream = MockUpstream(answer)
    try:
        async with build_client(make_settings(), MemoryStore(), upstream, tracing=traced.tracing) as c:
            for n in range(16):
                body = {"model": "mock/m", "messages": [{"role": "user", "content": f"hi {n}"}]}
                assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        recorded = {f"{s.context.trace_id:032x}" for s in traced.spans()}
    finally:
        traced.close()
    told = [(tp.split("-")[1], tp.endswith("-01")) for tp in upstream.traceparents if tp is not None]
    assert len(told) == 16
    assert [sampled for _, sampled in told] == [trace in recorded for trace, _ in told]
    if sampler == "traceidratio":  # (half of them, by their trace ids: both kinds, for sure)
        assert 0 < len(recorded) < 16
    else:
        assert not recorded


async def test_a_client_that_leaves_fails_its_turn_not_its_provider_call(traced: Traced) -> None:
    """A client gone mid-stream marked the provider's call as failed (status ERROR, `cancelled`),
    counted among the provider's errors."""

    class Slow(MockUpstream):
        async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:  # type: ignore[override]
            async for chunk in super().stream(body, waited=waited):
                yield chunk
                await asyncio.sleep(30)

    async with build_client(make_settings(), MemoryStore(), Slow(answer), tracing=traced.tracing) as c:
        body = {"model": "mock/m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
        for _ in range(500):  # (the turn ends once the gateway sees the client gone)
            if traced.spans():
                break
            await asyncio.sleep(0.02)
    (turn,) = traced.spans()
    (call,) = [s for s in traced.exporter.get_finished_spans() if s.name.startswith("upstream")]
    assert turn.status.status_code == StatusCode.ERROR
    assert call.status.status_code != StatusCode.ERROR and "error.type" not in (call.attributes or {})


def test_a_service_name_in_the_resource_attributes_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """`OTEL_RESOURCE_ATTRIBUTES=service.name=...` was replaced by "gateway"."""
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "service.name=my-llm-gateway,deployment.environment.name=prod"
    )
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    traced = Traced(make_settings())
    try:
        attributes = dict(traced.tracing.tracer_provider.resource.attributes)
    finally:
        traced.close()
    assert attributes["service.name"] == "my-llm-gateway"
    assert attributes["deployment.environment.name"] == "prod"


async def test_the_clients_tracestate_goes_on_with_its_trace(traced: Traced) -> None:
    """W3C Trace Context: a `tracestate` received with a `traceparent` is passed on. It was
    dropped: neither the provider nor the turn's span had it."""
    trace, span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    headers = {
        "traceparent": f"00-{trace}-{span}-01",
        "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
    }
    upstream = MockUpstream(answer)
    body = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}]}
    async with build_client(make_settings(), MemoryStore(), upstream, tracing=traced.tracing) as c:
        assert (await c.post("/v1/chat/completions", json=body, headers=headers)).status_code == 200
        alone = {"tracestate": "congo=t61rcWkgMzE"}  # (without a traceparent it is no one's: dropped)
        assert (await c.post("/v1/chat/completions", json=body, headers=alone)).status_code == 200
    assert upstream.tracestates == ["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", None]
    assert upstream.traceparents[0] is not None and upstream.traceparents[0].startswith(f"00-{trace}-")
    first = next(s for s in traced.spans() if f"{s.context.trace_id:032x}" == trace)
    assert first.context.trace_state.to_header() == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def test_only_a_well_formed_tracestate_becomes_a_header() -> None:
    from gateway.upstream.base import TRACEPARENT, TRACESTATE, take_trace_headers

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert take_trace_headers({"a": 1, TRACEPARENT: parent, TRACESTATE: "k=v"}) == (
        {"a": 1},
        {"traceparent": parent, "tracestate": "k=v"},
    )
    assert take_trace_headers({TRACEPARENT: parent, TRACESTATE: "k=v\r\nx-evil: 1"})[1] == {
        "traceparent": parent
    }
    assert take_trace_headers({TRACESTATE: "k=v"}) == ({}, {})  # (no traceparent: nothing)
    # Not W3C list members (OpenTelemetry drops them from the span too): not passed on.
    many = ",".join(f"k{n}=v" for n in range(33))
    for bad in ("UPPER=val", "k=a=b", many, "k=", "x" * 513):
        assert take_trace_headers({TRACEPARENT: parent, TRACESTATE: bad})[1] == {"traceparent": parent}, bad
    tenant = "t61@rojo=00f067aa0ba902b7, congo=t61rcWkgMzE"
    assert take_trace_headers({TRACEPARENT: parent, TRACESTATE: tenant})[1]["tracestate"] == tenant
