"""Model facts: window discovery against each server's answer shape, counting calibration, the
provider's "prompt too long" refusal (learned from, retried once), and sizing for small windows."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.config import ModelSettings, ProviderSettings
from gateway.context.calibration import UNCALIBRATED, Calibration, fit
from gateway.context.summary import chunk_budget, summary_cap
from gateway.context.window import fit_window
from gateway.exceptions import UpstreamTimeout
from gateway.services.models import ModelFacts
from gateway.store.memory import MemoryStore
from gateway.tokens import count_message, count_text, get_encoding
from gateway.upstream import Route
from gateway.upstream.base import ServerWindow, completion_from_text
from gateway.upstream.discovery import (
    window_from_llamacpp_props,
    window_from_lmstudio_models,
    window_from_models,
    window_from_ollama_ps,
    window_from_ollama_show,
)
from gateway.upstream.mock import MockUpstream
from gateway.upstream.openai import OpenAIUpstream, status_error
from gateway.upstream.refusal import parse_refusal
from tests.conftest import app_of, build_client, make_settings
from tests.helpers import serving_app

# -- the shapes each server answers with (trimmed copies of real answers) ---------------------------

LLAMACPP_PROPS = {
    "default_generation_settings": {"n_ctx": 512, "params": {"n_predict": -1}},
    "total_slots": 1,
    "model_path": "SmolLM2-135M-Instruct.Q4_1.gguf",
}
LLAMACPP_MODELS = {
    "object": "list",
    "data": [{"id": "smol.gguf", "object": "model", "owned_by": "llamacpp", "meta": {"n_ctx_train": 8192}}],
}
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "Qwen/Qwen2.5-1.5B-Instruct", "object": "model", "owned_by": "vllm", "max_model_len": 32768},
        {"id": "other", "object": "model", "owned_by": "vllm", "max_model_len": 4096},
    ],
}
OLLAMA_PS = {"models": [{"name": "qwen2.5:7b", "model": "qwen2.5:7b", "context_length": 8192}]}
OLLAMA_SHOW = {
    "parameters": 'num_ctx                        6144\nstop                           "<|im_end|>"',
    "model_info": {"general.architecture": "qwen2", "qwen2.context_length": 32768},
}
OLLAMA_SHOW_DEFAULT = {"parameters": "", "model_info": {"llama.context_length": 131072}}
LMSTUDIO_MODELS = {  # GET /api/v1/models (LM Studio 0.4): one model loaded at 8192, one not loaded
    "models": [
        {
            "type": "llm",
            "key": "qwen3-8b",
            "loaded_instances": [{"id": "qwen3-8b", "config": {"context_length": 8192}}],
            "max_context_length": 40960,
        },
        {"type": "llm", "key": "gemma-3-270m-it", "loaded_instances": [], "max_context_length": 32768},
        {"type": "llm", "key": "tiny", "loaded_instances": [], "max_context_length": 2048},
    ]
}
OPENAI_MODELS = {"object": "list", "data": [{"id": "gpt-4o", "object": "model", "owned_by": "system"}]}


def test_each_servers_answer_gives_its_runtime_window() -> None:
    assert window_from_llamacpp_props(LLAMACPP_PROPS) == 512
    # llama.cpp's /v1/models names the training window only: not the runtime one.
    assert window_from_models(LLAMACPP_MODELS, "smol.gguf") is None
    assert window_from_models(VLLM_MODELS, "Qwen/Qwen2.5-1.5B-Instruct") == 32768
    assert window_from_models(VLLM_MODELS, "unknown") is None  # two models, none of that name
    assert window_from_ollama_ps(OLLAMA_PS, "qwen2.5:7b") == 8192
    assert window_from_ollama_ps(OLLAMA_PS, "llama3") is None  # not loaded
    # A name without a tag is Ollama's ":latest", as /api/ps lists it.
    loaded = {"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest", "context_length": 8192}]}
    assert window_from_ollama_ps(loaded, "llama3.2") == 8192
    assert window_from_ollama_ps(loaded, "llama3.2:latest") == 8192
    assert window_from_ollama_ps(loaded, "llama3.2:1b") is None
    untagged = {"models": [{"name": "me/tuned", "context_length": 2048}]}
    assert window_from_ollama_ps(untagged, "me/tuned:latest") == 2048
    assert window_from_ollama_show(OLLAMA_SHOW) == (6144, True)  # the Modelfile's num_ctx
    assert window_from_ollama_show(OLLAMA_SHOW_DEFAULT) == (4096, False)  # a guess: Ollama's least default
    assert window_from_models(OPENAI_MODELS, "gpt-4o") is None
    assert window_from_lmstudio_models(LMSTUDIO_MODELS, "qwen3-8b") == (8192, True)  # loaded: its runtime
    second = {"id": "qwen3-8b:2", "config": {"context_length": 16384}}
    both = {"models": [{**LMSTUDIO_MODELS["models"][0], "loaded_instances": [
        LMSTUDIO_MODELS["models"][0]["loaded_instances"][0], second]}]}  # fmt: skip
    assert window_from_lmstudio_models(both, "qwen3-8b:2") == (16384, True)  # an instance by its id
    # Not loaded: LM Studio loads it on demand at its default context length (a guess).
    assert window_from_lmstudio_models(LMSTUDIO_MODELS, "gemma-3-270m-it") == (4096, False)
    assert window_from_lmstudio_models(LMSTUDIO_MODELS, "tiny") == (2048, False)
    assert window_from_lmstudio_models(LMSTUDIO_MODELS, "other") is None
    for junk in (None, [], "x", {"default_generation_settings": {"n_ctx": "512"}}, {"data": "x"}):
        assert window_from_llamacpp_props(junk) is None
        assert window_from_models(junk, "m") is None
        assert window_from_ollama_show(junk) is None
        assert window_from_lmstudio_models(junk, "m") is None


def _server_app(kind: str) -> web.Application:
    app = web.Application()

    def reply(data: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(data)

        return handler

    if kind == "llama.cpp":
        app.router.add_get("/props", reply(LLAMACPP_PROPS))
        app.router.add_get("/v1/models", reply(LLAMACPP_MODELS))
    elif kind == "llama.cpp router":  # (several models: a model's props when it is named)

        async def props(request: web.Request) -> web.Response:
            if request.query.get("model") != "org/gemma-GGUF:Q4_K_M":
                return web.json_response({"role": "router", "max_instances": 4})
            return web.json_response({**LLAMACPP_PROPS, "default_generation_settings": {"n_ctx": 4096}})

        app.router.add_get("/props", props)
    elif kind == "vllm":
        app.router.add_get("/v1/models", reply(VLLM_MODELS))
    elif kind == "ollama":
        app.router.add_get("/v1/models", reply({"object": "list", "data": [{"id": "qwen2.5:7b"}]}))
        app.router.add_get("/api/ps", reply({"models": []}))
        app.router.add_post("/api/show", reply(OLLAMA_SHOW))
    elif kind == "lm studio":
        app.router.add_get("/v1/models", reply({"object": "list", "data": [{"id": "qwen3-8b"}]}))
        app.router.add_get("/api/v1/models", reply(LMSTUDIO_MODELS))
    else:  # OpenAI itself: only a model list, without windows
        app.router.add_get("/v1/models", reply(OPENAI_MODELS))
    return app


@asynccontextmanager
async def serving(kind: str) -> AsyncIterator[str]:
    async with serving_app(_server_app(kind)) as url:
        yield f"{url}/v1"


@pytest.mark.parametrize(
    ("kind", "model", "expected"),
    [
        (
            "llama.cpp",
            "smol.gguf",
            ServerWindow(
                512, "llama.cpp GET /props", refuses_overlong=True, prompt_counter="llama.cpp", total_slots=1
            ),
        ),
        (
            "vllm",
            "Qwen/Qwen2.5-1.5B-Instruct",
            ServerWindow(
                32768, "vLLM GET /v1/models max_model_len", refuses_overlong=True, prompt_counter="vllm"
            ),
        ),
        (
            "llama.cpp router",
            "org/gemma-GGUF:Q4_K_M",
            ServerWindow(
                4096,
                "llama.cpp GET /props?model=",
                refuses_overlong=True,
                prompt_counter="llama.cpp",
                total_slots=1,
            ),
        ),
        ("ollama", "qwen2.5:7b", ServerWindow(6144, "Ollama POST /api/show", num_ctx_option=True)),
        ("lm studio", "qwen3-8b", ServerWindow(8192, "LM Studio GET /api/v1/models")),
        (
            "lm studio",
            "gemma-3-270m-it",
            ServerWindow(4096, "LM Studio GET /api/v1/models (model not loaded)", provisional=True),
        ),
        ("openai", "gpt-4o", None),
    ],
)
async def test_discovery_over_http(kind: str, model: str, expected: ServerWindow | None) -> None:
    async with serving(kind) as base_url:
        upstream = OpenAIUpstream(
            "p", make_settings().providers["mock"].model_copy(update={"base_url": base_url})
        )
        try:
            assert await upstream.describe(model) == expected
        finally:
            await upstream.aclose()


async def test_a_litellm_ollama_providers_window_questions_carry_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`/api/chat` carried the provider's key, its window questions (`/api/ps`, `/api/show`) none:
    an Ollama behind a proxy that wants the key answered them 401, and its window was not known."""
    from gateway.upstream.litellm import LitellmUpstream

    seen: list[str | None] = []
    app = _server_app("ollama")

    @web.middleware
    async def keyed(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer ollama-key":
            return web.json_response({"error": "unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    app.middlewares.append(keyed)
    monkeypatch.setenv("OLLAMA_TEST_KEY", "ollama-key")
    async with serving_app(app) as url:
        settings = ProviderSettings(
            kind="litellm", litellm_provider="ollama_chat", base_url=url, api_key_env="OLLAMA_TEST_KEY"
        )
        window = await LitellmUpstream("oll", settings).describe("qwen2.5:7b")
    assert window == ServerWindow(6144, "Ollama POST /api/show", num_ctx_option=True)
    assert seen and set(seen) == {"Bearer ollama-key"}


async def test_a_server_that_does_not_answer_is_asked_one_question_not_four(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window probe (before the first turn of a model) asked a hung server four questions,
    3 s each: the client's 504 came 12 s after the provider's `timeout`. One unanswered
    question ends it, and all of them share one deadline."""
    import gateway.upstream.discovery as discovery

    monkeypatch.setattr(discovery, "DESCRIBE_TIMEOUT", 0.3)
    heads: list[bytes] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readline())  # the request line; then no answer, ever
        await asyncio.sleep(30)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = (
        make_settings().providers["mock"].model_copy(update={"base_url": f"http://127.0.0.1:{port}/v1"})
    )
    upstream = OpenAIUpstream("p", settings)
    try:
        assert await upstream.describe("m") is None
    finally:
        await upstream.aclose()
        server.close()
    assert heads == [b"GET /props HTTP/1.1\r\n"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hung_providers_first_turn_ends_at_its_timeout_not_after_the_window_question(
    stream: bool,
) -> None:
    """A provider's `timeout` is the turn's deadline, its window's question included.

    The first turn for a model on a server that accepts connections and never answers waited
    3 s for the window (GET /props), then sent its request and waited the whole `timeout`
    again: a 504 after 4 s for a 1 s `timeout`. Now the question is held to the `timeout`, the
    time it took counts against the request's, and a deadline used up sends nothing more."""
    heads: list[bytes] = []
    loop = asyncio.get_running_loop()
    asked: list[float] = []  # when the window's question came

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.append(loop.time())
        heads.append(await reader.readline())
        await asyncio.sleep(30)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    provider = (
        make_settings()
        .providers["mock"]
        .model_copy(update={"base_url": f"http://127.0.0.1:{port}/v1", "timeout": 1.0, "retries": 0})
    )
    settings = make_settings().model_copy(update={"providers": {"mock": provider}})
    from gateway.app import create_app

    app = create_app(settings, store=MemoryStore())
    count_text("hi", "mock/m")  # (the tokenizer's first load, slow on a busy machine, is no part of this)
    try:
        async with (
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://g", timeout=30
            ) as client,
            app.router.lifespan_context(app),
        ):
            answer = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock/m",
                    "stream": stream,
                    "conversation_id": "c1",
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            took = loop.time() - asked[0]  # (what came before the question is not the provider's)
    finally:
        server.close()
    assert answer.status_code == 504, answer.text
    assert "providers.mock.timeout" in answer.json()["error"]["message"]
    assert heads == [b"GET /props HTTP/1.1\r\n"]  # the request itself was never sent
    assert took < 2.5  # (was 4 s: the window's 3 s question, then the whole timeout)


async def test_a_guessed_window_is_checked_again_and_a_failed_call_asks_the_server_again() -> None:
    """An Ollama model not loaded yet: its window was Ollama's least default (4096), kept for
    good, and told to Ollama as num_ctx (which holds a server of 8192 down to it). And a server
    that restarted (a llama.cpp with fewer slots) was never asked again: conversations whose slot
    was gone waited for it until their timeout, every turn."""
    answers = [
        ServerWindow(4096, "Ollama POST /api/show (model not loaded)", provisional=True),
        ServerWindow(8192, "Ollama GET /api/ps", num_ctx_option=True),
        None,  # (restarting: no answer)
        ServerWindow(8192, "Ollama GET /api/ps", num_ctx_option=True),
    ]
    asked: list[str] = []

    class Scripted(MockUpstream):
        async def describe(self, model: str) -> ServerWindow | None:
            asked.append(model)
            return answers[len(asked) - 1]

    now = [0.0]
    route = Route("mock", Scripted(), "qwen")
    facts = ModelFacts(make_settings(), clock=lambda: now[0])
    guess = await facts.window(route, "mock/qwen")
    assert (guess.tokens, guess.num_ctx_option) == (4096, False)  # (a guess is never sent as num_ctx)
    now[0] = 10.0
    assert (await facts.window(route, "mock/qwen")).tokens == 4096 and len(asked) == 1
    now[0] = 40.0  # past REASK_PROVISIONAL: the model is loaded by now
    loaded = await facts.window(route, "mock/qwen")
    assert (loaded.tokens, loaded.source, loaded.num_ctx_option) == (8192, "Ollama GET /api/ps", True)
    now[0] = 4000.0
    assert (await facts.window(route, "mock/qwen")).tokens == 8192 and len(asked) == 2  # kept
    facts.unanswered(route)  # a call timed out
    kept = await facts.window(route, "mock/qwen")
    assert kept.tokens == 8192 and len(asked) == 3  # asked; no answer: what it said before stands
    facts.unanswered(route)
    await facts.window(route, "mock/qwen")
    assert len(asked) == 4


async def test_a_turn_whose_provider_timed_out_has_the_next_turn_ask_the_server_again() -> None:
    asked: list[str] = []
    calls = [0]

    def answer(body: dict[str, Any]) -> str:
        calls[0] += 1
        if calls[0] == 1:
            raise UpstreamTimeout("Provider 'mock' gave no whole answer within 1 s")
        return "ok"

    class Asked(MockUpstream):
        async def describe(self, model: str) -> ServerWindow | None:
            asked.append(model)
            return ServerWindow(512, "llama.cpp GET /props", total_slots=2)

    async with build_client(make_settings(), MemoryStore(), Asked(answer)) as client:
        for expected in (504, 200, 200):
            body = {
                "model": "mock/smol",
                "conversation_id": "t",
                "messages": [{"role": "user", "content": "hi"}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == expected
    assert asked == ["smol", "smol"]  # the first turn's question, and one more after its timeout


async def test_window_precedence_and_the_server_is_asked_once() -> None:
    asked = []

    class Counting(MockUpstream):
        async def describe(self, model: str) -> ServerWindow | None:
            asked.append(model)
            return ServerWindow(512, "llama.cpp GET /props")

    route = Route("mock", Counting(), "smol")
    facts = ModelFacts(make_settings())
    for _ in range(3):
        found = await facts.window(route, "mock/smol")
        assert (found.tokens, found.source) == (512, "llama.cpp GET /props")
    assert asked == ["smol"]
    # A configured window wins, without asking.
    settings = make_settings().model_copy(
        update={"models": {"mock/smol": ModelSettings(context_window=2048)}}
    )
    configured = await ModelFacts(settings).window(route, "mock/smol")
    assert (configured.tokens, configured.source) == (2048, "config")
    assert asked == ["smol"]
    # No server answer: litellm's model map, else the default.
    silent = Route("mock", MockUpstream(), "gpt-4o")
    assert (await ModelFacts(make_settings()).window(silent, "mock/gpt-4o")).source == "litellm model map"
    unknown = Route("mock", MockUpstream(), "no-such-model")
    assert (await ModelFacts(make_settings()).window(unknown, "mock/no-such-model")).tokens == 8192
    # A litellm provider named otherwise than litellm's prefix: the map is keyed by the prefix.
    lite = make_settings().model_copy(
        update={"providers": {"mis": ProviderSettings(kind="litellm", litellm_provider="mistral")}}
    )
    mistral = Route("mis", MockUpstream(), "mistral-large-latest")
    found = await ModelFacts(lite).window(mistral, "mis/mistral-large-latest")
    assert (found.tokens, found.source) == (262144, "litellm model map")


# -- calibration ---------------------------------------------------------------------------------------


def test_calibration_learns_ratio_and_template_overhead_and_never_undercounts() -> None:
    rng = random.Random(7)
    observations = []
    for _ in range(50):
        ours = rng.randint(40, 480)
        theirs = round(1.12 * ours + 21 + rng.uniform(-6, 6))
        observations.append((ours, theirs))
    calibration = fit(observations)
    assert 1.08 < calibration.ratio < 1.16 and 10 < calibration.overhead < 32
    assert all(calibration.provider_tokens(o) >= t for o, t in observations)
    assert calibration.margin <= 16  # the worst miss plus rounding: the window is not wasted
    budget = calibration.our_budget(496)
    assert calibration.provider_tokens(budget) <= 496 < calibration.provider_tokens(budget + 2)


def test_calibration_with_too_little_spread_goes_through_the_origin() -> None:
    calibration = fit([(100, 130), (101, 125)])
    assert calibration.overhead == 0 and calibration.ratio == pytest.approx(127.5 / 100.5, rel=0.01)
    assert calibration.provider_tokens(100) >= 130 and calibration.provider_tokens(101) >= 125
    assert fit([]) == UNCALIBRATED
    assert fit([(0, 10), (10, 0)]) == UNCALIBRATED  # nothing usable


def test_one_pair_that_is_not_a_count_of_the_same_prompt_cannot_shrink_the_window_for_good() -> None:
    """A refusal's made-up figure (ours 8, theirs 5000) or a prompt with parts we did not count
    once made the through-origin ratio 625: every later turn was refused before being sent."""
    calibration = fit([(100, 130), (101, 125), (8, 5000)])
    assert calibration.ratio == pytest.approx(127.5 / 100.5, rel=0.01) and calibration.margin < 10
    assert fit([(8, 5000)]) == UNCALIBRATED


async def test_the_request_tools_are_part_of_the_window() -> None:
    """Tool definitions take room in the prompt (the provider counts them): planned as a fixed
    layer, and part of the total the provider's prompt_tokens are calibrated against."""
    upstream = MockUpstream()
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 20}}
        for i in range(8)
    ]
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        body = {"model": "mock/m", "conversation_id": "t", "messages": [{"role": "user", "content": "hi"}]}
        plain = (await client.get("/v1/conversations/t/context")).status_code
        await client.post("/v1/chat/completions", json=body)
        without = (await client.get("/v1/conversations/t/context")).json()
        await client.post("/v1/chat/completions", json={**body, "tools": tools})
        with_tools = (await client.get("/v1/conversations/t/context")).json()
    assert plain == 404
    assert "tools" not in without["tokens"]
    assert with_tools["tokens"]["tools"] > 200
    assert with_tools["tokens"]["total"] >= with_tools["tokens"]["tools"] + with_tools["tokens"]["new"]


async def test_calibration_is_persisted_and_loaded_by_the_next_process() -> None:
    store = MemoryStore()
    upstream = MockUpstream()
    upstream.reports_real_usage = True
    route = Route("mock", upstream, "smol")
    facts = ModelFacts(make_settings())
    assert (await facts.window(route, "mock/smol", store)).calibration == UNCALIBRATED
    for ours in range(100, 420, 40):
        facts.observe(route, ours, int(1.2 * ours) + 20)
    await facts.save(route, store)
    later = await ModelFacts(make_settings()).window(route, "mock/smol", store)
    assert later.calibration == facts.calibration(route) and later.calibration.samples == 8


# -- refusals --------------------------------------------------------------------------------------------


def llamacpp_refusal(n: int, n_ctx: int = 512) -> bytes:
    message = f"request ({n} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"
    error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
    return orjson.dumps({"error": {**error, "n_prompt_tokens": n, "n_ctx": n_ctx}})


def test_refusals_of_each_provider_are_recognised_with_their_numbers() -> None:
    err = status_error("llama", 400, llamacpp_refusal(631), {})
    assert err.code == "context_length_exceeded" and err.refusal is not None
    assert (err.refusal.window, err.refusal.prompt_tokens) == (512, 631)
    openai = {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, your messages "
            "resulted in 9000 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    err = status_error("openai", 400, orjson.dumps(openai), {})
    assert err.refusal is not None and (err.refusal.window, err.refusal.prompt_tokens) == (8192, 9000)
    vllm = (
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
        "(4900 in the messages, 100 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    err = status_error("vllm", 400, orjson.dumps({"object": "error", "message": vllm, "code": 400}), {})
    assert err.refusal is not None and (err.refusal.window, err.refusal.prompt_tokens) == (4096, 4900)
    assert err.refusal.completion_tokens == 100
    newer_vllm = (
        "This model's maximum context length is 2048 tokens. However, your request has 3000 input tokens."
    )
    refusal = parse_refusal(400, None, newer_vllm)
    assert refusal is not None and (refusal.window, refusal.prompt_tokens) == (2048, 3000)
    newest_vllm = (
        "You passed 900 input tokens and requested 200 output tokens. However, the model's context "
        "length is only 1024 tokens, resulting in a maximum input length of 824 tokens. Please reduce "
        "the length of the input prompt. (parameter=input_tokens, value=900)"
    )
    refusal = parse_refusal(400, {"error": {"message": newest_vllm, "type": "BadRequestError"}}, newest_vllm)
    assert refusal is not None  # (its input count is a least one: not read as the prompt's)
    assert (refusal.window, refusal.prompt_tokens, refusal.completion_tokens) == (1024, None, 200)
    anthropic = parse_refusal(400, None, "prompt is too long: 762 tokens > 600 maximum")
    assert anthropic is not None and (anthropic.window, anthropic.prompt_tokens) == (600, 762)
    ollama = parse_refusal(
        400, {"error": "the input length exceeds the context length"}, "input length exceeds"
    )
    assert ollama is not None and ollama.window is None
    assert status_error("x", 400, b'{"error": {"message": "temperature must be <= 2"}}', {}).refusal is None
    assert status_error("x", 429, b'{"error": {"message": "too many tokens per minute"}}', {}).refusal is None


class FakeLlama:
    """Counts like a model with another tokenizer (1.25x ours + a 21-token template) and
    refuses a prompt over its window exactly as llama.cpp does."""

    def __init__(self, n_ctx: int = 512) -> None:
        self.n_ctx = n_ctx
        self.prompts: list[int] = []
        self.refused = 0

    def count(self, messages: list[dict[str, Any]]) -> int:
        return int(1.25 * (3 + sum(count_message(m) for m in messages))) + 21

    def __call__(self, body: dict[str, Any]) -> Any:
        n = self.count(body["messages"])
        self.prompts.append(n)
        if n > self.n_ctx:
            self.refused += 1
            raise status_error("mock", 400, llamacpp_refusal(n, self.n_ctx), {})
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "smol",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
        }


def real_counting(handler: Any, window: ServerWindow | None = None) -> MockUpstream:
    upstream = MockUpstream(handler, window=window)
    upstream.reports_real_usage = True
    return upstream


SENTENCE = "the quick brown fox jumps over the lazy dog while the river runs past the old mill "


async def ask(client: httpx.AsyncClient, text: str, *, cid: str = "c", **extra: Any) -> httpx.Response:
    """One user message to `mock/smol` in conversation `cid` (`extra`: more body fields)."""
    body = {"model": "mock/smol", "messages": [{"role": "user", "content": text}], "conversation_id": cid}
    return await client.post("/v1/chat/completions", json={**body, **extra})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refusal_is_learned_from_and_retried_once_inside_the_request(stream: bool) -> None:
    llama = FakeLlama()
    settings = make_settings().model_copy(
        update={"models": {"mock/smol": ModelSettings(context_window=2048)}}
    )
    store = MemoryStore()
    async with build_client(settings, store, real_counting(llama)) as client:
        statuses = []
        for i in range(12):
            r = await ask(client, f"{i}: " + SENTENCE * 4, max_tokens=16, stream=stream)
            statuses.append(r.status_code)
        metrics = (await client.get("/metrics")).text
    assert statuses == [200] * 12
    assert llama.refused == 1  # once: the window it said (512) is planned with from then on
    assert 'gateway_context_refusals_total{outcome="retried"} 1.0' in metrics
    refitted = [c for records in store.responses.values() for c in records if c.get("after_refusal")]
    assert len(refitted) == 1 and refitted[0]["context_window"] == 512
    assert refitted[0]["context_window_source"].startswith("provider refusal")
    assert max(llama.prompts[llama.prompts.index(max(llama.prompts)) + 1 :]) <= 512 - 16


class MuteLlama(FakeLlama):
    """Refuses as llama.cpp does when it gives no numbers (Ollama's refusal says none either)."""

    def __call__(self, body: dict[str, Any]) -> Any:
        try:
            return super().__call__(body)
        except Exception:
            error = {
                "code": 400,
                "message": "the request exceeds the available context size, try increasing it",
                "type": "exceed_context_size_error",
            }
            raise status_error("mock", 400, orjson.dumps({"error": error}), {}) from None


class TemplatedLlama(FakeLlama):
    """Counts 6 times what we count (a chat template or parts we cannot see): more than any
    tokenizer's difference, so the calibration rejects its counts as implausible."""

    def count(self, messages: list[dict[str, Any]]) -> int:
        return 6 * sum(count_message(m) for m in messages)


@pytest.mark.parametrize(
    ("kind", "n_ctx", "assumed", "sentences"),
    [(MuteLlama, 1500, 8192, 6), (TemplatedLlama, 2048, 2048, 2)],
    ids=["no-numbers", "counted-far-higher"],
)
async def test_a_refused_prompt_is_never_resent_and_no_turn_sticks(
    kind: type[FakeLlama], n_ctx: int, assumed: int, sentences: int
) -> None:
    """no-numbers: the window assumed (8192) is far above the real one (1500) and the refusal says
    neither: the retry fits below the refused prompt, so no turn fails (it once took a refusal per
    15% of the assumed window, each one a failed turn).

    counted-far-higher: the provider's count of the refused prompt (6x ours) is rejected as
    implausible, and the window it names (2048) still held the prompt by our count: the retry, and
    every later turn, resent it and was refused again; the conversation was stuck at 400."""
    llama = kind(n_ctx=n_ctx)
    settings = make_settings().model_copy(
        update={"models": {"mock/smol": ModelSettings(context_window=assumed)}}
    )
    async with build_client(settings, MemoryStore(), real_counting(llama)) as client:
        statuses = [
            (await ask(client, f"{i}: " + SENTENCE * sentences, max_tokens=16)).status_code for i in range(14)
        ]
    assert statuses == [200] * 14
    assert llama.refused == 1
    refused = llama.prompts.index(max(llama.prompts))
    assert max(llama.prompts[refused + 1 :]) < llama.prompts[refused]  # never resent
    assert max(llama.prompts[refused + 1 :]) <= llama.n_ctx


async def test_a_request_too_long_for_the_real_window_is_a_400_and_the_conversation_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    llama = FakeLlama()
    settings = make_settings().model_copy(
        update={"models": {"mock/smol": ModelSettings(context_window=4096)}}
    )
    async with build_client(settings, MemoryStore(), real_counting(llama)) as client:
        assert (await ask(client, "hello")).status_code == 200
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            r = await ask(client, SENTENCE * 40)  # ~700 tokens alone: no window of 512 holds it
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert (await ask(client, "and now something short")).status_code == 200
        # the gateway now knows the window: the same request is refused before the provider
        calls = len(llama.prompts)
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            r = await ask(client, SENTENCE * 40)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert len(llama.prompts) == calls
        metrics = (await client.get("/metrics")).text
    lines = [orjson.loads(rec.getMessage()) for rec in caplog.records if rec.name == "gateway.access"]
    assert [(line["status"], line["outcome"]) for line in lines] == [(400, "error"), (400, "refused")]
    assert lines[1]["error"]["code"] == "context_length_exceeded" and lines[1]["conversation_id"] == "c"
    assert 'gateway_refusals_total{code="context_length_exceeded"} 1.0' in metrics
    # the provider's refusal, with no second call (the request alone could not fit): "refused"
    assert 'gateway_context_refusals_total{outcome="refused"} 1.0' in metrics
    assert 'gateway_context_refusals_total{outcome="retried"}' not in metrics


async def test_discovered_window_with_no_configuration_every_turn_fits() -> None:
    llama = FakeLlama()
    upstream = real_counting(llama, window=ServerWindow(512, "llama.cpp GET /props"))
    store = MemoryStore()
    async with build_client(make_settings(), store, upstream) as client:
        for i in range(20):
            r = await ask(client, f"{i}: " + SENTENCE * 4, max_tokens=16)
            assert r.status_code == 200, r.text
    assert llama.refused == 0
    # Calibrated after the first answers: the later prompts are cut in steps, from a full window
    # down to the low-water mark (cut_to = 0.6 of it, whole messages of ~100 tokens below).
    assert min(llama.prompts[6:]) >= 0.4 * 512 and max(llama.prompts[6:]) >= 0.8 * 512
    assert max(llama.prompts) <= 512 - 16


async def test_the_answer_reserve_is_max_tokens_when_sent_else_a_quarter_of_a_small_window() -> None:
    upstream = MockUpstream()
    settings = make_settings().model_copy(update={"models": {"mock/smol": ModelSettings(context_window=512)}})
    store = MemoryStore()
    async with build_client(settings, store, upstream) as client:
        text = "word " * 400  # ~408 tokens: fits 512 with max_tokens 16, not with half the window kept free
        r = await ask(client, text, cid="a", max_tokens=16)
        assert r.status_code == 200, r.text
        r = await ask(client, "hi", cid="b")
    reserves = [
        next(c for c in recs if c["type"] == "context")["reserve_tokens"] for recs in store.responses.values()
    ]
    assert reserves == [16, 128]


# -- sizing for small windows ------------------------------------------------------------------------------


def test_summary_cap_and_summarizer_chunk_follow_the_window() -> None:
    assert summary_cap(500, 512) == 102
    assert summary_cap(500, 128_000) == 500
    chunk = chunk_budget(512, 102, 1.12, 21, 8)
    # (instructions + current summary + chunk) in the provider's units, plus the answer, fit.
    assert chunk >= 32 and (96 + 102 + chunk) * 1.12 + 21 + 8 + 102 <= 512
    assert chunk_budget(128_000, 500, 1.0, 0, 0) == 3000


async def test_a_stored_summary_larger_than_a_small_window_allows_is_cut_not_refused() -> None:
    store = MemoryStore()
    upstream = MockUpstream()
    settings = make_settings()
    settings = settings.model_copy(
        update={
            "models": {"mock/smol": ModelSettings(context_window=512)},
            "context": settings.context.model_copy(
                update={"strategy": "summarize", "summary_model": "mock/s"}
            ),
        }
    )
    async with build_client(settings, store, upstream) as client:
        # (long enough that the history cannot go as it is beside the next request)
        first = (await ask(client, "my name is Ada " * 60, max_tokens=16)).json()["id"]
        # A summary written when the window was thought larger: 450 tokens.
        await store.append_side(
            "summaries",
            "c",
            {"type": "summary", "version": 1, "covers_through": first, "text": "Ada likes tea. " * 90},
        )
        r = await ask(client, "word " * 150, max_tokens=16)
        assert r.status_code == 200, r.text
    context = [c for c in store.responses[r.json()["id"]] if c["type"] == "context"][-1]
    assert context["summary_version"] == 1 and 24 <= context["tokens"]["summary"] <= 512 // 3
    assert context["tokens"]["total"] <= 512 - 16


# -- pinning rules -------------------------------------------------------------------------------------------


def _fit(history: list[dict[str, Any]], budget: int, **kw: Any) -> Any:
    new = [{"role": "user", "content": "newest question"}]
    conversation = [*history, *new]
    return fit_window(
        system=[],
        system_tokens=[],
        conversation=conversation,
        conversation_tokens=[10] * len(conversation),
        first_new=len(history),
        budget=budget,
        max_history_messages=kw.pop("max_history_messages", 100),
        marker_tokens=lambda n: 5,
        **kw,
    )


def _turns(n: int) -> list[dict[str, Any]]:
    return [{"role": r, "content": f"{r} {i}"} for i in range(n) for r in ("user", "assistant")]


def test_the_answer_before_the_newest_question_goes_only_with_everything_older() -> None:
    for budget in range(18, 120):
        w = _fit(_turns(5), budget)
        sent = [m["content"] for m in w.messages]
        assert sent[-1] == "newest question"
        if "user 4" in sent or "user 3" in sent:
            assert "assistant 4" in sent


def test_a_cut_drops_whole_turns() -> None:
    """After the marker comes a question, never an answer whose question was left out (chat
    templates that require user/assistant alternation refuse that); the one exception is the
    answer before the current request, which goes only with everything older."""
    for budget in range(18, 120):
        for limit in (200, 3, 4, 5):
            w = _fit(_turns(5), budget, max_history_messages=limit)
            sent = w.messages
            if w.omitted:
                after = sent[
                    [m["content"] for m in sent].index(f"[{w.omitted} earlier messages omitted]") + 1
                ]
                assert after["role"] == "user" or after["content"] == "assistant 4", (budget, limit, sent)


def test_a_request_adding_nothing_with_no_room_for_history_is_only_the_marker() -> None:
    """A client resending exactly what is stored adds no new message; with no room for any
    history the window is the marker alone (the whole-turn rule once read past the end: a 500)."""
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    w = fit_window(
        system=[],
        system_tokens=[],
        conversation=conversation,
        conversation_tokens=[10, 10],
        first_new=2,
        budget=12,
        max_history_messages=100,
        marker_tokens=lambda n: 2,
    )
    assert [m["content"] for m in w.messages] == ["[2 earlier messages omitted]"] and w.omitted == 2


def test_keep_recent_messages_passes_max_history_messages() -> None:
    w = _fit(_turns(5), 1000, max_history_messages=0, keep_recent=2)
    assert [m["content"] for m in w.messages][-3:] == ["user 4", "assistant 4", "newest question"]
    assert _fit(_turns(5), 1000, max_history_messages=0).messages[-2]["content"].startswith("[10 earlier")


def test_keep_first_keeps_the_first_message_ahead_of_the_marker_when_it_fits() -> None:
    history = _turns(5)
    first, rest = history[:1], history[1:]
    w = _fit(rest, 60, first=first, first_tokens=[10], keep_recent=2)
    sent = [m["content"] for m in w.messages]
    assert (
        sent[0] == "user 0"
        and sent[1].startswith("[")
        and sent[-3:] == ["user 4", "assistant 4", "newest question"]
    )
    assert w.omitted == 7  # "assistant 3" fitted too, but its question did not: whole turns only
    assert sent[2] == "user 4"
    # No room for it beside the newest question and the answer before it: it goes first.
    w = _fit(rest, 40, first=first, first_tokens=[10], keep_recent=2)
    assert "user 0" not in [m["content"] for m in w.messages] and w.omitted == 8


def test_calibration_defaults() -> None:
    assert Calibration().provider_tokens(100) == 100
    assert UNCALIBRATED.provider_tokens(100) > 140  # unknown tokenizer: room for 1.25x and a template


async def test_v1_models_lists_what_each_provider_reports() -> None:
    from gateway.app import create_app

    async with serving("vllm") as base_url:
        settings = make_settings().model_copy(
            update={
                "providers": {
                    "mock": make_settings().providers["mock"].model_copy(update={"base_url": base_url}),
                    "demo": make_settings().providers["mock"].model_copy(update={"kind": "demo"}),
                },
                "models": {"mock/configured": ModelSettings(context_window=4096)},
            }
        )
        app = create_app(settings, store=MemoryStore())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            listed = (await client.get("/v1/models")).json()
        await app.state.services.aclose()
    ids = {m["id"]: m["owned_by"] for m in listed["data"]}
    assert ids == {
        "mock/configured": "mock",
        "demo": "gateway",
        "mock/Qwen/Qwen2.5-1.5B-Instruct": "mock",
        "mock/other": "mock",
    }


async def test_a_provider_that_counts_fewer_tokens_is_not_taken_for_a_truncating_one() -> None:
    """A provider whose tokenizer counts about 0.6 of ours (short messages, a rough count),
    met first on a long conversation (a restarted gateway: nothing calibrated yet), must not
    shrink the window: the whole conversation is still sent (it once lost its start to
    '[N earlier messages omitted]')."""
    from gateway.upstream.base import approx_tokens, completion_from_text

    def counting(body: dict[str, Any]) -> Any:
        return completion_from_text("m", "ok", prompt_tokens=approx_tokens(body["messages"]))

    def no_usage(body: dict[str, Any]) -> Any:
        completion = completion_from_text("m", "ok", prompt_tokens=0)
        completion.pop("usage")
        return completion

    store = MemoryStore()

    async def turns(upstream: MockUpstream, first: int, count: int) -> None:
        async with build_client(make_settings(), store, upstream) as client:
            for n in range(first, first + count):
                body = {
                    "model": "mock/m",
                    "conversation_id": "terse",
                    "messages": [{"role": "user", "content": f"r0-w{n}-t0"}],
                }
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text

    await turns(MockUpstream(no_usage), 0, 40)  # history above 256 tokens, nothing calibrated
    upstream = MockUpstream(counting)
    upstream.reports_real_usage = True
    await turns(upstream, 40, 3)  # a new process meets the provider on a long conversation
    sent = upstream.requests[-1]["messages"]
    assert len(sent) == 85 and sent[0]["content"] == "r0-w0-t0"


class ToolBlindLlama(FakeLlama):
    """SmolLM2's chat template renders neither `tools` nor assistant `tool_calls`: llama.cpp
    counts such prompts well below ours (and still refuses what does not fit)."""

    def __call__(self, body: dict[str, Any]) -> Any:
        rendered = [{k: v for k, v in m.items() if k != "tool_calls"} for m in body["messages"]]
        return super().__call__({**body, "messages": rendered})


async def test_a_server_that_refuses_long_prompts_is_never_taken_for_one_that_cuts_them() -> None:
    """A tool-call history llama.cpp counts low once capped the window at that count for every
    conversation on the model, until a restart; fitting requests were then refused."""
    llama = ToolBlindLlama(n_ctx=1024)
    upstream = real_counting(llama, window=ServerWindow(1024, "llama.cpp GET /props", refuses_overlong=True))
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {}}} for i in range(12)]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "tool_1", "arguments": '{"x": 1}'}}
        for i in range(4)
    ]
    history = [
        {"role": "user", "content": "use the tools"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "done"} for c in calls),
        {"role": "user", "content": "thanks"},
    ]
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "mock/smol", "messages": history, "tools": tools, "conversation_id": "tools"},
        )
        assert r.status_code == 200, r.text
        sent = (await client.get("/v1/conversations/tools/context")).json()["tokens"]
        r = await ask(client, SENTENCE * 14, cid="other", max_tokens=16)  # ~250 of ours: fits 1024
        assert r.status_code == 200, r.text
        window = (await client.get("/v1/conversations/other/context")).json()["context_window"]
    assert sent["total"] > 2 * llama.prompts[0]  # counted well below ours
    assert window == 1024 and llama.refused == 0


def test_a_negative_intercept_falls_back_to_a_least_squares_ratio_not_the_largest_one() -> None:
    """A prompt of digits (151 of ours, 342 of SmolLM2's) among ordinary ones tilts the fitted
    line below zero: every prompt was then planned at that one prompt's 2.26x (or a short
    prompt's 2.77x, under the template's 21-token system prompt), and fitting requests were
    refused."""
    observations = [(250, 268), (252, 270), (248, 266), (151, 342)]  # as SmolLM2 counted them
    calibration = fit(observations)
    assert calibration.overhead == 0 and 1.1 < calibration.ratio < 1.3
    assert all(calibration.provider_tokens(o) >= t for o, t in observations)  # still never undercounts


async def test_a_request_that_fits_only_without_the_margin_is_sent() -> None:
    """One prompt the model counted at 2.3x made the margin large: a fitting request was
    refused by the gateway itself. The best estimate fits, so it goes to the provider."""
    llama = FakeLlama(n_ctx=512)
    upstream = real_counting(llama, window=ServerWindow(512, "llama.cpp GET /props", refuses_overlong=True))
    store = MemoryStore()
    async with build_client(make_settings(), store, upstream) as client:
        facts = client._transport.app.state.services.facts  # type: ignore[attr-defined]
        route = client._transport.app.state.services.router.resolve("mock/smol")  # type: ignore[attr-defined]
        for ours, theirs in [(250, 268), (252, 270), (248, 266), (151, 342)]:
            facts.observe(route, ours, theirs)  # margin 163: 183 of ours fit, with it
        r = await ask(client, SENTENCE * 14)  # 243 of ours, 328 of the model's: fits its 384
    assert r.status_code == 200, r.text
    assert llama.refused == 0


async def test_prompts_with_tools_never_teach_that_the_model_counts_less() -> None:
    """SmolLM2's template leaves tools out: its low counts of such prompts pulled the planned
    ratio to 0.7, the next ordinary prompt was planned too big and refused."""
    llama = ToolBlindLlama(n_ctx=1024)
    upstream = real_counting(llama, window=ServerWindow(1024, "llama.cpp GET /props", refuses_overlong=True))
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {}}} for i in range(4)]
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        for i in range(4):
            assert (
                await ask(client, f"{i}: " + SENTENCE * (2 + 2 * i), cid="plain", max_tokens=16)
            ).status_code == 200
        facts = app_of(client).state.service.facts  # the calibration the next turn plans with
        route = app_of(client).state.router.resolve("mock/smol")
        before = (await facts.window(route, "mock/smol")).calibration
        for i in range(4):
            r = await ask(client, f"call {i}: " + SENTENCE * 3, cid="tools", max_tokens=16, tools=tools)
            assert r.status_code == 200, r.text
        after = (await facts.window(route, "mock/smol")).calibration
    # (it lowered the ratio, 1.25 to 1.15, and tripled the margin, window wasted both ways)
    assert after.ratio >= before.ratio and after.margin <= before.margin and llama.refused == 0


async def test_one_cheaply_counted_prompt_is_not_taken_for_a_cut_but_a_run_of_cuts_is() -> None:
    """A message in a script tiktoken splits finely (one tenant's Hindi) looked like Ollama's
    silent cut and capped the model's window for every tenant at about 256 tokens."""
    cut_to: list[int | None] = [None]

    def provider(body: dict[str, Any]) -> Any:
        from gateway.upstream.base import approx_tokens

        seen = approx_tokens(body["messages"])
        counted = cut_to[0] if cut_to[0] is not None else seen
        return completion_from_text("m", "ok", prompt_tokens=counted)

    upstream = real_counting(provider)
    settings = make_settings().model_copy(update={"models": {"mock/o": ModelSettings(context_window=8192)}})
    async with build_client(settings, MemoryStore(), upstream) as client:

        async def window_after(text: str, cid: str) -> int:
            body = {
                "model": "mock/o",
                "conversation_id": cid,
                "messages": [{"role": "user", "content": text}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            return int((await client.get(f"/v1/conversations/{cid}/context")).json()["context_window"])

        await window_after(SENTENCE * 20, "plain")  # calibrated on an ordinary prompt
        cut_to[0] = 60  # one prompt counted far below ours
        await window_after(SENTENCE * 20, "hindi")
        cut_to[0] = None
        assert await window_after("hello", "other") == 8192  # not capped for anyone
        cut_to[0] = 300  # a provider that cuts every long prompt to its runtime window
        for cid in ("long-1", "long-2"):
            await window_after(SENTENCE * 30, cid)
        assert await window_after("hello", "after") == 300  # capped at what it sees


async def test_usage_figures_too_low_for_any_window_are_no_cut() -> None:
    """A provider whose usage says 50 prompt tokens whatever it is sent (a placeholder) looked
    like a silent cut repeated: the model's window, 8192 by its configuration, became 256 for
    every conversation, and ordinary prompts were refused."""
    upstream = real_counting(lambda body: completion_from_text("m", "ok", prompt_tokens=50))
    settings = make_settings().model_copy(update={"models": {"mock/o": ModelSettings(context_window=8192)}})
    async with build_client(settings, MemoryStore(), upstream) as client:
        for n in range(4):
            body = {
                "model": "mock/o",
                "conversation_id": f"c{n}",
                "messages": [{"role": "user", "content": SENTENCE * 30}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        context = (await client.get("/v1/conversations/c3/context")).json()
    assert context["context_window"] == 8192


async def test_ollama_native_through_litellm_gets_the_servers_window() -> None:
    """kind = "litellm" for Ollama's native API (`ollama_chat/...`) never asked the server: a
    prompt planned for the 8192 default went to a model running with num_ctx 2048."""
    from gateway.upstream.litellm import LitellmUpstream

    chats: list[dict[str, Any]] = []

    async def show(request: web.Request) -> web.Response:
        return web.json_response({"parameters": "num_ctx                        2048", "model_info": {}})

    async def chat_api(request: web.Request) -> web.Response:
        chats.append(await request.json())
        message = {"role": "assistant", "content": "ok"}
        answer = {"model": "llama3.2", "message": message, "done": True, "done_reason": "stop"}
        return web.json_response({**answer, "prompt_eval_count": 30, "eval_count": 1})

    app = web.Application()
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/chat", chat_api)
    store = MemoryStore()
    async with serving_app(app) as url:
        native = ProviderSettings(kind="litellm", litellm_provider="ollama_chat", base_url=url)
        upstream = LitellmUpstream("mock", native)
        async with build_client(make_settings(), store, upstream) as client:  # type: ignore[arg-type]
            hello = [{"role": "user", "content": "hi"}]
            body = {"model": "mock/llama3.2", "conversation_id": "o", "messages": hello}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
    (context,) = [rec for rec in store.responses[r.json()["id"]] if rec["type"] == "context"]
    assert (context["context_window"], context["context_window_source"]) == (2048, "Ollama POST /api/show")
    assert chats[-1]["options"]["num_ctx"] == 2048  # the window planned for, told to Ollama


class DigitLlama(FakeLlama):
    """Counts as SmolLM2 does text full of digits (one token each: far more than ours) and, as
    llama.cpp does, counts a prompt on request (`/apply-template` + `/tokenize`)."""

    def count(self, messages: list[dict[str, Any]]) -> int:
        digits = sum(sum(ch.isdigit() for ch in str(m.get("content"))) for m in messages)
        return int(1.1 * (3 + sum(count_message(m) for m in messages))) + digits + 21

    def __call__(self, body: dict[str, Any]) -> Any:
        n = self.count(body["messages"])
        self.prompts.append(n)
        if n > self.n_ctx:
            self.refused += 1
            raise status_error("mock", 400, llamacpp_refusal(n, self.n_ctx), {})
        answer = {"role": "assistant", "content": "ok"}
        usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
        choice = {"index": 0, "message": answer, "finish_reason": "stop"}
        return {"id": "x", "object": "chat.completion", "model": "smol", "choices": [choice], "usage": usage}


class CountingServer(MockUpstream):
    def __init__(self, llama: DigitLlama) -> None:
        window = ServerWindow(512, "llama.cpp GET /props", refuses_overlong=True, prompt_counter="llama.cpp")
        super().__init__(llama, window=window)
        self.reports_real_usage = True
        self.llama = llama
        self.counted = 0

    async def count_prompt(self, body: dict[str, Any]) -> int | None:
        self.counted += 1
        return self.llama.count(body["messages"])


async def test_a_server_that_counts_prompts_gets_windows_that_fit_its_count_exactly() -> None:
    """On SmolLM2 (llama.cpp), prompts with digits, emoji or other scripts were counted far
    above the calibration: prompts went over window - max_tokens (the answer cut at the
    window, or a refusal), and one such prompt made the margin shrink every later window to
    a third. llama.cpp counts a prompt on request: each window is checked with its count."""
    llama = DigitLlama()
    upstream = CountingServer(llama)
    store = MemoryStore()
    digits = " ".join(str(10**9 + 7919 * i) for i in range(12))  # 120 digits: ~45 of ours
    async with build_client(make_settings(), store, upstream) as client:
        for i in range(8):  # English turns: the calibration learns about 1.1x
            assert (await ask(client, f"{i}: " + SENTENCE * 2, cid="warm", max_tokens=64)).status_code == 200
        for i in range(10):  # several digit-heavy messages in one window
            r = await ask(client, f"{i} numbers: {digits}", cid="digits", max_tokens=64)
            assert r.status_code == 200, r.text
        first_english = len(llama.prompts)
        for i in range(12):  # then English again: the whole room is used, not a third of it
            assert (await ask(client, f"{i}: " + SENTENCE * 2, cid="after", max_tokens=64)).status_code == 200
    assert llama.refused == 0 and max(llama.prompts) <= 512 - 64  # never over window - max_tokens
    later = llama.prompts[first_english + 8 :]  # cut in steps: from nearly full to the low-water mark
    assert max(later) > 0.85 * (512 - 64) and min(later) > 0.55 * (512 - 64)
    assert upstream.counted >= len(llama.prompts)
    contexts = [r for records in store.responses.values() for r in records if r["type"] == "context"]
    assert all(c["server_prompt_tokens"] in llama.prompts for c in contexts)


async def test_where_the_server_counts_its_count_not_the_estimate_refuses_a_request() -> None:
    """On SmolLM2, a message that fitted (325 of llama.cpp's tokens against 491) was refused
    before llama.cpp was asked: earlier digits had made the calibration's estimate 3x, and a
    request's tools (which SmolLM2's template leaves out) were counted in full."""
    llama = DigitLlama()
    upstream = CountingServer(llama)
    async with build_client(make_settings(), MemoryStore(), upstream) as client:
        facts = client._transport.app.state.services.facts  # type: ignore[attr-defined]
        route = client._transport.app.state.services.router.resolve("mock/smol")  # type: ignore[attr-defined]
        for ours in (100, 110, 120, 130):
            facts.observe(route, ours, 3 * ours)  # an estimate of 3x: ~150 of ours fit 448
        r = await ask(client, SENTENCE * 11, cid="english", max_tokens=64)  # ~200 of ours: 250 of its
        assert r.status_code == 200, r.text
        tool = {"type": "function", "function": {"name": "lookup", "description": SENTENCE * 8}}
        r = await ask(client, "hello", cid="tools", max_tokens=64, tools=[tool] * 3)  # ~400 of ours
        assert r.status_code == 200, r.text
        r = await ask(client, SENTENCE * 30, cid="big", max_tokens=64)  # 600+ of its own: too big
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        for size in (30, 300):  # the message said "more than the -1054 the window allows"
            r = await ask(client, SENTENCE * size, cid="big", max_tokens=64)
            message = r.json()["error"]["message"]
            assert "leave 448 for the prompt" in message and "-" not in message.split("leave")[1], message
    assert llama.refused == 0 and max(llama.prompts) <= 512 - 64


def _vllm_app(window: int, asked: list[dict[str, Any]], prompts: list[int]) -> web.Application:
    """A vLLM server of `window` tokens whose tokenizer counts digits one token each and text
    about 1.3x ours: `POST /tokenize` with chat messages gives the count its chat completions
    then report (and refuse over the window, as vLLM does)."""

    def count(body: dict[str, Any]) -> int:
        messages = body["messages"]
        digits = sum(sum(ch.isdigit() for ch in str(m.get("content"))) for m in messages)
        return int(1.3 * (3 + sum(count_message(m) for m in messages))) + digits

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smol", "max_model_len": window}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body)
        n = count(body)
        return web.json_response({"count": n, "max_model_len": window, "tokens": list(range(n))})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        n = count(body)
        if n + body.get("max_tokens", 16) > window:
            message = (
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{n + body.get('max_tokens', 16)} tokens ({n} in the messages, "
                f"{body.get('max_tokens', 16)} in the completion). Please reduce the length."
            )
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        prompts.append(n)
        usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_vllm_counts_each_window_with_its_own_tokenizer() -> None:
    """SPEC 7 asks for the server's own tokenizer where offered; vLLM offers one (`POST
    /tokenize` with a chat request's messages), but only llama.cpp was asked: on vLLM every
    window was planned with the calibration and its margin, and digit-heavy prompts went over."""
    asked: list[dict[str, Any]] = []
    prompts: list[int] = []
    store = MemoryStore()
    digits = " ".join(str(10**9 + 7919 * i) for i in range(12))
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    async with serving_app(_vllm_app(512, asked, prompts)) as url:
        provider = make_settings().providers["mock"].model_copy(update={"base_url": f"{url}/v1"})
        upstream = OpenAIUpstream("mock", provider)
        try:
            async with build_client(make_settings(), store, upstream) as client:
                for i in range(14):
                    r = await ask(client, f"{i} numbers: {digits}", cid="v", max_tokens=64, tools=[tool])
                    assert r.status_code == 200, r.text
        finally:
            await upstream.aclose()
    assert asked, "vLLM's /tokenize was never asked"
    assert asked[-1]["model"] == "smol" and asked[-1]["add_generation_prompt"] is True
    assert asked[-1]["tools"] == [tool] and "conversation_id" not in asked[-1]
    assert max(prompts) <= 512 - 64 and min(prompts[-4:]) > 0.8 * (512 - 64)  # exact, and full
    contexts = [r for records in store.responses.values() for r in records if r["type"] == "context"]
    assert all(c["server_prompt_tokens"] in prompts for c in contexts)


WORDS = ("apple", "river", "stone", "cloud", "music", "garden", "silver", "window", "orange", "paper")


def words(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n))


async def test_a_configured_window_is_a_budget_kept_in_our_own_count() -> None:
    """A provider reporting 10 prompt tokens a message (a rough count, or only the part of a
    prompt its cache did not serve) taught a ratio below 1 on a few short messages: the
    gateway then planned prompts well over the max_context_tokens it was configured with."""
    size = [12]  # words in the next answer: as many as the question had

    def provider(body: dict[str, Any]) -> Any:
        n = len(body["messages"])
        return completion_from_text("m", words(size[0], seed=n), prompt_tokens=10 * n)

    upstream = real_counting(provider)
    settings = make_settings()
    context = settings.context.model_copy(update={"max_context_tokens": 1500})
    store = MemoryStore()
    async with build_client(settings.model_copy(update={"context": context}), store, upstream) as client:
        for i in range(4):  # a few short exchanges first
            assert (await ask(client, words(12, seed=i))).status_code == 200
        size[0] = 100
        for i in range(30):  # then many ~100-word turns
            assert (await ask(client, words(100, seed=100 + i))).status_code == 200
    contexts = [r for records in store.responses.values() for r in records if r["type"] == "context"]
    assert len(contexts) == 34 and max(c["tokens"]["total"] for c in contexts) <= 1500
    encoding = get_encoding("cl100k_base")  # measured here, as OpenAI counts a chat prompt

    def measured(body: dict[str, Any]) -> int:
        each = (3 + len(encoding.encode(m["role"] + m["content"])) for m in body["messages"])
        return 3 + sum(each)

    assert max(measured(body) for body in upstream.requests) <= 1500 * 1.02


async def test_a_prompt_of_images_refused_as_too_long_shrinks_no_other_conversations_window() -> None:
    """80 images counted a few tokens each, which the provider counts by the thousand: its
    refusal ("203000 tokens > 200000 maximum") set a window of about our count of that prompt
    (1,300) for every conversation of every tenant on the model, with no end."""
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}

    def provider(body: dict[str, Any]) -> str:
        if any(isinstance(m["content"], list) for m in body["messages"]):
            error = {
                "type": "invalid_request_error",
                "message": "prompt is too long: 203000 tokens > 200000 maximum",
            }
            raise status_error("mock", 400, orjson.dumps({"type": "error", "error": error}), {})
        return "ok"

    settings = make_settings().model_copy(
        update={"models": {"mock/big": ModelSettings(context_window=200_000)}}
    )
    store = MemoryStore()
    async with build_client(settings, store, MockUpstream(provider)) as client:
        pictures = {"role": "user", "content": [{"type": "text", "text": "describe"}, *[image] * 80]}
        body = {"model": "mock/big", "conversation_id": "pics", "messages": [pictures]}
        refused = await client.post("/v1/chat/completions", json=body)
        other = {
            "model": "mock/big",
            "conversation_id": "words",
            "messages": [{"role": "user", "content": "hi"}],
        }
        answered = await client.post("/v1/chat/completions", json=other)
        context = (await client.get("/v1/conversations/words/context")).json()
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert answered.status_code == 200
    assert (context["context_window"], context["context_window_source"]) == (200_000, "config")


@pytest.mark.parametrize("wording", ["openai", "vllm"])
async def test_a_refused_max_tokens_teaches_the_stated_window_and_nothing_smaller(wording: str) -> None:
    """ "you requested 5008 tokens (5 in the messages, 5000 in the completion)": the prompt was
    taken for one the provider counts higher than we can tell, and the model's window became 256
    tokens for every conversation (a long one then lost its history; Messages clients, whose
    max_tokens is required, were refused outright). The window named is learned; the client is
    told its max_tokens leaves no room."""

    def provider(body: dict[str, Any]) -> str:
        prompt = sum(len(str(m["content"])) // 4 + 4 for m in body["messages"])
        asked = body.get("max_tokens") or 0
        if prompt + asked > 4096:
            message = (
                "This model's maximum context length is 4096 tokens. However, you requested "
                f"{prompt + asked} tokens ({prompt} in the messages, {asked} in the completion). "
                "Please reduce the length of the messages or completion."
            )
            if wording == "vllm":  # (newer vLLM; its input count is of a prompt it cut first)
                message = (
                    f"You passed {min(prompt, 4097 - asked)} input tokens and requested {asked} output "
                    "tokens. However, the model's context length is only 4096 tokens, resulting in a "
                    f"maximum input length of {4096 - asked} tokens."
                )
            error = {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"}
            raise status_error("mock", 400, orjson.dumps({"error": error}), {})
        return "ok"

    settings = make_settings().model_copy(update={"models": {"mock/m": ModelSettings(context_window=8192)}})
    upstream = MockUpstream(provider)
    async with build_client(settings, MemoryStore(), upstream) as client:
        for i in range(6):
            long = {"role": "user", "content": f"part {i}: " + "word " * 300}
            body = {"model": "mock/m", "conversation_id": "long", "messages": [long]}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        greedy = {"model": "mock/m", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]}
        refused = await client.post("/v1/chat/completions", json={**greedy, "conversation_id": "greedy"})
        again = {
            "model": "mock/m",
            "conversation_id": "long",
            "messages": [{"role": "user", "content": "and?"}],
        }
        answered = await client.post("/v1/chat/completions", json=again)
        context = (await client.get("/v1/conversations/long/context")).json()
        # (the Responses API names its own field: it named the chat field it is sent as)
        output = {"model": "mock/m", "input": "hi", "max_output_tokens": 5000}
        capped = (await client.post("/v1/responses", json=output)).json()["error"]
    assert capped["param"] == "max_output_tokens" and "'max_output_tokens' of 5000" in capped["message"]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "'max_tokens' of 5000 leaves no room" in error["message"] and "4096" in error["message"]
    assert answered.status_code == 200
    assert context["context_window"] == 4096 and context["truncated"] == 0, context
    assert len(upstream.requests[-1]["messages"]) == 13  # the whole history and the new question


async def test_a_provider_with_a_key_and_credentials_in_its_url_is_still_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp refuses an Authorization header beside a `user:password@` URL: the model list and
    the window questions came back empty, without a word. The key is the provider's
    authorization; the URL's credentials are then left out."""
    monkeypatch.setenv("FACTS_TEST_KEY", "sk-test")
    async with serving("vllm") as base_url:
        with_user = base_url.replace("http://", "http://user:pw@")
        settings = (
            make_settings()
            .providers["mock"]
            .model_copy(update={"base_url": with_user, "api_key_env": "FACTS_TEST_KEY"})
        )
        upstream = OpenAIUpstream("p", settings)
        try:
            assert await upstream.list_models() == ["Qwen/Qwen2.5-1.5B-Instruct", "other"]
            window = await upstream.describe("Qwen/Qwen2.5-1.5B-Instruct")
            assert window is not None and window.tokens == 32768
        finally:
            await upstream.aclose()
