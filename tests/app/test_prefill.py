"""A request that ends with an assistant message asks the answer to go on from it (a prefill):
sent once, stored with the answer as one assistant message, on chat completions and Messages,
whether or not the provider says the prefill again in its answer (llama.cpp's whole answers do)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


def going_on(echo: bool) -> Any:
    """A provider that goes on from a final assistant message (saying it again when `echo`)."""

    def answer(body: dict[str, Any]) -> str:
        last = body["messages"][-1]
        if last["role"] != "assistant":
            return "Apples."
        return (last["content"] if echo else "") + " and more."

    return answer


def sent(upstream: MockUpstream) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in upstream.requests[-1]["messages"]]


async def history(client: Any, cid: str) -> list[tuple[str, str]]:
    items = (await client.get(f"/v1/conversations/{cid}/items", params={"order": "asc"})).json()["data"]
    return [(i["role"], i["content"][0]["text"]) for i in items]


@pytest.mark.parametrize("echo", [False, True])
async def test_a_history_resent_whole_ending_with_its_answer_goes_on_from_that_answer(echo: bool) -> None:
    """`[q, a1]` resent as stored, nothing new (going on from an answer cut short): the provider
    got `[q, a1, a1]`, which llama.cpp refuses ("Cannot have 2 or more assistant messages at the
    end of the list")."""
    upstream = MockUpstream(going_on(echo))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        q = {"role": "user", "content": "Fruits?"}
        body = {"model": "mock/m", "conversation_id": "c", "messages": [q]}
        a1 = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        again = await client.post("/v1/chat/completions", json={**body, "messages": [q, a1]})
        assert again.status_code == 200, again.text
        assert sent(upstream) == [("user", "Fruits?"), ("assistant", "Apples.")]
        assert await history(client, "c") == [("user", "Fruits?"), ("assistant", "Apples. and more.")]
        then = {"role": "user", "content": "thanks"}
        joined = {"role": "assistant", "content": "Apples. and more."}
        r = await client.post("/v1/chat/completions", json={**body, "messages": [q, joined, then]})
        assert r.status_code == 200
        assert sent(upstream) == [("user", "Fruits?"), ("assistant", "Apples. and more."), ("user", "thanks")]


@pytest.mark.parametrize("echo", [False, True])
async def test_a_chat_prefill_is_stored_with_its_answer_as_one_message(echo: bool) -> None:
    """It was stored as a message of its own: every later turn sent two assistant messages in a
    row (the prefill, then the answer), which chat templates that alternate roles refuse."""
    upstream = MockUpstream(going_on(echo))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        prefill = {"role": "assistant", "content": "Sure: apple,"}
        body = {
            "model": "mock/m",
            "conversation_id": "p",
            "messages": [{"role": "user", "content": "Fruits?"}],
        }
        first = await client.post(
            "/v1/chat/completions", json={**body, "messages": [*body["messages"], prefill]}
        )
        told = first.json()["choices"][0]["message"]["content"]
        assert sent(upstream)[-1] == ("assistant", "Sure: apple,")
        r = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "more"}]}
        )
        assert r.status_code == 200
    assert told == ("Sure: apple, and more." if echo else " and more.")  # (the provider's, as it said it)
    assert sent(upstream) == [
        ("user", "Fruits?"),
        ("assistant", "Sure: apple, and more."),
        ("user", "more"),
    ]


@pytest.mark.parametrize("echo", [False, True])
async def test_a_messages_prefill_said_again_by_the_provider_is_kept_once(echo: bool) -> None:
    """With llama.cpp, whose whole answer says the prefill again, the stored answer held it twice
    and the client's `content[0].text` held it too (Anthropic's holds what the model added)."""
    upstream = MockUpstream(going_on(echo))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {
            "model": "mock/m",
            "max_tokens": 32,
            "conversation_id": "m",
            "messages": [
                {"role": "user", "content": "Fruits?"},
                {"role": "assistant", "content": "Sure: apple,"},
            ],
        }
        headers = {"anthropic-version": "2023-06-01"}
        r = await client.post("/v1/messages", json=body, headers=headers)
        assert r.status_code == 200, r.text
        stored = await history(client, "m")
    assert r.json()["content"][0]["text"] == " and more."
    assert stored == [("user", "Fruits?"), ("assistant", "Sure: apple, and more.")]


async def test_a_responses_input_ending_with_assistant_text_is_stored_with_its_answer() -> None:
    """It was stored as two assistant messages in a row, sent on every later turn."""
    upstream = MockUpstream(going_on(False))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        items = [
            {"type": "message", "role": "user", "content": "Fruits?"},
            {"type": "message", "role": "assistant", "content": "Sure: apple,"},
        ]
        first = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": items, "conversation_id": "r"}
        )
        assert first.status_code == 200, first.text
        stored = await history(client, "r")
    assert stored == [("user", "Fruits?"), ("assistant", "Sure: apple, and more.")]


async def test_the_responses_object_says_the_service_tier_the_provider_served() -> None:
    """It said `service_tier: null` whatever the provider answered."""
    from gateway.upstream.base import completion_from_text

    upstream = MockUpstream(lambda body: {**completion_from_text("m", "hi"), "service_tier": "flex"})
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {"model": "mock/m", "input": "hi", "service_tier": "flex"}
        made = (await client.post("/v1/responses", json=body)).json()
        streamed = (await client.post("/v1/responses", json={**body, "stream": True})).text
        got = (await client.get(f"/v1/responses/{made['id']}")).json()
    assert made["service_tier"] == got["service_tier"] == "flex"
    assert '"service_tier":"flex"' in streamed.split("response.completed")[-1]


@pytest.mark.parametrize("sent_back", ["alone", "trimmed"])
async def test_an_answer_cut_short_sent_back_alone_or_trimmed_goes_on_once(sent_back: str) -> None:
    """An only-new-messages client sending the cut answer alone as its prefill, or a trimmed
    history ending with it: the model got the answer twice (two assistant messages in a row) and
    the conversation kept both."""
    upstream = MockUpstream(going_on(False))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body: dict[str, Any] = {"model": "mock/m", "conversation_id": "g"}
        for text in ("first", "Fruits?"):
            r = await client.post(
                "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": text}]}
            )
        cut = r.json()["choices"][0]["message"]
        resent = [cut] if sent_back == "alone" else [{"role": "user", "content": "Fruits?"}, cut]
        again = await client.post("/v1/chat/completions", json={**body, "messages": resent})
        assert again.status_code == 200, again.text
        stored = await history(client, "g")
    assert sent(upstream) == [
        ("user", "first"),
        ("assistant", "Apples."),
        ("user", "Fruits?"),
        ("assistant", "Apples."),
    ]
    assert stored[-2:] == [("user", "Fruits?"), ("assistant", "Apples. and more.")]
    assert len(stored) == 4


@pytest.mark.parametrize("echo", [False, True])
async def test_a_streamed_messages_prefill_said_again_is_left_out(echo: bool) -> None:
    """A provider that says the prefill again in its stream: the Messages stream gave it to the
    client again (`text_stream` read "Sure: apple, and more."), where the whole answer did not."""
    upstream = MockUpstream(going_on(echo))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {
            "model": "mock/m",
            "max_tokens": 32,
            "stream": True,
            "conversation_id": "s",
            "messages": [
                {"role": "user", "content": "Fruits?"},
                {"role": "assistant", "content": "Sure: apple,"},
            ],
        }
        r = await client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        stored = await history(client, "s")
    deltas = [
        json.loads(line[6:])["delta"]["text"]
        for line in r.text.splitlines()
        if line.startswith("data: ") and '"text_delta"' in line
    ]
    assert "".join(deltas) == " and more."
    assert stored == [("user", "Fruits?"), ("assistant", "Sure: apple, and more.")]


def test_text_like_the_prefill_that_goes_elsewhere_is_sent_whole() -> None:
    from gateway.api.messages import EchoCut

    cut = EchoCut("Sure: apple,")
    assert [cut.text(p) for p in ("Sure", ": ban", "ana")] == ["", "Sure: ban", "ana"]
    held = EchoCut("Sure: apple,")
    assert held.text("Sure:") == "" and held.rest()["choices"][0]["delta"]["content"] == "Sure:"


async def test_an_answer_sent_back_as_text_parts_goes_on_as_a_string_does() -> None:
    """OpenAI's array form (`[{"type": "text", ...}]`) was no prefill: the cut answer was sent
    twice and the conversation kept three assistant messages in a row."""
    upstream = MockUpstream(going_on(False))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body: dict[str, Any] = {"model": "mock/m", "conversation_id": "tp"}
        r = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Fruits?"}]}
        )
        cut = r.json()["choices"][0]["message"]["content"]
        parts = {"role": "assistant", "content": [{"type": "text", "text": cut}]}
        again = await client.post("/v1/chat/completions", json={**body, "messages": [parts]})
        assert again.status_code == 200, again.text
        stored = await history(client, "tp")
    assert sent(upstream) == [("user", "Fruits?"), ("assistant", "Apples.")]
    assert stored == [("user", "Fruits?"), ("assistant", "Apples. and more.")]


def test_text_held_as_maybe_the_prefill_goes_out_before_a_call() -> None:
    """Held text came out after the call's block: the stream's blocks were in another order than
    the whole answer's."""
    from gateway.api.messages import EchoCut

    cut = EchoCut("Let me check")
    text = {"choices": [{"index": 0, "delta": {"content": "Let"}}]}
    call = {
        "choices": [
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}}
        ]
    }
    assert cut.chunk(text)["choices"][0]["delta"]["content"] == ""
    flushed = cut.chunk(call)["choices"][0]["delta"]
    assert flushed["content"] == "Let" and flushed["tool_calls"][0]["id"] == "c"
    assert cut.held == "" and cut.chunk(text) is text  # (done: as they come)


@pytest.mark.parametrize("echo", [False, True])
async def test_a_request_of_a_system_message_alone_goes_on_from_the_stored_answer(echo: bool) -> None:
    """Only a (new) system prompt on a conversation whose history ends with an answer: nothing
    new to answer, so that answer goes on, as when it is sent back alone. The answer was stored
    beside the last one: two assistant messages in a row, which llama.cpp refuses next turn."""
    upstream = MockUpstream(going_on(echo))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {
            "model": "mock/m",
            "conversation_id": "c",
            "messages": [{"role": "user", "content": "Fruits?"}],
        }
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        system = {"role": "system", "content": "Be brief."}
        r = await client.post("/v1/chat/completions", json={**body, "messages": [system]})
        assert r.status_code == 200, r.text
        assert sent(upstream) == [("system", "Be brief."), ("user", "Fruits?"), ("assistant", "Apples.")]
        assert await history(client, "c") == [
            ("system", "Be brief."),
            ("user", "Fruits?"),
            ("assistant", "Apples. and more."),
        ]
        r = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "ok"}]}
        )
        roles = [role for role, _ in sent(upstream)]
        assert roles == ["system", "user", "assistant", "user"], sent(upstream)


async def test_a_system_message_alone_on_a_new_conversation_is_answered() -> None:
    upstream = MockUpstream(going_on(False))
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {
            "model": "mock/m",
            "conversation_id": "n",
            "messages": [{"role": "system", "content": "Greet."}],
        }
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert sent(upstream) == [("system", "Greet.")]
        assert await history(client, "n") == [("system", "Greet."), ("assistant", "Apples.")]


async def test_a_system_message_alone_after_a_call_without_its_result_sends_the_call_answered() -> None:
    """The history ended with the model's call, no result: providers refuse a call without its
    result (OpenAI: "must be followed by tool messages"), and the answer was stored after it."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]

    def answer(body: dict[str, Any]) -> Any:
        if len(body["messages"]) == 1:
            return {"role": "assistant", "content": None, "tool_calls": calls}
        return "Later, then."

    upstream = MockUpstream(answer)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {"model": "mock/m", "conversation_id": "t", "messages": [{"role": "user", "content": "Time?"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        system = {"role": "system", "content": "Never mind the tools."}
        r = await client.post("/v1/chat/completions", json={**body, "messages": [system]})
        assert r.status_code == 200, r.text
        roles = [m["role"] for m in upstream.requests[-1]["messages"]]
        assert roles == ["system", "user", "assistant", "tool"], upstream.requests[-1]["messages"]
        r = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "ok"}]}
        )
        roles = [m["role"] for m in upstream.requests[-1]["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
