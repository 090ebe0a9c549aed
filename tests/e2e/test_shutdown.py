"""SIGTERM with requests still in flight: those that finish within `server.shutdown_timeout`
are answered and recorded; those that outlive it get 503 `shutting_down` in OpenAI's error shape
(in-band for a stream that has begun), never a bare 500, and nothing enters history."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import GatewayProcess, write_config
from tests.mockserver import MockServer


def test_requests_that_outlive_the_shutdown_get_503_shutting_down(
    tmp_path: Path, upstream: MockServer
) -> None:
    config = write_config(tmp_path / "g.toml", upstream.url)
    config.write_text(
        config.read_text().replace("[storage]\n", '[server]\nshutdown_timeout = "1s"\n\n[storage]\n')
    )
    gw = GatewayProcess(config, tmp_path / "var").start()
    upstream.mode, upstream.hang_seconds = "stall", 4.0  # answers hang; a stream after its first chunk
    got: dict[str, Any] = {}

    def whole() -> None:
        body = {"model": "mock/m", "conversation_id": "sd-1", "messages": [{"role": "user", "content": "hi"}]}
        got["whole"] = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=20)

    def stream() -> None:
        body = {
            "model": "mock/m",
            "conversation_id": "sd-2",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=20) as r:
            got["stream_headers"] = r.headers
            got["stream"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(upstream.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # the stream's first chunk is through
        assert gw.proc is not None
        began = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(timeout=15)
        stopped = time.monotonic() - began
        for t in threads:
            t.join(timeout=15)
    finally:
        gw.stop()
    assert stopped < 5, stopped  # the drain (1 s), then the cancelled requests' answers

    whole_reply = got["whole"]
    assert whole_reply.status_code == 503, whole_reply.text
    error = whole_reply.json()["error"]
    assert error["code"] == "shutting_down" and set(error) == {"message", "type", "param", "code"}
    assert whole_reply.headers["x-response-id"].startswith("mock-m-")

    events = got["stream"]
    assert json.loads(events[0])["choices"], events  # the first chunk reached the client
    assert json.loads(events[-1])["error"]["code"] == "shutting_down" and "[DONE]" not in events

    conversations = tmp_path / "var" / "logs" / "conversations"
    assert not any(p.read_text().strip() for p in conversations.glob("*.jsonl"))  # nothing acknowledged
    lines = [
        json.loads(line) for line in gw.log().splitlines() if line.startswith('{"event":"chat.completion"')
    ]
    assert sorted(line["status"] for line in lines) == [200, 503]  # the stream's headers said 200
    assert "Traceback" not in gw.log()


def test_workers_stop_when_the_serve_process_is_killed(tmp_path: Path, upstream: MockServer) -> None:
    """`serve --workers 2` killed with SIGKILL (no chance to stop its workers): the workers notice
    and stop, so the port is free for the restart instead of held by orphans."""
    import os

    config = write_config(tmp_path / "g.toml", upstream.url)
    gw = GatewayProcess(config, tmp_path / "var", workers=2).start()
    assert gw.proc is not None
    try:
        supervisor = gw.proc.pid

        workers = _children(supervisor)
        assert len(workers) >= 2, workers
        os.kill(supervisor, signal.SIGKILL)
        gw.proc.wait(timeout=10)
        assert _running_after(workers, 15) == [], "workers kept serving after their supervisor was killed"
        again = GatewayProcess(config, tmp_path / "var")
        again.start()  # a fresh serve (any free port) on the same data dir
        again.stop()
    finally:
        gw.stop(signal.SIGKILL)


def test_workers_that_start_after_their_serve_process_died_stop_too(
    tmp_path: Path, upstream: MockServer
) -> None:
    """A worker still starting when its `serve` process is killed finds itself an orphan at
    once (its parent is no longer the pid it was given) and stops."""
    import os

    config = write_config(tmp_path / "g.toml", upstream.url)
    gw = GatewayProcess(config, tmp_path / "var", workers=2).spawn()
    assert gw.proc is not None
    proc = gw.proc
    try:
        deadline = time.monotonic() + 20
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:  # spawned, not yet serving
            time.sleep(0.02)
            workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _running_after(workers, 20) == [], "workers that started after their serve died kept running"
    finally:
        gw.stop(signal.SIGKILL)


def _running_after(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running (not zombies) after up to `seconds`."""
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
    return alive


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.append(int(entry.name))
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_an_attempt_whose_process_was_killed_reads_as_incomplete(
    tmp_path: Path, upstream: MockServer
) -> None:
    """SPEC 5.1: a failed attempt stays in its response log, marked incomplete. A process killed
    mid-request cannot write that mark; its request record names the process, so once that
    process is gone the attempt reads as failed (`interrupted`), not "in progress" for ever."""
    config = write_config(tmp_path / "g.toml", upstream.url)
    gw = GatewayProcess(config, tmp_path / "var").start()
    upstream.mode, upstream.hang_seconds = "hang", 4.0
    body = {"model": "mock/m", "conversation_id": "killed", "messages": [{"role": "user", "content": "hi"}]}
    asker = threading.Thread(
        target=lambda: _quietly(lambda: httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10))
    )
    asker.start()
    responses = tmp_path / "var" / "logs" / "responses"
    deadline = time.monotonic() + 10
    while not upstream.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    (log,) = list(responses.glob("*.jsonl"))
    gw.stop(signal.SIGKILL)
    asker.join(timeout=15)
    again = GatewayProcess(config, tmp_path / "var").start()
    try:
        r = httpx.get(f"{again.url}/v1/responses/{log.stem}")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "failed" and r.json()["error"]["code"] == "interrupted"
        assert not (tmp_path / "var" / "logs" / "conversations" / "killed.jsonl").exists()  # nothing indexed
        upstream.mode = "normal"
        live = httpx.post(f"{again.url}/v1/chat/completions", json=body, timeout=10)
        assert live.status_code == 200  # and the conversation goes on from nothing
        assert [m["content"] for m in upstream.requests[-1]["messages"]] == ["hi"]
    finally:
        again.stop()


def _quietly(call: Any) -> None:
    try:
        call()
    except httpx.HTTPError:
        pass
