"""Clients that go away: before the gateway's headers, during time-to-first-token, mid-stream.
The upstream request is cancelled within 1 s, the turn is recorded incomplete and never enters
history, the conversation stays usable, and the gateway's file descriptors return to baseline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import GatewayProcess
from tests.e2e.reliability.conftest import Conversation, open_fds, responses_of, wait_for
from tests.e2e.reliability.faultserver import FaultRequest, FaultServer, answer, hang, hang_after_head

LONG = " ".join(f"word{i}" for i in range(40))


@pytest.fixture
def convo(request: pytest.FixtureRequest, gw: GatewayProcess, fault: FaultServer) -> Iterator[Conversation]:
    c = Conversation(gw, fault, request.node.name.replace("[", "-").replace("]", ""))
    c.ok("Hello, my name is Ada.")
    yield c


def responses_body(cid: str, stream: bool) -> dict[str, object]:
    return {"model": "fault/m", "input": "What is my name?", "conversation": cid, "stream": stream}


def body(cid: str, stream: bool) -> dict[str, object]:
    return {
        "model": "fault/m",
        "messages": [{"role": "user", "content": "What is my name?"}],
        "conversation_id": cid,
        "stream": stream,
    }


def assert_cancelled(convo: Conversation, attempt: FaultRequest, gone_at: float, baseline: int) -> None:
    assert attempt.closed.is_set() or wait_for(lambda: attempt.closed_at is not None, 2.0)
    assert attempt.closed_at is not None
    assert attempt.closed_at - gone_at < 1.0, "the upstream request outlived the client by over 1 s"
    # The attempt is logged, marked incomplete (cancelled), and not in the index.
    data = convo.gw.data_dir

    def abandoned() -> list[str]:
        return [
            rid
            for rid, records in responses_of(data, convo.cid).items()
            if rid not in convo.acked and records[-1]["type"] == "incomplete"
        ]

    (rid,) = wait_for(abandoned, 2.0)
    last = responses_of(data, convo.cid)[rid][-1]
    assert last["reason"] == "cancelled", last
    assert not any(r["type"] == "response" for r in responses_of(data, convo.cid)[rid])
    pid = convo.gw.proc.pid if convo.gw.proc else 0
    assert wait_for(lambda: open_fds(pid) <= baseline, 3.0), (open_fds(pid), baseline)
    convo.check()  # the lock was released and the history is exactly the acknowledged turns


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_cancel_before_headers(convo: Conversation, fault: FaultServer, stream: bool, api: str) -> None:
    """Both APIs record a client that went away as `cancelled` (the Responses bridge once
    recorded it as a server error)."""
    baseline = open_fds(convo.gw.proc.pid)  # type: ignore[union-attr]
    fault.script(hang())
    n = len(fault.requests)
    path, make = ("/v1/chat/completions", body) if api == "chat" else ("/v1/responses", responses_body)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{convo.gw.url}{path}",
            json=make(convo.cid, stream),
            timeout=httpx.Timeout(5.0, read=0.4),
        )
    gone_at = time.monotonic()  # the client has closed its connection
    (attempt,) = fault.requests[n:]
    assert attempt.closed_at is None or attempt.closed_at >= attempt.received_at
    assert_cancelled(convo, attempt, gone_at, baseline)


def test_cancel_during_time_to_first_token(convo: Conversation, fault: FaultServer) -> None:
    baseline = open_fds(convo.gw.proc.pid)  # type: ignore[union-attr]
    fault.script(hang_after_head())
    n = len(fault.requests)
    with pytest.raises(httpx.ReadTimeout):
        # The gateway answers only once the provider's first chunk is in: the client waits.
        httpx.post(
            f"{convo.gw.url}/v1/chat/completions",
            json=body(convo.cid, True),
            timeout=httpx.Timeout(5.0, read=0.4),
        )
    gone_at = time.monotonic()
    (attempt,) = fault.requests[n:]
    assert attempt.chunked  # the provider had sent its headers
    assert_cancelled(convo, attempt, gone_at, baseline)


def test_cancel_mid_stream(convo: Conversation, fault: FaultServer) -> None:
    baseline = open_fds(convo.gw.proc.pid)  # type: ignore[union-attr]
    fault.script(answer(text=LONG, pause=0.1))
    n = len(fault.requests)
    received = []
    with httpx.Client(timeout=5.0) as client:
        with client.stream("POST", f"{convo.gw.url}/v1/chat/completions", json=body(convo.cid, True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received.append(line)
                if len(received) == 3:
                    break
    gone_at = time.monotonic()  # leaving both blocks closed the connection
    (attempt,) = fault.requests[n:]
    assert attempt.closed_at is None or attempt.closed_at > gone_at - 0.05  # it was still streaming
    assert_cancelled(convo, attempt, gone_at, baseline)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_queued_never_reaches_the_provider(
    convo: Conversation, fault: FaultServer, stream: bool
) -> None:
    """A request queued behind its conversation's turn in progress, whose client left: its
    whole prompt went to the provider (billed) once the queue moved, and only then was it
    found that nobody was waiting for the answer."""
    fault.script(answer(delay=1.0))  # the turn in progress holds the conversation (timeout 1.5 s)
    n = len(fault.requests)
    holder = threading.Thread(target=convo.ok, args=("I hold the conversation.",))
    holder.start()
    assert wait_for(lambda: len(fault.requests) > n, 3.0)
    with pytest.raises(httpx.ReadTimeout):  # queued, then gone
        httpx.post(
            f"{convo.gw.url}/v1/chat/completions",
            json=body(convo.cid, stream),
            timeout=httpx.Timeout(5.0, read=0.4),
        )
    holder.join(10)
    time.sleep(0.5)  # (the queued request would have been sent by now)
    assert len(fault.requests) == n + 1, [r.body for r in fault.requests[n:]]
    convo.ok("Still here?")  # the conversation goes on, with what was acknowledged
    convo.check()


def test_many_cancels_leave_no_descriptors_behind(convo: Conversation, fault: FaultServer) -> None:
    """Repeated cancels of every kind: descriptors back to baseline, history untouched."""
    pid = convo.gw.proc.pid  # type: ignore[union-attr]
    baseline = open_fds(pid)
    for i in range(6):
        kind = i % 3
        fault.script([hang(), hang_after_head(), answer(text=LONG, pause=0.05)][kind])
        stream = kind != 0 or i % 2 == 1
        with httpx.Client(timeout=httpx.Timeout(5.0, read=0.3)) as client:
            try:
                with client.stream(
                    "POST", f"{convo.gw.url}/v1/chat/completions", json=body(convo.cid, stream)
                ) as r:
                    for _ in r.iter_lines():
                        break
            except httpx.ReadTimeout:
                pass
    assert wait_for(lambda: all(req.closed_at is not None for req in fault.requests), 2.0)
    assert wait_for(lambda: open_fds(pid) <= baseline, 3.0), (open_fds(pid), baseline)
    convo.check()
