"""Streams rebuilt into the stored answer: tool-call arguments split across chunks, several
calls interleaved, refusals, usage; and the same stream through the app and back."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.exceptions import UpstreamProtocolError
from gateway.services.stream import StreamAccumulator, output_message
from gateway.store.memory import MemoryStore
from gateway.upstream.base import Body, Chunk
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings
from tests.views import load


def delta(**fields: Any) -> Chunk:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def call_piece(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> Chunk:
    function: dict[str, str] = {"arguments": args}
    if name is not None:
        function["name"] = name
    call: dict[str, Any] = {"index": index, "function": function}
    if id is not None:
        call.update(id=id, type="function")
    return delta(tool_calls=[call])


# Two calls, their arguments cut mid-token and interleaved, as providers stream them.
SPLIT_CALLS: list[Chunk] = [
    delta(role="assistant", content=None),
    call_piece(0, id="call_a", name="get_weather", args=""),
    call_piece(0, args='{"ci'),
    call_piece(1, id="call_b", name="get_time", args='{"tz": "Eu'),
    call_piece(0, args='ty": "Par'),
    call_piece(1, args='rope/Paris"}'),
    call_piece(0, args='is"}'),
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}},
]
EXPECTED_CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "id": "call_b",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'},
    },
]


def test_split_tool_call_arguments_are_joined_per_call() -> None:
    acc = StreamAccumulator()
    for chunk in SPLIT_CALLS:
        acc.add(chunk)
    assert acc.message() == {"role": "assistant", "content": None, "tool_calls": EXPECTED_CALLS}
    assert acc.finish_reason == "tool_calls"
    assert acc.usage == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    for call in EXPECTED_CALLS:
        orjson.loads(call["function"]["arguments"])  # whole JSON again


def test_calls_streamed_without_index_stay_apart() -> None:
    """Some OpenAI-compatible servers leave `index` out: two calls were stored as one named
    "ab" with arguments "{}{}" (and replayed so)."""
    acc = StreamAccumulator()
    pieces = [
        {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"x"'}},
        {"function": {"arguments": ": 1}"}},  # more of the same call
        {"id": "call_2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
    ]
    for piece in pieces:
        acc.add({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]})
    calls = acc.message()["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_1", "a", '{"x": 1}'),
        ("call_2", "b", "{}"),
    ]


def test_a_call_streamed_without_an_id_gets_one_the_client_sees_too() -> None:
    """vLLM, Ollama and others stream calls without ids: one was stored with a null id and sent
    back so on every later turn (a provider's 400), and the client had no id to answer."""
    acc = StreamAccumulator()
    first = {"type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    chunks = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, **first}]}, "finish_reason": None}]},
        {
            "choices": [
                {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}
            ]
        },
    ]
    for chunk in chunks:
        acc.add(chunk)
    [call] = acc.message()["tool_calls"]
    assert call["id"] and call["id"].startswith("call_") and call["function"]["arguments"] == '{"a": 1}'
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["id"] == call["id"]  # what the client got


def test_calls_a_provider_gave_one_id_get_ids_apart_streamed_or_not() -> None:
    """Two parallel calls with one id were relayed so; a client that resent them (Anthropic's
    SDK flow) was refused "two tool_use blocks with one id", and results could not tell them apart."""
    from gateway.services.stream import output_message

    acc = StreamAccumulator()
    chunks = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": k, "id": "call_same", "type": "function", "function": {"name": name, "arguments": "{}"}}
        ]}, "finish_reason": None}]}
        for k, name in enumerate(("a", "b"))
    ]  # fmt: skip
    for chunk in chunks:
        acc.add(chunk)
    first, second = acc.message()["tool_calls"]
    assert first["id"] == "call_same" and second["id"] != "call_same" and second["id"].startswith("call_")
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0]["id"] == second["id"]  # what the client got
    same = {"id": "call_same", "type": "function", "function": {"name": "a", "arguments": "{}"}}
    whole = output_message({"role": "assistant", "content": None, "tool_calls": [same, {**same}]})
    assert len({call["id"] for call in whole["tool_calls"]}) == 2


def test_a_call_streamed_without_arguments_is_stored_as_a_whole_answers_is() -> None:
    acc = StreamAccumulator()
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "now"}}
    acc.add({"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]})
    assert acc.message()["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}  # (was "")


def test_text_refusal_and_other_choices() -> None:
    acc = StreamAccumulator()
    for chunk in [
        delta(role="assistant", content="Hel"),
        {"choices": [{"index": 1, "delta": {"content": "other choice"}, "finish_reason": None}]},
        delta(content="lo"),
        delta(refusal="I can"),
        delta(refusal="not."),
        {"choices": "not a list"},  # ignored, not fatal
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]:
        acc.add(chunk)
    assert acc.message() == {"role": "assistant", "content": "Hello", "refusal": "I cannot."}


def test_output_message_keeps_known_fields_and_drops_nulls() -> None:
    raw = {
        "role": "assistant",
        "content": "x",
        "refusal": None,
        "audio": {"id": "a", "data": "UklG"},
        "tool_calls": [],
    }
    # an audio answer is kept by its id (replayed as OpenAI documents), never its data
    assert output_message(raw) == {"role": "assistant", "content": "x", "audio": {"id": "a"}}
    calls = output_message({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]})
    assert calls == {  # a call without arguments is stored with empty ones, as providers take it back
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


@pytest.mark.parametrize(
    "message",
    [
        {"content": 12345},
        {"content": {"text": "x"}},
        {"content": "x", "refusal": 5},
        {"tool_calls": [{"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}, "junk"]},
        {"tool_calls": "c"},
        {"function_call": {"name": 5, "arguments": "{}"}},
    ],
)
def test_a_reply_that_could_not_be_replayed_is_the_providers_bad_answer(message: dict[str, Any]) -> None:
    """A whole answer was stored as it came (a stream's chunks are checked): `content: 12345` or
    a call's object `arguments` went to the provider on every later turn, and a client resending
    its history got a 400 from the gateway's own validation on every turn."""
    with pytest.raises(UpstreamProtocolError):
        output_message({"role": "assistant", **message})


class SplitStream(MockUpstream):
    """Streams SPLIT_CALLS for the first request, then a plain answer."""

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        self.requests.append(body)
        if len(self.requests) == 1:
            for chunk in SPLIT_CALLS:
                yield chunk
            return
        async for chunk in super().stream(body):
            yield chunk


async def test_split_tool_calls_through_the_app_are_stored_whole_and_replayed() -> None:
    store = MemoryStore()
    upstream = SplitStream()
    async with build_client(make_settings(), store, upstream) as client:
        body = {
            "model": "mock/m",
            "conversation_id": "tools",
            "stream": True,
            "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        view = await load(store, "tools")
        assert view.history[-1] == {"role": "assistant", "content": None, "tool_calls": EXPECTED_CALLS}
        results = [
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_b", "content": "14:00"},
        ]
        r2 = await client.post(
            "/v1/chat/completions", json={"model": "mock/m", "conversation_id": "tools", "messages": results}
        )
        assert r2.status_code == 200
        sent = upstream.requests[-1]["messages"]
        assert sent[-3] == {"role": "assistant", "content": None, "tool_calls": EXPECTED_CALLS}
        assert sent[-2:] == results


class BreaksMidStream(MockUpstream):
    """Sends a first chunk, then fails as a provider dropping the connection does."""

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        from gateway.exceptions import UpstreamProtocolError

        self.requests.append(body)
        first = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        yield {**first, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}
        raise UpstreamProtocolError("Provider 'mock' at mock://upstream failed: the connection was reset")


async def test_a_stream_that_fails_after_its_first_byte_says_so_in_its_line_and_metrics(
    caplog: Any,
) -> None:
    """It was logged `status 200, outcome incomplete` with no reason, counted as a plain 200,
    and its provider time left out of gateway_upstream_seconds."""
    import logging

    body = {
        "model": "mock/m",
        "conversation_id": "cut",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with build_client(make_settings(), MemoryStore(), BreaksMidStream()) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        metrics = (await client.get("/metrics")).text
    assert "upstream_bad_response" in events[-1]  # the in-band error
    line = orjson.loads(next(rec.getMessage() for rec in caplog.records if rec.name == "gateway.access"))
    assert (line["status"], line["outcome"], line["error"]["code"]) == (200, "error", "upstream_bad_response")
    assert 'gateway_failed_turns_total{outcome="error"} 1.0' in metrics
    assert 'gateway_upstream_seconds_count{provider="mock"} 1.0' in metrics


async def test_a_stream_that_is_not_utf8_is_the_providers_bad_answer() -> None:
    """A whole answer that is not UTF-8 is a 502; a stream's was stored with U+FFFD in place
    of its bytes."""
    from aiohttp import web

    from gateway.upstream.openai import OpenAIUpstream
    from tests.helpers import serving_app

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "ok XX"}, "finish_reason": None}]}
        line = b"data: " + orjson.dumps(chunk).replace(b"XX", b"\xff\xfe") + b"\n\n"
        await response.write(line)
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await response.write(b"data: " + orjson.dumps(done) + b"\n\ndata: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    store = MemoryStore()
    async with serving_app(app) as url:
        provider = make_settings().providers["mock"].model_copy(update={"base_url": f"{url}/v1"})
        upstream = OpenAIUpstream("mock", provider)
        try:
            async with build_client(make_settings(), store, upstream) as client:
                body = {"model": "mock/m", "conversation_id": "u8", "stream": True}
                r = await client.post(
                    "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}
                )
                assert r.status_code == 502 and "UTF-8" in r.text, r.text
        finally:
            await upstream.aclose()
    assert [r for rs in store.responses.values() for r in rs if r["type"] == "response"] == []


def _calls_of(pieces: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """The stored calls (id, name, arguments) of a stream of tool-call pieces, and the pieces
    as the client got them."""
    acc = StreamAccumulator()
    for piece in pieces:
        acc.add({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]})
    calls = acc.message()["tool_calls"]
    return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls], pieces


def test_parallel_calls_from_servers_without_index_or_id_stay_apart() -> None:
    """Ollama sends `index: 0` for every call of a parallel batch, others no index or no id:
    the calls were merged into one named "get_weatherget_weather" (arguments glued), the second
    call's id was the first's, and the client's pieces had no index."""
    paris = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    rome = {"name": "get_weather", "arguments": '{"city":"Rome"}'}
    # no index, no id, each call whole
    calls, sent = _calls_of([{"function": dict(paris)}, {"function": dict(rome)}])
    assert [c[1:] for c in calls] == [("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Rome"}')]
    assert calls[0][0] != calls[1][0] and [p["index"] for p in sent] == [0, 1]
    assert [p["id"] for p in sent] == [c[0] for c in calls]
    # index 0 for both, ids of their own, arguments in pieces
    calls, sent = _calls_of(
        [
            {"index": 0, "id": "call_a", "function": {"name": "get_weather", "arguments": '{"city":'}},
            {"index": 0, "function": {"arguments": '"Paris"}'}},
            {"index": 0, "id": "call_b", "function": {"name": "get_weather", "arguments": '{"city":'}},
            {"index": 0, "function": {"arguments": '"Rome"}'}},
        ]
    )
    assert calls == [
        ("call_a", "get_weather", '{"city":"Paris"}'),
        ("call_b", "get_weather", '{"city":"Rome"}'),
    ]
    assert [p["index"] for p in sent] == [0, 0, 1, 1]  # what the client's SDK puts together
    # a server that says the name again in each numbered piece: one call still
    calls, _ = _calls_of(
        [
            {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": '{"x":'}},
            {"index": 0, "function": {"name": "f", "arguments": " 1}"}},
        ]
    )
    assert calls == [("call_a", "f", '{"x": 1}')]


def test_a_whole_answers_call_without_an_id_or_arguments_is_settled_for_client_and_store() -> None:
    """A call without an id was a 502 (streamed, it got an id); `arguments: ""` was stored and
    sent back on every later turn (a strict provider's 400), and the client got null or ""."""
    raw = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": ""}},
            {"id": "", "type": "function", "function": {"name": "today"}},
        ],
    }
    stored = output_message(raw)
    ids = [c["id"] for c in stored["tool_calls"]]
    assert all(i.startswith("call_") for i in ids) and ids[0] != ids[1]
    assert [c["function"]["arguments"] for c in stored["tool_calls"]] == ["{}", "{}"]
    assert [c["id"] for c in raw["tool_calls"]] == ids  # the client's copy says the same
    assert [c["function"]["arguments"] for c in raw["tool_calls"]] == ["{}", "{}"]


class NoArguments(MockUpstream):
    """Streams two calls that never get arguments: one before the chunk that finishes the answer,
    one begun in it."""

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        self.requests.append(body)
        yield call_piece(0, id="call_a", name="now")
        finishing = call_piece(1, id="call_b", name="today")
        finishing["choices"][0]["finish_reason"] = "tool_calls"
        yield finishing


def _sse_data(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_calls_streamed_without_arguments_reach_the_client_as_they_are_stored() -> None:
    """The client's stream said arguments "" while the stored calls (and so retrieve, the next
    turn and a Responses stream's `function_call_arguments.done`) said "{}"."""
    asked = {"model": "mock/m", "stream": True, "store": True}
    user = [{"role": "user", "content": "When?"}]
    async with build_client(make_settings(), MemoryStore(), NoArguments()) as client:
        r = await client.post("/v1/chat/completions", json={**asked, "messages": user})
        said: dict[int, str] = {}
        for chunk in _sse_data(r.text):
            for piece in chunk["choices"][0]["delta"].get("tool_calls") or []:
                said[piece["index"]] = said.get(piece["index"], "") + piece["function"].get("arguments", "")
        stored = (await client.get(f"/v1/chat/completions/{_sse_data(r.text)[0]['id']}")).json()
        assert said == {0: "{}", 1: "{}"}
        assert [c["function"]["arguments"] for c in stored["choices"][0]["message"]["tool_calls"]] == [
            "{}",
            "{}",
        ]

        r = await client.post("/v1/responses", json={"model": "mock/m", "input": "When?", "stream": True})
        events = _sse_data(r.text)
        deltas: dict[int, str] = {}
        for e in events:
            if e["type"] == "response.function_call_arguments.delta":
                deltas[e["output_index"]] = deltas.get(e["output_index"], "") + e["delta"]
        done = {
            e["output_index"]: e["arguments"]
            for e in events
            if e["type"] == "response.function_call_arguments.done"
        }
        assert deltas == done == {0: "{}", 1: "{}"}

        messages = {"model": "mock/m", "max_tokens": 64, "messages": user, "stream": True}
        r = await client.post("/v1/messages", json=messages, headers={"anthropic-version": "2023-06-01"})
        inputs: dict[int, str] = {}
        for e in _sse_data(r.text):
            if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
                inputs[e["index"]] = ""
            elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
                inputs[e["index"]] += e["delta"]["partial_json"]
        assert [json.loads(text or "{}") for text in inputs.values()] == [{}, {}]


class CutCall(MockUpstream):
    """Streams a call cut short by the token limit first, then answers plainly."""

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        self.requests.append(body)
        if len(self.requests) > 1:
            async for chunk in super().stream(body):
                yield chunk
            return
        yield call_piece(0, id="call_cut", name="weather", args='{"city": "Pa')
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}


async def test_a_call_cut_short_goes_back_to_the_provider_with_json_arguments() -> None:
    """A call cut short by max_tokens was stored as answered and sent back so on every later
    turn: `{"city": "Pa`, which providers that read arguments as JSON refuse."""
    upstream = CutCall()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {"model": "mock/m", "conversation_id": "cut", "stream": True, "store": True}
        r = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Paris?"}]}
        )
        rid = _sse_data(r.text)[0]["id"]
        again = {**body, "stream": False, "messages": [{"role": "user", "content": "Go on."}]}
        r = await client.post("/v1/chat/completions", json=again)
        assert r.status_code == 200, r.text
        stored = (await client.get(f"/v1/chat/completions/{rid}")).json()
        context = (await client.get("/v1/conversations/cut/context")).json()
    [sent_call] = [m for m in upstream.requests[-1]["messages"] if m.get("tool_calls")][0]["tool_calls"]
    assert sent_call["function"]["arguments"] == "{}"
    assert stored["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    [snapshot_call] = [m for m in context["messages"] if m.get("tool_calls")][0]["tool_calls"]
    assert snapshot_call["function"]["arguments"] == "{}"  # (what the model was given)


def test_a_calls_id_and_name_said_again_in_each_piece_reach_the_client_once() -> None:
    """Servers that repeat a call's id and name in every piece: the client's SDK adds strings up
    (`call_1call_1call_1`), as OpenAI says each once, in the call's first piece."""
    acc = StreamAccumulator()
    pieces = [
        call_piece(0, id="call_1", name="get_weather", args=part) for part in ('{"city"', ': "Paris"', "}")
    ]
    said = {"id": "", "name": "", "arguments": ""}
    for chunk in pieces:
        acc.add(chunk)
        [piece] = chunk["choices"][0]["delta"]["tool_calls"]
        said["id"] += piece.get("id", "")
        said["name"] += piece["function"].get("name", "")
        said["arguments"] += piece["function"].get("arguments", "")
    assert said == {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    [call] = acc.message()["tool_calls"]
    assert (call["id"], call["function"]) == (
        "call_1",
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    )


async def test_a_call_cut_short_is_the_incomplete_item_of_an_incomplete_response() -> None:
    """The response was `incomplete` but its cut call said `completed` (a cut text said
    `incomplete`)."""
    async with build_client(make_settings(), MemoryStore(), CutCall()) as client:
        r = await client.post("/v1/responses", json={"model": "mock/m", "input": "Paris?", "stream": True})
        final = _sse_data(r.text)[-1]["response"]
        kept = (await client.get(f"/v1/responses/{final['id']}")).json()
    for response in (final, kept):
        assert response["status"] == "incomplete"
        assert [(i["type"], i["status"]) for i in response["output"]] == [("function_call", "incomplete")]
