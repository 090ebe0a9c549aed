"""A provider answering 64 MiB: how long the client waits for its 502 and how much memory the
gateway takes meanwhile (its peak RSS, `VmHWM`).

    .venv/bin/python -m bench.big_answer            # 64 MiB, default max_response_bytes (32 MB)
    .venv/bin/python -m bench.big_answer --mib 256

One `gateway serve` (JSONL, fsync) in front of an aiohttp provider that answers every chat
request with a body of `--mib` MiB, in three shapes: a JSON body with its Content-Length, the
same body chunked (no length: the gateway must count while reading), and an SSE stream of
4 KiB deltas, asked for with `stream: true`. A fresh gateway per shape, so each peak is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
from aiohttp import web

from .harness import write_config
from .procs import HOST, Server, clean_env, free_port

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def provider(size: int) -> web.Application:
    piece = b"y" * MIB

    async def complete(request: web.Request) -> web.StreamResponse:
        try:
            return await answer(request)
        except ConnectionError:  # the gateway hung up once it had seen enough: expected
            return web.Response()

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        shape = body["model"]  # length, chunked or stream (client headers are not forwarded)
        if body.get("stream"):
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            delta = {
                "id": "x",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": "y" * 4096}}],
            }
            line = b"data: " + orjson.dumps(delta) + b"\n\n"
            for _ in range(size // len(line) + 1):
                await response.write(line)
            await response.write(b"data: [DONE]\n\n")
            return response
        head = (
            b'{"id":"x","object":"chat.completion","model":"m","choices":'
            b'[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"'
        )
        tail = b'"}}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
        length = len(head) + size + len(tail)
        headers = {"content-type": "application/json"}
        if shape == "length":
            headers["content-length"] = str(length)
        response = web.StreamResponse(headers=headers)
        if shape != "length":
            response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(head)
        for _ in range(size // MIB):
            await response.write(piece)
        await response.write(tail)
        return response

    app = web.Application(client_max_size=MIB)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


async def one(shape: str, size: int, tmp: Path, upstream_port: int) -> dict[str, object]:
    port = free_port()
    sections = {
        "server": {"host": HOST, "port": port},
        "storage": {"data_dir": str(tmp / shape)},
        "providers.big": {"kind": "openai", "base_url": f"http://{HOST}:{upstream_port}/v1", "retries": 0},
    }
    config = write_config(tmp / f"{shape}.toml", "big", sections)
    server = Server(
        shape,
        [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
        port,
        tmp / f"{shape}.log",
        clean_env(),
    )
    server.start(REPO)
    try:
        await asyncio.to_thread(server.wait_ready, "/readyz", 60)
        before = peak_kib(server.pid)
        body = {
            "model": shape,
            "messages": [{"role": "user", "content": "hi"}],
            "conversation_id": f"big-{shape}",
            "stream": shape == "stream",
        }
        started = time.perf_counter()
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(
                f"http://{HOST}:{port}/v1/chat/completions", json=body, headers={"x-shape": shape}
            )
        seconds = time.perf_counter() - started
        text = r.text
        if shape == "stream":  # the error comes in band, after whatever was relayed
            events = [json.loads(e) for e in text.split("data: ")[1:] if e.strip() != "[DONE]"]
            error = next(e["error"] for e in events if "error" in e)
            relayed = sum(len(c["delta"].get("content") or "") for e in events for c in e.get("choices", []))
        else:
            error, relayed = json.loads(text)["error"], 0
        return {
            "shape": shape,
            "status": r.status_code,
            "code": error.get("code"),
            "seconds": round(seconds, 2),
            "relayed_mib": round(relayed / MIB, 1),
            "peak_rss_mib_before": round(before / 1024, 1),
            "peak_rss_mib": round(peak_kib(server.pid) / 1024, 1),
        }
    finally:
        server.stop()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    runner = web.AppRunner(provider(args.mib * MIB))
    await runner.setup()
    upstream_port = free_port()
    await web.TCPSite(runner, HOST, upstream_port).start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for shape in ("length", "chunked", "stream"):
                rows.append(await one(shape, args.mib * MIB, Path(tmp), upstream_port))
    finally:
        await runner.cleanup()
    print(f"provider answer of {args.mib} MiB, default max_response_bytes")
    print("| shape | status | error code | relayed first | client waited | gateway peak RSS (before) |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['shape']} | {row['status']} | {row['code']} | {row['relayed_mib']} MiB "
            f"| {row['seconds']} s "
            f"| {row['peak_rss_mib']} MiB ({row['peak_rss_mib_before']}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
