"""`[tracing]` end to end: a real `gateway serve` exports its GenAI spans over OTLP/HTTP to a
loopback receiver while it runs, and its GenAI metrics when it stops."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

pytest.importorskip("opentelemetry.proto")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import GatewayProcess, write_config
from tests.mockserver import MockServer


class Receiver:
    """An OTLP/HTTP endpoint that keeps every POST (path, body) and answers 200."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver.lock:
                    receiver.posts.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def bodies(self, path: str) -> list[bytes]:
        with self.lock:
            return [body for p, body in self.posts if p == path]

    def wait_for(self, path: str, needle: bytes, timeout: float = 15.0) -> bytes:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [body for body in self.bodies(path) if needle in body]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no POST to {path} with {needle!r}: {[p for p, _ in self.posts]}")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.thread.start()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def test_serve_exports_genai_spans_and_metrics_over_otlp_http(
    tmp_path: Path, upstream: MockServer, receiver: Receiver
) -> None:
    extra = f'[tracing]\nendpoint = "{receiver.url}"\nservice_name = "gateway-e2e"\n'
    config = write_config(tmp_path / "gateway.toml", upstream.url, extra=extra)
    # Spans leave in batches: at most 50 ms after they end, not the SDK's 5 s.
    gateway = GatewayProcess(config, tmp_path / "var", env={"OTEL_BSP_SCHEDULE_DELAY": "50"}).start()
    try:
        body = {
            "model": "mock/m",
            "conversation_id": "traced-1",
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        raw = receiver.wait_for("/v1/traces", b"traced-1")
    finally:
        gateway.stop()
    assert b"gateway-e2e" in raw
    request = ExportTraceServiceRequest.FromString(raw)
    (resource_spans,) = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "gateway-e2e"
    (span,) = [s for scope in resource_spans.scope_spans for s in scope.spans]
    attributes = {a.key: a.value for a in span.attributes}
    assert span.name == "chat m" and span.kind == span.SPAN_KIND_CLIENT
    assert attributes["gen_ai.conversation.id"].string_value == "traced-1"
    assert attributes["gen_ai.response.id"].string_value == r.json()["id"]
    assert attributes["server.port"].int_value == int(upstream.url.rsplit(":", 1)[1])
    # The metrics went at shutdown (their reader exports every 60 s, and once more when stopped).
    raw_metrics = receiver.wait_for("/v1/metrics", b"gen_ai.client.token.usage", timeout=5)
    metrics = ExportMetricsServiceRequest.FromString(raw_metrics)
    names = {m.name for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert names == {"gen_ai.client.token.usage", "gen_ai.client.operation.duration"}
