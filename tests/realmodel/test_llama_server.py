"""The harness itself: the llama server runs the model with a 512-token context and rejects
prompts that do not fit with llama.cpp's own error."""

from __future__ import annotations

import httpx

from tests.realmodel.llama import LlamaServer


def test_llama_server_serves_the_model(llama: LlamaServer) -> None:
    props = httpx.get(f"{llama.url}/props", timeout=10).json()
    assert props["default_generation_settings"]["n_ctx"] == 512 == llama.n_ctx

    r = httpx.post(
        f"{llama.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0

    too_long = " ".join(["word"] * 700)
    r = httpx.post(
        f"{llama.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": too_long}], "max_tokens": 8},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert isinstance(error["n_ctx"], int) and error["n_ctx"] == 512
