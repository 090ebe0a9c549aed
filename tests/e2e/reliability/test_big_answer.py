"""A provider answering 64 MiB to `gateway serve` with the default `max_response_bytes` (32 MB):
a 502 `upstream_bad_response` whether the body declares its length, is chunked, or streams;
nothing is stored; the gateway's peak RSS stays under 300 MiB (it read at most the limit).
How long the client waits is measured by `bench/big_answer.py`, not here."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from aiohttp import web

from tests.conftest import GatewayProcess, free_port, write_config

MIB = 1024 * 1024
SIZE = 64 * MIB


async def answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    shape = body["model"]  # length, chunked or stream
    try:
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            delta = {
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": "y" * 4096}}],
            }
            line = b"data: " + orjson.dumps(delta) + b"\n\n"
            for _ in range(SIZE // len(line) + 1):
                await response.write(line)
            await response.write(b"data: [DONE]\n\n")
            return response
        head = b'{"object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"'
        tail = b'"},"finish_reason":"stop"}]}'
        headers = {"content-type": "application/json"}
        if shape == "length":
            headers["content-length"] = str(len(head) + SIZE + len(tail))
        response = web.StreamResponse(headers=headers)
        if shape == "chunked":
            response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(head)
        piece = b"y" * MIB
        for _ in range(SIZE // MIB):
            await response.write(piece)
        await response.write(tail)
        return response
    except ConnectionError:  # the gateway hung up once it had read its limit
        return web.Response()


@pytest.fixture(scope="module")
def huge_provider() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_64_mib_answer_is_a_502_with_bounded_memory(tmp_path: Path, huge_provider: str) -> None:
    config = write_config(tmp_path / "gateway.toml", huge_provider)
    text = config.read_text().replace("timeout = 5", "timeout = 60")  # the limit, not a timeout, ends it
    config.write_text(text.replace('base_url = "', 'retries = 0\nbase_url = "', 1))
    gateway = GatewayProcess(config, tmp_path / "var").start()
    try:
        assert gateway.proc is not None
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            for shape in ("length", "chunked", "stream"):
                body = {
                    "model": f"mock/{shape}",
                    "messages": [{"role": "user", "content": "hi"}],
                    "conversation_id": f"big-{shape}",
                    "stream": shape == "stream",
                }
                r = client.post("/v1/chat/completions", json=body)
                if shape == "stream":  # headers went out with the first chunk: the error is in band
                    assert r.status_code == 200
                    events = [orjson.loads(e) for e in r.text.split("data: ")[1:] if e.strip() != "[DONE]"]
                    errors = [e["error"] for e in events if "error" in e]
                    assert [e["code"] for e in errors] == ["upstream_bad_response"], r.text[-500:]
                    assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))
                else:
                    assert r.status_code == 502, r.text[:500]
                    assert r.json()["error"]["code"] == "upstream_bad_response"
                assert client.get(f"/v1/conversations/big-{shape}/items").status_code == 404
            peak = peak_rss_mib(gateway.proc.pid)
    finally:
        gateway.stop()
    assert peak < 300, f"gateway peak RSS {peak:.0f} MiB"
