"""Provider faults, byte by byte, against the real `gateway serve`: the client always gets a
well-formed error or a complete answer, nothing partial enters history, nothing is duplicated,
and a retry happens only before the first byte of an answer reached the client."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import GatewayProcess, sdk
from tests.e2e.reliability.conftest import Conversation, Reply, assert_history, response_records, wait_for
from tests.e2e.reliability.faultserver import (
    FaultRequest,
    FaultServer,
    answer,
    close_without_answer,
    hang,
    reset_before_answer,
    status,
    stream_then,
)


@pytest.fixture
def convo(request: pytest.FixtureRequest, gw: GatewayProcess, fault: FaultServer) -> Iterator[Conversation]:
    cid = re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)[:100]
    c = Conversation(gw, fault, cid)
    c.ok("Hello, my name is Ada.")  # a committed turn the faults must not disturb
    yield c


def assert_error(reply: Reply, status_code: int, code: str) -> dict[str, Any]:
    assert reply.status == status_code, (reply.status, reply.body)
    error = reply.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    # The attempt is named, and its log says how it ended.
    rid = reply.response_id
    assert rid
    return error


def assert_in_band_error(reply: Reply, code: str) -> None:
    assert reply.status == 200 and reply.chunks, "the stream should have started"
    assert reply.error is not None and reply.error["code"] == code, reply.error
    assert not reply.done


def attempts(fault: FaultServer, before: int) -> list[FaultRequest]:
    return fault.requests[before:]


# -- before the first byte ----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_500_before_first_byte_is_502_and_not_retried(
    convo: Conversation, fault: FaultServer, stream: bool
) -> None:
    fault.script(status(500, "kaboom", error_code="internal_kaboom"))
    n = len(fault.requests)
    reply = convo.send("What is my name?", stream=stream)
    # The gateway's 502, in its own terms (it carried the provider's type and code): the
    # provider's words in the message.
    error = assert_error(reply, 502, "upstream_error")
    assert error["type"] == "upstream_error"
    assert "kaboom" in error["message"] and "'fault'" in error["message"]
    assert len(attempts(fault, n)) == 1
    records = response_records(convo.gw.data_dir, str(reply.response_id))
    assert records[-1]["type"] == "incomplete" and records[-1]["error"]["code"] == "upstream_error"
    convo.check()


def test_500_through_the_sdk(convo: Conversation, fault: FaultServer) -> None:
    fault.script(status(500))
    with pytest.raises(openai.InternalServerError) as info:
        sdk(convo.gw, timeout=15).chat.completions.create(
            model="fault/m",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"conversation_id": convo.cid},
        )
    assert info.value.status_code == 502
    convo.check()


@pytest.mark.parametrize("stream", [False, True])
def test_429_is_passed_through_with_retry_after(
    convo: Conversation, fault: FaultServer, stream: bool
) -> None:
    fault.script(status(429, "slow down", {"retry-after": "7"}))
    n = len(fault.requests)
    with pytest.raises(openai.RateLimitError) as info:
        sdk(convo.gw, timeout=15).chat.completions.create(
            model="fault/m",
            messages=[{"role": "user", "content": "x"}],
            stream=stream,
            extra_body={"conversation_id": convo.cid},
        )
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "7"
    assert "slow down" in info.value.message
    assert len(attempts(fault, n)) == 1  # never retried by the gateway
    convo.check()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("first", ["503", "502", "close", "reset"])
def test_failure_before_first_byte_is_retried_once_without_duplicates(
    convo: Conversation, fault: FaultServer, stream: bool, first: str
) -> None:
    fault.script(
        {
            "503": status(503),
            "502": status(502),
            "close": close_without_answer(),
            "reset": reset_before_answer(),
        }[first],
        answer(),
    )
    n = len(fault.requests)
    reply = convo.ok("What is my name?", stream=stream)
    assert reply.text == "Your name is Ada."
    tries = attempts(fault, n)
    assert len(tries) == 2 and tries[0].messages == tries[1].messages
    assert len(convo.acked) == 2  # one turn, recorded once
    convo.check()


def test_retries_are_bounded(convo: Conversation, fault: FaultServer) -> None:
    fault.script(status(503), status(503), answer())
    n = len(fault.requests)
    reply = convo.send("What is my name?")
    assert_error(reply, 502, "upstream_error")
    assert len(attempts(fault, n)) == 2  # retries = 1
    fault.reset()
    convo.check()


def test_no_retry_when_retries_is_0(gw: GatewayProcess, fault: FaultServer) -> None:
    convo = Conversation(gw, fault, "noretry")
    fault.script(status(503), answer())
    reply = send_model(convo, "noretry/m")
    assert_error(reply, 502, "upstream_error")
    assert len(fault.requests) == 1


def send_model(convo: Conversation, model: str) -> Reply:
    return convo.send("hi", model=model)


def test_connection_refused_is_502_naming_provider_and_url(gw: GatewayProcess, fault: FaultServer) -> None:
    convo = Conversation(gw, fault, "refused")
    reply = send_model(convo, "refused/m")
    error = assert_error(reply, 502, "upstream_unreachable")
    assert "'refused'" in error["message"] and "http://127.0.0.1:" in error["message"]
    assert_history(gw.data_dir, "refused", [])


def test_connect_timeout_is_504_after_one_retry(gw: GatewayProcess, fault: FaultServer) -> None:
    convo = Conversation(gw, fault, "blackhole")
    started = time.monotonic()
    reply = send_model(convo, "blackhole/m")
    elapsed = time.monotonic() - started
    error = assert_error(reply, 504, "upstream_timeout")
    assert "connecting" in error["message"]
    assert 0.8 <= elapsed < 3.0  # two attempts of connect_timeout = 0.4 s, 0.2 s apart
    assert_history(gw.data_dir, "blackhole", [])


@pytest.mark.parametrize("stream", [False, True])
def test_read_timeout_before_headers_is_504_and_closes_upstream(
    convo: Conversation, fault: FaultServer, stream: bool
) -> None:
    fault.script(hang())
    n = len(fault.requests)
    started = time.monotonic()
    reply = convo.send("What is my name?", stream=stream)
    assert_error(reply, 504, "upstream_timeout")
    assert 1.4 <= time.monotonic() - started < 4.0  # timeout = 1.5 s, not retried
    (attempt,) = attempts(fault, n)
    assert wait_for(lambda: attempt.closed_at is not None, 2.0)  # the gateway hung up
    convo.check()


# -- after the first byte -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault_kind", "code"),
    [
        ("reset", "upstream_bad_response"),  # payload cut short by the reset
        ("invalid_json", "upstream_bad_response"),
        ("malformed", "upstream_bad_response"),  # valid JSON, not a chunk the gateway can use
        ("error_event", "upstream_error"),
        ("close", "upstream_bad_response"),  # body ended without a finish_reason
        ("hang", "upstream_timeout"),
    ],
)
def test_mid_stream_fault_is_an_in_band_error_never_retried(
    convo: Conversation, fault: FaultServer, fault_kind: str, code: str
) -> None:
    fault.script(stream_then(3, fault_kind), answer())
    n = len(fault.requests)
    reply = convo.send("What is my name?", stream=True)
    assert_in_band_error(reply, code)
    assert reply.text  # part of the answer reached the client: that is why it is not retried
    assert len(attempts(fault, n)) == 1
    records = response_records(convo.gw.data_dir, str(reply.response_id))
    assert records[-1]["type"] == "incomplete"
    assert not any(r["type"] == "response" for r in records)  # the partial text is not kept as an answer
    convo.check()


def test_mid_stream_reset_through_the_sdk(convo: Conversation, fault: FaultServer) -> None:
    fault.script(stream_then(3, "reset"))
    stream = sdk(convo.gw, timeout=15).chat.completions.create(
        model="fault/m",
        messages=[{"role": "user", "content": "What is my name?"}],
        stream=True,
        extra_body={"conversation_id": convo.cid},
    )
    received = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received.append(chunk)
    assert received  # the failure came mid-stream
    convo.check()


def test_error_event_before_any_chunk_is_an_http_error(convo: Conversation, fault: FaultServer) -> None:
    fault.script(stream_then(0, "error_event"))
    reply = convo.send("What is my name?", stream=True)
    error = assert_error(reply, 502, "upstream_error")
    assert "model overloaded" in error["message"]
    convo.check()


def test_invalid_json_before_any_chunk_is_502_not_retried(convo: Conversation, fault: FaultServer) -> None:
    fault.script(stream_then(0, "invalid_json"), answer())
    n = len(fault.requests)
    reply = convo.send("What is my name?", stream=True)
    assert_error(reply, 502, "upstream_bad_response")
    assert len(attempts(fault, n)) == 1  # the provider answered: sending again would not help
    convo.check()


def test_non_streaming_body_cut_short_is_retried(convo: Conversation, fault: FaultServer) -> None:
    async def cut(req: FaultRequest) -> None:
        body = b'{"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Your na'
        await req.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n" + body
        )
        req.reset()

    fault.script(cut, answer())
    n = len(fault.requests)
    assert convo.ok("What is my name?").text == "Your name is Ada."
    assert len(attempts(fault, n)) == 2
    convo.check()


@pytest.mark.parametrize(
    ("body", "code", "says"),
    [
        (b'{"id": "x", "choices": [', "upstream_bad_response", "invalid JSON"),
        (b'{"id": "x", "object": "chat.completion"}', "upstream_bad_response", "no choices"),
        (b'["not", "an", "object"]', "upstream_bad_response", "no choices"),
        (b'{"error": {"message": "model is loading", "type": "server_error"}}', "upstream_error", "loading"),
        (b'{"id": "x", "choices": []}', "upstream_bad_response", "no choices"),
    ],
    ids=["invalid-json", "no-choices", "not-an-object", "error-body", "empty-choices"],
)
def test_a_200_that_is_not_a_completion_is_an_error_and_adds_nothing(
    convo: Conversation, fault: FaultServer, body: bytes, code: str, says: str
) -> None:
    """A provider that answers 200 with something that is not a completion: the client gets a
    502 naming the problem, the attempt is logged incomplete, and the conversation is untouched
    (the provider answered, so the request is not sent again)."""

    async def odd(req: FaultRequest) -> None:
        await req.respond(200, body)

    fault.script(odd, answer())
    n = len(fault.requests)
    reply = convo.send("What is my name?")
    error = assert_error(reply, 502, code)
    assert says in error["message"], error["message"]
    assert len(attempts(fault, n)) == 1
    records = response_records(convo.gw.data_dir, str(reply.response_id))
    assert records[-1]["type"] == "incomplete"
    convo.check()


# -- odd but valid streams ----------------------------------------------------------------------------
UNICODE = "Grüße 你好 🚀—ça"


def test_one_byte_sse_chunks(convo: Conversation, fault: FaultServer) -> None:
    fault.script(answer(text=UNICODE, piece=1))
    reply = convo.ok("Say hello in many scripts.", stream=True)
    assert reply.text == UNICODE  # multi-byte characters split across reads survive
    stored = response_records(convo.gw.data_dir, str(reply.response_id))
    assert next(r for r in stored if r["type"] == "response")["message"]["content"] == UNICODE
    convo.check()


def test_ping_comments_are_ignored(convo: Conversation, fault: FaultServer) -> None:
    fault.script(answer(ping=True))
    reply = convo.ok("What is my name?", stream=True)
    assert reply.text == "Your name is Ada."
    convo.check()


@pytest.mark.parametrize("then", ["close", "hang"])
def test_missing_done_after_finish_reason_is_a_complete_answer(
    convo: Conversation, fault: FaultServer, then: str
) -> None:
    fault.script(answer(done=False, then=then))
    started = time.monotonic()
    reply = convo.ok("What is my name?", stream=True)
    assert reply.text == "Your name is Ada." and reply.done
    assert time.monotonic() - started < 3.0  # a short grace (a read timeout would be an error)
    convo.check()


def test_stream_with_nothing_but_done_is_an_http_error(convo: Conversation, fault: FaultServer) -> None:
    async def empty(req: FaultRequest) -> None:
        await req.head()
        await req.chunk(b": ping\n\ndata: [DONE]\n\n")
        await req.end()

    fault.script(empty)
    reply = convo.send("What is my name?", stream=True)
    error = assert_error(reply, 502, "upstream_bad_response")  # nothing was sent: not a 200
    assert "without an answer" in error["message"]
    convo.check()
