"""Storage faults, in process: an fsync error makes the gateway answer 503 `storage_unavailable`,
never a false 200; nothing is acknowledged or left in an index; after one failed fsync the store
refuses every write (the kernel may have dropped the dirty pages) until the gateway restarts."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.exceptions import StorageError
from gateway.store.jsonl import JsonlStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings
from tests.e2e.reliability.conftest import index_ids, response_records

CID = "durable"


async def chat(client: httpx.AsyncClient, text: str, *, stream: bool = False) -> httpx.Response:
    body = {
        "model": "mock/m",
        "messages": [{"role": "user", "content": text}],
        "conversation_id": CID,
        "stream": stream,
    }
    return await client.post("/v1/chat/completions", json=body)


def failing_on(folder: str, real: Callable[[int], None]) -> Callable[[int], None]:
    """fdatasync that fails with EIO for files under logs/{folder}/ (the journal's: the one
    fdatasync a turn waits for; forgotten.jsonl, which deletions sync, is there too)."""

    def sync(fd: int) -> None:
        if f"/logs/{folder}/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    return sync


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "storage_unavailable" and error["type"] == "server_error"
    assert set(error) == {"message", "type", "param", "code"}


def last_record(tmp_path: Path, rid: str) -> dict[str, Any]:
    return response_records(tmp_path / "var", rid)[-1]


async def test_fsync_error_is_503_and_nothing_is_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JsonlStore(tmp_path / "var")
    upstream = MockUpstream()
    async with build_client(make_settings(tmp_path), store, upstream) as client:
        first = await chat(client, "Hello, my name is Ada.")
        assert first.status_code == 200
        acked = [first.json()["id"]]
        monkeypatch.setattr(os, "fdatasync", failing_on("journal", os.fdatasync))
        r = await chat(client, "I like trains.")
        assert_unavailable(r)
        rid = r.headers["x-response-id"]
        assert index_ids(tmp_path / "var", CID) == acked  # an index line already written is taken back
        final = last_record(tmp_path, rid)
        assert final["type"] == "incomplete" and final["reason"] == "storage_error"
        # Sticky: even with the disk "back", this process acknowledges nothing more, and asks
        # the provider nothing (an answer nobody could keep), writes nothing, and is not ready.
        monkeypatch.undo()
        calls = len(upstream.requests)
        logs = sorted((tmp_path / "var" / "logs" / "responses").iterdir())
        again = await chat(client, "I like trains.")
        assert_unavailable(again)
        assert "restart" in again.json()["error"]["message"]
        assert len(upstream.requests) == calls
        assert sorted((tmp_path / "var" / "logs" / "responses").iterdir()) == logs
        assert index_ids(tmp_path / "var", CID) == acked
        meta = await client.post(f"/v1/conversations/{CID}", json={"metadata": {"k": "v"}})
        assert_unavailable(meta)
        assert_unavailable(await client.delete(f"/v1/conversations/{CID}"))
        with pytest.raises(StorageError):
            await store.fork(CID, "branch", acked[0])
        assert not (tmp_path / "var" / "logs" / "conversations" / "branch.jsonl").exists()
        assert index_ids(tmp_path / "var", CID) == acked
        client._transport.app.state.ready = True  # type: ignore[attr-defined] # lifespan ran
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["status"] == "storage_unavailable"

    # A restarted gateway (a fresh store) works, and the history is only what was acknowledged.
    upstream = MockUpstream()
    async with build_client(make_settings(tmp_path), JsonlStore(tmp_path / "var"), upstream) as client:
        r = await chat(client, "What is my name?")
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "Your name is Ada."
        users = [m["content"] for m in upstream.requests[-1]["messages"] if m["role"] == "user"]
        assert users == ["Hello, my name is Ada.", "What is my name?"]


async def test_fsync_error_on_a_stream_is_an_in_band_error_without_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with build_client(make_settings(tmp_path), JsonlStore(tmp_path / "var"), MockUpstream()) as client:
        monkeypatch.setattr(os, "fdatasync", failing_on("journal", os.fdatasync))
        r = await chat(client, "Hello, my name is Ada.", stream=True)
    # The 200 and the text went out before the commit; the commit's failure ends the stream
    # with an error event and no [DONE], which the SDK raises.
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "storage_unavailable"
    assert index_ids(tmp_path / "var", CID) == []
    assert last_record(tmp_path, r.headers["x-response-id"])["type"] == "incomplete"


async def test_write_error_is_503_and_not_sticky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed write (disk full) is refused too, but unlike a failed fsync it leaves no doubt
    about what is on disk: once space is back, writes are acknowledged again."""
    store = JsonlStore(tmp_path / "var")
    async with build_client(make_settings(tmp_path), store, MockUpstream()) as client:
        first = await chat(client, "Hello, my name is Ada.")
        real_write = os.write

        def full(fd: int, data: bytes) -> int:
            if data.endswith(b"\n") and len(data) < 40 and b"{" not in data:  # the index line
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", full)
        assert_unavailable(await chat(client, "I like trains."))
        monkeypatch.undo()
        assert index_ids(tmp_path / "var", CID) == [first.json()["id"]]
        ok = await chat(client, "What is my name?")
        assert ok.status_code == 200
        assert index_ids(tmp_path / "var", CID) == [first.json()["id"], ok.json()["id"]]


async def test_a_full_disk_leaves_no_empty_response_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The response file is created, then its first record does not fit: the turn is refused,
    and no empty (or torn) file is left to name a response that never was."""
    store = JsonlStore(tmp_path / "var")
    responses = tmp_path / "var" / "logs" / "responses"
    async with build_client(make_settings(tmp_path), store, MockUpstream()) as client:
        first = await chat(client, "Hello, my name is Ada.")
        real_write = os.write

        def full(fd: int, data: bytes) -> int:
            if data.startswith(b'{"type":"request"'):
                real_write(fd, data[:7])  # part of it fits
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", full)
        refused = await chat(client, "I like trains.")
        monkeypatch.undo()
        assert_unavailable(refused)
        assert sorted(p.stem for p in responses.iterdir()) == [first.json()["id"]]
        assert index_ids(tmp_path / "var", CID) == [first.json()["id"]]
        assert (await chat(client, "What is my name?")).status_code == 200


async def test_conversation_over_the_size_cap_is_a_clear_400(tmp_path: Path) -> None:
    """`storage.max_conversation_messages`: the turn that would pass the cap gets a 400
    `conversation_too_large` before the provider is called; a reset makes room again."""
    upstream = MockUpstream()
    settings = make_settings(tmp_path, max_conversation_messages=6)
    async with build_client(settings, JsonlStore(tmp_path / "var"), upstream) as client:
        for n in range(3):  # 3 turns x (user + assistant) = 6 messages
            assert (await chat(client, f"turn {n}")).status_code == 200
        calls = len(upstream.requests)
        over = await chat(client, "one more")
        assert over.status_code == 400
        error = over.json()["error"]
        assert error["code"] == "conversation_too_large" and error["param"] == "conversation_id"
        assert "6" in error["message"] and "reset" in error["message"]
        assert len(upstream.requests) == calls
        items = await client.post(
            f"/v1/conversations/{CID}/items", json={"items": [{"role": "user", "content": "x"}]}
        )
        assert items.status_code == 400 and items.json()["error"]["code"] == "conversation_too_large"
        assert len(index_ids(tmp_path / "var", CID)) == 3
        assert (await client.post(f"/v1/conversations/{CID}/reset", json={})).status_code == 200
        assert (await chat(client, "fresh start")).status_code == 200
