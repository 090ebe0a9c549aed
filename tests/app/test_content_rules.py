"""One set of content rules for every way into a conversation (chat completions, Responses input,
Conversations items): the same bad content is the same 400, in OpenAI's error shape, and stores
nothing (what is stored goes back to the provider on every later turn)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.context.content import is_image_url
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream

CID = "rules"


def _chat(content: list[dict[str, Any]], model: str) -> tuple[str, dict[str, Any], str]:
    body = {"model": model, "conversation_id": CID, "messages": [{"role": "user", "content": content}]}
    return "/v1/chat/completions", body, "messages[0]"


def _responses(content: list[dict[str, Any]], model: str) -> tuple[str, dict[str, Any], str]:
    body = {"model": model, "conversation": CID, "input": [{"role": "user", "content": content}]}
    return "/v1/responses", body, "input[0]"


def _items(content: list[dict[str, Any]], model: str) -> tuple[str, dict[str, Any], str]:
    body = {"items": [{"type": "message", "role": "user", "content": content}]}
    return f"/v1/conversations/{CID}/items", body, "items[0]"


WAYS_IN = {"chat": _chat, "responses": _responses, "items": _items}


def _image(url: object, way: str) -> dict[str, Any]:
    """An image part as each way in writes it (chat: an `image_url` object)."""
    if way == "chat":
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "input_image", "image_url": url}


# The same bad content, each written as that way in writes an image.
BAD_IMAGES: dict[str, Any] = {
    "a file URL": "file:///etc/passwd",
    "a javascript URL": "javascript:alert(1)",
    "an ftp URL": "ftp://example.com/a.png",
    "a bare file id": "file-abc123",
    "a URL without a host": "https:",
    "an empty URL": "",
}


async def _refused(
    client: httpx.AsyncClient, upstream: MockUpstream, way: str, content: list[dict[str, Any]], model: str
) -> dict[str, Any]:
    """The error of a turn (or an item) with `content` on a fresh conversation, which then holds nothing."""
    assert (await client.post("/v1/conversations", json={"id": CID})).status_code == 200
    path, body, where = WAYS_IN[way](content, model)
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(where), error
    assert error["message"].startswith(where), error
    listed = await client.get(f"/v1/conversations/{CID}/items")
    assert listed.json()["data"] == [] and upstream.requests == []
    assert (await client.delete(f"/v1/conversations/{CID}")).status_code == 200
    return {
        **error,
        "message": error["message"].removeprefix(where),
        "param": error["param"].removeprefix(where),
    }


@pytest.mark.parametrize("url", BAD_IMAGES.values(), ids=list(BAD_IMAGES))
async def test_an_image_url_is_http_or_data_on_every_way_in(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, url: str
) -> None:
    errors = {
        way: await _refused(app_client, mock_upstream, way, [_image(url, way)], "mock/m") for way in WAYS_IN
    }
    assert errors["chat"]["code"] == "invalid_image_url"
    assert errors["chat"] == errors["responses"] == errors["items"], errors


@pytest.mark.parametrize(
    "url", ["https://example.com/a.png", "HTTP://example.com/a.png", "data:image/png;base64,iVBORw0K"]
)
async def test_http_and_data_images_are_taken_on_every_way_in(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, url: str
) -> None:
    for n, way in enumerate(WAYS_IN):
        cid = f"{CID}-{n}"
        assert (await app_client.post("/v1/conversations", json={"id": cid})).status_code == 200
        path, body, _ = WAYS_IN[way]([_image(url, way)], "mock/m")
        body = {**body, "conversation_id": cid} if way == "chat" else {**body, "conversation": cid}
        r = await app_client.post(
            path.replace(CID, cid), json=body if way != "items" else {"items": body["items"]}
        )
        assert r.status_code == 200, r.text
        [item] = (await app_client.get(f"/v1/conversations/{cid}/items?order=asc&limit=1")).json()["data"]
        assert item["content"][0]["image_url"] == url


# An image part's shape: chat's `image_url` is an object with a string `url`; an item's
# `image_url` is the URL itself. A shape the way in does not take is refused alike.
BAD_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "the URL where an object belongs / an object where the URL belongs": {
        "chat": {"type": "image_url", "image_url": "https://example.com/a.png"},
        "responses": {"type": "input_image", "image_url": {"url": "https://example.com/a.png"}},
        "items": {"type": "input_image", "image_url": {"url": "https://example.com/a.png"}},
    },
    "a number for the URL": {
        "chat": {"type": "image_url", "image_url": {"url": 5}},
        "responses": {"type": "input_image", "image_url": 5},
        "items": {"type": "input_image", "image_url": 5},
    },
    "no URL": {
        "chat": {"type": "image_url", "image_url": {"detail": "low"}},
        "responses": {"type": "input_image", "detail": "low"},
        "items": {"type": "input_image", "detail": "low"},
    },
    "an unknown detail": {
        "chat": {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "ultra"}},
        "responses": {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "ultra"},
        "items": {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "ultra"},
    },
}


@pytest.mark.parametrize("parts", BAD_SHAPES.values(), ids=list(BAD_SHAPES))
@pytest.mark.parametrize("way", list(WAYS_IN))
async def test_an_image_of_the_wrong_shape_is_refused_on_every_way_in(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, way: str, parts: dict[str, dict[str, Any]]
) -> None:
    error = await _refused(app_client, mock_upstream, way, [parts[way]], "mock/m")
    assert error["code"] == "invalid_image" and error["param"] == ".content", error


BAD_MODELS = {
    "a NUL": "mock/m\x00",
    "a newline": "mock/m\nX-Injected: 1",
    "a tab": "mock/\tm",
    "an escape": "mock/m\x1b[31m",
    "a DEL": "mock/m\x7f",
    "a C1 control": "mock/m\x85",
}


@pytest.mark.parametrize("model", BAD_MODELS.values(), ids=list(BAD_MODELS))
async def test_a_model_name_has_no_control_characters_on_every_way_in(
    app_client: httpx.AsyncClient, memory_store: MemoryStore, mock_upstream: MockUpstream, model: str
) -> None:
    """Items name no model: chat and Responses, the two ways in that do, refuse it alike."""
    errors = []
    for path, body in (
        (
            "/v1/chat/completions",
            {"model": model, "conversation_id": CID, "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("/v1/responses", {"model": model, "conversation": CID, "input": "hi"}),
    ):
        assert (await app_client.post("/v1/conversations", json={"id": CID})).status_code == 200
        r = await app_client.post(path, json=body)
        assert r.status_code == 400, r.text
        errors.append(r.json()["error"])
        assert (await app_client.get(f"/v1/conversations/{CID}/items")).json()["data"] == []
        await app_client.delete(f"/v1/conversations/{CID}")
    assert mock_upstream.requests == []
    assert errors[0] == errors[1] and errors[0]["param"] == "model", errors
    assert errors[0]["type"] == "invalid_request_error" and errors[0]["code"] == "invalid_model"


@pytest.mark.parametrize(
    ("url", "taken"),
    [
        ("https://example.com/a.png", True),
        ("http://127.0.0.1:8080/a.png", True),
        ("data:image/png;base64,iVBORw0K", True),
        ("Data:image/png;base64,iVBORw0K", True),
        ("data:image/png", False),  # (no data)
        ("https://[::1/a.png", False),  # (a broken host: no 500)
        ("https://example.com:port/a.png", True),  # (the provider's to fetch or refuse)
        ("https://exa\nmple.com/a.png", False),
        ("//example.com/a.png", False),
        ("file:///etc/passwd", False),
    ],
)
def test_what_an_image_url_may_be(url: str, taken: bool) -> None:
    assert is_image_url(url) is taken


@pytest.mark.parametrize(
    ("content", "what"),
    [([{"text": "hi"}], "a part without its type"), (None, "no content")],
    ids=["untyped part", "no content"],
)
@pytest.mark.parametrize("way", list(WAYS_IN))
async def test_a_message_without_content_or_a_part_without_type_is_refused_on_every_way_in(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, way: str, content: Any, what: str
) -> None:
    """Chat completions stored `{"role": "user"}` and a part `{"text": "hi"}`, which the other ways
    in refuse; stored, they went to the provider on every later turn."""
    path, body, where = WAYS_IN[way](content, "mock/m")
    for message in body.get("messages") or body.get("input") or body["items"]:
        if content is None:
            del message["content"]
    assert (await app_client.post("/v1/conversations", json={"id": CID})).status_code == 200
    r = await app_client.post(path, json=body)
    assert r.status_code == 400, (what, r.text)
    assert r.json()["error"]["param"].startswith(where)
    assert (await app_client.get(f"/v1/conversations/{CID}/items")).json()["data"] == []
    assert mock_upstream.requests == []


async def test_errors_name_what_is_missing_not_a_python_none(app_client: httpx.AsyncClient) -> None:
    """They said "unsupported content part None" and "Invalid conversation None"."""
    item = {"items": [{"type": "message", "role": "user", "content": [{"text": "hi"}]}]}
    assert (await app_client.post("/v1/conversations", json={"id": CID})).status_code == 200
    untyped = (await app_client.post(f"/v1/conversations/{CID}/items", json=item)).json()["error"]
    assert "without a string 'type'" in untyped["message"] and "None" not in untyped["message"]
    empty = await app_client.post(
        "/v1/responses", json={"model": "mock/m", "input": "hi", "conversation": {}}
    )
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "conversation.id"
    assert "None" not in empty.json()["error"]["message"]


@pytest.mark.parametrize("way", ["responses", "items", "messages"])
async def test_an_empty_content_array_is_refused_on_every_way_in(
    app_client: httpx.AsyncClient, way: str
) -> None:
    """Chat refused `content: []`; Responses and items stored it (an empty message sent on every
    later turn), and Messages took an empty assistant message mid-history."""
    assert (await app_client.post("/v1/conversations", json={"id": CID})).status_code == 200
    if way == "messages":
        empty = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": []},
            {"role": "user", "content": "b"},
        ]
        r = await app_client.post(
            "/v1/messages",
            json={"model": "mock/m", "max_tokens": 8, "messages": empty, "conversation_id": CID},
            headers={"anthropic-version": "2023-06-01"},
        )
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
    else:
        path, body, where = WAYS_IN[way]([], "mock/m")
        r = await app_client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"{where}.content", r.text
    assert (await app_client.get(f"/v1/conversations/{CID}/items")).json()["data"] == []
