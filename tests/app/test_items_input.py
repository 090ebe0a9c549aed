"""Items added through the Conversations and Responses APIs are checked as chat messages are: a
field of the wrong type is a 400 that stores nothing (what is stored is replayed on every later
turn), and the items view shows each stored part as what it is."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.context.items import items_to_messages, message_to_items
from gateway.exceptions import InvalidRequest
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.helpers import say_each

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}

BAD_ITEMS: dict[str, list[dict[str, Any]]] = {
    "image_url not a string": [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}],
    "text not a string": [{"role": "user", "content": [{"type": "input_text", "text": {"a": [1]}}]}],
    "text null": [{"role": "user", "content": [{"type": "input_text", "text": None}]}],
    "message without content": [{"type": "message", "role": "user"}],
    "call_id not a string": [{**CALL, "call_id": 5}],
    "arguments not a string": [{**CALL, "arguments": 5}],
    "name missing": [{"type": "function_call", "call_id": "c1"}],
    "output an object": [CALL, {"type": "function_call_output", "call_id": "c1", "output": {"temp": 22}}],
    "output call_id not a string": [CALL, {"type": "function_call_output", "call_id": 1, "output": "x"}],
    "input_file without a file": [{"role": "user", "content": [{"type": "input_file", "filename": "a.pdf"}]}],
    # A file id went upstream as an image URL on every later turn (a provider's 400 each time).
    "image by file_id": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-abc123"}]}],
    "image_url not a URL": [{"role": "user", "content": [{"type": "input_image", "image_url": "file-abc"}]}],
    "image detail unknown": [
        {
            "role": "user",
            "content": [{"type": "input_image", "image_url": "https://x/a.png", "detail": "ultra"}],
        }
    ],
}


@pytest.mark.parametrize("items", BAD_ITEMS.values(), ids=list(BAD_ITEMS))
def test_a_field_of_the_wrong_type_is_a_400(items: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidRequest):
        items_to_messages(items)


@pytest.mark.parametrize("items", BAD_ITEMS.values(), ids=list(BAD_ITEMS))
async def test_bad_items_store_nothing(
    app_client: httpx.AsyncClient, memory_store: MemoryStore, mock_upstream: MockUpstream, items: list[Any]
) -> None:
    created = await app_client.post("/v1/conversations", json={"id": "bad-items", "items": items})
    assert created.status_code == 400, created.text
    assert created.json()["error"]["type"] == "invalid_request_error"
    await app_client.post("/v1/conversations", json={"id": "bad-items-2"})
    added = await app_client.post("/v1/conversations/bad-items-2/items", json={"items": items})
    assert added.status_code == 400, added.text
    listed = await app_client.get("/v1/conversations/bad-items-2/items")
    assert listed.json()["data"] == []
    await say_each(app_client, "bad-items-2", ["hi"])  # (each answered 200)
    assert mock_upstream.requests[-1]["messages"] == [{"role": "user", "content": "hi"}]


def test_a_function_call_without_arguments_is_stored_with_empty_ones() -> None:
    """Stored as "", it went to the provider on every later turn (a strict one refuses it)."""
    [message] = items_to_messages([{"type": "function_call", "call_id": "c1", "name": "now"}])
    assert message["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}


def test_tool_output_may_be_text_parts() -> None:
    parts = [{"type": "input_text", "text": "22 "}, {"type": "input_text", "text": "degrees"}]
    out = items_to_messages([CALL, {"type": "function_call_output", "call_id": "c1", "output": parts}])
    assert out[-1] == {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"}


def test_audio_and_file_parts_are_listed_as_what_they_are() -> None:
    audio = {"data": "UklGRg==", "format": "wav"}
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "transcribe:"},
            {"type": "input_audio", "input_audio": audio},
            {"type": "file", "file": {"file_id": "file-1", "filename": "a.pdf"}},
            {"type": "text", "text": None},
        ],
    }
    [item] = message_to_items(message, "m-0123456789ab", 0)
    assert item["content"] == [
        {"type": "input_text", "text": "transcribe:"},
        {"type": "input_audio", "input_audio": audio},
        {"type": "input_file", "file_id": "file-1", "filename": "a.pdf"},
        {"type": "input_text", "text": ""},
    ]
    # and the listed parts, added back as items, are the same chat message
    again = items_to_messages([{"role": "user", "content": item["content"][:3]}])
    assert again == [{"role": "user", "content": message["content"][:3]}]


def test_an_images_detail_is_listed_as_stored() -> None:
    """Every image was listed with detail "auto", whatever detail was stored and sent."""
    for detail in ("high", "low"):
        part = {"type": "input_image", "image_url": "https://x/a.png", "detail": detail}
        [message] = items_to_messages([{"role": "user", "content": [part]}])
        assert message["content"] == [
            {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": detail}}
        ]
        [item] = message_to_items(message, "m-0123456789ab", 0)
        assert item["content"] == [{**part, "file_id": None}]


async def test_a_system_item_added_later_takes_its_place_in_line(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    """Adding a system item replaced the system prompt: the first instructions left the items
    and never reached the model again (OpenAI's API only adds items). A conversation with
    nothing yet still takes leading system items as its system prompt."""
    vet = {"role": "system", "content": "You are a vet."}
    start = [vet, {"role": "user", "content": "My dog is Rex."}, {"role": "assistant", "content": "Hi Rex!"}]
    created = await app_client.post("/v1/conversations", json={"id": "sys-later", "items": start})
    assert created.status_code == 200, created.text
    note = {"role": "system", "content": "The user is logged in."}
    added = await app_client.post("/v1/conversations/sys-later/items", json={"items": [note]})
    assert added.status_code == 200, added.text
    await say_each(app_client, "sys-later", ["Who is my dog?"])
    assert mock_upstream.requests[-1]["messages"] == [
        *start,
        note,
        {"role": "user", "content": "Who is my dog?"},
    ]
    listed = (await app_client.get("/v1/conversations/sys-later/items", params={"order": "asc"})).json()
    texts = [item["content"][0]["text"] for item in listed["data"]]
    assert texts[:5] == [
        "You are a vet.",
        "My dog is Rex.",
        "Hi Rex!",
        "The user is logged in.",
        "Who is my dog?",
    ]
    assert len(texts) == 6  # and the answer
    assert listed["data"][3]["role"] == "system"

    await app_client.post("/v1/conversations", json={"id": "sys-empty"})
    added = await app_client.post("/v1/conversations/sys-empty/items", json={"items": [vet]})
    assert added.status_code == 200, added.text
    await say_each(app_client, "sys-empty", ["hi"])
    assert mock_upstream.requests[-1]["messages"] == [vet, {"role": "user", "content": "hi"}]


async def test_a_prompt_template_is_named_in_its_400(app_client: httpx.AsyncClient) -> None:
    """Said "'input' must be a string or an array of items" to a request naming a template."""
    r = await app_client.post("/v1/responses", json={"model": "mock/m", "prompt": {"id": "pmpt_1"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


async def test_responses_store_and_metadata_are_checked(app_client: httpx.AsyncClient) -> None:
    for field, value in (("store", "no"), ("metadata", 5), ("metadata", {"k": 5})):
        r = await app_client.post("/v1/responses", json={"model": "mock/m", "input": "hi", field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field
    ok = await app_client.post(
        "/v1/responses", json={"model": "mock/m", "input": "hi", "metadata": {"k": "v"}}
    )
    assert ok.status_code == 200, ok.text


async def test_a_deleted_response_is_no_longer_a_turn_in_the_list(app_client: httpx.AsyncClient) -> None:
    """The process that deleted it kept counting it (3 turns) where any other reader, or the same
    one after a restart, counts 2."""
    ids = await say_each(app_client, "turns", ["a", "b", "c"])
    assert (await app_client.delete(f"/v1/responses/{ids[1]}")).status_code == 200
    listed = (await app_client.get("/v1/conversations")).json()["data"]
    assert [(c["id"], c["turns"]) for c in listed] == [("turns", 2)]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/conversations?limit=%C2%B2",  # ² is a digit to str.isdigit, not to int()
        "/v1/conversations/q/items?limit=%C2%B2",
        "/v1/conversations/q/items?after=fc_x-0123456789ab_0_%C2%B2",
        "/ui/api/conversations/q?since=%C2%B2",
        "/ui/api/conversations/q?since=" + "9" * 5000,  # over int()'s 4,300 digits
    ],
)
async def test_numbers_in_query_parameters_are_ascii_digits_or_a_400(
    app_client: httpx.AsyncClient, path: str
) -> None:
    body = {"model": "mock/m", "conversation_id": "q", "messages": [{"role": "user", "content": "x"}]}
    assert (await app_client.post("/v1/chat/completions", json=body)).status_code == 200
    r = await app_client.get(path)
    assert r.status_code in (400, 404) and r.json()["error"]["type"] == "invalid_request_error", r.text
