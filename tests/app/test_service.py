"""The chat-completions turn through the app, on the twins (MemoryStore / JsonlStore + MockUpstream)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.exceptions import UpstreamTimeout
from gateway.store.jsonl import JsonlStore
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


async def chat(
    client: httpx.AsyncClient, messages: list[dict[str, Any]], cid: str | None = "c", **extra: Any
) -> httpx.Response:
    body: dict[str, Any] = {"model": "mock/m", "messages": messages, **extra}
    if cid is not None:
        body["conversation_id"] = cid
    return await client.post("/v1/chat/completions", json=body)


def user(text: str, **kw: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **kw}


def sent(upstream: MockUpstream, i: int = -1) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in upstream.requests[i]["messages"]]


async def test_system_prompt_carried_forward_and_replaced(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    await chat(app_client, [{"role": "system", "content": "S1"}, user("a")])
    await chat(app_client, [user("b")])
    assert sent(mock_upstream)[0] == ("system", "S1")
    await chat(app_client, [{"role": "system", "content": "S2"}, user("c")])
    await chat(app_client, [user("d")])
    msgs = sent(mock_upstream)
    assert msgs[0] == ("system", "S2")
    assert [m for m in msgs if m[0] == "system"] == [("system", "S2")]
    assert [c for r, c in msgs if r == "user"] == ["a", "b", "c", "d"]


async def test_feedback_only_turn_forwarded_once_never_replayed(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    await chat(app_client, [user("my name is Eve")])
    r = await chat(app_client, [user("that answer was rude", is_feedback=True)])
    assert r.status_code == 200
    fb = mock_upstream.requests[-1]["messages"]
    assert fb[-1] == {"role": "user", "content": "that answer was rude"}  # forwarded, flag stripped
    await chat(app_client, [user("what is my name?")])
    msgs = sent(mock_upstream)
    assert "that answer was rude" not in [c for _, c in msgs]
    # Neither the feedback nor its reply is replayed: no orphan assistant turn.
    assert [r for r, _ in msgs] == ["user", "assistant", "user"]


async def test_top_level_is_feedback_marks_the_last_message_and_is_stripped(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    await chat(app_client, [user("my name is Ada")])
    r = await app_client.post(
        "/v1/chat/completions",
        json={"model": "mock/m", "conversation_id": "c", "is_feedback": True, "messages": [user("great")]},
    )
    assert r.status_code == 200, r.text
    assert "is_feedback" not in mock_upstream.requests[-1]  # extra_body={"is_feedback": True}
    assert mock_upstream.requests[-1]["messages"][-1] == {"role": "user", "content": "great"}
    await chat(app_client, [user("what is my name?")])
    assert [c for r, c in sent(mock_upstream) if r == "user"] == ["my name is Ada", "what is my name?"]
    bad = await app_client.post(
        "/v1/chat/completions",
        json={"model": "mock/m", "conversation_id": "c", "is_feedback": "yes", "messages": [user("x")]},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "is_feedback"


async def test_feedback_beside_ordinary_message_left_out_alone(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    await chat(app_client, [user("first")])
    await chat(app_client, [user("meh", is_feedback=True), user("second")])
    await chat(app_client, [user("third")])
    assert [c for r, c in sent(mock_upstream) if r == "user"] == ["first", "second", "third"]
    assert [r for r, _ in sent(mock_upstream)] == ["user", "assistant", "user", "assistant", "user"]


def _weather_call(body: dict[str, Any]) -> Any:
    """A model that calls a weather tool when asked about the weather, and reads its result."""
    last = body["messages"][-1]
    if last["role"] == "user" and "weather" in str(last["content"]):
        call = {"id": "call_fb", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if last["role"] == "tool":
        return f"It is {last['content']}."
    return "noted"


@pytest.mark.parametrize("backend", ["memory", "jsonl"])
async def test_feedback_answered_by_a_tool_call_goes_on_and_stays_out(backend: str, tmp_path: Path) -> None:
    upstream = MockUpstream(_weather_call)
    settings = make_settings(tmp_path if backend == "jsonl" else None)
    async with build_client(settings, MemoryStore() if backend == "memory" else None, upstream) as client:
        await chat(client, [user("my name is Eve")])
        fb = await chat(client, [user("wrong: check the weather again", is_feedback=True)])
        assert fb.json()["choices"][0]["finish_reason"] == "tool_calls"
        # The call's result goes on from the feedback's turn: sent with it, this once.
        r = await chat(client, [{"role": "tool", "tool_call_id": "call_fb", "content": "sunny"}])
        assert r.status_code == 200, r.text
        assert sent(upstream)[2:] == [
            ("user", "wrong: check the weather again"),
            ("assistant", None),
            ("tool", "sunny"),
        ]
        assert r.json()["choices"][0]["message"]["content"] == "It is sunny."
        # The whole exchange stays out of history, as the feedback it answers does.
        await chat(client, [user("what is my name?")])
        asked = [("user", "my name is Eve"), ("assistant", "noted"), ("user", "what is my name?")]
        assert sent(upstream) == asked
        # Once an ordinary turn came between, a result for that call answers nothing.
        orphan = await chat(client, [{"role": "tool", "tool_call_id": "call_fb", "content": "rainy"}])
        assert orphan.status_code == 400
        # A result sent with a new message goes on from the feedback as well; the message is the
        # client's turn, kept (it was sent without the result, which was dropped without a word).
        await chat(client, [user("wrong again: the weather?", is_feedback=True)])
        both = await chat(
            client, [{"role": "tool", "tool_call_id": "call_fb", "content": "rainy"}, user("and?")]
        )
        assert both.status_code == 200, both.text
        assert sent(upstream)[-4:] == [
            ("user", "wrong again: the weather?"), ("assistant", None), ("tool", "rainy"), ("user", "and?"),
        ]  # fmt: skip
        await chat(client, [user("last")])
        assert [c for r, c in sent(upstream) if r == "user"] == [
            "my name is Eve",
            "what is my name?",
            "and?",
            "last",
        ]
        # Nor is it among the conversation's items, as feedback is not.
        items = (await client.get("/v1/conversations/c/items", params={"order": "asc"})).json()["data"]
        assert [i.get("role") or i["type"] for i in items] == ["user", "assistant"] * 4


async def test_feedback_tool_chain_from_a_client_that_resends_its_history() -> None:
    def two_calls(body: dict[str, Any]) -> Any:
        last = body["messages"][-1]
        n = sum(1 for m in body["messages"] if m["role"] == "tool")
        if last["role"] == "tool" and n == 1:  # the first result asks for a second call
            call = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return _weather_call(body)

    upstream = MockUpstream(two_calls)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        history: list[dict[str, Any]] = []
        for message in ([user("hi")], [user("bad: the weather?", is_feedback=True)], [], []):
            history += message
            r = await chat(client, history)
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]
            history.append({k: v for k, v in answer.items() if v is not None})
            for call in answer.get("tool_calls") or []:
                result = {"role": "tool", "tool_call_id": call["id"], "content": f"result {call['id']}"}
                history.append(result)
        assert sent(upstream)[2:] == [
            ("user", "bad: the weather?"),
            ("assistant", None),
            ("tool", "result call_fb"),
            ("assistant", None),
            ("tool", "result call_2"),
        ]
        r = await chat(client, [*history, user("and now?")])
        assert sent(upstream) == [("user", "hi"), ("assistant", "noted"), ("user", "and now?")]


async def test_a_new_result_that_answers_no_call_is_refused_beside_other_messages() -> None:
    """Beside a user message, a result for a call answered before (or never made) was stored and
    never sent: the stored history showed two results for one call."""
    upstream = MockUpstream(_weather_call)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        await chat(client, [user("the weather?")])
        await chat(client, [{"role": "tool", "tool_call_id": "call_fb", "content": "sunny"}])
        again = {"role": "tool", "tool_call_id": "call_fb", "content": "sunny again"}
        r = await chat(client, [again, user("thanks")])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "'call_fb'" in r.json()["error"]["message"]
        items = (await client.get("/v1/conversations/c/items")).json()["data"]
    assert [i.get("output") for i in items if i["type"] == "function_call_output"] == ["sunny"]


async def test_tool_calls_round_trip_exactly() -> None:
    def handler(body: dict[str, Any]) -> Any:
        last = body["messages"][-1]
        if last["role"] == "user":
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            }
        return f"It is {last['content']}."

    upstream = MockUpstream(handler)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await chat(client, [user("weather in Oslo?")])
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        await chat(client, [{"role": "tool", "tool_call_id": call["id"], "content": "sunny"}])
        await chat(client, [user("thanks")])
    msgs = upstream.requests[-1]["messages"]
    assert msgs[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
            }
        ],
    }
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert msgs[3] == {"role": "assistant", "content": "It is sunny."}


async def test_a_trimmed_resend_with_rebuilt_arguments_reaches_the_model_once() -> None:
    # LangChain's trim_messages(start_on="human") resends [question, call, result], the call's
    # arguments rebuilt with json.dumps: no duplicate of the call, no invented tool result.
    def handler(body: dict[str, Any]) -> Any:
        if body["messages"][-1]["content"] == "weather?":
            function = {"name": "weather", "arguments": '{"city":"Oslo"}'}
            calls = [{"id": "call_1", "type": "function", "function": function}]
            return {"role": "assistant", "content": None, "tool_calls": calls}
        return "ok"

    upstream = MockUpstream(handler)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        await chat(client, [user("hello")])
        r = await chat(client, [user("weather?")])
        stored_call = r.json()["choices"][0]["message"]
        resent_call = json.loads(json.dumps(stored_call))
        resent_call["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": "Oslo"})
        result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
        await chat(client, [user("weather?"), resent_call, result])
        await chat(client, [user("thanks")])
    msgs = upstream.requests[-1]["messages"]
    roles = ["user", "assistant", "user", "assistant", "tool", "assistant", "user"]
    assert [m["role"] for m in msgs] == roles
    # the model's call, as it wrote it
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == '{"city":"Oslo"}'
    assert msgs[4] == result


async def test_abandoned_tool_call_is_repaired_before_forwarding() -> None:
    def handler(body: dict[str, Any]) -> Any:
        if len(body["messages"]) == 1:
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_x",
                        "type": "function",
                        "function": {"name": "delete_all", "arguments": "{}"},
                    }
                ],
            }
        return "ok"

    upstream = MockUpstream(handler)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        await chat(client, [user("clean up")])
        await chat(client, [user("no, stop")])
    msgs = upstream.requests[-1]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[2]["tool_call_id"] == "call_x"
    assert msgs[3]["content"] == "no, stop"


@pytest.mark.parametrize("stored", [False, True])
async def test_a_request_of_only_orphan_tool_results_is_refused_before_the_provider(
    app_client: httpx.AsyncClient, memory_store: MemoryStore, mock_upstream: MockUpstream, stored: bool
) -> None:
    if stored:
        await chat(app_client, [user("hello")])
    before = len(mock_upstream.requests)
    r = await chat(app_client, [{"role": "tool", "tool_call_id": "zz", "content": "orphan only"}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "'zz'" in error["message"]
    assert len(mock_upstream.requests) == before  # nothing (an empty list) went upstream
    assert len(memory_store.indexes.get("c", [])) == (1 if stored else 0)  # and nothing was stored


async def test_stateless_pass_through_is_logged_not_indexed(
    tmp_path: Path, mock_upstream: MockUpstream
) -> None:
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    async with build_client(make_settings(tmp_path), store, mock_upstream) as client:
        r = await chat(client, [user("hi", is_feedback=True)], cid=None)
    assert r.status_code == 200
    assert "conversation_id" not in r.json() and "x-conversation-id" not in r.headers
    assert mock_upstream.requests[-1]["messages"] == [{"role": "user", "content": "hi"}]
    assert (tmp_path / "var" / "logs" / "responses" / f"{r.json()['id']}.jsonl").exists()
    assert list((tmp_path / "var" / "logs" / "conversations").iterdir()) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_the_response_log_is_on_disk_while_the_provider_answers(tmp_path: Path, stream: bool) -> None:
    """The log's file is made once the provider has the request (or its answer has begun),
    not before the request goes: an operator still sees every turn in flight."""
    store = JsonlStore(tmp_path / "var")
    await store.open()
    responses = tmp_path / "var" / "logs" / "responses"
    seen: list[list[str]] = []

    class Watching(MockUpstream):
        async def complete(self, body: dict[str, Any], *, waited: float = 0.0) -> dict[str, Any]:
            await asyncio.sleep(0.05)  # the provider at work
            seen.append([json.loads(p.read_text().splitlines()[0])["type"] for p in responses.iterdir()])
            return await super().complete(body)

    upstream = Watching(name="mock")
    async with build_client(make_settings(tmp_path), store, upstream) as client:
        r = await chat(client, [user("hi")], cid="c", stream=stream)
        assert r.status_code == 200
        r = await chat(client, [user("again")], cid="c", stream=stream)
    await store.close()
    assert seen == [["request"], ["request", "request"]]
    rid = r.headers["x-response-id"]
    records = [json.loads(line) for line in (responses / f"{rid}.jsonl").read_text().splitlines()]
    assert [x["type"] for x in records] == ["request", "context", "response", "commit"]


async def test_agent_id_and_header_are_conversation_ids(
    app_client: httpx.AsyncClient, memory_store: MemoryStore
) -> None:
    r = await app_client.post(
        "/v1/chat/completions", json={"model": "mock/m", "messages": [user("x")], "agent_id": "agent-7"}
    )
    assert r.json()["conversation_id"] == "agent-7"
    r = await app_client.post(
        "/v1/chat/completions",
        json={"model": "mock/m", "messages": [user("x")]},
        headers={"X-Conversation-Id": "../x"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Conversation-Id"
    assert set(memory_store.indexes) == {"agent-7"}


async def test_session_id_is_a_conversation_id_and_gateway_fields_never_reach_the_provider(
    app_client: httpx.AsyncClient, memory_store: MemoryStore, mock_upstream: MockUpstream
) -> None:
    r = await app_client.post(
        "/v1/chat/completions",
        json={
            "model": "mock/m",
            "messages": [user("x")],
            "session_id": "sess-1",
            "agent_id": "ignored-when-session-id-is-sent",
            "response_id": "client-chosen-id",
            "user_timezone": "Europe/Berlin",
            "is_feedback": False,  # a message field; at the top level it is stripped too
            "temperature": 0.2,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["conversation_id"] == "sess-1" and r.json()["id"] != "client-chosen-id"
    sent = mock_upstream.requests[-1]
    assert set(sent) == {"model", "messages", "temperature"}
    assert set(memory_store.indexes) == {"sess-1"}


async def test_the_recap_is_off_unless_configured(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    for cid, text in (("a", "my secret project is Falcon"), ("b", "hello")):
        r = await app_client.post(
            "/v1/chat/completions",
            json={"model": "mock/m", "messages": [user(text)], "conversation_id": cid, "user": "shared"},
        )
        assert r.status_code == 200
    assert "Falcon" not in json.dumps(mock_upstream.requests[-1]["messages"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x", "is_feedback": "yes"}]},
            "messages[0].is_feedback",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "conversation_id": "a b"},
            "conversation_id",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "conversation_id": "x" * 129},
            "conversation_id",
        ),
    ],
)
async def test_bad_input_is_400_with_param(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, body: dict[str, Any], param: str
) -> None:
    r = await app_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert mock_upstream.requests == []


async def test_invalid_json_and_oversized_body(mock_upstream: MockUpstream) -> None:
    settings = make_settings()
    settings = settings.model_copy(
        update={"server": settings.server.model_copy(update={"max_body_bytes": 1000})}
    )
    async with build_client(settings, MemoryStore(), mock_upstream) as client:
        r = await client.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await chat(client, [user("x" * 2000)])
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert mock_upstream.requests == []


async def test_upstream_timeout_is_504_and_adds_nothing(memory_store: MemoryStore) -> None:
    calls = []

    def handler(body: dict[str, Any]) -> Any:
        calls.append(body)
        if len(calls) == 2:
            raise UpstreamTimeout("Provider 'mock' timed out")
        return "fine"

    async with build_client(make_settings(), memory_store, MockUpstream(handler)) as client:
        assert (await chat(client, [user("one")])).status_code == 200
        r = await chat(client, [user("two")])
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        await chat(client, [user("three")])
    assert [m["content"] for m in calls[-1]["messages"] if m["role"] == "user"] == ["one", "three"]
    assert len(memory_store.indexes["c"]) == 2
    failed = [rs for rs in memory_store.responses.values() if rs[-1]["type"] == "incomplete"]
    assert len(failed) == 1 and failed[0][0]["input"][0]["content"] == "two"


async def test_stream_error_mid_stream_is_reported_in_band_and_not_stored(memory_store: MemoryStore) -> None:
    class Broken(MockUpstream):
        async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:
            yield {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": "par"}, "finish_reason": None}
                ],
            }
            raise UpstreamTimeout("Provider 'mock' timed out")

    async with build_client(make_settings(), memory_store, Broken()) as client:
        r = await chat(client, [user("hi")], stream=True)
    lines = [line for line in r.text.split("\n\n") if line]
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == "par"
    assert json.loads(lines[-1][6:])["error"]["code"] == "upstream_timeout"
    assert "[DONE]" not in r.text
    assert memory_store.indexes.get("c", []) == []


async def test_stream_without_finish_is_incomplete(memory_store: MemoryStore) -> None:
    class Cut(MockUpstream):
        async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:
            yield {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": "half"}, "finish_reason": None}],
            }

    async with build_client(make_settings(), memory_store, Cut()) as client:
        r = await chat(client, [user("hi")], stream=True)
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in r.text
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "half"  # what came, then
    error = json.loads(events[-1][6:])["error"]  # an in-band error naming the cause
    assert (
        error["code"] == "upstream_bad_response" and "ended the stream before finishing" in error["message"]
    )
    assert memory_store.indexes.get("c", []) == []
    log = next(iter(memory_store.responses.values()))
    assert log[-1]["type"] == "incomplete"  # the attempt stays in its log, marked incomplete


async def test_stream_usage_chunk_only_when_asked(app_client: httpx.AsyncClient) -> None:
    r = await chat(app_client, [user("hi")], stream=True)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert all(e["choices"] for e in events)
    assert r.text.endswith("data: [DONE]\n\n")
    r = await chat(app_client, [user("hi")], stream=True, stream_options={"include_usage": True})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] > 0
    assert {e["id"] for e in events} == {r.headers["x-response-id"]}


async def test_client_supplied_endpoints_and_keys_are_not_forwarded(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    await chat(
        app_client,
        [user("hi")],
        api_base="http://evil.example",
        base_url="http://evil",
        api_key="sk-x",
        user_timezone="Europe/Berlin",
        temperature=0.3,
        # litellm's credentials and routing, passed on to an OpenAI-compatible provider before
        aws_secret_access_key="aws-x",
        vertex_credentials="{}",
        azure_ad_token="ad-x",
        custom_llm_provider="bedrock",
        headers={"Authorization": "Bearer x"},
    )
    body = mock_upstream.requests[-1]
    assert body["temperature"] == 0.3
    for key in ("api_base", "base_url", "api_key", "user_timezone", "conversation_id"):
        assert key not in body
    for key in (
        "aws_secret_access_key",
        "vertex_credentials",
        "azure_ad_token",
        "custom_llm_provider",
        "headers",
    ):
        assert key not in body
    # The Responses API's field, sent to chat completions: left out (it went to the provider).
    await chat(app_client, [user("hi")], previous_response_id="mock-m-0123456789ab")
    assert "previous_response_id" not in mock_upstream.requests[-1]


async def test_a_key_inside_a_literal_extra_body_is_not_forwarded_nor_stored(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, memory_store: MemoryStore
) -> None:
    """The SDK merges `extra_body`; a client that sends the field itself had its api_key in it
    passed on to the provider and written into the response log."""
    r = await chat(
        app_client, [user("hi")], extra_body={"api_key": "sk-nested", "base_url": "http://evil", "top_k": 3}
    )
    assert r.status_code == 200
    assert mock_upstream.requests[-1]["extra_body"] == {"top_k": 3}
    assert "sk-nested" not in json.dumps(memory_store.responses[r.headers["x-response-id"]])
    # The gateway's own fields too: a provider that validates arguments refused them.
    nested = {"conversation_id": "c", "session_id": "s", "is_feedback": False, "top_k": 3}
    assert (await chat(app_client, [user("hi")], extra_body=nested)).status_code == 200
    assert mock_upstream.requests[-1]["extra_body"] == {"top_k": 3}


async def test_storage_failure_is_503_and_not_acknowledged(
    memory_store: MemoryStore, app_client: httpx.AsyncClient
) -> None:
    from gateway.exceptions import StorageError

    memory_store.fail_commit = StorageError("disk full")
    r = await chat(app_client, [user("hi")])
    assert r.status_code == 503 and r.json()["error"]["code"] == "storage_unavailable"
    assert memory_store.indexes.get("c", []) == []


async def test_unknown_route_is_openai_shaped_404(app_client: httpx.AsyncClient) -> None:
    r = await app_client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


async def test_metrics(app_client: httpx.AsyncClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    await chat(app_client, [user("hello")])
    await chat(app_client, [user("again")], stream=True)
    await chat(app_client, [{"role": "wizard"}])
    r = await app_client.get("/metrics")
    assert r.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }
    assert samples[("gateway_requests_total", (("route", "chat_completions"), ("status", "200")))] == 2
    assert samples[("gateway_requests_total", (("route", "chat_completions"), ("status", "400")))] == 1
    assert samples[("gateway_overhead_seconds_count", ())] == 2
    assert samples[("gateway_upstream_seconds_count", (("provider", "mock"),))] == 2
    assert samples[("gateway_tokens_total", (("direction", "in"),))] > 0
    assert samples[("gateway_conversations_active", ())] == 1


def test_active_conversation_tracking_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gauge's bookkeeping forgets idle conversations as it goes (a soak showed it grew)."""
    from gateway import metrics as metrics_module

    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: now[0])
    m = metrics_module.Metrics(active_window=60.0)
    for i in range(5000):
        now[0] += 1.0
        m.conversation_touched(f"c{i}")
    assert len(m._last_turn) <= 60 + 1024  # only the last minute, plus one pruning interval
    assert m._count_active() == 61  # touched within the last 60 s, both ends included


async def test_malformed_chunk_mid_stream_is_an_in_band_error(memory_store: MemoryStore) -> None:
    class Bad(MockUpstream):
        async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:
            yield {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
            yield {"choices": [{"index": 0, "delta": "lo"}]}  # not an object: breaks the accumulator

    async with build_client(make_settings(), memory_store, Bad()) as client:
        r = await chat(client, [user("hi")], stream=True)
    events = [line for line in r.text.split("\n\n") if line]
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_bad_response"
    assert "[DONE]" not in r.text
    assert memory_store.indexes.get("c", []) == []


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": {}, "content": "x"}, "messages[0].role"),  # unhashable: was a 500
        ({"role": ["user"], "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": ["a"]}, "messages[0].content[0]"),
        ({"role": "user", "content": "x", "name": 3}, "messages[0].name"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": {}}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0]"),
        # Stored, these went to the provider on every later turn (OpenAI refuses them).
        ({"role": "assistant"}, "messages[0]"),
        ({"role": "assistant", "content": []}, "messages[0]"),
        ({"role": "user", "content": []}, "messages[0]"),
    ],
)
def test_malformed_messages_are_a_400_naming_the_field(message: dict[str, Any], param: str) -> None:
    from gateway.api.validation import parse_chat
    from gateway.exceptions import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        parse_chat({"model": "m", "messages": [message]})
    assert info.value.param == param
    assert info.value.status_code == 400


def test_content_part_with_a_non_string_type_is_a_400() -> None:
    from gateway.context.items import items_to_messages
    from gateway.exceptions import InvalidRequest

    with pytest.raises(InvalidRequest):
        items_to_messages([{"role": "user", "content": [{"type": {}, "text": ""}]}])
    assert items_to_messages([{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]) == [
        {"role": "user", "content": "hi"}
    ]


@pytest.mark.parametrize("since", ["abc", "-1", "1.5"])
async def test_the_inspectors_since_must_be_a_turn_index(app_client: httpx.AsyncClient, since: str) -> None:
    r = await app_client.post(
        "/v1/chat/completions", json={"model": "mock/m", "messages": [user("x")], "conversation_id": "c"}
    )
    assert r.status_code == 200
    r = await app_client.get(f"/ui/api/conversations/c?since={since}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    r = await app_client.get("/ui/api/conversations/c?since=0")
    assert r.status_code == 200 and len(r.json()["turns"]) == 1


async def test_the_inspectors_delta_form_says_each_window_once(app_client: httpx.AsyncClient) -> None:
    """Each turn's whole sent list repeated the window of the turn before it: 40 turns said it
    40 times. `?sent=delta` says what a turn shares with the one before it as a count."""
    cid = {"conversation_id": "long"}
    r = await app_client.post(
        "/v1/chat/completions",
        json={"model": "mock/m", "messages": [{"role": "system", "content": "Be brief."}], **cid},
    )
    for n in range(40):
        body = {"model": "mock/m", "messages": [user(f"question {n} " + "words " * 20)], **cid}
        assert (await app_client.post("/v1/chat/completions", json=body)).status_code == 200
    r = await app_client.post("/v1/conversations/long/reset", json={"keep_system_message": True})
    assert r.status_code == 200
    body = {"model": "mock/m", "messages": [user("after the reset")], **cid}
    assert (await app_client.post("/v1/chat/completions", json=body)).status_code == 200
    whole = await app_client.get("/ui/api/conversations/long")
    delta = await app_client.get("/ui/api/conversations/long?sent=delta")
    assert whole.status_code == delta.status_code == 200
    rebuilt, before = [], []
    # The first turn sent the system prompt; each turn after it, the answer before it and its
    # question (the reset's turn, its question alone).
    assert sum(len(t.get("sent_tail", [])) for t in delta.json()["turns"]) == 1 + 2 * 40 + 1
    for turn in delta.json()["turns"]:
        assert "sent" not in turn
        if "marker" in turn:
            rebuilt.append(turn)
            continue
        turn["sent"] = before[: turn.pop("sent_shared")] + turn.pop("sent_tail")
        before = turn["sent"]
        rebuilt.append(turn)
    assert rebuilt == whole.json()["turns"]
    assert [t.get("marker") for t in rebuilt][-2:] == ["reset", None]
    later = (await app_client.get("/ui/api/conversations/long?since=40&sent=delta")).json()["turns"]
    assert later[0]["sent_shared"] == 0 and later[0]["sent_tail"] == whole.json()["turns"][40]["sent"]
    r = await app_client.get("/ui/api/conversations/long?sent=some")
    assert r.status_code == 400 and r.json()["error"]["param"] == "sent"


async def test_a_stream_whose_commit_fails_never_shows_a_finish_reason(
    memory_store: MemoryStore, app_client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that stops reading at finish_reason must not take an unsaved answer for a
    saved one: the finishing chunk is held until the commit, and a failed commit is an
    in-band error instead (and the log line says error)."""
    import logging

    from gateway.exceptions import StorageError

    memory_store.fail_commit = StorageError("disk full")
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        r = await chat(app_client, [user("hi")], stream=True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "storage_unavailable"
    finishes = [c for e in events for c in e.get("choices") or () if c.get("finish_reason")]
    assert finishes == [] and "[DONE]" not in r.text
    assert any(e.get("choices") for e in events)  # the answer's text did stream
    assert memory_store.indexes.get("c", []) == []
    line = json.loads(next(r.getMessage() for r in caplog.records if r.name == "gateway.access"))
    assert (line["status"], line["outcome"]) == (200, "error")  # the 200 it got; not stored
    assert 'gateway_failed_turns_total{outcome="error"} 1.0' in (await app_client.get("/metrics")).text
    memory_store.fail_commit = None
    r = await chat(app_client, [user("hi")], stream=True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e.get("choices") or () if c.get("finish_reason")] == [
        "stop"
    ]
    assert r.text.rstrip().endswith("data: [DONE]")


async def test_a_closed_turn_gives_one_frozen_outcome(memory_store: MemoryStore) -> None:
    """The service hands callers a frozen TurnOutcome (not its working state); closing again,
    as a stream's error path and its on-close hook both do, gives the same value."""
    import dataclasses

    from gateway.api.validation import parse_chat
    from gateway.services import Services
    from gateway.upstream import Router

    upstream = MockUpstream(lambda body: "four")
    services = Services.from_settings(
        make_settings(), store=memory_store, router=Router({"mock": upstream}, "mock")
    )
    body = {"model": "mock/m", "messages": [user("2+2?")], "conversation_id": "frozen"}
    turn = await services.turns.prepare(parse_chat(body))
    await services.turns.complete(turn)
    outcome = await services.turns.close(turn)
    assert outcome.committed and outcome.message == {"role": "assistant", "content": "four"}
    assert (outcome.conversation_id, outcome.new_messages, outcome.sent_messages) == ("frozen", 1, 1)
    assert outcome.timings is not None and outcome.timings["total_ms"] >= outcome.timings["upstream_ms"]
    assert outcome.window_tokens is not None and outcome.window_tokens["total"] > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.committed = False  # type: ignore[misc]
    assert await services.turns.close(turn) is outcome

    failed = await services.turns.prepare(parse_chat({**body, "messages": [user("again")]}))
    outcome = await services.turns.close(failed, UpstreamTimeout("slow"))
    assert not outcome.committed and outcome.message is None and outcome.finish_reason is None


class _Breaking(MockUpstream):
    """A provider whose stream breaks after its first chunk with what no gateway error is."""

    async def stream(self, body: Any, *, waited: float = 0.0) -> Any:
        yield {"choices": [{"index": 0, "delta": {"content": "fo"}, "finish_reason": None}]}
        raise ValueError("not JSON")


def _owned_turns(memory_store: MemoryStore, upstream: MockUpstream | None = None) -> Any:
    from gateway.services import Services
    from gateway.upstream import Router

    upstream = upstream or MockUpstream(lambda body: "four")
    return Services.from_settings(
        make_settings(), store=memory_store, router=Router({"mock": upstream}, "mock")
    ).turns


async def test_a_stream_closes_its_turn_when_its_chunks_end(memory_store: MemoryStore) -> None:
    from gateway.api.validation import parse_chat

    turns = _owned_turns(memory_store)
    body = {"model": "mock/m", "messages": [user("2+2?")], "conversation_id": "s", "stream": True}
    turn = await turns.prepare(parse_chat(body))
    stream = await turns.open_chunks(turn)
    assert turn.outcome is None
    assert [c async for c in stream]
    assert stream.outcome.committed and stream.outcome.message == {"role": "assistant", "content": "four"}
    # The conversation was released by the stream itself: the next turn needs no other close.
    nxt = await asyncio.wait_for(turns.prepare(parse_chat({**body, "messages": [user("again")]})), 2)
    assert (await stream.aclose(RuntimeError("late"))) is stream.outcome
    await turns.close(nxt)


async def test_a_stream_closed_before_its_first_read_abandons_its_turn(memory_store: MemoryStore) -> None:
    from gateway.api.validation import parse_chat
    from gateway.exceptions import ClientDisconnected

    turns = _owned_turns(memory_store)
    body = {"model": "mock/m", "messages": [user("2+2?")], "conversation_id": "s", "stream": True}
    turn = await turns.prepare(parse_chat(body))
    stream = await turns.open_chunks(turn)
    outcome = await stream.aclose(ClientDisconnected())
    assert not outcome.committed and outcome.error is None  # a client that left: a cancellation
    assert (await memory_store.read_entries("s")).entries == []
    nxt = await asyncio.wait_for(turns.prepare(parse_chat(body)), 2)  # the lock is free
    await turns.close(nxt)


async def test_a_stream_that_breaks_closes_its_turn_with_the_gateways_error(
    memory_store: MemoryStore,
) -> None:
    from gateway.api.validation import parse_chat
    from gateway.exceptions import UpstreamProtocolError

    turns = _owned_turns(memory_store, _Breaking())
    body = {"model": "mock/m", "messages": [user("2+2?")], "conversation_id": "s", "stream": True}
    turn = await turns.prepare(parse_chat(body))
    stream = await turns.open_chunks(turn)
    with pytest.raises(UpstreamProtocolError, match="malformed stream"):
        async for _ in stream:
            pass
    assert isinstance(turn.closed().error, UpstreamProtocolError) and not turn.closed().committed


async def test_closing_closes_the_turn_with_what_ended_the_block(memory_store: MemoryStore) -> None:
    from gateway.api.validation import parse_chat

    turns = _owned_turns(memory_store)
    body = {"model": "mock/m", "messages": [user("2+2?")], "conversation_id": "k"}
    turn = await turns.prepare(parse_chat(body))
    with pytest.raises(UpstreamTimeout):
        async with turns.closing(turn):
            raise UpstreamTimeout("slow")
    assert isinstance(turn.closed().error, UpstreamTimeout) and not turn.closed().committed
    kept = await turns.prepare(parse_chat(body))
    async with turns.closing(kept, on_failure_only=True):
        pass
    assert kept.outcome is None  # (left open: a stream that began owns it)
    async with turns.closing(kept):
        await turns.complete(kept)
    assert kept.closed().committed


async def test_every_request_whichever_api_gets_exactly_one_json_log_line(
    app_client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    stored = (await chat(app_client, [user("stored")], store=True)).json()["id"]
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        calls = [
            ("chat.completion", 200, await chat(app_client, [user("hi")])),
            ("chat.completion", 200, await chat(app_client, [user("hi")], stream=True)),
            ("chat.completion", 400, await chat(app_client, [user("hi")], cid="bad id")),
            ("http.request", 200, await app_client.get("/v1/conversations/c")),
            ("http.request", 200, await app_client.get("/v1/conversations/c/items")),
            ("http.request", 200, await app_client.get("/v1/conversations")),
            ("http.request", 404, await app_client.get("/v1/conversations/nope")),
            ("http.request", 200, await app_client.post("/v1/conversations", json={})),
            ("http.request", 200, await app_client.get("/v1/models")),
            ("http.request", 200, await app_client.get("/healthz")),
            ("http.request", 404, await app_client.get("/no/such/path")),
            ("response", 200, await app_client.post("/v1/responses", json={"model": "mock/m", "input": "x"})),
            ("http.request", 200, await app_client.get(f"/v1/chat/completions/{stored}")),
        ]
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(line["event"], line["status"]) for line in lines] == [(e, s) for e, s, _ in calls]
    assert [r.status_code for _, _, r in calls] == [s for _, s, _ in calls]
    conversation = lines[3]
    assert conversation["method"] == "GET" and conversation["path"] == "/v1/conversations/c"
    assert conversation["route"] == "get_conversation" and conversation["conversation_id"] == "c"
    assert isinstance(conversation["ms"], float)
    assert lines[-1]["response_id"] == stored  # (the path's completion_id: a stored completion is a response)


async def test_the_log_line_carries_the_context_snapshots_numbers(
    app_client: httpx.AsyncClient, memory_store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC 7: one structured log line per request carries the snapshot's numbers: stored and
    sent messages, tokens per layer, truncated count, summary version, the responses included."""
    import logging

    await chat(app_client, [user("one")])
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        rid = (await chat(app_client, [user("two")])).json()["id"]
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    (snapshot,) = [r for r in memory_store.responses[rid] if r["type"] == "context"]
    for key in ("stored_messages", "sent_messages", "truncated", "summary_version", "included_response_ids"):
        assert line[key] == snapshot[key], key
    assert line["tokens"] == snapshot["tokens"]
    assert line["stored_messages"] == 2 and len(line["included_response_ids"]) == 1


async def test_a_request_refused_for_its_key_is_counted_and_logged_as_unauthenticated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    monkeypatch.setenv("SERVICE_TEST_KEYS", "k1")
    settings = make_settings().model_copy(
        update={"auth": make_settings().auth.model_copy(update={"keys_env": "SERVICE_TEST_KEYS"})}
    )
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            refused = await client.post(
                "/v1/chat/completions", json={"model": "mock/m", "messages": [user("x")]}
            )
        metrics = (await client.get("/metrics", headers={"Authorization": "Bearer k1"})).text
    assert refused.status_code == 401
    line = json.loads(next(r.getMessage() for r in caplog.records if r.name == "gateway.access"))
    assert line["route"] == "unauthenticated" and line["status"] == 401  # not "unmatched": it had a route
    assert 'gateway_requests_total{route="unauthenticated",status="401"} 1.0' in metrics


async def test_a_new_conversation_s_turn_does_not_look_for_its_index_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading found no index (under the lock the turn holds): the response log's work while
    the provider answers does not look again; a conversation with turns is looked at, and the
    sizes the journal records are right either way (the next turn reads them back whole)."""
    import gateway.store.jsonl.log as log_module

    looked: list[str] = []
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        looked.append(Path(path).name)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(log_module.os, "stat", stat)
    settings = make_settings(tmp_path)
    async with build_client(settings, None, MockUpstream()) as client:
        r = await chat(client, [user("first")], cid="fresh")
        assert r.status_code == 200, r.text
        assert "fresh.jsonl" not in looked
        r = await chat(client, [user("second")], cid="fresh")
        assert r.status_code == 200, r.text
        assert looked.count("fresh.jsonl") == 1
    index = (tmp_path / "var" / "logs" / "conversations" / "fresh.jsonl").read_text().split()
    assert len(index) == 2


class SlowLoads(MemoryStore):
    """Loading a conversation takes `delay` seconds: gateway time, not the provider's."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def read_conversation(self, conversation_id: str, after: Any = None) -> Any:
        await asyncio.sleep(self.delay)
        return await super().read_conversation(conversation_id, after)

    async def read_entries(self, conversation_id: str) -> Any:
        await asyncio.sleep(self.delay)
        return await super().read_entries(conversation_id)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_overhead_metric_counts_the_gateway_s_own_time(stream: bool) -> None:
    """`gateway_overhead_seconds` is the turn's time less the provider's: loading the
    conversation is part of it (it counted only from the end of the preparation on)."""
    from prometheus_client.parser import text_string_to_metric_families

    store, upstream = SlowLoads(0.05), MockUpstream(delay=0.02)
    async with build_client(make_settings(), store, upstream) as client:
        r = await chat(client, [user("hello")], stream=stream)
        assert r.status_code == 200
        metrics = (await client.get("/metrics")).text
        stored = (await client.get(f"/v1/responses/{r.headers['x-response-id']}")).json()["gateway"]
    samples = {
        s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples if not s.labels
    }
    assert samples["gateway_overhead_seconds_count"] == 1
    assert 0.05 <= samples["gateway_overhead_seconds_sum"] < 1.0
    timings = stored["response"]["timings"]
    assert timings["upstream_ms"] >= 20 and timings["total_ms"] >= timings["upstream_ms"] + 50


async def test_completion_tokens_are_counted_when_the_provider_reports_none(
    app_client: httpx.AsyncClient,
) -> None:
    """`gateway_tokens_total{direction="out"}`: the provider's count, else ours (a stream
    without a usage chunk), as for prompt tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    def tokens(direction: str) -> float:
        samples = [s for f in text_string_to_metric_families(metrics) for s in f.samples]
        return next((s.value for s in samples if s.labels == {"direction": direction}), 0.0)

    for cid in ("c", None):  # (stateless too: its stream moved neither counter)
        metrics = (await app_client.get("/metrics")).text
        before = tokens("in"), tokens("out")
        r = await chat(app_client, [user("count my answer")], cid=cid, stream=True)  # no include_usage
        assert r.status_code == 200 and '"usage"' not in r.text
        metrics = (await app_client.get("/metrics")).text
        assert tokens("in") > before[0] and tokens("out") > before[1], cid


async def test_an_answered_turn_is_stored_though_its_caller_leaves_while_the_answer_is_counted(
    memory_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long answer is counted in a worker thread: a cancellation meanwhile (the client left)
    must not lose the answered turn, whose write is never interrupted."""
    import threading

    import gateway.services.turns as turns_module
    from gateway.api.validation import parse_chat
    from gateway.services.planning import COUNT_OFF_LOOP_CHARS
    from tests.views import load

    answer = "word " * 1000
    assert len(answer) > COUNT_OFF_LOOP_CHARS  # counted off the loop
    turns = _owned_turns(memory_store, MockUpstream(lambda body: answer))
    counting, release = threading.Event(), threading.Event()
    counter_for = turns_module.counter_for

    def held_counter(model: str) -> Any:
        encoding, count = counter_for(model)

        def held(message: Any) -> int:
            if message.get("role") == "assistant":  # the answer's count waits to be let go
                counting.set()
                release.wait(5)
            return count(message)

        return encoding, held

    monkeypatch.setattr(turns_module, "counter_for", held_counter)
    body = {"model": "mock/m", "messages": [user("say a lot")], "conversation_id": "counted"}
    turn = await turns.prepare(parse_chat(body))
    call = asyncio.ensure_future(turns.complete(turn))
    assert await asyncio.to_thread(counting.wait, 5)
    call.cancel()  # the client left while the answer was being counted
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    outcome = await turns.close(turn, asyncio.CancelledError())
    assert outcome.committed
    view = await load(memory_store, "counted")
    assert view.response_ids == [turn.response_id]
    assert view.history[-1] == {"role": "assistant", "content": answer}


async def test_a_clients_own_gateway_fields_never_reach_the_provider() -> None:
    """A `gateway.traceparent` in the body became the provider request's raw header: a value with
    a line break and a second request in it was written on a kept connection, and one tenant's
    answer went to another's turn."""
    upstream = MockUpstream()
    smuggled = "00-" + "a" * 32 + "-" + "b" * 16 + "-01\r\n\r\nPOST /v1/chat/completions HTTP/1.1\r\nX: y"
    fields = {"gateway.traceparent": smuggled, "gateway.cache_key": "someone-else", "gateway.other": 1}
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await chat(client, [user("hi")], **fields)
        assert r.status_code == 200, r.text
    assert upstream.traceparents == [None]  # (not a W3C traceparent: no header at all)
    assert not any(key.startswith("gateway.") for key in upstream.requests[-1])


def test_a_header_that_would_break_the_request_is_never_written() -> None:
    from gateway.upstream.http1 import head_lines

    assert head_lines({"traceparent": "00-abc", "x-team": "ml"}) == b"traceparent: 00-abc\r\nx-team: ml\r\n"
    for bad in ({"x": "a\r\nPOST / HTTP/1.1"}, {"x": "a\nb"}, {"x\r\ny": "v"}, {"x": "a\x00"}, {"x": "€"}):
        with pytest.raises(ValueError):
            head_lines(bad)


async def test_a_turn_cut_by_the_servers_stop_is_logged_as_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A turn that outlived the shutdown's grace got its 503 and was recorded as an `error` (its
    log line, the failed-turns metric, its response log), where the metrics name `cancelled`."""
    import logging

    def stopped(body: dict[str, Any]) -> str:
        raise asyncio.CancelledError("graceful shutdown")  # (as uvicorn cancels what outlives it)

    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream(stopped)) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            body = {"model": "mock/m", "messages": [user("hi")], "conversation_id": "c"}
            r = await client.post("/v1/chat/completions", json=body)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    (line,) = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "gateway.access"]
    assert (line["status"], line["outcome"], line["error"]["code"]) == (503, "cancelled", "shutting_down")
    assert 'gateway_failed_turns_total{outcome="cancelled"} 1.0' in metrics
    (records,) = [await store.read_response(r.headers["x-response-id"])]
    assert records[-1]["type"] == "incomplete" and records[-1]["reason"] == "cancelled"
    assert records[-1]["error"]["code"] == "shutting_down"


async def test_a_stream_cut_by_the_servers_stop_is_logged_as_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cut after its first chunk, a stream's in-band `shutting_down` was logged and counted as an
    `error`; a whole answer cut so was `cancelled`."""
    import logging

    class StopsMidStream(MockUpstream):
        async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:  # type: ignore[override]
            async for chunk in super().stream(body, waited=waited):
                yield chunk
                raise asyncio.CancelledError("graceful shutdown")  # (as uvicorn cancels what outlives it)

    async with build_client(make_settings(), MemoryStore(), StopsMidStream()) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            body = {"model": "mock/m", "stream": True, "messages": [user("hi")], "conversation_id": "c"}
            r = await client.post("/v1/chat/completions", json=body)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200 and "shutting_down" in r.text and "[DONE]" not in r.text
    (line,) = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "gateway.access"]
    assert (line["status"], line["outcome"], line["error"]["code"]) == (200, "cancelled", "shutting_down")
    assert 'gateway_failed_turns_total{outcome="cancelled"} 1.0' in metrics


async def turns_while_refusing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    store: JsonlStore,
    create: Any,
    opening: Any,
) -> tuple[httpx.Response, httpx.Response, httpx.Response, Any]:
    """Two turns while the data dir refuses writes (`create` and `opening` in place of the spare
    files' and `os.open`), each checked to reach the provider only the first time, then one once
    it takes them again: the three answers, and the app client's reads after them."""
    upstream = MockUpstream()
    real_create, real_open = store.spares.create, os.open
    body = {"model": "mock/m", "messages": [user("hi")], "conversation_id": "c"}
    async with build_client(make_settings(tmp_path), store, upstream) as client:
        monkeypatch.setattr(store.spares, "create", create)
        monkeypatch.setattr(os, "open", opening)
        first = await client.post("/v1/chat/completions", json=body)
        held = await client.post("/v1/chat/completions", json=body)
        assert len(upstream.requests) == 1  # (the second was refused before its provider was asked)
        monkeypatch.setattr(store.spares, "create", real_create)  # (room again: a probe sees it)
        monkeypatch.setattr(os, "open", real_open)
        again = await client.post("/v1/chat/completions", json=body)
        assert len(upstream.requests) == 2
        reads = {
            "items": (await client.get("/v1/conversations/c/items")).json()["data"],
            "refused": (await client.get(f"/v1/responses/{first.headers['x-response-id']}")).json(),
            "stored": (await client.get("/v1/chat/completions")).json()["data"],
        }
    assert first.status_code == held.status_code == 503
    return first, held, again, reads


async def test_a_data_dir_refusing_writes_refuses_turns_before_their_provider_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full or read-only data dir was found out only once the provider had answered: every turn
    (and each of an SDK's retries of its 503) was a provider call whose answer was thrown away.
    After the data dir refused a response log, a turn looks first whether it takes writes again."""
    import errno

    store = JsonlStore(tmp_path / "var")
    await store.open()

    def full(path: Path, flags: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    real_open = os.open

    def no_room(path: Any, flags: int, *args: Any) -> int:  # (the probe's file finds no room either)
        if ".probe-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args)

    _, held, again, reads = await turns_while_refusing(tmp_path, monkeypatch, store, full, no_room)
    assert "No space left on device" in held.json()["error"]["message"]
    assert held.json()["error"]["code"] == "storage_unavailable"
    assert again.status_code == 200 and len(reads["items"]) == 2


async def test_a_conversations_folder_refusing_writes_refuses_turns_before_their_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the response logs writable but `logs/conversations` not (read-only on its own), each
    turn was a provider call whose answer was thrown away when its index could not be made."""
    import errno

    store = JsonlStore(tmp_path / "var")
    await store.open()
    conversations = str(store.data_dir.conversations_dir)
    real_create, real_open = store.spares.create, os.open

    def create(path: Path, flags: int) -> int:
        if str(path).startswith(conversations):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_create(path, flags)

    def opening(path: Any, flags: int, *args: Any) -> int:
        if str(path).startswith(conversations) and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    first, held, again, reads = await turns_while_refusing(tmp_path, monkeypatch, store, create, opening)
    assert "Read-only file system" in held.json()["error"]["message"]
    assert again.status_code == 200
    # The turn the client was told failed read back as a completed response, and was listed.
    assert reads["refused"]["status"] != "completed"
    assert reads["refused"]["error"]["code"] == "storage_unavailable"  # (as its 503 said)
    assert [c["id"] for c in reads["stored"]] == [again.headers["x-response-id"]]


async def test_a_disk_with_less_room_than_a_turn_refuses_it_before_its_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for a small file but not for a turn's log, the check written before a turn (a
    few bytes) passed, and each turn was still a provider call whose answer was thrown away. It
    now writes as much as was refused."""
    import errno

    store = JsonlStore(tmp_path / "var")
    await store.open()
    upstream = MockUpstream()
    real_write = os.write

    def little_room(fd: int, data: Any) -> int:
        if len(data) > 4000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    body = {"model": "mock/m", "messages": [user("hello " * 1000)], "conversation_id": "c"}
    async with build_client(make_settings(tmp_path), store, upstream) as client:
        monkeypatch.setattr(os, "write", little_room)
        first = await client.post("/v1/chat/completions", json=body)
        held = await client.post("/v1/chat/completions", json=body)
        assert len(upstream.requests) == 1  # (the second was refused before its provider was asked)
        monkeypatch.setattr(os, "write", real_write)
        again = await client.post("/v1/chat/completions", json=body)
    assert first.status_code == held.status_code == 503
    assert again.status_code == 200 and len(upstream.requests) == 2
