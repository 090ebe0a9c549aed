"""Compaction on every backend (OpenAI's `POST /v1/responses/compact`, compaction items sent
back in `input`, `context_management` on `POST /v1/responses`), through the app on the store
twin, with the mock model: its summarizer keeps the facts it is given (the demo model's)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import pytest

from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings

SUMMARIZER = "You maintain the running summary"
KEYS_ENV = "COMPACTION_TEST_KEYS"


def summarizer_calls(upstream: MockUpstream) -> list[dict[str, Any]]:
    return [b for b in upstream.requests if str(b["messages"][0].get("content", "")).startswith(SUMMARIZER)]


def turns(upstream: MockUpstream) -> list[dict[str, Any]]:
    return [b for b in upstream.requests if b not in summarizer_calls(upstream)]


async def respond(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/responses", json={"model": "mock/m", **body})
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


@pytest.fixture
async def client() -> Any:
    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as c:
        c.upstream = upstream  # type: ignore[attr-defined]
        yield c


async def test_compact_a_conversation_then_continue_from_its_output(client: Any) -> None:
    r1 = await respond(client, input="Hi, my name is Bob.")
    r2 = await respond(client, input="my city is Oslo", previous_response_id=r1["id"])
    r = await client.post("/v1/responses/compact", json={"model": "mock/m", "previous_response_id": r2["id"]})
    assert r.status_code == 200, r.text
    compacted = r.json()
    assert compacted["object"] == "response.compaction" and compacted["id"].startswith("mock-m-")
    assert isinstance(compacted["created_at"], int)
    *kept, item = compacted["output"]
    # The user messages as they were, then one compaction item.
    assert [(m["type"], m["role"], m["content"][0]["text"]) for m in kept] == [
        ("message", "user", "Hi, my name is Bob."),
        ("message", "user", "my city is Oslo"),
    ]
    assert all(m["id"].startswith("msg_") and m["status"] == "completed" for m in kept)
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert "Bob" not in item["encrypted_content"] and "Bob" not in base64.urlsafe_b64decode(
        item["encrypted_content"]
    ).decode(errors="replace")  # a reference, never the summary
    usage = compacted["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert len(summarizer_calls(client.upstream)) == 1
    # Stateless chaining: the compacted output, then a new message, in a new conversation.
    follow = await respond(
        client, input=[*compacted["output"], {"role": "user", "content": "what is my city?"}]
    )
    assert text_of(follow) == "Your city is Oslo."
    sent = turns(client.upstream)[-1]["messages"]
    summary = [m for m in sent if m["role"] == "system"]
    assert len(summary) == 1 and summary[0]["content"].startswith("Summary of the earlier conversation:\n")
    assert "my name is Bob" in summary[0]["content"] and "compaction" not in summary[0]  # never sent
    # The item is listed back as the client sent it (the summary is not shown as an input).
    items = (await client.get(f"/v1/responses/{follow['id']}/input_items?order=asc")).json()["data"]
    assert [i["type"] for i in items] == ["message", "message", "compaction", "message"]
    assert items[2]["encrypted_content"] == item["encrypted_content"]


async def test_compact_input_items_and_a_compaction_compacted_again(client: Any) -> None:
    first = await client.post(
        "/v1/responses/compact",
        json={"model": "mock/m", "input": [{"role": "user", "content": "my dog is Rex"}]},
    )
    assert first.status_code == 200, first.text
    again = await client.post(
        "/v1/responses/compact",
        json={
            "model": "mock/m",
            "input": [*first.json()["output"], {"role": "user", "content": "my cat is Tom"}],
        },
    )
    assert again.status_code == 200, again.text
    *kept, item = again.json()["output"]
    assert [m["content"][0]["text"] for m in kept] == ["my dog is Rex", "my cat is Tom"]
    r = await respond(client, input=[item, {"role": "user", "content": "what is my dog?"}])
    assert text_of(r) == "Your dog is Rex."  # the first compaction's facts, carried by the second


async def test_a_string_input_and_instructions_are_compacted_and_nothing_is_a_400(client: Any) -> None:
    r = await client.post(
        "/v1/responses/compact", json={"model": "mock/m", "input": "my name is Ann", "instructions": "x"}
    )
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "my name is Ann"
    empty = await client.post("/v1/responses/compact", json={"model": "mock/m"})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    both = await client.post(
        "/v1/responses/compact", json={"model": "mock/m", "conversation": "c", "previous_response_id": "x"}
    )
    assert both.status_code == 400
    unknown = await client.post(
        "/v1/responses/compact", json={"model": "mock/m", "previous_response_id": "nope"}
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    missing = await client.post("/v1/responses/compact", json={"model": "mock/m", "conversation": "never"})
    assert missing.status_code == 404


async def test_compact_a_conversation_named_by_the_gateway_s_conversation(client: Any) -> None:
    for text in ["my name is Eve", "my city is Rome"]:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "conversation_id": "named",
                "messages": [{"role": "user", "content": text}],
            },
        )
        assert r.status_code == 200
    r = await client.post("/v1/responses/compact", json={"model": "mock/m", "conversation": {"id": "named"}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output"]) == 3
    compactions = (await client.get("/ui/api/conversations/named")).json()["compactions"]
    assert [(c["trigger"], c["covered_messages"]) for c in compactions] == [("compact", 4)]


def _forged(content: str) -> list[str]:
    raw = bytearray(base64.urlsafe_b64decode(content))
    raw[-1] ^= 1  # the secret altered
    other = bytearray(raw)
    other[3] ^= 1  # the id altered
    return [
        "gAAAAABnot-a-gateway-reference==",
        base64.urlsafe_b64encode(bytes(raw)).decode(),
        base64.urlsafe_b64encode(bytes(other)).decode(),
        "",
    ]


async def test_a_forged_or_altered_reference_is_a_400_in_openai_s_shape(client: Any) -> None:
    r = await client.post("/v1/responses/compact", json={"model": "mock/m", "input": "my name is Bob"})
    content = r.json()["output"][-1]["encrypted_content"]
    sent = len(client.upstream.requests)
    for forged in _forged(content):
        for path in ("/v1/responses", "/v1/responses/compact"):
            bad = await client.post(
                path,
                json={
                    "model": "mock/m",
                    "input": [
                        {"type": "compaction", "encrypted_content": forged},
                        {"role": "user", "content": "hi"},
                    ],
                },
            )
            assert bad.status_code == 400, bad.text
            error = bad.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == "input[0].encrypted_content"
            if forged:
                assert error["code"] == "invalid_encrypted_content"
                assert "could not be verified" in error["message"]
    assert len(client.upstream.requests) == sent  # the provider was never asked


async def test_another_tenant_s_compaction_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, "key-a,key-b")
    settings = make_settings()
    settings = settings.model_copy(update={"auth": settings.auth.model_copy(update={"keys_env": KEYS_ENV})})
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
        made = await client.post(
            "/v1/responses/compact", json={"model": "mock/m", "input": "my name is A"}, headers=a
        )
        item = made.json()["output"][-1]
        body = {"model": "mock/m", "input": [item, {"role": "user", "content": "what is my name?"}]}
        mine = await client.post("/v1/responses", json=body, headers=a)
        assert mine.status_code == 200 and text_of(mine.json()) == "Your name is A."
        theirs = await client.post("/v1/responses", json=body, headers=b)
        assert theirs.status_code == 400 and theirs.json()["error"]["code"] == "invalid_encrypted_content"


@pytest.mark.parametrize("stream", [False, True])
async def test_context_management_compacts_past_the_threshold_and_later_turns_recall(
    client: Any, stream: bool
) -> None:
    manage = [{"type": "compaction", "compact_threshold": 60}]
    previous = None
    outputs, ids = [], []
    for text in ["Hi, my name is Bob.", "my city is Oslo", "I like trains a lot.", "my dog is Rex"]:
        body = {"input": text, "previous_response_id": previous, "context_management": manage}
        if stream:
            r = await client.post("/v1/responses", json={"model": "mock/m", "stream": True, **body})
            assert r.status_code == 200, r.text
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            response = events[-1]["response"]
            assert events[-1]["type"] == "response.completed"
            added = [
                (e["output_index"], e["item"]["type"])
                for e in events
                if e["type"] == "response.output_item.added"
            ]
            assert added == list(enumerate(i["type"] for i in response["output"]))
        else:
            response = await respond(client, **body)
        outputs.append([i["type"] for i in response["output"]])
        ids.append(previous := response["id"])
    compacting = next(i for i, kinds in enumerate(outputs) if kinds[0] == "compaction")
    assert outputs[compacting] == ["compaction", "message"] and compacting > 0
    assert all(kinds == ["message"] for kinds in outputs[:compacting])
    # The turn that compacted: sent the summary, and not the turns it covers.
    sent = turns(client.upstream)[compacting]["messages"]
    assert sent[0]["content"].startswith("Summary of the earlier conversation:\n")
    assert "my name is Bob" in sent[0]["content"]
    assert "Hi, my name is Bob." not in [m["content"] for m in sent]
    # A later turn (no context_management) still recalls what only the summary holds.
    later = await respond(client, input="what is my name?", previous_response_id=previous)
    assert text_of(later) == "Your name is Bob."
    prompt = turns(client.upstream)[-1]["messages"]
    assert any(m["role"] == "system" and "my name is Bob" in m["content"] for m in prompt)
    assert "Hi, my name is Bob." not in [m["content"] for m in prompt]
    # The stored response keeps its compaction item, and the item resolves (input chaining).
    stored = (await client.get(f"/v1/responses/{ids[compacting]}")).json()["output"]
    assert [i["type"] for i in stored] == ["compaction", "message"]
    chained = await respond(client, input=[stored[0], {"role": "user", "content": "what is my name?"}])
    assert text_of(chained) == "Your name is Bob."
    compactions = (await client.get(f"/ui/api/conversations/{later['conversation']['id']}")).json()[
        "compactions"
    ]
    made = sum(kinds[0] == "compaction" for kinds in outputs)
    assert [c["trigger"] for c in compactions] == ["context_management"] * made


async def test_context_management_below_the_threshold_changes_nothing(client: Any) -> None:
    manage = [{"type": "compaction", "compact_threshold": 100_000}]
    r1 = await respond(client, input="my name is Bob", context_management=manage)
    r2 = await respond(
        client, input="what is my name?", previous_response_id=r1["id"], context_management=manage
    )
    assert [i["type"] for i in r2["output"]] == ["message"] and text_of(r2) == "Your name is Bob."
    assert summarizer_calls(client.upstream) == []


async def test_context_management_is_checked(client: Any) -> None:
    for bad in ([{"type": "other"}], [{"type": "compaction", "compact_threshold": 0}], "compaction"):
        r = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": "x", "context_management": bad}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("context_management")


async def test_with_truncation_disabled_a_compaction_is_not_a_cut(client: Any) -> None:
    """`truncation: "disabled"` refuses a window that leaves messages out or folds them into a
    rolling summary; a compaction the client asked for is the conversation it goes on from."""
    manage = [{"type": "compaction", "compact_threshold": 40}]
    previous = None
    kinds = []
    for text in ["my name is Bob", "my city is Oslo", "my dog is Rex", "what is my name?"]:
        body = {"input": text, "previous_response_id": previous, "truncation": "disabled"}
        r = await respond(client, **body, context_management=manage)
        kinds.append(r["output"][0]["type"])
        previous = r["id"]
    assert "compaction" in kinds and text_of(r) == "Your name is Bob."
    after = await respond(
        client, input="what is my city?", previous_response_id=previous, truncation="disabled"
    )
    assert text_of(after) == "Your city is Oslo."


async def test_input_tokens_counts_a_compaction_item_as_its_summary(client: Any) -> None:
    made = await client.post("/v1/responses/compact", json={"model": "mock/m", "input": "my name is Bob"})
    item = made.json()["output"][-1]
    body = {"model": "mock/m", "input": [item, {"role": "user", "content": "what is my name?"}]}
    counted = await client.post("/v1/responses/input_tokens", json=body)
    assert counted.status_code == 200, counted.text
    alone = await client.post("/v1/responses/input_tokens", json={**body, "input": body["input"][1:]})
    assert counted.json()["input_tokens"] > alone.json()["input_tokens"]
    forged = {**body, "input": [{**item, "encrypted_content": "gAAAAABforged=="}]}
    refused = await client.post("/v1/responses/input_tokens", json=forged)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_encrypted_content"


async def test_a_background_response_keeps_its_compaction_item(client: Any) -> None:
    manage = [{"type": "compaction", "compact_threshold": 20}]
    r1 = await respond(client, input="my name is Bob")
    r2 = await respond(client, input="my city is Oslo", previous_response_id=r1["id"])
    queued = await respond(
        client,
        input="my dog is Rex",
        previous_response_id=r2["id"],
        background=True,
        context_management=manage,
    )
    assert queued["status"] == "queued" and queued["output"][0]["type"] == "compaction"
    for _ in range(200):
        done = (await client.get(f"/v1/responses/{queued['id']}")).json()
        if done["status"] == "completed":
            break
        await asyncio.sleep(0.01)
    assert [i["type"] for i in done["output"]] == ["compaction", "message"]
    replay = await client.get(f"/v1/responses/{queued['id']}?stream=true")
    frames = [json.loads(line[6:]) for line in replay.text.splitlines() if line.startswith("data: ")]
    added = [
        (e["output_index"], e["item"]["type"]) for e in frames if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "compaction"), (1, "message")]


def test_a_replayed_response_announces_its_compaction_item_whole() -> None:
    """Replayed as the events of a whole answer (a background response's, elsewhere or after a
    restart), the compaction item is added as it is: not given a message's or a call's fields."""
    from gateway.api.response_shapes import replayed_events

    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "AVhU"}
    message = {
        "type": "message",
        "id": "msg_r_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "hi", "annotations": []}],
    }
    final = {"id": "r", "object": "response", "status": "completed", "output": [item, message]}
    frames = [json.loads(f.split(b"data: ", 1)[1]) for f in replayed_events(final)]
    added = [(e["output_index"], e["item"]) for e in frames if e["type"] == "response.output_item.added"]
    assert added[0] == (0, item) and added[1][1]["content"] == []
    assert [e["output_index"] for e in frames if e["type"] == "response.output_item.done"] == [0, 1]


async def test_context_management_compacts_a_conversation_post_processing_summarized() -> None:
    """Post-processing's summary covers the whole conversation but waits for a cut: the prompt
    was measured as that summary and the new input, so no compaction was due while the whole
    history went to the provider on every turn."""
    from tests.conftest import app_of

    upstream = MockUpstream()
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        previous = None
        for text in ["Hi, my name is Bob.", "my city is Oslo", "I like trains a lot.", "my dog is Rex"]:
            previous = (await respond(client, input=text, previous_response_id=previous))["id"]
        cid = (await client.get(f"/v1/responses/{previous}")).json()["conversation"]["id"]
        summaries = app_of(client).state.processor.sessions.summaries
        await summaries.summarize_all("", cid, "mock/m")  # idle: post-processing folds it all
        manage = [{"type": "compaction", "compact_threshold": 60}]
        response = await respond(
            client, input="and my cat is Tom", previous_response_id=previous, context_management=manage
        )
    assert [i["type"] for i in response["output"]] == ["compaction", "message"]
    sent = [m["content"] for m in turns(upstream)[-1]["messages"]]
    assert "Hi, my name is Bob." not in sent and sent[0].startswith("Summary of the earlier conversation")
    # Every turn but the newest folded: the newest is sent as it is (post-processing's summary
    # of all of them had stood in for it too).
    assert sent[-3:-1] == ["my dog is Rex", sent[-2]] and sent[-1] == "and my cat is Tom"
