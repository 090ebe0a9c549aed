"""Requests checked by the pydantic models (gateway/api/schemas.py): 400s in OpenAI's shape that
name the field as the client wrote it, bodies forwarded as sent, and the OpenAPI document
generated from the models keeping every operation of the API."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.api.openapi import build_schema
from gateway.api.validation import parse_chat
from gateway.exceptions import InvalidRequest
from gateway.upstream.mock import MockUpstream

U = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# SPEC.md section 5, and the Responses API (docs/http-api.md): every operation the document must keep.
OPERATIONS = {
    ("post", "/v1/chat/completions"),
    ("get", "/v1/models"),
    ("post", "/v1/conversations"),
    ("get", "/v1/conversations"),
    ("get", "/v1/conversations/{conversation_id}"),
    ("post", "/v1/conversations/{conversation_id}"),
    ("delete", "/v1/conversations/{conversation_id}"),
    ("get", "/v1/conversations/{conversation_id}/items"),
    ("post", "/v1/conversations/{conversation_id}/items"),
    ("get", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("delete", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("post", "/v1/conversations/{conversation_id}/reset"),
    ("get", "/v1/conversations/{conversation_id}/context"),
    ("get", "/v1/responses/{response_id}"),
    ("get", "/v1/models/{model}"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    # The Responses API bridge.
    ("post", "/v1/responses"),
    ("post", "/v1/responses/input_tokens"),
    ("delete", "/v1/responses/{response_id}"),
    ("get", "/v1/responses/{response_id}/input_items"),
    ("post", "/v1/responses/{response_id}/cancel"),
    ("post", "/v1/responses/compact"),
    # Stored chat completions.
    ("get", "/v1/chat/completions"),
    ("get", "/v1/chat/completions/{completion_id}"),
    ("post", "/v1/chat/completions/{completion_id}"),
    ("delete", "/v1/chat/completions/{completion_id}"),
    ("get", "/v1/chat/completions/{completion_id}/messages"),
    # Anthropic's Messages API.
    ("post", "/v1/messages"),
    ("post", "/v1/messages/count_tokens"),
}
TURN = {200, 400, 401, 404, 408, 409, 413, 429, 502, 503, 504}


def test_the_generated_document_keeps_every_operation_and_status() -> None:
    paths = build_schema()["paths"]
    assert {(method, path) for path, ops in paths.items() for method in ops} == OPERATIONS
    statuses = {
        (m, p): {int(s) for s in op["responses"]} for p, ops in paths.items() for m, op in ops.items()
    }
    assert statuses["post", "/v1/chat/completions"] == statuses["post", "/v1/responses"] == TURN
    assert statuses["post", "/v1/responses/compact"] == TURN  # (the summarizer is a provider call)
    assert statuses["post", "/v1/messages"] == TURN
    assert statuses["post", "/v1/messages/count_tokens"] == {200, 400, 401, 404, 408, 413, 503}
    # Anthropic's errors in Anthropic's shape, and its version header required.
    messages = paths["/v1/messages"]["post"]
    assert messages["responses"]["401"] == {"$ref": "#/components/responses/A401"}
    [version] = messages["parameters"]
    assert (version["name"], version["in"], version["required"]) == ("anthropic-version", "header", True)
    assert statuses["post", "/v1/conversations/{conversation_id}/items"] == {
        200,
        400,
        401,
        404,
        408,
        409,
        413,
        503,
    }
    assert statuses["delete", "/v1/responses/{response_id}"] == {200, 400, 401, 404, 409, 503}
    assert statuses["post", "/v1/responses/input_tokens"] == {200, 400, 401, 404, 408, 413, 503}
    assert statuses["delete", "/v1/chat/completions/{completion_id}"] == {200, 400, 401, 404, 409, 503}
    assert statuses["get", "/v1/chat/completions"] == statuses["get", "/v1/chat/completions/{completion_id}"]
    assert statuses["get", "/v1/chat/completions"] == {200, 400, 401, 404}
    assert statuses["get", "/v1/models"] == {200, 401} and statuses["get", "/readyz"] == {200, 503}


def test_every_reference_in_the_document_resolves() -> None:
    document = build_schema()
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(v for k, v in node.items() if k == "$ref")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    for ref in found:
        _, section, kind, name = ref.split("/")
        assert name in document[section][kind], ref
    assert "#/components/schemas/ToolMessage" in found and "#/components/schemas/FunctionCallItem" in found


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ([], None, "The request body must be a JSON object"),
        ({"messages": [U]}, "model", "'model' is required and must be a non-empty string"),
        ({"model": "m", "messages": {}}, "messages", "'messages' must be a non-empty array"),
        ({"model": "m", "messages": [U, 5]}, "messages[1]", "messages[1] must be an object"),
        ({"model": "m", "messages": [{}]}, "messages[0].role", None),
        ({"model": "m", "messages": [U, {"role": "wizard"}]}, "messages[1].role", None),
        (
            {"model": "m", "messages": [U, U, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            "messages[2].tool_calls[0]",
            "messages[2].tool_calls[0] must be {id, type: 'function', function: {name, arguments}}",
        ),
        (
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": [CALL, {**CALL, "id": 5}]}]},
            "messages[0].tool_calls[1]",
            None,
        ),
        (
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "messages[0].tool_call_id is required for a tool message",
        ),
        (
            {"model": "m", "messages": [{"role": "tool", "tool_call_id": 7}]},
            "messages[0].tool_call_id",
            "messages[0].tool_call_id must be a string",
        ),
        # A key named like the message's role is not where pydantic's union tag points.
        (
            {"model": "m", "messages": [{"role": "user", "user": 1, "content": 5}]},
            "messages[0].content",
            None,
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{}, "x"]}]},
            "messages[0].content[0]",
            None,
        ),
        # A content part's type is a string (what else a part holds is the provider's to check).
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": {"x": 1}}]}]},
            "messages[0].content[0]",
            None,
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": 3}]}]},
            "messages[0].content[0]",
            None,
        ),
        (
            {"model": "m", "messages": [U], "is_feedback": "yes"},
            "is_feedback",
            "'is_feedback' must be a boolean",
        ),
        ({"model": "m", "messages": [U], "max_completion_tokens": 0}, "max_completion_tokens", None),
        ({"model": "m", "messages": [U], "stream_options": []}, "stream_options", None),
        ({"model": "m", "messages": [U], "session_id": "a b"}, "session_id", None),
    ],
)
def test_a_chat_request_error_names_the_field_as_sent(
    body: Any, param: str | None, message: str | None
) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body)
    assert info.value.param == param
    assert info.value.to_dict()["error"]["type"] == "invalid_request_error"
    if message is not None:
        assert info.value.message == message


def test_the_services_get_the_clients_own_dicts() -> None:
    body = {"model": "m", "messages": [U], "stream": None, "stream_options": {"include_usage": 1}}
    request = parse_chat(body, header_conversation_id="from-header")
    assert request.body is body and request.messages is body["messages"]
    assert (request.stream, request.include_usage, request.conversation_id) == (False, True, "from-header")


async def test_messages_reach_the_provider_byte_for_byte(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    """Unknown fields, nulls and key order are kept; the models add no defaults."""
    messages = [
        {"content": "Be brief.", "role": "system", "name": None},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [{**CALL, "extra": [1]}]},
        {"tool_call_id": "c1", "role": "tool", "content": "42"},
        {"role": "user", "content": "and?", "x-vendor": {"a": 1}},
    ]
    for extra in ({}, {"conversation_id": "bytes"}):
        r = await app_client.post(
            "/v1/chat/completions", json={"model": "mock/m", "messages": messages, **extra}
        )
        assert r.status_code == 200, r.text
        assert orjson.dumps(mock_upstream.requests[-1]["messages"]) == orjson.dumps(messages)


async def test_responses_and_items_errors_name_the_item(app_client: httpx.AsyncClient) -> None:
    async def error(path: str, body: Any) -> dict[str, Any]:
        r = await app_client.post(path, json=body)
        assert r.status_code == 400, r.text
        err: dict[str, Any] = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        return err

    bad = [{"role": "user", "content": "a"}, {"type": "bogus"}]
    err = await error("/v1/responses", {"model": "mock/m", "input": bad})
    assert (err["param"], err["message"]) == ("input[1].type", "input[1]: unsupported item type 'bogus'")
    err = await error("/v1/responses", {"model": "mock/m", "input": [{"role": "tool", "content": "x"}]})
    assert err["param"] == "input[0].role"
    err = await error("/v1/responses", {"model": "mock/m", "input": "x", "tools": [{"type": "web_search"}]})
    assert (err["param"], err["message"]) == ("tools[0]", "tools[0]: only function tools are supported")
    err = await error("/v1/conversations", {"items": [{"role": "user", "content": None}]})
    assert (err["param"], err["message"]) == (
        "items[0].content",
        "items[0].content must be a string or an array of parts",
    )
    err = await error("/v1/conversations", {"metadata": {"k": "v" * 513}})
    assert err["param"] == "metadata" and "≤512" in err["message"]
    assert (await app_client.post("/v1/conversations", json={"id": "c1"})).status_code == 200
    err = await error("/v1/conversations/c1/items", {"items": [{"type": "function_call", "name": "f"}]})
    assert (err["param"], err["message"]) == (
        "items[0]",
        "items[0]: a function_call needs call_id and name (non-empty strings)",
    )
    err = await error("/v1/conversations/c1", {})
    assert (err["param"], err["message"]) == ("metadata", "'metadata' is required")
    # Null clears it, as the SDK's `conversations.update(id, metadata=None)` sends (a 400 before).
    r = await app_client.post("/v1/conversations/c1", json={"metadata": {"k": "v"}})
    assert r.json()["metadata"] == {"k": "v"}
    r = await app_client.post("/v1/conversations/c1", json={"metadata": None})
    assert r.status_code == 200 and r.json()["metadata"] == {}


@pytest.mark.parametrize("value", ["lots", 1.5, True, 0, 10**8])
async def test_max_output_tokens_is_checked_under_its_own_name(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, value: Any
) -> None:
    """Was: a non-integer silently ignored, an integer out of range reported as `max_tokens`."""
    r = await app_client.post(
        "/v1/responses", json={"model": "mock/m", "input": "hi", "max_output_tokens": value}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r = await app_client.post(
        "/v1/responses", json={"model": "mock/m", "input": "hi", "max_output_tokens": 16}
    )
    assert r.status_code == 200 and mock_upstream.requests[-1]["max_tokens"] == 16


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": 5},
        {"type": "image_url", "image_url": 5},
        {"type": "image_url", "image_url": {"url": {"a": 1}}},
        {"type": "image_url", "image_url": {"detail": "low"}},
        {"type": "text"},
    ],
)
async def test_a_part_of_the_wrong_shape_is_a_400_and_nothing_is_stored(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, part: dict[str, Any]
) -> None:
    """Accepted, stored and sent back on every later turn (the items API refused the same
    parts; with llama.cpp it was a 502)."""
    body = {"model": "mock/m", "conversation_id": "parts", "messages": [{"role": "user", "content": [part]}]}
    r = await app_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content"), r.text
    assert mock_upstream.requests == []
    ok = {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}
    r = await app_client.post(
        "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": [ok]}]}
    )
    assert r.status_code == 200, r.text


async def _called_back(client: httpx.AsyncClient, cid: str, call: dict[str, Any]) -> httpx.Response:
    """A turn whose history holds `call` and its result, as a client sends it back."""
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "noon"},
    ]
    return await client.post(
        "/v1/chat/completions", json={"model": "mock/m", "conversation_id": cid, "messages": messages}
    )


async def test_a_call_with_an_empty_id_is_a_400(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    """Stored, its result named no call and went missing: a call without its result went to the
    provider on every later turn."""
    r = await _called_back(
        app_client, "e", {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0]", r.text
    assert mock_upstream.requests == []


async def test_two_calls_with_one_id_are_a_400(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    """Stored, one result answered both: a call without its result went to the provider on
    every later turn."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"model": "mock/m", "conversation_id": "dup", "messages": [
        {"role": "user", "content": "t"},
        {"role": "assistant", "content": None, "tool_calls": [call, dict(call)]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]}  # fmt: skip
    r = await app_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "two tool calls with one id" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[1].tool_calls" and mock_upstream.requests == []


async def test_a_call_sent_back_with_null_arguments_is_taken(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    """A provider's call without arguments reaches the client as null; sent back in the
    history, the gateway refused its own answer (a 400)."""
    r = await _called_back(
        app_client, "nul", {"id": "c1", "type": "function", "function": {"name": "now", "arguments": None}}
    )
    assert r.status_code == 200, r.text
    # and it goes on (to the provider, and into the store) with "{}": as sent, a strict
    # provider refused every later turn
    sent = mock_upstream.requests[-1]["messages"][1]["tool_calls"][0]["function"]
    assert sent == {"name": "now", "arguments": "{}"}


@pytest.mark.parametrize("model", ["mock/o3-mini", "mock/o1", "mock/gpt-5-nano"])
async def test_reasoning_models_get_max_output_tokens_as_max_completion_tokens(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream, model: str
) -> None:
    """OpenAI's reasoning models refuse `max_tokens` (a 400: "Use 'max_completion_tokens'
    instead"), and the bridge sent `max_output_tokens` as `max_tokens` to every model."""
    body = {"model": model, "input": "hi", "max_output_tokens": 40, "reasoning": {"effort": "low"}}
    r = await app_client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    sent = mock_upstream.requests[-1]
    assert sent["max_completion_tokens"] == 40 and "max_tokens" not in sent
    assert (await app_client.get(f"/v1/responses/{r.json()['id']}")).json()["max_output_tokens"] == 40


async def test_a_function_tool_needs_a_string_name(
    app_client: httpx.AsyncClient, mock_upstream: MockUpstream
) -> None:
    """Was: any truthy name (a number, a list) forwarded for the provider to refuse."""
    for name in (5, ["f"], ""):
        tools = [{"type": "function", "name": name}]
        r = await app_client.post("/v1/responses", json={"model": "mock/m", "input": "hi", "tools": tools})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
    assert mock_upstream.requests == []


@pytest.mark.parametrize("items", [0, "", False, {}])
async def test_a_new_conversations_items_must_be_an_array(app_client: httpx.AsyncClient, items: Any) -> None:
    """Was: a falsy non-array (0, "", false, {}) taken as "no items"."""
    r = await app_client.post("/v1/conversations", json={"items": items})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "'items' must be an array",
        "type": "invalid_request_error",
        "param": "items",
        "code": None,
    }
    assert (await app_client.post("/v1/conversations", json={"items": None})).status_code == 200
