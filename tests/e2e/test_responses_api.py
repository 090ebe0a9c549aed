"""The Responses API bridge, driven by the official SDK's `client.responses.*`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import GatewayProcess, sdk
from tests.mockserver import MockServer


def stream_text(client: OpenAI, **kwargs: object) -> tuple[str, str]:
    """Run a streamed response; (text, response id) from the events."""
    text, rid, kinds = "", "", []
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
        rid = final.id
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == text
    return text, rid


@pytest.mark.parametrize("streaming", [False, True])
def test_multi_turn_recall_with_previous_response_id(
    gateway: GatewayProcess, upstream: MockServer, streaming: bool
) -> None:
    client = sdk(gateway)
    previous = None
    answers = []
    for text in ["Hi, my name is Bob.", "I like trains.", "What is my name?"]:
        kwargs = {
            "model": "mock/m",
            "input": text,
            "instructions": "Be brief.",
            "previous_response_id": previous,
        }
        if streaming:
            answer, previous = stream_text(client, **kwargs)
        else:
            r = client.responses.create(**kwargs)  # type: ignore[arg-type]
            assert r.status == "completed" and r.object == "response"
            answer, previous = r.output_text, r.id
        answers.append(answer)
    assert answers[-1] == "Your name is Bob."
    assert previous.startswith("mock-m-")
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in sent if m["role"] == "user"] == [
        "Hi, my name is Bob.",
        "I like trains.",
        "What is my name?",
    ]


@pytest.mark.parametrize("streaming", [False, True])
def test_recall_with_conversation_and_chat_completions_see_each_other(
    gateway: GatewayProcess, upstream: MockServer, streaming: bool
) -> None:
    client = sdk(gateway)
    conv = client.conversations.create()
    if streaming:
        stream_text(client, model="mock/m", input="my city is Oslo", conversation=conv.id)
    else:
        client.responses.create(model="mock/m", input="my city is Oslo", conversation=conv.id)
    # A chat-completions turn on the same conversation sees the Responses turn...
    chat = client.chat.completions.create(
        model="mock/m",
        messages=[{"role": "user", "content": "my name is Eve"}],
        extra_body={"conversation_id": conv.id},
    )
    assert chat.choices[0].message.content.startswith("Nice to meet you, Eve")
    # ...and the next Responses turn sees both.
    r = client.responses.create(model="mock/m", input="what is my city?", conversation={"id": conv.id})
    assert r.output_text == "Your city is Oslo."
    assert r.conversation is not None and r.conversation.id == conv.id
    r2 = client.responses.create(model="mock/m", input="what is my name?", previous_response_id=r.id)
    assert r2.output_text == "Your name is Eve."


def test_a_conversation_named_must_exist(gateway: GatewayProcess, upstream: MockServer) -> None:
    """`conversation` names a Conversation, as in OpenAI's API: a mistyped or deleted id gave a
    200 from a new, empty conversation under that id (an assistant that knew nothing)."""
    client = sdk(gateway)
    conv = client.conversations.create()
    client.responses.create(model="mock/m", input="my city is Oslo", conversation=conv.id)
    sent = len(upstream.requests)
    for name in (conv.id + "x", "never-made"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model="mock/m", input="what is my city?", conversation=name)
        assert caught.value.body["param"] == "conversation"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(name)  # nothing was made under that id
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="mock/m", input="what is my city?", conversation={"id": conv.id})
    assert len(upstream.requests) == sent  # the provider was never asked


@pytest.mark.parametrize("streaming", [False, True])
def test_function_calling_across_turns(
    gateway: GatewayProcess, upstream: MockServer, streaming: bool
) -> None:
    client = sdk(gateway)
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    upstream.mode = "tool_call"
    if streaming:
        with client.responses.stream(model="mock/m", input="weather in Paris?", tools=tools) as stream:  # type: ignore[arg-type]
            kinds = [e.type for e in stream]
            first = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
    else:
        first = client.responses.create(model="mock/m", input="weather in Paris?", tools=tools)  # type: ignore[arg-type]
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert upstream.requests[-1]["tools"][0]["function"]["name"] == "get_weather"
    upstream.mode = "normal"
    second = client.responses.create(
        model="mock/m",
        previous_response_id=first.id,
        tools=tools,  # type: ignore[arg-type]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}],
    )
    assert second.output_text == "The tool said: sunny, 21C"
    sent = upstream.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[1]["tool_calls"][0]["id"] == call.call_id and sent[2]["tool_call_id"] == call.call_id
    third = client.responses.create(model="mock/m", previous_response_id=second.id, input="thanks")
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert third.status == "completed"


def test_branching_from_an_earlier_response(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    r1 = client.responses.create(model="mock/m", input="my name is Ann")
    a = client.responses.create(model="mock/m", input="my pet is a cat", previous_response_id=r1.id)
    b = client.responses.create(model="mock/m", input="my pet is a dog", previous_response_id=r1.id)
    assert (
        client.responses.create(
            model="mock/m", input="what is my pet?", previous_response_id=a.id
        ).output_text
        == "Your pet is a cat."
    )
    assert (
        client.responses.create(
            model="mock/m", input="what is my pet?", previous_response_id=b.id
        ).output_text
        == "Your pet is a dog."
    )
    sent_b = upstream.requests[-1]["messages"]
    assert "my pet is a cat" not in [m["content"] for m in sent_b]
    assert (
        client.responses.create(
            model="mock/m", input="what is my name?", previous_response_id=b.id
        ).output_text
        == "Your name is Ann."
    )
    # The branch shares the prefix's response files instead of copying them.
    files = list((gateway.data_dir / "logs" / "responses").glob(f"{r1.id}*"))
    assert len(files) == 1


def test_retrieve_input_items_delete_and_errors(gateway: GatewayProcess, upstream: MockServer) -> None:
    client = sdk(gateway)
    r = client.responses.create(
        model="mock/m",
        input=[{"type": "message", "role": "user", "content": "my name is Max"}],
        instructions="Hi",
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == "completed"
    items = client.responses.input_items.list(r.id)
    # The input alone, as OpenAI lists it: not the instructions (echoed on the response instead).
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [("message", "user")]
    assert got.instructions == "Hi"
    follow = client.responses.create(model="mock/m", input="what is my name?", previous_response_id=r.id)
    assert follow.output_text == "Your name is Max."
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="mock/m", input="x", previous_response_id="mock-m-000000000000")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="mock/m", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    stateless = client.responses.create(model="mock/m", input="hello", store=False)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="mock/m", input="again", previous_response_id=stateless.id)


def test_invalid_body_with_an_older_previous_response_makes_no_fork(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    """Validation runs before branching: a 400 leaves no fork conversation behind."""
    client = sdk(gateway)
    first = client.responses.create(model="mock/m", input="one")
    client.responses.create(model="mock/m", input="two", previous_response_id=first.id)
    indexes = gateway.data_dir / "logs" / "conversations"
    before = sorted(p.name for p in indexes.iterdir())
    bad = httpx.post(
        f"{gateway.url}/v1/responses",
        json={"model": "mock/m", "input": "three", "previous_response_id": first.id, "stream": [None]},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "stream"
    bad_item = httpx.post(
        f"{gateway.url}/v1/responses",
        json={
            "model": "mock/m",
            "input": [{"role": "user", "content": [{"type": {}}]}],
            "previous_response_id": first.id,
        },
    )
    assert bad_item.status_code == 400
    assert sorted(p.name for p in indexes.iterdir()) == before


async def test_responses_turns_get_the_log_line_and_metrics_chat_turns_get(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from gateway.store.memory import MemoryStore
    from gateway.upstream.mock import MockUpstream
    from tests.conftest import build_client, make_settings

    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            for stream in (False, True):
                r = await client.post(
                    "/v1/responses", json={"model": "mock/m", "input": "hi", "stream": stream}
                )
                assert r.status_code == 200
            bad = await client.post("/v1/responses", json={"model": "mock/m", "input": 3})
            assert bad.status_code == 400
        metrics = (await client.get("/metrics")).text
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [(line["event"], line["status"], line["outcome"]) for line in lines] == [
        ("response", 200, "complete"),
        ("response", 200, "complete"),
        ("response", 400, "refused"),
    ]
    assert 'gateway_upstream_seconds_count{provider="mock"} 2.0' in metrics  # both turns counted
    assert len(upstream.requests) == 2


async def test_a_deleted_response_is_skipped_without_a_damage_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from gateway.store.memory import MemoryStore
    from gateway.upstream.mock import MockUpstream
    from tests.conftest import build_client, make_settings

    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream()) as client:
        first = (await client.post("/v1/responses", json={"model": "mock/m", "input": "one"})).json()
        cid = (
            first["conversation"]["id"]
            if isinstance(first.get("conversation"), dict)
            else first["conversation"]
        )
        second = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "two", "conversation": cid}
        )
        assert second.status_code == 200
        assert (await client.delete(f"/v1/responses/{first['id']}")).status_code == 200
    # Another process (a fresh cache) reads the conversation from the start.
    async with build_client(make_settings(), store, MockUpstream()) as client:
        with caplog.at_level(logging.WARNING):
            items = (await client.get(f"/v1/conversations/{cid}/items?order=asc")).json()["data"]
            third = await client.post(
                "/v1/responses", json={"model": "mock/m", "input": "three", "conversation": cid}
            )
        assert third.status_code == 200
    texts = [c["text"] for item in items for c in item["content"]]
    assert "one" not in texts and "two" in texts
    assert "not committed" not in caplog.text  # a deletion is not damage


def test_retrieving_with_stream_is_a_400(gateway: GatewayProcess, upstream: MockServer) -> None:
    """`responses.retrieve(id, stream=True)` read nothing, without an error."""
    client = sdk(gateway)
    created = client.responses.create(model="mock/m", input="hello")
    with pytest.raises(openai.BadRequestError) as caught:
        for _ in client.responses.retrieve(created.id, stream=True):
            pass
    assert caught.value.body["param"] == "stream"  # type: ignore[index]
    assert client.responses.retrieve(created.id).id == created.id
