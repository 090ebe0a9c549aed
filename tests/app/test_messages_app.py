"""Anthropic's Messages API in-process (the app over a MockUpstream): the one log line and the
metrics every turn gets, failures before and after the stream began, and the stored turn."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.exceptions import UpstreamProtocolError, UpstreamTimeout
from gateway.store.memory import MemoryStore
from gateway.upstream.base import Body, Chunk, ServerWindow
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

VERSION = {"anthropic-version": "2023-06-01"}


def request(text: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "mock/m", "max_tokens": 64, "messages": [{"role": "user", "content": text}], **fields}


def events_of(body: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_messages_turns_get_the_log_line_and_metrics_chat_turns_get(
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            for stream in (False, True):
                r = await client.post(
                    "/v1/messages", json=request(stream=stream, conversation_id="logged"), headers=VERSION
                )
                assert r.status_code == 200
            streamed = events_of(r.text)
            bad = await client.post("/v1/messages", json={"model": "mock/m", "messages": []}, headers=VERSION)
            assert bad.status_code == 400
            counted = await client.post("/v1/messages/count_tokens", json=request(), headers=VERSION)
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        metrics = (await client.get("/metrics")).text
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(line["event"], line["status"], line.get("outcome")) for line in lines] == [
        ("message", 200, "complete"),
        ("message", 200, "complete"),
        ("message", 400, "refused"),
        ("http.request", 200, None),
    ]
    assert lines[1]["conversation_id"] == "logged" and lines[1]["tokens"]["total"] > 0
    # The stream's message_start says the prompt as the window counted it.
    assert streamed[0][1]["message"]["usage"]["input_tokens"] == lines[1]["tokens"]["total"]
    assert streamed[0][1]["message"]["conversation_id"] == "logged"  # as on a whole message
    assert 'gateway_upstream_seconds_count{provider="mock"} 2.0' in metrics  # both turns counted
    assert 'gateway_requests_total{route="create_message",status="200"} 2.0' in metrics
    assert len(upstream.requests) == 2


class BreaksMidStream(MockUpstream):
    """Sends a first chunk, then fails as a provider dropping the connection does."""

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        self.requests.append(body)
        yield {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}  # fmt: skip
        raise UpstreamProtocolError("Provider 'mock' at mock://upstream failed: the connection was reset")


async def test_a_stream_that_breaks_after_it_began_ends_with_an_error_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with build_client(make_settings(), MemoryStore(), BreaksMidStream()) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            r = await client.post(
                "/v1/messages", json=request(stream=True, conversation_id="cut"), headers=VERSION
            )
        assert r.status_code == 200
        events = events_of(r.text)
        items = await client.get("/v1/conversations/cut")
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert events[-1][1] == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "Provider 'mock' at mock://upstream failed: the connection was reset",
        },
    }
    assert items.status_code == 404  # nothing stored
    line = json.loads(next(rec.getMessage() for rec in caplog.records if rec.name == "gateway.access"))
    assert (line["event"], line["status"], line["outcome"]) == ("message", 200, "error")


async def test_a_failure_before_the_answer_is_its_status_in_anthropics_shape() -> None:
    def times_out(body: Body) -> str:
        raise UpstreamTimeout("Provider 'mock' did not answer within 5 s")

    async with build_client(make_settings(), MemoryStore(), MockUpstream(times_out)) as client:
        for stream in (False, True):
            r = await client.post("/v1/messages", json=request(stream=stream), headers=VERSION)
            assert r.status_code == 504
            # Anthropic's `request_id` (body) and `request-id` (header): the attempt's log
            rid = r.headers["x-response-id"]
            assert rid.startswith("mock-m-") and r.headers["request-id"] == rid
            assert r.json() == {
                "type": "error",
                "error": {"type": "timeout_error", "message": "Provider 'mock' did not answer within 5 s"},
                "request_id": rid,
            }


async def test_the_stored_turn_is_the_chat_turn_the_other_apis_read() -> None:
    """A Messages turn is stored as chat messages: chat completions and the Responses API read it."""
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        history = [
            {"role": "user", "content": [{"type": "text", "text": "my name is Bob"}]},
        ]
        r = await client.post(
            "/v1/messages",
            json={**request(), "messages": history, "system": [{"type": "text", "text": "Be brief."}]},
            headers={**VERSION, "X-Conversation-Id": "shared"},
        )
        assert r.status_code == 200
        rid = r.json()["id"]
        stored = (await client.get(f"/v1/responses/{rid}")).json()
        assert stored["output"][0]["content"][0]["text"].startswith("Nice to meet you, Bob")
        assert stored["gateway"]["request"]["system"] == [{"role": "system", "content": "Be brief."}]
        assert stored["gateway"]["request"]["input"] == [{"role": "user", "content": "my name is Bob"}]
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "conversation_id": "shared",
                "messages": [{"role": "user", "content": "what is my name?"}],
            },
        )
        assert chat.json()["choices"][0]["message"]["content"] == "Your name is Bob."
    assert upstream.requests[-1]["messages"][0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": None}, "'max_tokens' is required and must be an integer between 1 and 10000000"),
        ({"messages": []}, "'messages' must be a non-empty array"),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            "messages[0].role must be 'user' or 'assistant'",
        ),
        (
            {"messages": [{"role": "user", "content": []}]},
            "messages[0].content must be a string or a non-empty array of content blocks",
        ),
        ({"tools": [{"name": "x"}]}, "tools[0] must be a client tool: {name, description, input_schema}"),
        ({"system": 3}, "'system' must be a string or an array of text blocks"),
        (
            {"tool_choice": {"type": "sometimes"}},
            "'tool_choice' must be {type: auto}, {type: any}, {type: tool, name} or {type: none}",
        ),  # fmt: skip
    ],
)
async def test_a_bad_request_is_a_400_naming_the_field_as_anthropic_has_it(
    fields: dict[str, Any], message: str
) -> None:
    upstream = MockUpstream()
    body = {k: v for k, v in {**request(), **fields}.items() if v is not None}
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post("/v1/messages", json=body, headers=VERSION)
    request_id = r.headers["request-id"]  # Anthropic's, in the header and the body
    assert request_id.startswith("req_")
    assert (r.status_code, r.json()) == (
        400,
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
            "request_id": request_id,
        },
    )
    assert upstream.requests == []


async def test_a_messages_turn_is_no_stored_chat_completion() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        message = await client.post("/v1/messages", json=request(), headers=VERSION)
        chat = await client.post(
            "/v1/chat/completions", json={"model": "mock/m", "messages": [{"role": "user", "content": "hi"}]}
        )
        listed = (await client.get("/v1/chat/completions")).json()["data"]
        assert [c["id"] for c in listed] == [chat.json()["id"]]
        assert (await client.get(f"/v1/chat/completions/{message.json()['id']}")).status_code == 404
        assert (await client.get(f"/v1/responses/{message.json()['id']}")).status_code == 200


PREFILLED = [{"role": "user", "content": "Give JSON"}, {"role": "assistant", "content": "{"}]


def goes_on(body: Body) -> str:
    """A provider that goes on from the prefill `{` (and answers "ok" to anything else)."""
    last = body["messages"][-1]
    return '"a": 1}' if last["role"] == "assistant" and last["content"] == "{" else "ok"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_is_stored_as_the_beginning_of_its_answer(stream: bool) -> None:
    """A request ending with assistant text (Anthropic's prefill) was stored as a message of its
    own, then the answer as another: every later turn sent two assistant messages in a row,
    which strict chat templates refuse. The answer goes on from the prefill: stored as one."""

    upstream, prefilled = MockUpstream(goes_on), PREFILLED
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post(
            "/v1/messages",
            json=request(messages=prefilled, conversation_id="pre", stream=stream),
            headers=VERSION,
        )
        assert r.status_code == 200, r.text
        if stream:
            answered = "".join(
                data["delta"].get("text", "")
                for kind, data in events_of(r.text)
                if kind == "content_block_delta"
            )
        else:
            answered = r.json()["content"][0]["text"]
        nxt = await client.post("/v1/messages", json=request("next", conversation_id="pre"), headers=VERSION)
        items = (await client.get("/v1/conversations/pre/items?order=asc")).json()["data"]
    assert answered == '"a": 1}'  # as Anthropic's: what the model added
    assert upstream.requests[0]["messages"][-1] == {"role": "assistant", "content": "{"}  # sent as it is
    assert nxt.status_code == 200
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user", "assistant", "user"]
    assert upstream.requests[-1]["messages"][1]["content"] == '{"a": 1}'
    assert [(i["role"], i["content"][0]["text"]) for i in items[:2]] == [
        ("user", "Give JSON"),
        ("assistant", '{"a": 1}'),
    ]


@pytest.mark.parametrize("answer", ["string", "blocks"])
async def test_a_prefill_kept_apart_from_its_answer_is_the_one_turn_stored(answer: str) -> None:
    """LangChain keeps a prefill and the answer that went on from it as two assistant messages,
    which Anthropic's API makes one turn of. The gateway took the resent pair for an edit of the
    stored answer (prefill and answer as one message): a branch, and the two sent in a row."""

    upstream, prefilled = MockUpstream(goes_on), PREFILLED
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post(
            "/v1/messages", json=request(messages=prefilled, conversation_id="pf"), headers=VERSION
        )
        assert r.status_code == 200, r.text
        said = r.json()["content"][0]["text"]
        kept: object = said if answer == "string" else [{"type": "text", "text": said}]
        history = [*prefilled, {"role": "assistant", "content": kept}, {"role": "user", "content": "Thanks."}]
        nxt = await client.post(
            "/v1/messages", json=request(messages=history, conversation_id="pf"), headers=VERSION
        )
        items = (await client.get("/v1/conversations/pf/items?order=asc")).json()["data"]
        logged = (await client.get(f"/v1/responses/{nxt.json()['id']}")).json()["gateway"]
    assert nxt.status_code == 200
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user", "assistant", "user"]
    assert upstream.requests[-1]["messages"][1]["content"] == '{"a": 1}'
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("user", "Give JSON"),
        ("assistant", '{"a": 1}'),
        ("user", "Thanks."),
        ("assistant", "ok"),
    ]
    assert logged["request"].get("branch") is None


def test_assistant_messages_in_a_row_are_one_turn_of_text_and_calls() -> None:
    """As Anthropic's API combines them: text joined as written, then the calls of both."""
    from gateway.context.anthropic import chat_messages

    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}
    made = chat_messages(
        None,
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "Let me "},
            {"role": "assistant", "content": [{"type": "text", "text": "look."}, use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]},
            {"role": "assistant", "content": "It is 2.", "is_feedback": True},
            {"role": "assistant", "content": "Two."},
        ],
    )
    assert [m["role"] for m in made] == ["user", "assistant", "tool", "assistant", "assistant"]
    assert made[1]["content"] == "Let me look." and [c["id"] for c in made[1]["tool_calls"]] == ["t1"]
    assert made[3].get("is_feedback") and made[4]["content"] == "Two."  # (feedback stays its own)


async def test_a_call_with_broken_arguments_resent_as_given_is_no_edit() -> None:
    """A call whose arguments are not JSON (small models write such) is given to the client as
    `input: {}`; resent so with its result, it was taken for an edit of the stored call: a branch
    that left the turn's own log behind."""

    def answer(body: Body) -> Any:
        if body["messages"][-1]["role"] == "tool":
            return "done"
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "not json {"}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    upstream = MockUpstream(answer)
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    asked = [{"role": "user", "content": "call f"}]
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post(
            "/v1/messages", json=request(messages=asked, tools=tools, conversation_id="bad"), headers=VERSION
        )
        (use,) = r.json()["content"]
        assert use["type"] == "tool_use" and use["input"] == {}
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": "2"}
        history = [*asked, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
        nxt = await client.post(
            "/v1/messages",
            json=request(messages=history, tools=tools, conversation_id="bad"),
            headers=VERSION,
        )
        logged = (await client.get(f"/v1/responses/{nxt.json()['id']}")).json()["gateway"]
    assert nxt.status_code == 200 and logged["request"].get("branch") is None
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    # The stored call, as providers take it back (its arguments as answered are not JSON).
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("empty", ["", []])
async def test_an_empty_prefill_is_no_prefill(empty: object) -> None:
    """`[user, assistant ""]` stored an empty assistant message and then the answer: every later
    turn sent two assistant messages in a row, the first empty."""
    upstream = MockUpstream()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": empty}]
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post(
            "/v1/messages", json=request(messages=messages, conversation_id="e"), headers=VERSION
        )
        assert r.status_code == 200, r.text
        await client.post("/v1/messages", json=request("next", conversation_id="e"), headers=VERSION)
    assert [m["role"] for m in upstream.requests[0]["messages"]] == ["user"]
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user", "assistant", "user"]


async def test_count_tokens_with_max_tokens_counts_what_the_turn_then_sends() -> None:
    """Counted without the turn's `max_tokens`, the window was cut where the gateway's own reserve
    put it: past three quarters of the window the count said half of what the turn then sent."""
    base = make_settings()
    settings = base.model_copy(
        update={
            "context": base.context.model_copy(update={"max_context_tokens": 1000, "reserve_tokens": 250})
        }
    )
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        for i in range(30):
            said = "sentence " * 12
            r = await client.post(
                "/v1/messages",
                json=request(f"{i}: {said}", conversation_id="count", max_tokens=40),
                headers=VERSION,
            )
            assert r.status_code == 200
        ask = request("and now?", conversation_id="count", max_tokens=40)
        counted = (await client.post("/v1/messages/count_tokens", json=ask, headers=VERSION)).json()
        assert (await client.post("/v1/messages", json=ask, headers=VERSION)).status_code == 200
        sent = (await client.get("/v1/conversations/count/context")).json()
    assert counted["input_tokens"] == sent["tokens"]["total"]


async def test_count_tokens_for_a_users_new_conversation_counts_its_recap() -> None:
    """`metadata.user_id` names the end user as on a turn: the count left the recap out, which
    the turn then sent (62 tokens more here)."""
    base = make_settings()
    settings = base.model_copy(update={"sessions": base.sessions.model_copy(update={"recap": True})})
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        said = request("my flight is LH 454 to Berlin", conversation_id="a", metadata={"user_id": "alice"})
        assert (await client.post("/v1/messages", json=said, headers=VERSION)).status_code == 200
        ask = request("hi", conversation_id="b", metadata={"user_id": "alice"})
        counted = (await client.post("/v1/messages/count_tokens", json=ask, headers=VERSION)).json()
        assert (await client.post("/v1/messages", json=ask, headers=VERSION)).status_code == 200
        sent = (await client.get("/v1/conversations/b/context")).json()
    assert counted["gateway"]["tokens"]["recap"] == sent["tokens"]["recap"] > 0
    assert counted["input_tokens"] == sent["tokens"]["total"]


async def test_count_tokens_with_no_conversation_counts_the_request_whole_as_it_is_sent() -> None:
    """A history resent with no conversation named was counted as a new conversation's first
    turn, cut to the window: the stateless turn sends it whole, so a client was told it fits and
    the turn was then refused by the provider."""
    base = make_settings()
    settings = base.model_copy(
        update={"context": base.context.model_copy(update={"max_context_tokens": 1000})}
    )
    history: list[dict[str, Any]] = []
    for i in range(30):
        history += [
            {"role": "user", "content": f"{i}: " + "sentence " * 30},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    body = {
        "model": "mock/m",
        "max_tokens": 64,
        "system": "Be brief.",
        "messages": [*history, {"role": "user", "content": "and now?"}],
    }
    upstream = MockUpstream()
    async with build_client(settings, MemoryStore(), upstream) as client:
        whole = (await client.post("/v1/messages/count_tokens", json=body, headers=VERSION)).json()
        named = {**body, "conversation_id": "new"}
        planned = (await client.post("/v1/messages/count_tokens", json=named, headers=VERSION)).json()
        short = {**body, "messages": body["messages"][-3:]}
        alone = (await client.post("/v1/messages/count_tokens", json=short, headers=VERSION)).json()
        as_new = {**short, "conversation_id": "new"}
        as_first = (await client.post("/v1/messages/count_tokens", json=as_new, headers=VERSION)).json()
        assert (await client.post("/v1/messages", json=body, headers=VERSION)).status_code == 200
    assert whole["gateway"]["truncated"] == 0 and whole["gateway"]["sent_messages"] == 62
    assert len(upstream.requests[-1]["messages"]) == 62  # (what the stateless turn sent)
    assert whole["input_tokens"] > 1000 > planned["input_tokens"] and planned["gateway"]["truncated"] > 0
    assert whole["gateway"]["context_window"] == 1000 and whole["gateway"]["reserve_tokens"] == 64
    # What fits is counted the same either way.
    assert alone["input_tokens"] == as_first["input_tokens"] and alone["gateway"] == as_first["gateway"]


class CountsPrompts(MockUpstream):
    """A server that counts prompts on request (as llama.cpp does): 3 tokens a message, and 7."""

    def __init__(self) -> None:
        super().__init__(window=ServerWindow(4096, "llama.cpp GET /props", prompt_counter="llama.cpp"))

    async def count_prompt(self, body: dict[str, Any]) -> int | None:
        return 3 * len(body["messages"]) + 7


async def test_count_tokens_with_no_conversation_takes_the_servers_count() -> None:
    """The stateless count was the gateway's own where the server counts prompts itself: 10
    tokens on llama.cpp for a prompt it counts 33, as a named conversation's count says."""
    body = request(messages=[{"role": "user", "content": "Hello there friend"}])
    async with build_client(make_settings(), MemoryStore(), CountsPrompts()) as client:
        alone = (await client.post("/v1/messages/count_tokens", json=body, headers=VERSION)).json()
        named = {**body, "conversation_id": "c"}
        planned = (await client.post("/v1/messages/count_tokens", json=named, headers=VERSION)).json()
    assert alone["input_tokens"] == planned["input_tokens"] == 3 + 7
    assert alone["gateway"]["counted_by"] == planned["gateway"]["counted_by"] == "server"


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


async def test_a_whole_history_resent_by_another_api_is_not_stored_twice() -> None:
    """A chat turn with an image (its detail set), a file and a `name`, resent whole through
    Messages, which carries none of those trimmings: the overlap is found, nothing repeated."""
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        first = [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
            {
                "type": "file",
                "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"},
            },
        ]
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "conversation_id": "moved",
                "messages": [{"role": "user", "name": "bob", "content": first}],
            },
        )
        assert chat.status_code == 200, chat.text
        answer = chat.json()["choices"][0]["message"]["content"]
        resent = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                    {
                        "type": "document",
                        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
                    },
                ],
            },
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "and now?"},
        ]
        r = await client.post(
            "/v1/messages",
            json={**request(), "messages": resent},
            headers={**VERSION, "X-Conversation-Id": "moved"},
        )
        assert r.status_code == 200, r.text
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[-1]["content"] == "and now?"


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_feedback_through_messages_and_responses_is_never_replayed(api: str) -> None:
    """`is_feedback` on a message (or on the request: its last message) is the gateway's flag on
    every API, as on chat completions: sent once, left out of later history whole."""
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:

        async def turn(text: str, **flags: Any) -> None:
            message = {"role": "user", "content": text, **flags.pop("message", {})}
            if api == "messages":
                r = await client.post(
                    "/v1/messages",
                    json={**request(), "messages": [message], **flags},
                    headers={**VERSION, "X-Conversation-Id": f"fb-{api}"},
                )
            else:
                r = await client.post(
                    "/v1/responses",
                    json={"model": "mock/m", "input": [message], "conversation_id": f"fb-{api}", **flags},
                )
            assert r.status_code == 200, r.text

        await turn("my name is Bob")
        await turn("that answer was bad", message={"is_feedback": True})
        await turn("too short", is_feedback=True)
        await turn("what is my name?")
        sent = [m["content"] for m in upstream.requests[-1]["messages"]]
        assert sent[0] == "my name is Bob" and sent[-1] == "what is my name?"
        assert len(sent) == 3  # the first exchange and the new question: no feedback turn
        assert all("is_feedback" not in m for r in upstream.requests for m in r["messages"])
        bad = {"role": "user", "content": "x", "is_feedback": "yes"}
        if api == "messages":
            r = await client.post("/v1/messages", json={**request(), "messages": [bad]}, headers=VERSION)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        else:
            r = await client.post("/v1/responses", json={"model": "mock/m", "input": [bad]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].is_feedback"


async def test_is_feedback_null_is_no_feedback_on_every_api() -> None:
    """A chat message's `"is_feedback": null` was a 400 where the other APIs took it as absent."""
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        for text in ("my name is Bob", "what is my name?"):
            message = {"role": "user", "content": text, "is_feedback": None}
            body = {"model": "mock/m", "conversation_id": "nul", "messages": [message]}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    assert [m["content"] for m in upstream.requests[-1]["messages"]][0] == "my name is Bob"
    assert all("is_feedback" not in m for m in upstream.requests[-1]["messages"])


@pytest.mark.parametrize(
    ("field", "value"), [("stream", "yes"), ("stop_sequences", "x"), ("metadata", "x"), ("max_tokens", 0)]
)
async def test_count_tokens_refuses_what_the_turn_refuses(field: str, value: Any) -> None:
    """`/v1/messages` refused these with a 400, `count_tokens` counted them: it counts what the
    turn would send, and the turn sends nothing."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        body = request(**{field: value})
        turn = await client.post("/v1/messages", json=body, headers=VERSION)
        counted = await client.post("/v1/messages/count_tokens", json=body, headers=VERSION)
    assert turn.status_code == counted.status_code == 400, (turn.text, counted.text)
    assert counted.json()["type"] == "error" and counted.json()["error"]["type"] == "invalid_request_error"
