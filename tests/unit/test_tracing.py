"""`[tracing]`: when it is on and where it exports (the gateway's key, then the standard OTEL_
variables), what its span attributes are made of, and what happens without the SDK installed."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from gateway.app import tracing_for
from gateway.config import ProviderSettings, TracingSettings, load_settings
from gateway.exceptions import ConfigError, UpstreamStatusError, UpstreamTimeout
from gateway.services.turn import TurnOutcome
from gateway.tracing import (
    ExportTargets,
    Tracing,
    content_attributes,
    error_type,
    export_targets,
    request_attributes,
    server_of,
)
from tests.conftest import REPO

EMPTY = REPO / "tests" / "empty.toml"


def test_off_unless_an_endpoint_is_configured() -> None:
    assert export_targets(TracingSettings(), {}) is None
    settings = load_settings(EMPTY, environ={})
    assert settings.tracing == TracingSettings(endpoint="", service_name="gateway", capture_content=False)
    assert type(tracing_for(settings, environ={})) is Tracing  # off: does nothing


def test_the_gateway_key_comes_before_the_standard_variables() -> None:
    standard = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/v1/traces",
    }
    ours = TracingSettings(endpoint="http://127.0.0.1:4318")
    assert export_targets(ours, standard) == ExportTargets(
        "http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/metrics"
    )
    # Without it: a signal's own variable (a whole URL), else the common base.
    assert export_targets(TracingSettings(), standard) == ExportTargets(
        "http://traces:4318/v1/traces", "http://collector:4318/v1/metrics"
    )
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector"}
    assert export_targets(TracingSettings(), base) == ExportTargets(
        "https://collector/v1/traces", "https://collector/v1/metrics"
    )
    # Metrics only where a metrics endpoint is known, and only if wanted.
    only_traces = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/v1/traces"}
    assert export_targets(TracingSettings(), only_traces) == ExportTargets(
        "http://traces:4318/v1/traces", None
    )
    assert export_targets(TracingSettings(endpoint="http://c:4318", metrics=False), {}) == ExportTargets(
        "http://c:4318/v1/traces", None
    )
    # The SDK's own off switch.
    assert export_targets(ours, {"OTEL_SDK_DISABLED": "true"}) is None


def test_every_key_takes_its_environment_variable() -> None:
    settings = load_settings(
        EMPTY,
        environ={
            "GATEWAY_TRACING__ENDPOINT": "http://otel.internal:4318/",
            "GATEWAY_TRACING__SERVICE_NAME": "gw-eu",
            "GATEWAY_TRACING__CAPTURE_CONTENT": "true",
            "GATEWAY_TRACING__METRICS": "false",
        },
    )
    assert settings.tracing == TracingSettings(
        endpoint="http://otel.internal:4318", service_name="gw-eu", capture_content=True, metrics=False
    )
    with pytest.raises(
        ConfigError, match=r"^config error: tracing.endpoint: must be an http:// or https:// URL"
    ):
        load_settings(EMPTY, environ={"GATEWAY_TRACING__ENDPOINT": "collector:4318"})


def test_configured_without_the_sdk_warns_and_runs_untraced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "gateway.otel", None)  # as if opentelemetry were not installed
    settings = load_settings(EMPTY, environ={"GATEWAY_TRACING__ENDPOINT": "http://127.0.0.1:4318"})
    with caplog.at_level(logging.WARNING, logger="gateway"):
        tracing = tracing_for(settings, environ={})
    assert type(tracing) is Tracing
    (record,) = caplog.records
    assert "tracing is configured (http://127.0.0.1:4318/v1/traces)" in record.getMessage()
    assert f"{sys.executable} -m pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http" in (
        record.getMessage()
    )


def test_server_address_and_port_of_a_provider() -> None:
    assert server_of(ProviderSettings(kind="openai", base_url="https://api.openai.com/v1")) == (
        "api.openai.com",
        443,
    )
    assert server_of(ProviderSettings(kind="openai", base_url="http://127.0.0.1:11434/v1")) == (
        "127.0.0.1",
        11434,
    )
    assert server_of(ProviderSettings(kind="demo")) is None  # in process
    assert server_of(ProviderSettings(kind="litellm")) is None  # litellm's own default


def test_error_type_of_each_ending() -> None:
    assert error_type("complete", None) is None
    assert error_type("error", UpstreamTimeout("slow")) == "upstream_timeout"
    assert error_type("error", UpstreamStatusError("busy", upstream_status=503)) == "503"
    assert error_type("disconnected", None) == "client_disconnected"
    assert error_type("cancelled", None) == "cancelled"
    assert error_type("error", None) == "_OTHER"  # an unexpected exception (a 500)
    # An error the provider reported inside its 200 stream: its code, not the gateway's 502.
    from gateway.upstream.openai import UpstreamErrorEvent

    in_band = UpstreamErrorEvent("Provider 'p' reported an error", upstream_status=502)
    assert error_type("error", in_band) == "upstream_error"


def test_request_parameters_as_the_conventions_name_them() -> None:
    body = {"max_completion_tokens": 64, "temperature": 1, "top_p": 0.5, "seed": 7, "n": 2, "stop": "END"}
    assert request_attributes(body) == {
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 1.0,
        "gen_ai.request.top_p": 0.5,
        "gen_ai.request.seed": 7,
        "gen_ai.request.choice.count": 2,
        "gen_ai.request.stop_sequences": ["END"],
    }
    # Values of the wrong kind are left out, never guessed at.
    assert request_attributes({"temperature": "hot", "max_tokens": True, "n": 1}) == {}


def _outcome(**fields: object) -> TurnOutcome:
    base: dict[str, object] = {
        "response_id": "m-abc",
        "conversation_id": "c",
        "model": "m",
        "provider": "p",
        "stream": False,
        "committed": True,
        "message": None,
        "finish_reason": None,
        "created": None,
        "new_messages": 1,
        "sent_messages": 1,
        "elapsed_ms": 1.0,
        "usage": None,
        "timings": None,
        "window_tokens": None,
        "budget": None,
        "truncated": None,
        "summary_version": None,
        "upstream_truncated": False,
    }
    return TurnOutcome(**{**base, **fields})  # type: ignore[arg-type]


def test_content_follows_the_conventions_message_parts() -> None:
    sent = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"at": "y"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
    ]
    answer = {"role": "assistant", "content": "A cat."}
    content = content_attributes(
        _outcome(upstream_body={"messages": sent}, message=answer, finish_reason="stop")
    )
    assert json.loads(str(content["gen_ai.input.messages"])) == [
        {
            "role": "user",
            "parts": [
                {"type": "text", "content": "what is this?"},
                {"type": "uri", "modality": "image", "uri": "https://x/y.png"},
            ],
        },
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "call_1", "name": "look", "arguments": {"at": "y"}}],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "a cat"}]},
    ]
    assert json.loads(str(content["gen_ai.output.messages"])) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "A cat."}], "finish_reason": "stop"}
    ]
    # A turn that was not answered: the input only.
    assert content_attributes(_outcome(upstream_body={"messages": sent})).keys() == {"gen_ai.input.messages"}
