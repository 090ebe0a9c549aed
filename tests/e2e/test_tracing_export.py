"""`[tracing]` end to end: one `gateway serve` exports its GenAI spans and metrics over OTLP/HTTP
to a loopback receiver while it runs, and every attribute is read back from the protobufs: a
chat turn continuing its client's trace (and sending it on to the provider), a stream, a
provider's refusal refitted and retried, turns that fail, the summarizer's calls. With tracing
off, opentelemetry is never imported."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

pytest.importorskip("opentelemetry.proto")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from bench.harness import OtlpReceiver
from gateway.server import running_in_thread
from gateway.upstream.base import approx_tokens
from tests.conftest import REPO, GatewayProcess, write_config
from tests.mockserver import MockServer

N_CTX = 512  # the window of the `refuses-*` models
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(OtlpReceiver):
    """The OTLP/HTTP receiver, reading what it got as spans and metric points."""

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """Every span received so far, with its resource's attributes."""
        found = []
        for raw in self.bodies("/v1/traces"):
            for resource_spans in ExportTraceServiceRequest.FromString(raw).resource_spans:
                resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
                found += [(resource, s) for scope in resource_spans.scope_spans for s in scope.spans]
        return found

    def metrics(self) -> dict[str, list[Any]]:
        """Every histogram data point received so far, by metric name."""
        points: dict[str, list[Any]] = {}
        for raw in self.bodies("/v1/metrics"):
            for resource_metrics in ExportMetricsServiceRequest.FromString(raw).resource_metrics:
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        points.setdefault(metric.name, []).extend(metric.histogram.data_points)
        return points


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes(span: Span) -> dict[str, Any]:
    return {a.key: value_of(a.value) for a in span.attributes}


def wait_for(what: Callable[[], Any], description: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"never came: {description}")


class RefusingServer(MockServer):
    """The mock upstream, whose `refuses-*` models refuse a prompt over N_CTX tokens (as it
    counts them) with llama.cpp's 400 `exceed_context_size_error`."""

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        n = approx_tokens(body.get("messages"))
        if not str(body.get("model")).startswith("refuses") or n <= N_CTX:
            return await super().chat(request)
        with self._lock:
            self.requests.append(body)
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
        message = f"request ({n} tokens) exceeds the available context size ({N_CTX} tokens)"
        error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
        refusal = {"error": {**error, "n_prompt_tokens": n, "n_ctx": N_CTX}}
        return Response(orjson.dumps(refusal), status_code=400, media_type="application/json")


class Traced:
    """The module's gateway, its upstream and the receiver its spans and metrics go to."""

    def __init__(self, gateway: GatewayProcess, upstream: RefusingServer, receiver: Receiver) -> None:
        self.gateway, self.upstream, self.receiver = gateway, upstream, receiver

    def chat(self, cid: str, text: str, model: str = "mock/m", **extra: Any) -> httpx.Response:
        body = {"model": model, "conversation_id": cid, "messages": [{"role": "user", "content": text}]}
        return httpx.post(f"{self.gateway.url}/v1/chat/completions", json={**body, **extra}, timeout=10)

    def turn(self, answer: httpx.Response) -> Span:
        """The span of the turn that gave `answer`, once exported."""
        response_id = answer.headers["x-response-id"]

        def find() -> list[Span]:
            return [
                s
                for _, s in self.receiver.spans()
                if attributes(s).get("gateway.operation") == "turn"
                and attributes(s).get("gen_ai.response.id") == response_id
            ]

        (span,) = wait_for(find, f"the span of {response_id}")
        return span

    def children(self, parent: Span, count: int) -> dict[str, list[Span]]:
        """The spans whose parent is `parent` (once `count` of them came), by name."""

        def find() -> list[Span]:
            found = [s for _, s in self.receiver.spans() if s.parent_span_id == parent.span_id]
            return found if len(found) >= count else []

        children: dict[str, list[Span]] = {}
        for span in sorted(wait_for(find, f"{count} child spans"), key=lambda s: s.start_time_unix_nano):
            assert span.trace_id == parent.trace_id
            children.setdefault(span.name, []).append(span)
        return children


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    root = tmp_path_factory.mktemp("traced")
    receiver = Receiver().__enter__()
    upstream = RefusingServer()
    extra = f"""
[tracing]
endpoint = "{receiver.url}"
service_name = "gateway-e2e"

[context]
strategy = "summarize"
summary_model = "mock/m"

[models."mock/small"]
context_window = 1024

[models."mock/refuses-once"]
context_window = 4096

[models."mock/refuses-always"]
context_window = 4096
"""
    # Spans leave in batches at most 50 ms after they end (not the SDK's 5 s), metrics every 200 ms.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_METRIC_EXPORT_INTERVAL": "200"}
    with running_in_thread(upstream.app()) as url:
        upstream.url = url
        config = write_config(root / "gateway.toml", url, extra=extra)
        gateway = GatewayProcess(config, root / "var", env=env).start()
        try:
            yield Traced(gateway, upstream, receiver)
        finally:
            gateway.stop()
            receiver.__exit__()


def upstream_port(traced: Traced) -> int:
    return int(traced.upstream.url.rsplit(":", 1)[1])


def test_a_chat_turn_continues_the_clients_trace_with_every_attribute(traced: Traced) -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    body = {
        "model": "mock/m",
        "conversation_id": "traced-1",
        "max_tokens": 64,
        "temperature": 0.5,
        "messages": [{"role": "user", "content": "hi, my name is Ada"}],
    }
    r = httpx.post(
        f"{traced.gateway.url}/v1/chat/completions",
        json=body,
        headers={"traceparent": traceparent, "tracestate": "vendor=opaque-1"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    span = traced.turn(r)
    resource = next(res for res, s in traced.receiver.spans() if s.span_id == span.span_id)
    assert resource["service.name"] == "gateway-e2e" and resource["service.version"]
    # The client's trace, continued: its span is the turn's parent.
    assert span.trace_id.hex() == CLIENT_TRACE and span.parent_span_id.hex() == CLIENT_SPAN
    assert span.name == "chat m" and span.kind == Span.SPAN_KIND_CLIENT
    assert span.status.code == Status.STATUS_CODE_UNSET
    facts = attributes(span)
    usage = r.json()["usage"]
    assert {key: facts[key] for key in facts if not key.startswith("gateway.")} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "mock",
        "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.response.model": "m",
        "gen_ai.response.id": r.json()["id"],
        "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.conversation.id": "traced-1",
        "session.id": "traced-1",
        "server.address": "127.0.0.1",
        "server.port": upstream_port(traced),
    }
    assert facts["gateway.operation"] == "turn" and facts["gateway.outcome"] == "complete"
    assert facts["gateway.status"] == 200 and facts["gateway.request.model"] == "mock/m"
    assert facts["gateway.messages.sent"] == 1 and facts["gateway.window.truncated"] == 0
    # Its steps: the window plan, the provider's call, the commit, one after the other.
    children = traced.children(span, 3)
    assert list(children) == ["plan window", "upstream mock", "commit"]
    (plan,), (call,), (commit,) = children.values()
    assert span.start_time_unix_nano <= plan.start_time_unix_nano <= plan.end_time_unix_nano
    assert plan.end_time_unix_nano <= call.start_time_unix_nano <= call.end_time_unix_nano
    assert call.end_time_unix_nano <= commit.start_time_unix_nano <= commit.end_time_unix_nano
    assert commit.end_time_unix_nano <= span.end_time_unix_nano
    planned = attributes(plan)
    assert planned["gateway.window.tokens"] == facts["gateway.window.tokens"] > 0
    assert planned["gateway.window.budget"] == facts["gateway.window.budget"]
    assert planned["gateway.window.truncated"] == 0 and planned["gateway.messages.sent"] == 1
    assert planned["gateway.window.context_window"] > planned["gateway.window.budget"]
    assert planned["gateway.calibration.ratio"] > 0 and planned["gateway.calibration.samples"] >= 0
    assert call.kind == Span.SPAN_KIND_CLIENT and "error.type" not in attributes(call)
    assert attributes(call)["server.port"] == upstream_port(traced)
    # The provider was told the same trace, with the call's span as its parent.
    sent = traced.upstream.headers[-1]["traceparent"]
    assert sent == f"00-{CLIENT_TRACE}-{call.span_id.hex()}-01"
    assert traced.upstream.headers[-1]["tracestate"] == "vendor=opaque-1"  # (the client's, passed on)


def test_a_turn_without_a_traceparent_starts_a_trace_the_provider_is_told(traced: Traced) -> None:
    r = traced.chat("traced-root", "hello")
    assert r.status_code == 200
    span = traced.turn(r)
    assert not span.parent_span_id and span.trace_id.hex() != CLIENT_TRACE
    (call,) = traced.children(span, 3)["upstream mock"]
    assert traced.upstream.headers[-1]["traceparent"] == f"00-{span.trace_id.hex()}-{call.span_id.hex()}-01"


def test_a_stream_has_its_time_to_first_chunk(traced: Traced) -> None:
    r = traced.chat("traced-stream", "count to three", stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    span = traced.turn(r)
    facts = attributes(span)
    assert (
        facts["gen_ai.request.stream"] is True and facts["gen_ai.response.id"] == r.headers["x-response-id"]
    )
    assert facts["gen_ai.response.finish_reasons"] == ["stop"] and facts["gen_ai.response.model"] == "m"
    assert facts["gen_ai.usage.input_tokens"] > 0 and facts["gen_ai.usage.output_tokens"] > 0
    whole = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert 0 < facts["gen_ai.response.time_to_first_chunk"] <= whole
    children = traced.children(span, 3)
    (call,) = children["upstream mock"]
    assert (
        0
        < attributes(call)["gen_ai.response.time_to_first_chunk"]
        <= facts["gen_ai.response.time_to_first_chunk"]
    )
    assert "commit" in children and "plan window" in children


def test_a_refusal_is_a_failed_call_and_the_refitted_retry_answers(traced: Traced) -> None:
    """The provider refuses the prompt as too long for its window (llama.cpp's 400): the
    gateway refits the window to what it said and asks again, in the same turn."""
    paragraph = "the quick brown fox jumps over the lazy dog by the river " * 20  # ~250 tokens
    r = traced.chat("traced-refit", f"0: {paragraph}", model="mock/refuses-once", max_tokens=16)
    assert r.status_code == 200, r.text
    # Planned for the 4096 configured, the second turn is over the provider's 512.
    r = traced.chat("traced-refit", f"1: {paragraph}", model="mock/refuses-once", max_tokens=16)
    assert r.status_code == 200, r.text
    span = traced.turn(r)
    facts = attributes(span)
    assert "error.type" not in facts and facts["gateway.outcome"] == "complete"
    assert span.status.code == Status.STATUS_CODE_UNSET
    calls = traced.children(span, 4)["upstream mock"]
    assert len(calls) == 2
    refused, retried = (attributes(c) for c in calls)
    assert refused["error.type"] == "400" and refused["gateway.upstream.context_refused"] is True
    assert calls[0].status.code == Status.STATUS_CODE_ERROR
    assert "error.type" not in retried and calls[1].status.code == Status.STATUS_CODE_UNSET
    # The retry sent less: what the window was refitted to.
    assert facts["gateway.window.truncated"] > 0
    # (the turn's two calls: a summary of what the refit left out may be asked after them)
    turns = [
        h for r, h in zip(traced.upstream.requests, traced.upstream.headers, strict=True) if r["model"] != "m"
    ]
    assert [h["traceparent"] for h in turns[-2:]] == [
        f"00-{span.trace_id.hex()}-{c.span_id.hex()}-01" for c in calls
    ]


def test_a_refusal_no_window_holds_fails_the_turn_with_its_error_type(traced: Traced) -> None:
    r = traced.chat("traced-refused", "word " * 800, model="mock/refuses-always")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    span = traced.turn(r)
    facts = attributes(span)
    assert facts["error.type"] == "context_length_exceeded" and facts["gateway.status"] == 400
    assert span.status.code == Status.STATUS_CODE_ERROR and "context window" in span.status.message
    assert "gen_ai.response.finish_reasons" not in facts and "gen_ai.usage.output_tokens" not in facts
    children = traced.children(span, 2)
    assert "commit" not in children
    (call,) = children["upstream mock"]
    assert attributes(call)["error.type"] == "400"


def test_a_provider_error_fails_the_turn_with_its_error_type(traced: Traced) -> None:
    traced.upstream.mode = "error500"
    try:
        r = traced.chat("traced-failed", "hello")
    finally:
        traced.upstream.mode = "normal"
    assert r.status_code == 502
    span = traced.turn(r)
    facts = attributes(span)
    assert facts["error.type"] == "500" and facts["gateway.outcome"] == "error"
    assert facts["gen_ai.response.id"] == r.headers["x-response-id"]
    assert span.status.code == Status.STATUS_CODE_ERROR
    (call,) = traced.children(span, 2)["upstream mock"]
    assert attributes(call)["error.type"] == "500"


def test_the_summarizers_calls_are_spans_of_their_own(traced: Traced) -> None:
    filler = "some filler words to fill the window " * 12
    for i in range(8):
        r = traced.chat("traced-summary", f"turn {i}: {filler}", model="mock/small")
        assert r.status_code == 200

    def summaries() -> list[Span]:
        return [
            s
            for _, s in traced.receiver.spans()
            if attributes(s).get("gateway.operation") == "summary"
            and attributes(s).get("gen_ai.conversation.id") == "traced-summary"
        ]

    span = wait_for(summaries, "a summarizer call's span")[0]
    facts = attributes(span)
    assert span.name == "chat m" and span.kind == Span.SPAN_KIND_CLIENT
    assert facts["gen_ai.operation.name"] == "chat" and facts["gen_ai.provider.name"] == "mock"
    assert facts["gen_ai.request.model"] == "m" and facts["gen_ai.request.max_tokens"] > 0
    assert facts["gen_ai.response.model"] == "m" and facts["gen_ai.response.id"]
    assert facts["gen_ai.usage.input_tokens"] > 0 and facts["gen_ai.usage.output_tokens"] > 0
    assert facts["session.id"] == "traced-summary" and facts["server.port"] == upstream_port(traced)
    assert "error.type" not in facts
    # A turn after it sends the summary: its plan says so.
    r = traced.chat("traced-summary", "and one more", model="mock/small")
    assert r.status_code == 200
    turn = traced.turn(r)
    (plan,) = traced.children(turn, 3)["plan window"]
    planned = attributes(plan)
    assert planned["gateway.summary.version"] >= 1 and planned["gateway.summary.covers_messages"] > 0
    assert planned["gateway.messages.stored"] > planned["gateway.messages.sent"]


def test_the_genai_metrics_are_exported(traced: Traced) -> None:
    for text in ("hello", "again"):  # two streams of its own (the module's others may run elsewhere)
        r = traced.chat("traced-metrics", text, stream=True)
        assert r.status_code == 200
    traced.upstream.mode = "error500"
    try:
        assert traced.chat("traced-metrics-failed", "hello").status_code == 502
    finally:
        traced.upstream.mode = "normal"
    wanted = {
        "gen_ai.client.token.usage",
        "gen_ai.client.operation.duration",
        "gen_ai.client.operation.time_to_first_chunk",
    }

    def dimensions(points: dict[str, list[Any]]) -> set[tuple[tuple[str, Any], ...]]:
        return {
            tuple(sorted((a.key, value_of(a.value)) for a in p.attributes))
            for p in points["gen_ai.client.operation.duration"]
        }

    def exported() -> dict[str, list[Any]] | None:
        """The newest export once it holds this test's turns (cumulative: earlier ones too)."""
        points = traced.receiver.metrics()
        if not points.keys() >= wanted or not any(("error.type", "500") in d for d in dimensions(points)):
            return None
        firsts = points["gen_ai.client.operation.time_to_first_chunk"]
        return points if max(p.count for p in firsts) >= 2 else None

    points = wait_for(exported, "the GenAI metrics of two streams and a failed turn")
    usage = {p.attributes[-1].value.string_value for p in points["gen_ai.client.token.usage"]}
    assert usage >= {"input", "output"}
    assert any(
        dict(d).get("gen_ai.request.model") == "m" and dict(d).get("server.port") == upstream_port(traced)
        for d in dimensions(points)
    )
    assert all("gen_ai.conversation.id" not in dict(d) for d in dimensions(points))


def test_with_tracing_off_opentelemetry_is_never_imported(tmp_path: Path) -> None:
    """A gateway built without `[tracing]` serves a turn (and a stream) without importing it."""
    script = """
import asyncio, sys
import httpx
from gateway.app import create_app
from gateway.config import load_settings

async def main():
    app = create_app(load_settings(sys.argv[1], environ={}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
            for stream in (False, True):
                body = {"model": "demo", "conversation_id": "off", "stream": stream,
                        "messages": [{"role": "user", "content": "hello"}]}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
    assert app.state.tracing.enabled is False
    loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
    assert not loaded, loaded

asyncio.run(main())
"""
    config = tmp_path / "gateway.toml"
    data = tmp_path / "var"
    config.write_text(
        f'default_provider = "demo"\n[storage]\ndata_dir = "{data}"\n[providers.demo]\nkind = "demo"\n'
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(config)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
