"""Schemathesis over the schema served at /openapi.json, against a real `gateway serve` (JSONL
store, the built-in demo provider so every well-formed turn can complete): for generated valid
and invalid input, no response is a 5xx, every status is one the schema documents, and every
JSON body matches its documented shape (errors in OpenAI's error shape)."""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.api.openapi import build_schema
from gateway.ids import is_valid_response_id
from tests.conftest import GatewayProcess


def _import_every_gateway_module() -> None:
    """Hypothesis draws some strings from the constants of the local modules loaded in the
    process: whatever ran before in the same process (another file's tests, under xdist) changed
    what these derandomized tests generate. With every module of gateway loaded first, they
    generate the same cases however they are run."""
    for module in pkgutil.walk_packages(importlib.import_module("gateway").__path__, "gateway."):
        if module.name != "gateway.__main__":
            try:
                importlib.import_module(module.name)
            except ImportError:  # an optional dependency that is not installed
                pass


_import_every_gateway_module()
schema = schemathesis.openapi.from_dict(build_schema())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("openapi")
    config = root / "gateway.toml"
    config.write_text(
        """default_provider = "demo"

[server]
max_body_bytes = 200_000
body_timeout = 2

[storage]
lock_timeout = 2

[sessions]
idle_after = "0"

[providers.demo]
kind = "demo"
"""
    )
    proc = GatewayProcess(config, root / "var").start()
    yield proc
    proc.stop()


def test_each_operation_is_a_test_of_its_own(request: pytest.FixtureRequest) -> None:
    """Under xdist only distinct node ids are scheduled: one per operation, or most never run."""
    fuzzed = [i.nodeid for i in request.session.items if "test_no_5xx_and_documented_responses" in i.nodeid]
    operations = list(schema.get_all_operations())
    assert len(operations) >= 20
    assert len(set(fuzzed)) == len(fuzzed) == len(operations)


def test_the_served_schema_is_the_one_fuzzed(gateway: GatewayProcess) -> None:
    served = httpx.get(f"{gateway.url}/openapi.json")
    assert served.status_code == 200
    assert served.headers["content-type"] == "application/json"
    assert served.json() == build_schema()
    assert {"/v1/chat/completions", "/v1/conversations/{conversation_id}/items", "/v1/responses"} <= set(
        served.json()["paths"]
    )


@schema.parametrize()
@settings(
    max_examples=int(os.environ.get("OPENAPI_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_5xx_and_documented_responses(case: schemathesis.Case, gateway: GatewayProcess) -> None:
    case.call_and_validate(base_url=gateway.url, checks=CHECKS, timeout=10)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_schema_valid_turns_complete_and_continue(path: str, gateway: GatewayProcess) -> None:
    """Schema-valid turns only (random roles, content parts, tool calls, feedback flags, ids):
    most complete with 200, none is a 5xx, and each stored conversation can be continued."""
    statuses: Counter[int] = Counter()
    continued: list[str] = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(schema[path]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case: schemathesis.Case) -> None:
        reply = case.call(base_url=gateway.url, timeout=10)
        assert reply.status_code < 500, reply.text
        body = reply.json() if "json" in reply.headers.get("content-type", "") else {}
        sent = case.body.get("input") if isinstance(case.body, dict) else None
        if any(isinstance(item, dict) and item.get("type") == "compaction" for item in sent or ()):
            return  # a generated compaction item is schema-valid, but only the gateway's own resolve
        statuses[reply.status_code] += 1
        cid = body.get("conversation_id") or (body.get("conversation") or {}).get("id")
        if reply.status_code == 200 and cid:
            continued.append(cid)

    run()
    assert statuses[200] >= 10 or statuses[200] * 4 >= statuses.total(), statuses
    for cid in set(continued):
        more = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={
                "model": "demo",
                "conversation_id": cid,
                "messages": [{"role": "user", "content": "and now?"}],
            },
            timeout=10,
        )
        assert more.status_code in (200, 400), more.text  # 400 only for a window the fuzz filled
        assert httpx.get(f"{gateway.url}/v1/conversations/{cid}/context").status_code == 200


def test_the_data_dir_holds_only_valid_files(gateway: GatewayProcess) -> None:
    """After the fuzzing (or, run alone, after turns of its own), every stored file is inside
    data_dir and valid: JSON records, and index lines that are response ids or JSON markers."""
    root = Path(gateway.data_dir).resolve()
    for n in range(20):  # whatever ran before: at least these turns are stored
        r = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={
                "model": "demo",
                "conversation_id": f"files-{n % 4}",
                "messages": [{"role": "user", "content": f"{n}"}],
            },
            timeout=10,
        )
        assert r.status_code == 200, r.text
    assert len(list((root / "logs" / "responses").glob("*.jsonl"))) >= 20
    checked = 0
    for file in root.rglob("*"):
        assert file.resolve().is_relative_to(root)
        if file.suffix != ".jsonl":
            continue
        index = file.parent.name == "conversations"
        for line in file.read_bytes().splitlines():
            if index and not line.startswith(b"{"):
                assert is_valid_response_id(line.decode()), (file, line)
            else:
                orjson.loads(line)
            checked += 1
    assert checked >= 20 * 4  # request, context, response and commit records at least
