"""Deleting one item of an answer that holds several (its text, its parallel calls): that item
alone, as OpenAI deletes an item, on every store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


def answer(body: dict[str, Any]) -> object:
    """Text and two calls on the first turn, text after."""
    if any(m["role"] == "tool" for m in body["messages"]) or len(body["messages"]) > 1:
        return "done"
    calls = [
        {"id": f"call_{k}", "type": "function", "function": {"name": f"f{k}", "arguments": "{}"}}
        for k in (0, 1)
    ]
    return {"role": "assistant", "content": "Looking both up.", "tool_calls": calls}


@pytest.fixture(params=["memory", "jsonl"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return make_settings(tmp_path) if request.param == "jsonl" else make_settings()


async def test_an_answers_items_are_deleted_one_by_one(settings: Any) -> None:
    """Deleting `fc_..._0` deleted the whole answer, its text and `fc_..._1` with it, so the SDK's
    loop that deletes each listed item met a 404 on the next one."""
    upstream = MockUpstream(answer)
    async with build_client(settings, None, upstream) as client:
        conv = (await client.post("/v1/conversations", json={})).json()["id"]
        body = {"model": "mock/m", "conversation": conv, "input": "weather and time?"}
        assert (await client.post("/v1/responses", json=body)).status_code == 200
        results = [
            {"type": "function_call_output", "call_id": f"call_{k}", "output": f"r{k}"} for k in (0, 1)
        ]
        assert (await client.post("/v1/responses", json={**body, "input": results})).status_code == 200

        async def items() -> list[str]:
            page = await client.get(f"/v1/conversations/{conv}/items", params={"order": "asc"})
            return [i["id"] for i in page.json()["data"]]

        listed = await items()
        calls = [i for i in listed if i.startswith("fc_")]
        text = next(i for i in listed if i.startswith("msg_") and i.endswith("_1"))
        assert len(calls) == 2
        assert (await client.delete(f"/v1/conversations/{conv}/items/{calls[0]}")).status_code == 200
        assert calls[1] in await items() and text in await items()
        assert (await client.get(f"/v1/conversations/{conv}/items/{calls[1]}")).status_code == 200
        assert (await client.post("/v1/responses", json={**body, "input": "and?"})).status_code == 200
        sent = upstream.requests[-1]["messages"]
        kept = next(m for m in sent if m.get("tool_calls"))
        assert kept["content"] == "Looking both up." and [c["id"] for c in kept["tool_calls"]] == ["call_1"]
        assert [m["tool_call_id"] for m in sent if m["role"] == "tool"] == ["call_1"]
        assert all("call_numbers" not in m for m in sent)
        assert (await client.delete(f"/v1/conversations/{conv}/items/{text}")).status_code == 200
        assert calls[1] in await items() and text not in await items()
        # The inspector (and `gateway show`) says what of the answer is no longer sent.
        shown = (await client.get(f"/ui/api/conversations/{conv}")).json()["turns"]
        first = next(t for t in shown if t.get("response_id") and "marker" not in t)
        assert first["not_sent_parts"] == {"1": ["call 0", "its text"]} and 1 not in first["not_sent"]
        for item in await items():  # the SDK's loop: each listed item deleted
            r = await client.delete(f"/v1/conversations/{conv}/items/{item}")
            assert r.status_code == 200, (item, r.text)
        assert await items() == []
        assert (await client.post("/v1/responses", json={**body, "input": "hi"})).status_code == 200
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user"]


async def test_a_response_output_sent_back_is_one_answer() -> None:
    """OpenAI's function-calling loop (`input += response.output`, then the results): the answer's
    text and its calls went to the provider, and into the conversation, as two assistant messages
    in a row."""
    upstream = MockUpstream(answer)
    async with build_client(make_settings(), None, upstream) as client:
        question = {"role": "user", "content": "weather and time?"}
        first = (await client.post("/v1/responses", json={"model": "mock/m", "input": [question]})).json()
        results = [
            {"type": "function_call_output", "call_id": f"call_{k}", "output": f"r{k}"} for k in (0, 1)
        ]
        again = await client.post(
            "/v1/responses", json={"model": "mock/m", "input": [question, *first["output"], *results]}
        )
        assert again.status_code == 200, again.text
        cid = again.json()["conversation"]["id"]
        items = (await client.get(f"/v1/conversations/{cid}/items", params={"order": "asc"})).json()["data"]
    roles = [m["role"] for m in upstream.requests[-1]["messages"]]
    assert roles == ["user", "assistant", "tool", "tool"]
    assert upstream.requests[-1]["messages"][1]["content"] == "Looking both up."
    assert [i["type"] for i in items][:4] == ["message", "message", "function_call", "function_call"]
    text, calls = items[1]["id"], [i["id"] for i in items[2:4]]  # one stored message: one position
    assert calls == [f"fc_{text.removeprefix('msg_')}_0", f"fc_{text.removeprefix('msg_')}_1"]
