"""Turn paths are served without Starlette's router, with the same middlewares and error answers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.services.turns import ChatService
from gateway.store.memory import MemoryStore
from gateway.upstream import Router
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings

CHAT = {"model": "mock/m", "messages": [{"role": "user", "content": "hi"}], "conversation_id": "d-1"}


async def test_turns_go_through_the_direct_stack_and_other_requests_through_starlette() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        app = app_of(client)
        chat = await client.post("/v1/chat/completions", json=CHAT)
        bare = await client.post("/chat/completions", json={**CHAT, "conversation_id": "d-2"})
        response = await client.post("/v1/responses", json={"model": "mock/m", "input": "hi"})
        message = await client.post(
            "/v1/messages",
            json={"model": "mock/m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
            headers={"anthropic-version": "2023-06-01"},
        )
        assert [chat.status_code, bare.status_code, response.status_code, message.status_code] == [200] * 4
        assert chat.json()["conversation_id"] == "d-1" and response.json()["object"] == "response"
        assert message.json()["type"] == "message"
        assert app.direct_stack is not None
        assert app.middleware_stack is None  # Starlette's own stack was never needed
        listed = await client.get("/v1/chat/completions")  # the same path, another method
        assert listed.status_code == 200 and app.middleware_stack is not None
        metrics = (await client.get("/metrics")).text
    # counted by the endpoint's name, as Starlette's routes are
    assert 'gateway_requests_total{route="chat_completions",status="200"} 2.0' in metrics
    assert 'gateway_requests_total{route="create_response",status="200"} 1.0' in metrics
    assert 'gateway_requests_total{route="create_message",status="200"} 1.0' in metrics


async def test_errors_on_the_direct_paths_keep_each_api_s_shape() -> None:
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        openai = await client.post("/v1/chat/completions", content=b"{not json")
        anthropic = await client.post(
            "/v1/messages", content=b"{not json", headers={"anthropic-version": "2023-06-01"}
        )
        metrics = (await client.get("/metrics")).text
    assert openai.status_code == 400 and openai.json()["error"]["type"] == "invalid_request_error"
    assert anthropic.status_code == 400
    shape = anthropic.json()
    assert shape["type"] == "error" and shape["error"]["type"] == "invalid_request_error"
    assert 'gateway_requests_total{route="chat_completions",status="400"} 1.0' in metrics


async def test_an_unexpected_error_on_a_direct_path_is_a_500_in_openai_s_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = create_app(make_settings(), store=MemoryStore(), router=Router({"mock": MockUpstream()}, "mock"))
    service: ChatService = app.state.service

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "prepare", broken)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
        answer = await client.post("/v1/chat/completions", json=CHAT)
        metrics = (await client.get("/metrics")).text
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == "Internal gateway error; see the gateway log"
    assert 'gateway_requests_total{route="chat_completions",status="500"} 1.0' in metrics


async def test_an_app_under_a_root_path_routes_turns_through_starlette() -> None:
    app = create_app(make_settings(), store=MemoryStore(), router=Router({"mock": MockUpstream()}, "mock"))
    transport = httpx.ASGITransport(app=app, root_path="/gw")
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
        answer = await client.post("/gw/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200 and answer.json()["conversation_id"] == "d-1"
    assert app.direct_stack is None and app.middleware_stack is not None


def test_a_direct_path_is_served_by_its_own_post_route() -> None:
    from starlette.routing import Route

    from gateway.api.direct import GatewayApp

    async def create(request: Any) -> Any:
        raise AssertionError("not called")

    async def listing(request: Any) -> Any:
        raise AssertionError("not called")

    routes = [Route("/v1/things", listing, methods=["GET"]), Route("/v1/things", create, methods=["POST"])]
    assert GatewayApp(direct=["/v1/things"], routes=routes).direct == {"/v1/things": create}
    with pytest.raises(ValueError, match="/v1/other"):
        GatewayApp(direct=["/v1/other"], routes=routes)


async def test_a_path_with_a_slash_more_is_no_route_not_a_redirect_to_another_resource() -> None:
    """`DELETE /v1/conversations/victim/` (an id that ends in "/", or "%2F") was a 307 to
    `/v1/conversations/victim`, which the SDK followed: it deleted conversation `victim`."""
    async with build_client(make_settings(), MemoryStore(), MockUpstream()) as client:
        made = await client.post("/v1/chat/completions", json={**CHAT, "conversation_id": "victim"})
        assert made.is_success
        gone = await client.delete("/v1/conversations/victim/")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_url", gone.text
        gone = await client.delete("/v1/conversations/victim%2F")  # (an id with a "/" in it)
        assert gone.status_code == 400 and gone.json()["error"]["code"] == "invalid_conversation_id"
        changed = await client.post("/v1/conversations/%2F", json={"metadata": {"k": "v"}})
        assert changed.status_code == 400, changed.text  # (not a new conversation made by a redirect)
        # An encoded "/" inside an id reached another route: the reset of `victim`, an item's
        # deletion, the list of its items.
        reset = await client.post("/v1/conversations/victim%2Freset", json={"metadata": {"k": "v"}})
        assert reset.status_code == 400 and reset.json()["error"]["code"] == "invalid_conversation_id"
        items = await client.get("/v1/conversations/victim%2fitems")
        assert items.status_code == 400, items.text
        assert (await client.post("/v1/messages%2Fcount_tokens", json={})).status_code == 404
        # A model's id holds a "/", which clients send encoded: still the model.
        listed = (await client.get("/v1/models")).json()["data"][0]["id"]
        one = await client.get("/v1/models/" + listed.replace("/", "%2F"))
        assert one.status_code == 200 and one.json()["id"] == listed, one.text
        bare = await client.get("/v1/models/")
        assert bare.status_code == 404 and bare.json()["error"]["code"] == "unknown_url", bare.text
        assert (await client.get("/v1/conversations/victim")).status_code == 200
        assert len((await client.get("/v1/conversations")).json()["data"]) == 1
        assert len((await client.get("/v1/conversations/victim/items")).json()["data"]) == 2  # (kept)
