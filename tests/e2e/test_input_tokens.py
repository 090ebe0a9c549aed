"""Counting before sending through the official SDK (`client.responses.input_tokens.count`), and
`truncation`, against `gateway serve` in front of the mock provider (a 1200-token window)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import GatewayProcess, sdk, write_config
from tests.mockserver import MockServer

TOOL: Any = {"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": False}
LONG = "Tell me about the weather in the mountains and by the sea, in some detail. " * 5


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, upstream_server: MockServer) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("count")
    extra = '\n[models."mock/m"]\ncontext_window = 1200\n'
    proc = GatewayProcess(write_config(root / "gateway.toml", upstream_server.url, extra=extra), root / "var")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def context_of(gateway: GatewayProcess, rid: str) -> dict[str, Any]:
    return dict(httpx.get(f"{gateway.url}/v1/responses/{rid}").json()["gateway"]["context"])


def test_the_count_is_what_the_next_turn_sends(small: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(small)
    previous: Any = openai.omit
    by = set()
    for n in range(8):
        turn: dict[str, Any] = {"model": "mock/m", "input": f"{n}: {LONG}", "previous_response_id": previous}
        turn["instructions"] = "Be brief."
        # (tools once calibrated: the mock provider does not count them, so nothing is learned then)
        turn["tools"] = [TOOL] if n >= 5 else openai.omit
        counted = client.responses.input_tokens.count(**turn)
        assert counted.object == "response.input_tokens"
        sent = len(upstream.requests)
        r = client.responses.create(**turn)
        assert len(upstream.requests) == sent + 1  # the count asked the provider nothing
        context = context_of(small, r.id)
        total, calibration = context["tokens"]["total"], context["calibration"]
        gateway = counted.to_dict()["gateway"]
        assert gateway["tokens"] == context["tokens"]  # the very window the turn sent
        by.add(gateway["counted_by"])
        if gateway["counted_by"] == "calibration":  # (the snapshot's figures are rounded)
            expected = math.ceil(calibration["ratio"] * total + calibration["overhead"])
            assert abs(counted.input_tokens - expected) <= 1, (counted, calibration, total)
        else:  # nothing learned yet: the gateway's own count
            assert counted.input_tokens == total
        previous = r.id
    assert context["truncated"] > 0 and context["tokens"]["tools"] > 0  # the window cut, the count too
    assert by == {"gateway", "calibration"}  # the mock provider reports usage: it is learned from


def test_truncation_disabled_refuses_when_over_and_works_when_under(
    small: GatewayProcess, upstream: MockServer
) -> None:
    client = sdk(small)
    r = client.responses.create(model="mock/m", input="Hi, I am Bob.", truncation="disabled")
    assert r.truncation == "disabled"
    refused = None
    for n in range(10):
        turn: dict[str, Any] = {"model": "mock/m", "input": f"{n}: {LONG}", "previous_response_id": r.id}
        try:
            r = client.responses.create(**turn, truncation="disabled")
        except openai.BadRequestError as exc:
            refused = exc
            break
        assert context_of(small, r.id)["truncated"] == 0
    assert refused is not None and n >= 2
    assert refused.code == "context_length_exceeded" and refused.param == "input"
    assert refused.body["message"].startswith(  # type: ignore[index]
        "Your input exceeds the context window of this model. Please adjust your input and try again."
    )
    with pytest.raises(openai.BadRequestError) as counted:
        client.responses.input_tokens.count(**turn, truncation="disabled")
    assert counted.value.code == "context_length_exceeded"
    sent = len(upstream.requests)
    assert client.responses.input_tokens.count(**turn).input_tokens > 0  # auto, the default: fitted
    assert client.responses.create(**turn).truncation == "auto"
    assert len(upstream.requests) == sent + 1


@pytest.mark.parametrize("value", ["sometimes", "Disabled"])
def test_another_truncation_is_a_400_naming_it(
    small: GatewayProcess, upstream: MockServer, value: str
) -> None:
    client = sdk(small)
    for call in (client.responses.create, client.responses.input_tokens.count):
        with pytest.raises(openai.BadRequestError) as caught:
            call(model="mock/m", input="hi", truncation=value)  # type: ignore[operator, arg-type]
        assert caught.value.param == "truncation"
    assert upstream.requests == []
