"""The Responses API takes the conversation named as chat completions and Messages name it: the
`conversation_id` field or the `X-Conversation-Id` header, besides OpenAI's `conversation`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


def chat(cid: str, text: str) -> dict[str, Any]:
    return {"model": "mock/m", "conversation_id": cid, "messages": [{"role": "user", "content": text}]}


async def respond(client: httpx.AsyncClient, text: Any, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", None)
    return await client.post(
        "/v1/responses", json={"model": "mock/m", "input": text, **extra}, headers=headers
    )


async def test_a_conversation_begun_on_chat_completions_goes_on_by_its_field_or_its_header() -> None:
    """Both were taken as unknown fields: the turn began a new conversation that knew nothing."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        assert (await client.post("/v1/chat/completions", json=chat("c-1", "one"))).status_code == 200
        by_field = await respond(client, "two", conversation_id="c-1")
        by_header = await respond(client, "three", headers={"X-Conversation-Id": "c-1"})
        shown = (await client.get("/v1/conversations/c-1/items", params={"limit": 100})).json()
    assert by_field.status_code == by_header.status_code == 200
    assert by_field.headers["x-conversation-id"] == by_header.headers["x-conversation-id"] == "c-1"
    assert by_field.json()["conversation"] == {"id": "c-1"}
    assert "(turn 2, 3 messages in my context)" in by_field.json()["output"][0]["content"][0]["text"]
    assert "(turn 3, 5 messages in my context)" in by_header.json()["output"][0]["content"][0]["text"]
    assert len(shown["data"]) == 6


async def test_a_new_id_starts_the_conversation_as_on_chat_completions() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        first = await respond(client, "hello", conversation_id="fresh-1")
        then = await client.post("/v1/chat/completions", json=chat("fresh-1", "again"))
        unknown = await respond(client, "hello", conversation="never-made")
    assert first.status_code == 200 and first.json()["conversation"] == {"id": "fresh-1"}
    assert "(turn 2, 3 messages in my context)" in then.json()["choices"][0]["message"]["content"]
    assert unknown.status_code == 404  # OpenAI's `conversation` must exist, as before


async def test_naming_it_twice_is_a_400_and_the_header_yields_to_the_body() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        await client.post("/v1/chat/completions", json=chat("a-1", "one"))
        await client.post("/v1/chat/completions", json=chat("b-1", "one"))
        rid = (await respond(client, "two", conversation_id="a-1")).json()["id"]
        both = await respond(client, "x", conversation="a-1", conversation_id="a-1")
        with_previous = await respond(client, "x", conversation_id="a-1", previous_response_id=rid)
        bad = await respond(client, "x", conversation_id="no/slash")
        field_wins = await respond(client, "x", conversation_id="b-1", headers={"X-Conversation-Id": "a-1"})
        previous_wins = await respond(
            client, "x", previous_response_id=rid, headers={"X-Conversation-Id": "b-1"}
        )
    assert (both.status_code, both.json()["error"]["param"]) == (400, "conversation_id")
    assert (with_previous.status_code, with_previous.json()["error"]["param"]) == (
        400,
        "previous_response_id",
    )
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "conversation_id")
    assert field_wins.json()["conversation"] == {"id": "b-1"}
    assert previous_wins.json()["conversation"] == {"id": "a-1"}


async def test_input_tokens_counts_the_conversation_the_header_names() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        alone = (
            await client.post("/v1/responses/input_tokens", json={"model": "mock/m", "input": "hi"})
        ).json()
        await client.post(
            "/v1/chat/completions", json=chat("n-1", "a first message, long enough to count " * 5)
        )
        named = await client.post(
            "/v1/responses/input_tokens",
            json={"model": "mock/m", "input": "hi"},
            headers={"X-Conversation-Id": "n-1"},
        )
    assert named.status_code == 200 and named.json()["input_tokens"] > alone["input_tokens"] + 40


async def test_a_request_too_long_for_the_window_is_said_of_input() -> None:
    """The chat core's refusal named `messages`, a parameter the Responses API does not have."""
    settings = make_settings()
    settings = settings.model_copy(
        update={"context": settings.context.model_copy(update={"max_context_tokens": 1000})}
    )
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        plain = await respond(client, "word " * 1200)
        streamed = await respond(client, "word " * 1200, stream=True)
    for refused in (plain, streamed):
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input")


def sse_types(body: str) -> list[str]:
    return [line[len("event: ") :] for line in body.splitlines() if line.startswith("event: ")]


@pytest.mark.parametrize(
    ("finish_reason", "reason"), [("length", "max_output_tokens"), ("content_filter", "content_filter")]
)
async def test_an_answer_cut_short_ends_its_stream_incomplete(finish_reason: str, reason: str) -> None:
    """The stream of a response whose status was `incomplete` ended `response.completed`; an
    answer the provider's filter stopped was `completed`, with no `incomplete_details`."""
    from gateway.upstream.base import completion_from_text

    def cut(body: dict[str, Any]) -> Any:
        completion = completion_from_text("m", "a long answer that was")
        completion["choices"][0]["finish_reason"] = finish_reason
        return completion

    async with build_client(make_settings(), MemoryStore(), MockUpstream(cut)) as client:
        streamed = await respond(client, "hello", max_output_tokens=16, stream=True)
        whole = (await respond(client, "hello", max_output_tokens=16)).json()
        kept = (await client.get(f"/v1/responses/{whole['id']}")).json()
    types = sse_types(streamed.text)
    assert types[-1] == "response.incomplete" and "response.completed" not in types
    final = json.loads(streamed.text.strip().rsplit("data: ", 1)[1])
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": reason}
    assert (kept["status"], kept["incomplete_details"]) == ("incomplete", {"reason": reason})
    # Its message is `incomplete` too, as OpenAI's (it said `completed`).
    assert [item["status"] for item in final["response"]["output"]] == ["incomplete"]
    assert [item["status"] for item in whole["output"]] == ["incomplete"]


async def test_input_items_leave_the_instructions_out() -> None:
    """OpenAI lists a response's input alone: the `instructions` were listed as a system item."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        rid = (await respond(client, "hi there", instructions="Be nice")).json()["id"]
        items = (await client.get(f"/v1/responses/{rid}/input_items")).json()["data"]
        as_system = [{"role": "system", "content": "Speak French."}, {"role": "user", "content": "hi"}]
        rid2 = (await respond(client, as_system, instructions="Be nice")).json()["id"]
        items2 = (await client.get(f"/v1/responses/{rid2}/input_items", params={"order": "asc"})).json()[
            "data"
        ]
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [("user", "hi there")]
    assert [i["role"] for i in items2] == ["system", "user"]  # a system message of the input is listed


async def test_store_false_in_a_named_conversation_keeps_the_turn_and_says_so() -> None:
    """The turn went into the conversation (and was replayed) while its response said
    `store: false`. Naming a conversation keeps the turn; without one, nothing is kept."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        first = (await respond(client, "my pin is 4321")).json()
        kept = await respond(client, "and more", previous_response_id=first["id"], store=False)
        chained = await respond(client, "again", previous_response_id=kept.json()["id"])
        alone = await respond(client, "hello", store=False)
        fetched = await client.get(f"/v1/responses/{kept.json()['id']}")
    assert kept.status_code == chained.status_code == 200
    assert kept.json()["store"] is True and fetched.json()["store"] is True
    assert "(turn 3, 5 messages in my context)" in chained.json()["output"][0]["content"][0]["text"]
    assert alone.json()["store"] is False and alone.json()["conversation"] is None


async def test_continuing_the_response_before_a_deleted_newest_one_stays_in_the_conversation() -> None:
    """With the newest response deleted, continuing the one before it made a fork conversation,
    though that response was the conversation's newest again."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        a1 = (await respond(client, "one")).json()
        a2 = (await respond(client, "two", previous_response_id=a1["id"])).json()
        assert (await client.delete(f"/v1/responses/{a2['id']}")).status_code == 200
        a3 = (await respond(client, "three", previous_response_id=a1["id"])).json()
    assert a3["conversation"] == a1["conversation"]  # not a `.fork-` of it
    assert "(turn 2, 3 messages in my context)" in a3["output"][0]["content"][0]["text"]


async def test_continuing_a_stateless_chat_completion_says_why_it_cannot() -> None:
    """It said "was not stored (store=false)" of a chat completion sent without any store."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        body = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}]}
        stateless = (await client.post("/v1/chat/completions", json=body)).json()["id"]
        r = await respond(client, "more", previous_response_id=stateless)
    assert r.status_code == 400 and "stateless chat completion" in r.json()["error"]["message"]


async def test_a_refused_turns_log_line_names_the_conversation_of_conversation_or_previous(
    caplog: Any,
) -> None:
    """Its `conversation_id` was null when the request named it by `conversation` or
    `previous_response_id` (only the body's `conversation_id` and the header were read)."""
    import logging

    base = make_settings()
    settings = base.model_copy(
        update={"context": base.context.model_copy(update={"max_context_tokens": 400})}
    )
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        first = (await respond(client, "hello", conversation=conv)).json()
        too_long = "word " * 2000
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            by_conversation = await respond(client, too_long, conversation=conv)
            by_previous = await respond(client, too_long, previous_response_id=first["id"])
    assert by_conversation.status_code == by_previous.status_code == 400
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    refused = [line for line in lines if line.get("outcome") == "refused"]
    assert [line["conversation_id"] for line in refused] == [conv, conv]


class CallThenText(MockUpstream):
    """A provider that streams a tool call before its text (some local models, litellm routes)."""

    async def stream(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:  # type: ignore[override]
        self.requests.append(body)
        head = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        call = {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "f", "arguments": '{"a":'},
        }
        for delta in (
            {"role": "assistant", "tool_calls": [call]},
            {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
            {"content": "Let me "},
            {"content": "check."},
        ):
            yield {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}


async def test_a_call_streamed_before_the_text_keeps_one_output_index_per_item() -> None:
    """The message was announced at the call's output index, and the call announced again at
    the next: the SDK's `responses.stream` raised "Duplicate response output index 0"."""
    async with build_client(make_settings(), MemoryStore(), CallThenText()) as client:
        streamed = await respond(client, "hello", stream=True)
        rid = streamed.headers["x-response-id"]
        stored = (await client.get(f"/v1/responses/{rid}")).json()
    events = [
        json.loads(line[len("data: ") :]) for line in streamed.text.splitlines() if line.startswith("data: ")
    ]
    added = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "function_call"), (1, "message")]
    done = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.done"
    ]
    assert sorted(done) == added
    indexes = {e["type"]: e["output_index"] for e in events if "output_index" in e and "item" not in e}
    assert (
        indexes["response.function_call_arguments.done"]
        == indexes["response.function_call_arguments.delta"]
        == 0
    )
    assert indexes["response.output_text.delta"] == indexes["response.output_text.done"] == 1
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["function_call", "message"]
    # Read back, it lists them as the stream did (it had listed the message first).
    assert [(item["type"], item["id"]) for item in stored["output"]] == [
        (item["type"], item["id"]) for item in final["output"]
    ]


async def test_store_null_is_the_default() -> None:
    """The SDK types `store` as optional; `store: null` was a 400 ("must be a boolean"), where every
    other nullable create parameter takes null."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        first = await respond(client, "my pin is 4321", store=None)
        then = await respond(client, "and more", previous_response_id=first.json()["id"])
        wrong = await respond(client, "hello", store="yes")
    assert first.status_code == then.status_code == 200, first.text
    assert first.json()["store"] is True and first.json()["conversation"] is not None
    assert "(turn 2, 3 messages in my context)" in then.json()["output"][0]["content"][0]["text"]
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "store"


async def test_the_newest_response_after_a_reset_goes_on_with_its_own_history() -> None:
    """Continuing the newest response of a conversation reset since sent the model an empty
    history (the reset conversation went on), while continuing an older one branched with its
    history. Both branch now, and counting the turn first says what it will send."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        r1 = (await respond(client, "my dog is Rex", conversation_id="c-r")).json()
        r2 = (await respond(client, "my cat is Tom", conversation_id="c-r")).json()
        body = {"model": "mock/m", "input": "what are my pets?", "previous_response_id": r2["id"]}
        before = (await client.post("/v1/responses/input_tokens", json=body)).json()
        assert (await client.post("/v1/conversations/c-r/reset")).status_code == 200
        counted = (await client.post("/v1/responses/input_tokens", json=body)).json()
        went_on = (await client.post("/v1/responses", json=body)).json()
        fresh = (await respond(client, "hello", conversation_id="c-r")).json()
    assert r1["conversation"] == {"id": "c-r"}
    assert "(turn 3, 5 messages in my context)" in went_on["output"][0]["content"][0]["text"]
    assert went_on["conversation"]["id"].startswith("c-r.fork-")
    assert counted == before
    assert "(turn 1, 1 messages in my context)" in fresh["output"][0]["content"][0]["text"]


async def test_a_developer_item_in_a_named_conversations_input_is_appended_not_the_system_prompt() -> None:
    """`input=[developer "Answer in French.", user ...]` on a conversation made with a system
    item replaced that system prompt (never sent again, its item gone from the list); OpenAI
    appends input items, as `items.create` does here. `instructions` still set the system prompt,
    and the gateway's own naming (`conversation_id`) keeps chat completions' rule."""
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        items = [
            {"type": "message", "role": "system", "content": "You are a vet."},
            {"type": "message", "role": "user", "content": "my dog is Rex"},
        ]
        conv = (await client.post("/v1/conversations", json={"items": items})).json()["id"]
        note = {"type": "message", "role": "developer", "content": "Answer in French."}
        user = {"type": "message", "role": "user", "content": "hi"}
        body = {"model": "mock/m", "conversation": conv, "input": [note, user]}
        counted = (await client.post("/v1/responses/input_tokens", json=body)).json()
        first = await client.post("/v1/responses", json=body)
        again = await client.post("/v1/responses", json={**body, "input": "and now?"})
        told = await client.post("/v1/responses", json={**body, "input": "ok", "instructions": "Be brief."})
        listed = (await client.get(f"/v1/conversations/{conv}/items", params={"order": "asc"})).json()["data"]
    assert first.status_code == again.status_code == told.status_code == 200, first.text
    roles = [
        [(m["role"], m["content"]) for m in b["messages"] if m["role"] != "assistant"]
        for b in upstream.requests
    ]
    assert roles[0] == [
        ("system", "You are a vet."),
        ("user", "my dog is Rex"),
        ("developer", "Answer in French."),
        ("user", "hi"),
    ]
    assert roles[1][:3] == roles[0][:3] and roles[1][-1] == ("user", "and now?")
    assert roles[2][0] == ("system", "Be brief.") and ("developer", "Answer in French.") in roles[2]
    assert ("system", "You are a vet.") not in roles[2]
    assert [i["role"] for i in listed][:4] == ["system", "user", "developer", "user"]
    assert counted["input_tokens"] > 0


async def test_an_unknown_parameter_is_a_400_as_openai_says_it() -> None:
    """`previous_respons_id` (a typo) was dropped without a word: the turn started a new
    conversation and the model got no history; `max_output_token` and `metdata` were ignored."""
    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream()) as client:
        r1 = (await respond(client, "my dog is Rex")).json()
        typo = await respond(client, "what is my dog?", previous_respons_id=r1["id"])
        capped = await respond(client, "hi", max_output_token=5)
        chat_named = await respond(client, "hi", max_tokens=5)  # (was said to be max_output_tokens)
        messages = await respond(client, "hi", messages=[])  # (its param was said to be input)
        conv = await client.post("/v1/conversations", json={"metdata": {"a": "1"}})
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        update = await client.post(
            f"/v1/conversations/{cid}", json={"metadta": {}}
        )  # ('metadata' is required)
        count = await client.post(
            "/v1/responses/input_tokens", json={"model": "mock/m", "input": "x", "n": 2}
        )
        compact = await client.post(
            "/v1/responses/compact", json={"model": "mock/m", "input": "x", "stream": True}
        )
        known = await respond(
            client, "hi", include=["reasoning.encrypted_content"], service_tier="auto", top_logprobs=0, seed=7
        )
    for r, name in [
        (typo, "previous_respons_id"),
        (capped, "max_output_token"),
        (chat_named, "max_tokens"),
        (messages, "messages"),
        (conv, "metdata"),
        (update, "metadta"),
        (count, "n"),
        (compact, "stream"),
    ]:
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"] == {
            "message": f"Unknown parameter: '{name}'.",
            "type": "invalid_request_error",
            "param": name,
            "code": "unknown_parameter",
        }
    assert known.status_code == 200, known.text
    assert len(store.indexes) == 3  # the first turn's, the created conversation and the last turn's


async def test_the_gateways_own_bodies_refuse_a_field_they_do_not_know() -> None:
    """`reset` with `keep_system_messages` (a typo) reset the conversation without its system
    prompt; `items.create` and the updates took unknown fields for nothing."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        body = {"model": "mock/m", "conversation_id": "k", "messages": [{"role": "system", "content": "S"}]}
        body["messages"].append({"role": "user", "content": "hi"})
        made = (await client.post("/v1/chat/completions", json=body)).json()
        typo = await client.post("/v1/conversations/k/reset", json={"keep_system_messages": True})
        items = await client.post("/v1/conversations/k/items", json={"items": [], "itmes": []})
        update = await client.post(f"/v1/chat/completions/{made['id']}", json={"metadata": None, "tags": {}})
        kept = await client.post("/v1/conversations/k/reset", json={"keep_system_message": True})
        listed = (await client.get("/v1/conversations/k/items")).json()["data"]
    for r, name in [(typo, "keep_system_messages"), (items, "itmes"), (update, "tags")]:
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter", (name, r.text)
        assert r.json()["error"]["param"] == name
    assert kept.status_code == 200
    assert [i["role"] for i in listed] == ["system"]


async def test_compacting_through_a_response_a_reset_or_an_edit_left_behind() -> None:
    """`compact` with such a `previous_response_id` was a 404 "no longer part of a conversation",
    where `create` and `input_tokens` go on from that response's history."""
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r1 = (await respond(client, "my dog is Rex", conversation_id="c-x")).json()
        r2 = (await respond(client, "my cat is Tom", conversation_id="c-x")).json()
        assert (await client.post("/v1/conversations/c-x/reset")).status_code == 200
        body = {"model": "mock/m", "input": "and fish?", "previous_response_id": r2["id"]}
        after_reset = await client.post("/v1/responses/compact", json=body)
        older = await client.post("/v1/responses/compact", json={**body, "previous_response_id": r1["id"]})
    assert after_reset.status_code == 200, after_reset.text
    assert older.status_code == 200, older.text
    summarized = [b for b in upstream.requests if "my cat is Tom" in str(b["messages"])]
    assert summarized and "my dog is Rex" in str(summarized[-1]["messages"])
