"""Anthropic's Messages API, driven by the official `anthropic` SDK against `gateway serve` (the
built-in demo model and a mock OpenAI-compatible upstream): create, both ways of streaming, a
tool round trip, count_tokens, errors in Anthropic's shape, and one conversation continued
across chat completions, Responses and Messages in any order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Message

from gateway.context.tools import UNANSWERED_TOOL_RESULT
from tests.conftest import GatewayProcess, sdk, write_config
from tests.mockserver import MockServer

VERSION = {"anthropic-version": "2023-06-01"}
TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def claude(gateway: GatewayProcess, key: str = "client-key-not-forwarded") -> anthropic.Anthropic:
    """The official SDK pointed at a gateway process (no retries: a test sees every failure)."""
    return anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0)


def say(
    client: anthropic.Anthropic, cid: str, messages: Any, model: str = "mock/m", **kwargs: Any
) -> Message:
    return client.messages.create(
        model=model, max_tokens=256, messages=messages, extra_body={"conversation_id": cid}, **kwargs
    )


def items_of(gateway: GatewayProcess, cid: str) -> list[tuple[str, str]]:
    """The stored conversation as (role or item type, text), oldest first."""
    page = sdk(gateway).conversations.items.list(cid, order="asc", limit=100)
    out = []
    for item in page.data:
        if item.type == "message":
            out.append((item.role, "".join(getattr(part, "text", "") for part in item.content)))
        else:
            out.append((item.type, ""))
    return out


@pytest.mark.parametrize("model", ["demo", "mock/m"])
def test_create_remembers_with_the_conversation_named_in_the_body_or_a_header(
    gateway: GatewayProcess, upstream: MockServer, model: str
) -> None:
    client = claude(gateway)
    cid = f"claude-{model.replace('/', '-')}"
    first = say(
        client, cid, [{"role": "user", "content": "Hi, my name is Bob."}], model=model, system="Be brief."
    )
    assert first.type == "message" and first.role == "assistant" and first.model == model
    assert first.content[0].type == "text" and first.content[0].text.startswith("Nice to meet you, Bob")
    assert first.stop_reason == "end_turn" and first.stop_sequence is None
    assert first.id.startswith(model.replace("/", "-") + "-")  # the minted response id
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    raw = client.messages.with_raw_response.create(
        model=model,
        max_tokens=256,
        messages=[{"role": "user", "content": "What is my name?"}],
        extra_headers={"X-Conversation-Id": cid},
    )
    second = raw.parse()
    assert second.content[0].type == "text" and second.content[0].text == "Your name is Bob."
    assert raw.headers["x-conversation-id"] == cid and raw.headers["x-response-id"] == second.id
    assert second._request_id == second.id
    assert items_of(gateway, cid)[0] == ("system", "Be brief.")  # the system prompt, kept


@pytest.mark.parametrize("model", ["demo", "mock/m"])
def test_streaming_with_messages_stream_and_create_stream(
    gateway: GatewayProcess, upstream: MockServer, model: str
) -> None:
    client = claude(gateway)
    cid = f"claude-stream-{model.replace('/', '-')}"
    say(client, cid, [{"role": "user", "content": "my city is Oslo"}], model=model)
    with client.messages.stream(
        model=model,
        max_tokens=256,
        messages=[{"role": "user", "content": "what is my city?"}],
        extra_body={"conversation_id": cid},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Your city is Oslo."
    assert [block.type for block in final.content] == ["text"] and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0 and final.usage.input_tokens > 0

    events = client.messages.create(
        model=model,
        max_tokens=256,
        messages=[{"role": "user", "content": "what did I say first?"}],
        extra_body={"conversation_id": cid},
        stream=True,
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert len(items_of(gateway, cid)) == 6  # three turns, each stored once


def test_the_raw_stream_has_anthropics_event_lines(gateway: GatewayProcess, upstream: MockServer) -> None:
    body = {
        "model": "demo",
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", f"{gateway.url}/v1/messages", json=body, headers=VERSION, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert len(names) == len([line for line in lines if line.startswith("data: ")])


@pytest.mark.parametrize("streaming", [False, True])
def test_a_tool_use_round_trip(gateway: GatewayProcess, upstream: MockServer, streaming: bool) -> None:
    """The answer's tool call is a tool_use block; the client resends its whole history with
    the tool_result, as Anthropic's clients do: the call and its result reach the provider once."""
    client = claude(gateway)
    cid = f"claude-tools-{streaming}"
    question = {"role": "user", "content": "weather in Paris?"}
    upstream.mode = "tool_call"
    if streaming:
        with client.messages.stream(
            model="mock/m",
            max_tokens=256,
            messages=[question],  # type: ignore[list-item]
            tools=TOOLS,
            extra_body={"conversation_id": cid},
        ) as stream:
            kinds = [event.type for event in stream]
            first = stream.get_final_message()
        assert "input_json" in kinds  # the SDK's event for an input_json_delta
    else:
        first = say(client, cid, [question], tools=TOOLS)
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert upstream.requests[-1]["tools"][0]["function"]["name"] == "get_weather"
    upstream.mode = "normal"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}
    history = [
        question,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = say(client, cid, history, tools=TOOLS)
    assert second.content[0].type == "text" and second.content[0].text == "The tool said: sunny, 21C"
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == call.id and sent[2]["tool_call_id"] == call.id
    kinds = [kind for kind, _ in items_of(gateway, cid)]
    assert kinds == ["user", "function_call", "function_call_output", "assistant"]


def test_a_whole_history_client_stores_each_message_once(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    client = claude(gateway)
    history: list[Any] = []
    for text in ["my name is Ada", "my city is Rome", "what is my name?"]:
        history.append({"role": "user", "content": text})
        answer = say(client, "claude-whole", history)
        history.append({"role": "assistant", "content": answer.content})
    assert answer.content[0].text == "Your name is Ada."  # type: ignore[union-attr]
    sent = upstream.requests[-1]["messages"]
    assert [m["content"] for m in sent if m["role"] == "user"] == [
        "my name is Ada",
        "my city is Rome",
        "what is my name?",
    ]
    assert [role for role, _ in items_of(gateway, "claude-whole")] == ["user", "assistant"] * 3


def test_count_tokens_is_what_the_window_counts(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = claude(gateway)
    messages: Any = [{"role": "user", "content": "Hi, my name is Bob. How are you today?"}]
    counted = client.messages.count_tokens(model="demo", system="Be brief.", messages=messages)
    with_tools = client.messages.count_tokens(
        model="demo", system="Be brief.", messages=messages, tools=TOOLS
    )
    assert 0 < counted.input_tokens < with_tools.input_tokens
    say(client, "claude-count", messages, model="demo", system="Be brief.", tools=TOOLS)

    def window() -> Any:
        return httpx.get(f"{gateway.url}/v1/conversations/claude-count/context").json()["tokens"]

    assert window()["total"] == with_tools.input_tokens  # (the demo model counts as the gateway does)
    # With the conversation named: the window the next turn plans, history included.
    more: Any = [{"role": "user", "content": "What is my name?"}]
    named = client.messages.count_tokens(
        model="demo",
        system="Be brief.",
        messages=more,
        tools=TOOLS,
        extra_body={"conversation_id": "claude-count"},
    )
    assert named.gateway["counted_by"] == "gateway"  # type: ignore[attr-defined]
    say(client, "claude-count", more, model="demo", system="Be brief.", tools=TOOLS)
    assert window()["total"] == named.input_tokens > with_tools.input_tokens
    assert window()["history"] > 0


def test_errors_are_in_anthropics_shape(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = claude(gateway)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post(
            "/v1/messages",
            body={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
            cast_to=Message,
        )
    assert caught.value.status_code == 400
    assert caught.value.request_id and caught.value.request_id.startswith("req_")
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'max_tokens' is required and must be an integer between 1 and 10000000",
        },
        "request_id": caught.value.request_id,
    }
    bad_image = {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
        say(client, "claude-bad", [{"role": "user", "content": [bad_image]}])
    no_version = httpx.post(
        f"{gateway.url}/v1/messages",
        json={"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
    )
    assert no_version.status_code == 400
    assert no_version.json()["error"] == {
        "type": "invalid_request_error",
        "message": "anthropic-version: header is required",
    }
    upstream.mode = "error500"
    with pytest.raises(anthropic.InternalServerError) as failed:
        say(client, "claude-fails", [{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 502 and failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    upstream.mode = "error429"
    with pytest.raises(anthropic.RateLimitError) as limited:
        say(client, "claude-fails", [{"role": "user", "content": "hi"}])
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert limited.value.response.headers["retry-after"] == "7"
    upstream.mode = "normal"
    # Failures add nothing to history (here: no conversation at all).
    assert httpx.get(f"{gateway.url}/v1/conversations/claude-fails").status_code == 404
    unknown = httpx.post(f"{gateway.url}/v1/messages/nothing", json={}, headers=VERSION)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


@pytest.fixture
def keyed_gateway(tmp_path: Path, upstream: MockServer) -> Iterator[GatewayProcess]:
    config = write_config(tmp_path / "g.toml", upstream.url, extra='\n[auth]\nkeys_env = "GW_CLAUDE_KEYS"\n')
    proc = GatewayProcess(config, tmp_path / "var", env={"GW_CLAUDE_KEYS": "key-a,key-b"}).start()
    yield proc
    proc.stop()


def test_gateway_keys_by_bearer_or_x_api_key(keyed_gateway: GatewayProcess, upstream: MockServer) -> None:
    gw = keyed_gateway
    with pytest.raises(anthropic.AuthenticationError) as caught:
        say(claude(gw, "wrong"), "keyed", [{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid gateway key"},
        "request_id": caught.value.request_id,
    }
    missing = httpx.post(f"{gw.url}/v1/messages/count_tokens", json={}, headers=VERSION)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(f"{gw.url}/v1/models").json()["error"]["type"] == "authentication_error"
    )  # (OpenAI's shape)

    say(claude(gw, "key-a"), "keyed", [{"role": "user", "content": "my name is Alice"}])
    body = {"model": "mock/m", "max_tokens": 64, "conversation_id": "keyed"}
    asked = {**body, "messages": [{"role": "user", "content": "what is my name?"}]}
    by_header = httpx.post(f"{gw.url}/v1/messages", json=asked, headers={**VERSION, "x-api-key": "key-a"})
    assert by_header.status_code == 200 and by_header.json()["content"][0]["text"] == "Your name is Alice."
    other = httpx.post(f"{gw.url}/v1/messages", json=asked, headers={**VERSION, "x-api-key": "key-b"})
    assert (
        other.json()["content"][0]["text"] == "I don't know your name yet."
    )  # another tenant's conversation
    wrong = httpx.post(f"{gw.url}/v1/messages", json=asked, headers={**VERSION, "x-api-key": "key-c"})
    assert wrong.status_code == 401


def test_one_conversation_across_chat_completions_responses_and_messages(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    openai_client, client, cid = sdk(gateway), claude(gateway), "claude-across"
    chat = openai_client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "my name is Eve"}],
        extra_body={"conversation_id": cid},
    )
    greeting = chat.choices[0].message.content
    # A whole-history Messages client that knows the chat turn: the overlap is not stored again.
    history: Any = [
        {"role": "user", "content": "my name is Eve"},
        {"role": "assistant", "content": [{"type": "text", "text": greeting}]},
        {"role": "user", "content": "my city is Oslo"},
    ]
    say(client, cid, history)
    openai_client.responses.create(model="mock/m", input="my pet is a cat", conversation=cid)
    name = client.messages.create(
        model="mock/m",
        max_tokens=64,
        messages=[{"role": "user", "content": "what is my name?"}],
        extra_headers={"X-Conversation-Id": cid},
    )
    assert name.content[0].text == "Your name is Eve."  # type: ignore[union-attr]
    city = openai_client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "what is my city?"}],
        extra_body={"conversation_id": cid},
    )
    assert city.choices[0].message.content == "Your city is Oslo."
    with client.messages.stream(
        model="mock/m",
        max_tokens=64,
        messages=[{"role": "user", "content": "what is my pet?"}],
        extra_body={"conversation_id": cid},
    ) as stream:
        assert stream.get_final_text() == "Your pet is a cat."
    pet = openai_client.responses.create(model="mock/m", input="what did I say first?", conversation=cid)
    assert pet.output_text == 'You first said: "my name is Eve"'
    said = ["my name is Eve", "my city is Oslo", "my pet is a cat", "what is my name?", "what is my city?"]
    said += ["what is my pet?", "what did I say first?"]
    stored = items_of(gateway, cid)
    assert [text for role, text in stored if role == "user"] == said
    assert [role for role, _ in stored] == ["user", "assistant"] * len(said)
    sent = upstream.requests[-1]["messages"]
    assert [m["content"] for m in sent if m["role"] == "user"] == said
    # Each turn is read back by its API: a Messages turn is no stored chat completion.
    listed = {c.id for c in openai_client.chat.completions.list(model="mock/m", limit=100)}
    assert city.id in listed and chat.id in listed and name.id not in listed
    assert openai_client.responses.retrieve(name.id).output_text == "Your name is Eve."


def test_tool_calls_cross_apis_both_ways_and_stay_repaired(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    openai_client, client = sdk(gateway), claude(gateway)
    # A chat completion's tool call, answered with a Messages tool_result.
    upstream.mode = "tool_call"
    asked = openai_client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        extra_body={"conversation_id": "claude-calls"},
    )
    call_id = asked.choices[0].message.tool_calls[0].id  # type: ignore[index]
    upstream.mode = "normal"
    result = {"type": "tool_result", "tool_use_id": call_id, "content": "sunny"}
    answer = say(client, "claude-calls", [{"role": "user", "content": [result]}], tools=TOOLS)
    assert answer.content[0].text == "The tool said: sunny"  # type: ignore[union-attr]
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"] and sent[2]["tool_call_id"] == call_id

    # A Messages tool_use never answered: the next chat completion's history is repaired.
    upstream.mode = "tool_call"
    used = say(client, "claude-calls", [{"role": "user", "content": "and in Rome?"}], tools=TOOLS)
    assert used.stop_reason == "tool_use"
    upstream.mode = "normal"
    openai_client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "never mind"}],
        extra_body={"conversation_id": "claude-calls"},
    )
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent][-4:] == ["user", "assistant", "tool", "user"]
    assert sent[-2] == {"role": "tool", "tool_call_id": used.content[0].id, "content": UNANSWERED_TOOL_RESULT}  # type: ignore[union-attr]
