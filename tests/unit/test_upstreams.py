"""The upstream seam: OpenAI fast path (real HTTP mock), error mapping, litellm path, routing."""

from __future__ import annotations

import inspect
import json
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.config import ProviderSettings, unset_key_variables
from gateway.exceptions import (
    NotFound,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from gateway.upstream import Router, http1
from gateway.upstream.demo import DemoUpstream
from gateway.upstream.openai import OpenAIUpstream, map_upstream_errors, parse_sse_line
from tests.conftest import free_port
from tests.helpers import serving_app
from tests.mockserver import MockServer

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "my name is Kim"}]}


def _all_client_exceptions() -> list[type[BaseException]]:
    classes = [
        obj
        for _, obj in inspect.getmembers(aiohttp)
        if inspect.isclass(obj) and issubclass(obj, aiohttp.ClientError)
    ]
    ours = [
        obj for _, obj in inspect.getmembers(http1) if inspect.isclass(obj) and issubclass(obj, Exception)
    ]
    return [*classes, *(c for c in ours if not c.__name__.startswith("_")), TimeoutError]


def _instance(exc_class: type[BaseException]) -> BaseException:
    request_info = aiohttp.RequestInfo(
        URL("http://u"), "POST", CIMultiDictProxy(CIMultiDict()), URL("http://u")
    )
    for args in [
        ("x",),
        (),
        (request_info, ()),
        (ConnectionKey("u", 80, False, True, None, None, None), OSError(1, "x")),
        (b"a", b"b", "u", 443),
    ]:
        try:
            exc = exc_class(*args)
            str(exc)  # some classes only fail when rendered with the wrong arguments
            return exc
        except (TypeError, AttributeError):
            continue
    raise AssertionError(f"cannot build {exc_class}")


def lite_openai(base_url: str, **extra: Any) -> ProviderSettings:
    """A litellm provider of OpenAI's kind at `base_url`, its key in LITE_TEST_KEY."""
    return ProviderSettings(
        kind="litellm", litellm_provider="openai", base_url=base_url, api_key_env="LITE_TEST_KEY", **extra
    )


@pytest.mark.parametrize("exc_class", _all_client_exceptions(), ids=lambda c: c.__name__)
def test_every_client_exception_is_mapped(exc_class: type[BaseException]) -> None:
    exc = _instance(exc_class)
    with pytest.raises(UpstreamError) as info, map_upstream_errors("p", "http://u"):
        raise exc
    assert "'p'" in info.value.message and "http://u" in info.value.message
    # Each kind of failure has its own class (and so its own status and code).
    if isinstance(exc, TimeoutError):
        expected: type[UpstreamError] = UpstreamTimeout
    elif isinstance(exc, aiohttp.ClientConnectionError | http1.ConnectFailed | http1.Disconnected):
        expected = UpstreamUnreachable
    else:
        expected = UpstreamProtocolError
    assert type(info.value) is expected, (exc_class, type(info.value))


def test_sse_line_parsing() -> None:
    assert parse_sse_line(": ping") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line("data: [DONE]") is True
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    with pytest.raises(UpstreamProtocolError):
        parse_sse_line("data: {broken")


def _provider(url: str, **kw: Any) -> ProviderSettings:
    return ProviderSettings(kind="openai", base_url=f"{url}/v1", timeout=kw.pop("timeout", 5), **kw)


async def test_openai_fast_path_complete_and_stream(upstream: MockServer) -> None:
    up = OpenAIUpstream("mock", _provider(upstream.url))
    try:
        result = await up.complete(BODY)
        assert result["choices"][0]["message"]["content"]
        chunks = [c async for c in up.stream({**BODY, "stream": True})]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        await up.aclose()
    assert upstream.requests[0] == BODY


async def test_an_openai_compatible_server_is_not_sent_thinking_blocks(upstream: MockServer) -> None:
    """Stored with an answer for Anthropic (through litellm), they went to the next provider of
    the conversation too: a strict server refuses a message field it does not know."""
    up = OpenAIUpstream("mock", _provider(upstream.url))
    thought = {
        "role": "assistant",
        "content": "x",
        "thinking_blocks": [{"type": "thinking", "thinking": "t"}],
    }
    body = {
        **BODY,
        "messages": [{"role": "user", "content": "hi"}, thought, {"role": "user", "content": "go"}],
    }
    assert (await up.complete(body))["choices"]
    sent = upstream.requests[-1]["messages"]
    assert sent == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "go"},
    ]
    assert body["messages"][1]["thinking_blocks"]  # (the caller's copy is left as it is)


async def test_openai_status_errors_keep_message_and_retry_after(upstream: MockServer) -> None:
    up = OpenAIUpstream("mock", _provider(upstream.url))
    try:
        upstream.mode = "error429"
        with pytest.raises(UpstreamStatusError) as info:
            await up.complete(BODY)
        assert info.value.status_code == 429 and info.value.headers() == {"Retry-After": "7"}
        assert "slow down" in info.value.message
        upstream.mode = "error500"
        with pytest.raises(UpstreamStatusError) as info:
            await up.complete(BODY)
        assert info.value.status_code == 502
        with pytest.raises(UpstreamStatusError):
            [c async for c in up.stream({**BODY, "stream": True})]
    finally:
        await up.aclose()


async def test_a_json_answer_to_a_stream_is_read_as_the_error_or_answer_it_holds(
    upstream: MockServer,
) -> None:
    """Both were "ended the stream without an answer": the provider's own error message was lost,
    and a server that answers `stream: true` with a whole completion was refused."""
    up = OpenAIUpstream("mock", _provider(upstream.url, retries=0))
    try:
        upstream.mode = "error_in_200"
        with pytest.raises(UpstreamStatusError) as info:
            [c async for c in up.stream({**BODY, "stream": True})]
        assert info.value.status_code == 502 and "model overloaded, try later" in info.value.message
        upstream.mode = "detail_in_200"  # (it was "returned no choices", the text not quoted)
        for call in (up.complete(BODY), anext(aiter(up.stream({**BODY, "stream": True})))):
            with pytest.raises(UpstreamStatusError) as info:
                await call
            assert info.value.status_code == 502 and "model is still loading" in info.value.message
        upstream.mode = "no_stream"
        wants_usage = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        chunks = [c async for c in up.stream(wants_usage)]
        whole = upstream.completion(BODY)
        assert chunks[0]["choices"][0]["delta"]["content"] == whole["choices"][0]["message"]["content"]
        assert chunks[0]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    finally:
        await up.aclose()


async def test_openai_timeout_and_unreachable(upstream: MockServer) -> None:
    upstream.mode = "hang"
    upstream.hang_seconds = 2
    up = OpenAIUpstream("mock", _provider(upstream.url, timeout=0.3))
    try:
        with pytest.raises(UpstreamTimeout):
            await up.complete(BODY)
    finally:
        await up.aclose()
    dead = OpenAIUpstream("ollama", _provider(f"http://127.0.0.1:{free_port()}"))
    try:
        with pytest.raises(UpstreamUnreachable) as info:
            await dead.complete(BODY)
        assert "'ollama'" in info.value.message and "127.0.0.1" in info.value.message
    finally:
        await dead.aclose()


async def test_litellm_path_against_real_http_mock(
    upstream: MockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.upstream.litellm import LitellmUpstream

    monkeypatch.setenv("LITE_TEST_KEY", "sk-test")
    up = LitellmUpstream("lite", lite_openai(f"{upstream.url}/v1", timeout=10))
    result = await up.complete(dict(BODY))
    assert result["choices"][0]["message"]["content"] == "Nice to meet you, Kim! (turn 1)"
    assert upstream.requests[-1]["messages"] == BODY["messages"]
    assert upstream.requests[-1]["model"] == "tiny"
    chunks = [c async for c in up.stream(dict(BODY))]
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    assert text == "Nice to meet you, Kim! (turn 1)"
    upstream.mode = "error500"
    with pytest.raises(UpstreamStatusError) as info:
        await up.complete(dict(BODY))
    assert info.value.upstream_status == 500 and info.value.status_code == 502


def test_routing() -> None:
    demo = DemoUpstream()
    other = DemoUpstream("ollama")
    router = Router({"demo": demo, "ollama": other}, "ollama")
    assert router.resolve("ollama/phi4-mini").model == "phi4-mini"
    assert router.resolve("ollama/phi4-mini").upstream is other
    assert router.resolve("demo").upstream is demo
    assert router.resolve("llama3:8b").upstream is other and router.resolve("llama3:8b").model == "llama3:8b"
    assert router.resolve("unknown/x").model == "unknown/x"
    with pytest.raises(NotFound):
        Router({}, "none").resolve("x")


async def test_litellm_path_retries_like_the_fast_path(
    upstream: MockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 before any answer byte is retried (`retries`), a 429 never is, and with
    retries = 0 the first failure is final: litellm's own retries do not add attempts."""
    from gateway.upstream.litellm import LitellmUpstream

    monkeypatch.setenv("LITE_TEST_KEY", "sk-test")

    def lite(retries: int) -> LitellmUpstream:
        return LitellmUpstream("lite", lite_openai(f"{upstream.url}/v1", timeout=10, retries=retries))

    for streaming in (False, True):
        upstream.reset()
        upstream.mode = "error503_once"
        if streaming:
            chunks = [c async for c in lite(1).stream(dict(BODY))]
            assert any(c.get("choices") for c in chunks)
        else:
            assert (await lite(1).complete(dict(BODY)))["choices"]
        assert len(upstream.requests) == 2
    upstream.reset()
    upstream.mode = "error503_once"
    with pytest.raises(UpstreamError) as info:
        await lite(0).complete(dict(BODY))
    assert info.value.status_code == 502
    assert len(upstream.requests) == 1
    upstream.reset()
    upstream.mode = "error429"
    with pytest.raises(UpstreamStatusError) as info:
        await lite(2).complete(dict(BODY))
    assert info.value.status_code == 429
    assert len(upstream.requests) == 1
    # passed through as the fast path does: its Retry-After and OpenAI's error type
    assert info.value.headers() == {"Retry-After": "7"} and info.value.error_type == "rate_limit_error"
    dead = lite_openai(f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(UpstreamUnreachable):  # not "returned HTTP 500"
        await LitellmUpstream("dead", dead).complete(dict(BODY))
    # The turn's wait for the provider counts against its `timeout`: used up, nothing is sent.
    upstream.reset()
    with pytest.raises(UpstreamTimeout, match=r"providers\.lite\.timeout"):
        await lite(1).complete(dict(BODY), waited=10)
    with pytest.raises(UpstreamTimeout):
        [c async for c in lite(1).stream(dict(BODY), waited=12)]
    assert upstream.requests == []
    assert (await lite(1).complete(dict(BODY), waited=9))["choices"]  # a second is left
    assert len(upstream.requests) == 1


async def test_litellm_path_takes_only_openai_parameters_from_the_client(
    upstream: MockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """litellm reads many body keys as its own options: a client must not send the provider's
    key elsewhere (`fallbacks` with an `api_base`), replace its headers, or make up the answer
    (`mock_response`). And a provider whose key variable is unset is not called with the
    machine's own OPENAI_API_KEY."""
    from gateway.upstream.litellm import LitellmUpstream

    monkeypatch.setenv("LITE_TEST_KEY", "sk-provider")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-machine-global")
    settings = ProviderSettings(
        kind="litellm", litellm_provider="openai", base_url=f"{upstream.url}/v1", api_key_env="LITE_TEST_KEY"
    )
    hostile = {
        **BODY,
        "fallbacks": [{"model": "openai/stolen", "api_base": f"http://127.0.0.1:{free_port()}/v1"}],
        "headers": {"Authorization": "Bearer attacker-key"},
        "extra_headers": {"X-Injected": "1"},
        "organization": "org-attacker",
        "mock_response": "made up",
        "temperature": 0.5,
    }
    result = await LitellmUpstream("lite", settings).complete(hostile)
    assert result["choices"][0]["message"]["content"] == "Nice to meet you, Kim! (turn 1)"  # the provider's
    assert upstream.headers[-1]["authorization"] == "Bearer sk-provider"
    assert "x-injected" not in upstream.headers[-1] and "openai-organization" not in upstream.headers[-1]
    assert upstream.requests[-1]["temperature"] == 0.5  # OpenAI's own parameters go on
    keyless = ProviderSettings(
        kind="litellm", litellm_provider="openai", base_url=f"{upstream.url}/v1", api_key_env="UNSET_TEST_KEY"
    )
    monkeypatch.delenv("UNSET_TEST_KEY", raising=False)
    before = len(upstream.requests)
    with pytest.raises(UpstreamError) as info:
        await LitellmUpstream("keyless", keyless).complete(dict(BODY))
    assert info.value.code == "upstream_key_missing" and "UNSET_TEST_KEY" in info.value.message
    assert len(upstream.requests) == before  # not called at all


async def test_a_key_pasted_as_its_variables_name_is_never_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Groq-style key (`gsk_` and letters and digits) is a legal variable name: pasted into
    `api_key_env`, it was quoted in the 502 every client of a litellm provider got."""
    from gateway.upstream.litellm import LitellmUpstream

    pasted = "gsk_R3alKeyPastedByMistake0123456789abcdefXYZ"
    monkeypatch.delenv(pasted, raising=False)
    lite = ProviderSettings(kind="litellm", litellm_provider="groq", api_key_env=pasted)
    with pytest.raises(UpstreamError) as info:
        await LitellmUpstream("groq", lite).complete(dict(BODY))
    message = info.value.message
    assert info.value.code == "upstream_key_missing" and pasted not in message
    assert "environment variable (named by providers.groq.api_key_env) is not set" in message
    providers = {
        "groq": ProviderSettings(kind="openai", base_url="http://127.0.0.1:9", api_key_env=pasted),
        "lite": lite,
        "up": ProviderSettings(kind="openai", base_url="http://127.0.0.1:9", api_key_env="UNSET_K"),
        "set": ProviderSettings(kind="openai", base_url="http://127.0.0.1:9", api_key_env="SET_K"),
        "none": ProviderSettings(kind="openai", base_url="http://127.0.0.1:9"),
    }
    assert unset_key_variables(providers, {"SET_K": "k"}) == [
        "providers.groq.api_key_env names a variable, which is not set: its calls go without a key",
        "providers.lite.api_key_env names a variable, which is not set: its calls are refused (502)",
        "providers.up.api_key_env names UNSET_K, which is not set: its calls go without a key",
    ]


async def test_litellm_anthropic_errors_say_what_happened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through litellm's Anthropic client: a refused connection read "returned HTTP 500" and was
    never retried; a 429's Retry-After was dropped; a stall after the first delta read "HTTP 408
    MidStreamFallbackError"; a provider's 400 lost its error type."""
    import asyncio

    from aiohttp import web

    from gateway.upstream.litellm import LitellmUpstream

    monkeypatch.setenv("LITE_ANTHROPIC_KEY", "sk-ant-test-0123456789")
    seen: list[str] = []

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text = body["messages"][-1]["content"]
        text = text if isinstance(text, str) else text[0]["text"]
        seen.append(text)
        if text == "busy":
            error = {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
            return web.json_response(error, status=429, headers={"retry-after": "17"})
        if text == "bad":
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad field"}}
            return web.json_response(error, status=400)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
                   "stop_reason": None, "usage": {"input_tokens": 5, "output_tokens": 0}}  # fmt: skip
        for event, data in (
            ("message_start", {"type": "message_start", "message": message}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "Hel"}}),
        ):  # fmt: skip
            await response.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        await asyncio.sleep(5)  # then nothing: a stall mid-answer
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)

    def anthropic(url: str, **extra: Any) -> LitellmUpstream:
        settings = ProviderSettings(
            kind="litellm",
            litellm_provider="anthropic",
            base_url=url,
            api_key_env="LITE_ANTHROPIC_KEY",
            **extra,
        )
        return LitellmUpstream("anth", settings)

    def ask(text: str) -> dict[str, Any]:
        return {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}

    async with serving_app(app) as url:
        up = anthropic(url, timeout=1)
        with pytest.raises(UpstreamStatusError) as info:
            await up.complete(ask("busy"))
        assert info.value.status_code == 429 and info.value.headers() == {"Retry-After": "17"}
        with pytest.raises(UpstreamStatusError) as info:
            await up.complete(ask("bad"))
        assert info.value.status_code == 400 and info.value.error_type == "invalid_request_error"
        assert info.value.message.endswith("returned HTTP 400: bad field")
        with pytest.raises(UpstreamTimeout):
            async for _ in up.stream({**ask("stall"), "stream": True}):
                pass
        dead = anthropic(f"http://127.0.0.1:{free_port()}", retries=1)
        with pytest.raises(UpstreamUnreachable) as unreachable:
            await dead.complete(ask("hello"))
        assert "is unreachable" in unreachable.value.message and "HTTP 500" not in unreachable.value.message


async def test_litellm_is_imported_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its import takes seconds of CPU: on the loop it held every other request that long."""
    import threading

    import gateway.upstream.litellm as module

    where: list[str] = []

    def fake_import(provider: str = "") -> Any:
        where.append(threading.current_thread().name)
        return "litellm"

    monkeypatch.setattr(module, "_litellm", None)
    monkeypatch.setattr(module, "import_litellm", fake_import)
    assert await module.litellm_module("anth") == "litellm"
    assert where and where[0] != threading.main_thread().name


async def test_the_environments_proxy_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kind = "openai"` providers connected directly whatever HTTP(S)_PROXY said: on a network
    reached only through a proxy, OpenAI itself could not be reached. NO_PROXY is honoured."""
    from aiohttp import web

    seen: list[str] = []

    async def proxy(request: web.Request) -> web.Response:
        seen.append(str(request.url))  # a forward proxy gets the absolute URL
        reply = {"role": "assistant", "content": "via the proxy"}
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": reply}]}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy)
    async with serving_app(app) as proxy_url:
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        settings = ProviderSettings(kind="openai", base_url="http://provider.invalid/v1", timeout=5)
        up = OpenAIUpstream("p", settings)
        try:
            answer = await up.complete(dict(BODY))
        finally:
            await up.aclose()
        assert answer["choices"][0]["message"]["content"] == "via the proxy"
        assert seen == ["http://provider.invalid/v1/chat/completions"]
        monkeypatch.setenv("NO_PROXY", "provider.invalid")
        direct = OpenAIUpstream("p", settings)
        try:
            with pytest.raises(UpstreamUnreachable):  # not through the proxy: a name that resolves nowhere
                await direct.complete(dict(BODY))
        finally:
            await direct.aclose()
        assert len(seen) == 1


def test_a_servers_routes_keep_the_base_urls_query_at_the_end() -> None:
    """`/props` and `/models` were appended after the query: `/v1?api-version=x/models`."""
    from gateway.upstream.discovery import server_root, url_at

    base = "http://h:8080/v1?api-version=2024-10-21"
    assert url_at(base, "/models") == "http://h:8080/v1/models?api-version=2024-10-21"
    assert url_at(server_root(base), "/props") == "http://h:8080/props?api-version=2024-10-21"
    assert url_at(server_root("http://h:8080/v1/"), "/api/ps") == "http://h:8080/api/ps"
    assert (
        url_at("https://u:p@h/openai/v1", "/chat/completions") == "https://u:p@h/openai/v1/chat/completions"
    )


async def test_litellm_holds_timeout_as_a_deadline_for_a_whole_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer whose head came at once and whose body dripped a byte at a time was waited for
    as long as it dripped: litellm's `timeout` holds each read, not the whole answer."""
    import asyncio

    from aiohttp import web

    from gateway.upstream.litellm import LitellmUpstream, litellm_module

    async def drip(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        for byte in b'{"id": "x", "object": "chat.completion", "choices": []}':
            await response.write(bytes([byte]))
            await asyncio.sleep(0.2)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", drip)
    monkeypatch.setenv("LITE_TEST_KEY", "sk-test")
    async with serving_app(app) as url:
        settings = lite_openai(f"{url}/v1", timeout=1, retries=0)
        await litellm_module("lite")  # (imported first: its import is not the provider's time)
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(UpstreamTimeout, match=r"no whole answer within 1 s \(providers\.lite\.timeout\)"):
            await LitellmUpstream("lite", settings).complete(dict(BODY))
        assert loop.time() - began < 5  # (the drip takes 11 s)


async def test_litellm_anthropic_overloaded_is_said_as_529_and_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Anthropic's 529 `overloaded_error` came back as "returned HTTP 500" (litellm's own
    status) and was not retried, unlike a 503."""
    from aiohttp import web

    from gateway.upstream.litellm import LitellmUpstream

    calls: list[int] = []
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    answer = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-3-5-haiku-20241022",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }

    async def messages(request: web.Request) -> web.Response:
        calls.append(1)
        if len(calls) == 1 or always:
            return web.json_response(overloaded, status=529)
        return web.json_response(answer)

    always = False
    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    monkeypatch.setenv("LITE_TEST_KEY", "sk-test")
    async with serving_app(app) as url:
        settings = ProviderSettings(
            kind="litellm", litellm_provider="anthropic", base_url=url, api_key_env="LITE_TEST_KEY", retries=1
        )
        body = {"model": "claude-3-5-haiku-20241022", "messages": [{"role": "user", "content": "hi"}]}
        assert (await LitellmUpstream("anth", settings).complete(dict(body)))["choices"]
        assert len(calls) == 2  # retried
        always = True
        with pytest.raises(UpstreamStatusError, match="returned HTTP 529") as raised:
            await LitellmUpstream("anth", settings.model_copy(update={"retries": 0})).complete(dict(body))
    assert raised.value.status_code == 502


@pytest.mark.parametrize(
    ("message", "choices"),
    [
        ({"role": "assistant", "content": 5}, None),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}],
            },
            None,
        ),
        ({"role": "assistant", "content": "fine", "refusal": 7}, None),
        (None, []),
        (None, [{"index": 0, "finish_reason": "stop"}]),  # (a choice without its message)
        (None, [{"index": 0, "message": "hi", "finish_reason": "stop"}]),
    ],
)
async def test_a_whole_answer_to_a_stream_is_checked_as_a_streams_chunks_are(
    message: dict[str, Any] | None, choices: list[Any] | None
) -> None:
    """A stream asked for and answered with a JSON body went out as its chunks unchecked: an
    object for `arguments` was stored as Python's repr of it and sent back on every later turn;
    no choices at all began a 200 stream that then broke off."""
    from aiohttp import web

    async def whole(request: web.Request) -> web.Response:
        said = choices if choices is not None else [{"index": 0, "message": message, "finish_reason": "stop"}]
        return web.json_response({"id": "x", "object": "chat.completion", "choices": said})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", whole)
    async with serving_app(app) as url:
        up = OpenAIUpstream("p", ProviderSettings(kind="openai", base_url=f"{url}/v1", timeout=5))
        try:
            with pytest.raises(UpstreamProtocolError):
                async for _ in up.stream({**BODY, "stream": True}):
                    pass
        finally:
            await up.aclose()
