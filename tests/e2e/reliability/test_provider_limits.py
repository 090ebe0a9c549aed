"""A provider that sends an endless head or drips its answer, against `gateway serve`: a 32 MiB
header is a prompt 502 while `/healthz` keeps answering and the gateway's memory stays flat; an
answer dripped a byte a second is a 504 at its 6 s `timeout`, streamed or not; either way the
provider's connection is closed, nothing is retried, and the conversation's next turn is a 200."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import GatewayProcess
from tests.e2e.reliability.conftest import Conversation, gateway_config, wait_for
from tests.e2e.reliability.faultserver import FaultServer, drip, huge_head

MIB = 1024 * 1024
SLOW = """
[providers.slow]
kind = "openai"
base_url = "{url}/v1"
timeout = 6
retries = 0
"""


@pytest.fixture(scope="module")
def slow_gw(tmp_path_factory: pytest.TempPathFactory, fault_server: FaultServer) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("provider-limits")
    extra = SLOW.format(url=fault_server.url)
    proc = GatewayProcess(gateway_config(root / "gateway.toml", fault_server.url, extra=extra), root / "var")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and at its peak (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def test_a_32_mib_header_is_a_prompt_502_with_flat_memory_and_the_loop_free(
    slow_gw: GatewayProcess, fault: FaultServer
) -> None:
    assert slow_gw.proc is not None
    pid = slow_gw.proc.pid
    convo = Conversation(slow_gw, fault, "huge-head")
    convo.ok("hello", model="slow/m")  # the code of a turn is loaded before memory is measured
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak starts again from here
    before = memory_mib(pid)
    fault.script(huge_head(32 * MIB))
    result: dict[str, Any] = {}

    def chat() -> None:
        start = time.monotonic()
        result["reply"] = convo.send("and now?", model="slow/m", timeout=60)
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=chat)
    thread.start()
    health: list[tuple[int, float]] = []
    with httpx.Client(base_url=slow_gw.url, timeout=30) as client:
        while not health or thread.is_alive():
            start = time.monotonic()
            health.append((client.get("/healthz").status_code, time.monotonic() - start))
            time.sleep(0.02)
    thread.join()
    after = memory_mib(pid)
    reply = result["reply"]
    assert reply.status == 502 and reply.body["error"]["code"] == "upstream_bad_response", reply.body
    assert "head" in reply.body["error"]["message"]
    assert result["seconds"] < 5
    assert all(status == 200 and seconds < 1 for status, seconds in health), health
    assert after["VmHWM"] - before["VmRSS"] < 16, (before, after)  # not the 32 MiB header
    assert len(fault.requests) == 2  # not retried
    assert wait_for(lambda: fault.requests[-1].closed_at is not None)
    convo.check()  # the conversation holds its one turn and takes the next at once


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_dripped_a_byte_a_second_is_a_504_at_its_timeout(
    slow_gw: GatewayProcess, fault: FaultServer, stream: bool
) -> None:
    convo = Conversation(slow_gw, fault, f"drip-{'stream' if stream else 'whole'}")
    fault.script(drip(1.0))
    start = time.monotonic()
    reply = convo.send("hello", model="slow/m", stream=stream, timeout=60)
    seconds = time.monotonic() - start
    assert reply.status == 504 and reply.body["error"]["code"] == "upstream_timeout", reply.body
    assert "providers.slow.timeout" in reply.body["error"]["message"]
    assert seconds < 10
    assert len(fault.requests) == 1  # a timeout is not retried
    assert wait_for(lambda: fault.requests[0].closed_at is not None)  # the drip was hung up on
    convo.ok("hello again", model="slow/m", stream=stream)  # the conversation is free at once
    convo.check()
