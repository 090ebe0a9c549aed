"""Asking an OpenAI-compatible server for the context window it runs a model with.

llama.cpp's `/props`, vLLM's `max_model_len`, Ollama's `/api/ps` and `/api/show`, LM Studio's
`/api/v1/models`. Each reader
takes one answer and returns the window, or None when that answer does not say (llama.cpp's also
says how many slots it keeps prompts in). Then, where the server offers it, its own count of a
prompt (`count_prompt`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import aiohttp
import orjson

from gateway.upstream.base import ServerWindow


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def window_from_llamacpp_props(props: object) -> int | None:
    """llama.cpp `GET /props`: the runtime (per-slot) window, not the training one."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    return _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None


def slots_from_llamacpp_props(props: object) -> int:
    """llama.cpp `GET /props`: its slots (`total_slots`, from `--parallel`), 0 when it does not say."""
    return (_positive(props.get("total_slots")) if isinstance(props, dict) else None) or 0


def window_from_models(listing: object, model: str) -> int | None:
    """vLLM `GET /v1/models`: `max_model_len` of the model (the only one, if the name differs)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    entries = [m for m in data if isinstance(m, dict)]
    named = [m for m in entries if m.get("id") == model or model in (m.get("aliases") or ())]
    for entry in named or (entries if len(entries) == 1 else []):
        found = _positive(entry.get("max_model_len"))
        if found:
            return found
    return None


def _ollama_name(name: object) -> object:
    """Ollama's own rule: a model named without a tag is its `:latest`.

    `/api/ps` lists `llama3.2:latest` for a request that said `llama3.2`.
    """
    if isinstance(name, str) and ":" not in name.rsplit("/", 1)[-1]:
        return f"{name}:latest"
    return name


def window_from_ollama_ps(ps: object, model: str) -> int | None:
    """Ollama `GET /api/ps`: `context_length` of the loaded model (its runtime num_ctx)."""
    models = ps.get("models") if isinstance(ps, dict) else None
    wanted = _ollama_name(model)
    for entry in models if isinstance(models, list) else ():
        if isinstance(entry, dict) and wanted in (
            _ollama_name(entry.get("name")),
            _ollama_name(entry.get("model")),
        ):
            return _positive(entry.get("context_length"))
    return None


# Ollama's runtime window when neither the Modelfile nor a loaded model says (its documented default).
OLLAMA_DEFAULT_NUM_CTX = 4096


def window_from_ollama_show(show: object) -> tuple[int, bool] | None:
    """Ollama `POST /api/show`: the Modelfile's `num_ctx` (and True: the model's runtime window),
    else the model's trained length capped at Ollama's smallest default (and False: a guess).

    Ollama's default runtime window is `OLLAMA_CONTEXT_LENGTH`, else one it picks by memory, which
    `/api/show` does not say: `/api/ps` says it once the model is loaded.
    """
    if not isinstance(show, dict):
        return None
    parameters = show.get("parameters")
    if isinstance(parameters, str):
        for line in parameters.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "num_ctx" and parts[1].isdigit():
                return int(parts[1]), True
    info = show.get("model_info")
    trained = None
    if isinstance(info, dict):
        trained = next(
            (_positive(v) for k, v in info.items() if k.endswith(".context_length") and _positive(v)), None
        )
    return (min(trained, OLLAMA_DEFAULT_NUM_CTX), False) if trained else None


# LM Studio's context length for a model it loads on demand, unless its settings say otherwise.
LMSTUDIO_DEFAULT_CONTEXT = 4096


def window_from_lmstudio_models(listing: object, model: str) -> tuple[int, bool] | None:
    """LM Studio `GET /api/v1/models`: a loaded instance's `context_length` (and True: its runtime
    window), else, for a model not loaded, its `max_context_length` capped at LM Studio's default
    context length (and False: a guess; LM Studio loads it on the first request).

    A request names a model by its key or by a loaded instance's id (`qwen3-8b:2`)."""
    models = listing.get("models") if isinstance(listing, dict) else None
    for entry in models if isinstance(models, list) else ():
        if not isinstance(entry, dict):
            continue
        instances = [i for i in entry.get("loaded_instances") or () if isinstance(i, dict)]
        named = [i for i in instances if i.get("id") == model]
        if not named and entry.get("key") != model:
            continue
        for instance in named or instances:
            config = instance.get("config")
            found = _positive(config.get("context_length")) if isinstance(config, dict) else None
            if found:
                return found, True
        longest = _positive(entry.get("max_context_length"))
        return (min(longest, LMSTUDIO_DEFAULT_CONTEXT), False) if longest else None
    return None


DESCRIBE_TIMEOUT = 3.0


def url_at(base_url: str, path: str) -> str:
    """`base_url` with `path` added to its path: its query (`?api-version=...`) stays at the end."""
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


def with_query(url: str, **fields: str) -> str:
    """`url` with `fields` added to its query (after what it holds already)."""
    parts = urlsplit(url)
    added = urlencode(fields)
    return urlunsplit(parts._replace(query=f"{parts.query}&{added}" if parts.query else added))


def server_root(base_url: str) -> str:
    """The server's own root for its non-OpenAI routes (`/props`, `/api/...`): `base_url` less `/v1`."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    return urlunsplit(parts._replace(path=path[: -len("/v1")] if path.endswith("/v1") else path))


async def describe_openai_compatible(
    session: aiohttp.ClientSession, base_url: str, model: str, within: float | None = None
) -> ServerWindow | None:
    """Ask an OpenAI-compatible server for its runtime window: llama.cpp, vLLM, Ollama, then LM Studio.

    The questions share one deadline (DESCRIBE_TIMEOUT in all, not each; `within` seconds if
    that is shorter: the provider's `timeout`, which the turn waiting on the answer counts this
    wait against), and a server that cannot be reached or does not answer one in time is asked
    nothing more, not four questions' worth of waiting (a hung server gave 15 s for a 3 s
    `timeout`)."""
    root = server_root(base_url)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(DESCRIBE_TIMEOUT, within or DESCRIBE_TIMEOUT)
    unreachable = False

    async def get_json(method: str, url: str, payload: object = None) -> object:
        nonlocal unreachable
        left = deadline - loop.time()
        if unreachable or left <= 0:
            return None
        try:
            timeout = aiohttp.ClientTimeout(total=left)
            async with session.request(method, url, json=payload, timeout=timeout) as response:
                if response.status != 200:
                    return None
                return orjson.loads(await response.read())
        except (aiohttp.ClientConnectionError, TimeoutError):
            unreachable = True  # (refused, reset, or no answer in time: the others would be too)
            return None
        except (aiohttp.ClientError, orjson.JSONDecodeError, ValueError):
            return None

    props = await get_json("GET", url_at(root, "/props"))
    source = "llama.cpp GET /props"
    if isinstance(props, dict) and props.get("role") == "router":
        # A llama.cpp router (several models behind one server) says a model's facts when it
        # is named: `GET /props?model=NAME`.
        source = "llama.cpp GET /props?model="
        props = await get_json("GET", with_query(url_at(root, "/props"), model=model))
    found = window_from_llamacpp_props(props)
    if found:
        return ServerWindow(
            found,
            source,
            refuses_overlong=True,
            prompt_counter="llama.cpp",
            total_slots=slots_from_llamacpp_props(props),
        )
    found = window_from_models(await get_json("GET", url_at(base_url, "/models")), model)
    if found:
        source = "vLLM GET /v1/models max_model_len"
        return ServerWindow(found, source, refuses_overlong=True, prompt_counter="vllm")
    found = window_from_ollama_ps(await get_json("GET", url_at(root, "/api/ps")), model)
    if found:
        return ServerWindow(found, "Ollama GET /api/ps", num_ctx_option=True)
    shown = window_from_ollama_show(await get_json("POST", url_at(root, "/api/show"), {"model": model}))
    if shown:
        tokens, set_in_modelfile = shown
        if set_in_modelfile:
            return ServerWindow(tokens, "Ollama POST /api/show", num_ctx_option=True)
        # (a guess: never told to Ollama as num_ctx, which would hold its own window down to it)
        return ServerWindow(tokens, "Ollama POST /api/show (model not loaded)", provisional=True)
    listed = window_from_lmstudio_models(await get_json("GET", url_at(root, "/api/v1/models")), model)
    if listed:
        tokens, loaded = listed
        if loaded:
            return ServerWindow(tokens, "LM Studio GET /api/v1/models")
        return ServerWindow(tokens, "LM Studio GET /api/v1/models (model not loaded)", provisional=True)
    return None


async def list_openai_models(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    """The ids of `GET {base_url}/models` (OpenAI, vLLM, llama.cpp, Ollama's /v1 all have it)."""
    try:
        async with session.get(
            url_at(base_url, "/models"), timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT)
        ) as response:
            if response.status != 200:
                return []
            listing = orjson.loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
        return []
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m["id"] for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)]


LIST_TIMEOUT = 2.0


COUNT_TIMEOUT = 5.0


async def count_prompt(
    session: aiohttp.ClientSession, base_url: str, counter: str, body: Mapping[str, Any]
) -> int | None:
    """The server's own count of a chat request's prompt, what it then reports as `usage.prompt_tokens`.

    Counted the way `counter` names (`ServerWindow.prompt_counter`):
    - "llama.cpp": its chat template applied (`POST /apply-template`, the request's tools
      included), then its tokenizer (`POST /tokenize`, the special tokens it adds included);
    - "vllm": `POST /tokenize` with the request's messages and tools and the generation prompt,
      as its chat completions render them.
    None when an answer is missing (an older server, a failure: the calibration then plans alone).
    """
    root = server_root(base_url)
    timeout = aiohttp.ClientTimeout(total=COUNT_TIMEOUT)
    headers = {"content-type": "application/json"}

    async def answer(path: str, payload: object, field: str) -> object:
        async with session.post(
            url_at(root, path), data=orjson.dumps(payload), headers=headers, timeout=timeout
        ) as response:
            got = orjson.loads(await response.read()) if response.status == 200 else None
        return got.get(field) if isinstance(got, dict) else None

    try:
        if counter == "vllm":
            asked = {key: body[key] for key in _VLLM_COUNT_FIELDS if body.get(key) is not None}
            count = await answer("/tokenize", {**asked, "add_generation_prompt": True}, "count")
            return count if isinstance(count, int) and not isinstance(count, bool) else None
        if counter != "llama.cpp":
            return None
        prompt = await answer("/apply-template", body, "prompt")
        if not isinstance(prompt, str):
            return None
        # (`model`: a llama.cpp router sends the request to that model's server by it)
        asked = {"content": prompt, "add_special": True}
        if isinstance(body.get("model"), str):
            asked["model"] = body["model"]
        tokens = await answer("/tokenize", asked, "tokens")
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError):
        return None
    return len(tokens) if isinstance(tokens, list) else None


# What vLLM's `POST /tokenize` takes of a chat request to render its prompt as the chat
# completion will (its TokenizeChatRequest; older versions ignore `tools`).
_VLLM_COUNT_FIELDS = ("model", "messages", "tools", "chat_template_kwargs")
