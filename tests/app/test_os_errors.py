"""What the OS refuses reaches clients as 503 storage_unavailable, whatever the code path:
a store that raises a bare OSError (EMFILE, EACCES) still gives the OpenAI-shaped 503."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from gateway.store.base import IndexRead, Version
from gateway.store.jsonl import JsonlStore
from gateway.store.memory import MemoryStore
from gateway.types import Record
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings


class RefusingStore(MemoryStore):
    """A store whose reads hit the OS's limits."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        raise OSError(self.code, "refused")

    async def read_entries(self, conversation_id: str) -> IndexRead:
        raise OSError(self.code, "refused")

    async def read_index(self, conversation_id: str) -> list[str | Record]:
        raise OSError(self.code, "refused")


@pytest.mark.parametrize("code", [errno.EMFILE, errno.EACCES, errno.EIO])
async def test_a_bare_os_error_is_a_503_in_openai_shape(code: int) -> None:
    store = RefusingStore(code)
    async with build_client(make_settings(), store, MockUpstream()) as client:
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "mock/m", "conversation_id": "c", "messages": [{"role": "user", "content": "hi"}]},
        )
        items = await client.get("/v1/conversations/c/items")
    for r in (chat, items):
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "storage_unavailable" and error["type"]
        assert "refused" in error["message"] or "system" in error["message"]


async def test_a_corrupt_record_is_a_503_naming_the_file_and_line_not_the_server_path(tmp_path: Path) -> None:
    """A line in the middle of a response log that cannot be decoded: every reader says which
    file and line (relative to the data dir), as a 503, and never shows where the data dir is."""
    settings = make_settings(tmp_path, durability="none")
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    async with build_client(settings, store, MockUpstream()) as client:
        body = {"model": "mock/m", "conversation_id": "bad", "messages": [{"role": "user", "content": "hi"}]}
        first = (await client.post("/v1/chat/completions", json=body)).json()["id"]
        path = tmp_path / "var" / "logs" / "responses" / f"{first}.jsonl"
        lines = path.read_bytes().split(b"\n")
        lines[1] = b'{"type": "context", oops'
        path.write_bytes(b"\n".join(lines))
        fresh = JsonlStore(tmp_path / "var", durability="none")  # no cached view to answer from
        await fresh.open()
    async with build_client(settings, fresh, MockUpstream()) as client:
        replies = [
            await client.get(f"/v1/responses/{first}"),
            await client.post("/v1/chat/completions", json=body),
            await client.get("/v1/conversations/bad/items"),
        ]
    for r in replies:
        assert r.status_code == 503, (r.request.url, r.text)
        message = r.json()["error"]["message"]
        assert f"logs/responses/{first}.jsonl:2" in message, message
        assert str(tmp_path) not in message


async def test_an_attempt_the_full_disk_kept_from_marking_is_marked_once_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the provider answers: the client gets 503, and even the log's
    `incomplete` ending cannot be written. Once writes succeed again (the readiness probe, or
    the next commit), that ending is written: the response reads as failed, not in progress."""
    import gateway.store.jsonl.files as files_module
    import gateway.store.jsonl.log as log_module

    settings = make_settings(tmp_path, durability="none")
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    real_write_all, real_pwrite = log_module.write_all, files_module.os.pwrite
    full = [True]

    def write_all(fd: int, data: bytes) -> None:
        if full[0] and b'"type":"response"' in data:  # the disk fills half-way through
            real_write_all(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "short write")
        real_write_all(fd, data)

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(log_module, "write_all", write_all)
    monkeypatch.setattr(files_module.os, "pwrite", pwrite)
    body = {"model": "mock/m", "conversation_id": "full", "messages": [{"role": "user", "content": "hi"}]}
    async with build_client(settings, store, MockUpstream()) as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503, r.text
        rid = r.headers["x-response-id"]
        assert (await client.get(f"/v1/responses/{rid}")).json()["status"] == "in_progress"
        full[0] = False  # space again
        assert await app_of(client).state.services.readiness() is None  # (what /readyz asks)
        answer = (await client.get(f"/v1/responses/{rid}")).json()
        assert answer["status"] == "failed", answer
        lines = (tmp_path / "var" / "logs" / "responses" / f"{rid}.jsonl").read_text().splitlines()
        assert '"storage_error"' in lines[-1]
        # none torn (the context snapshot was on file from when the provider got the request)
        assert [json.loads(line)["type"] for line in lines] == ["request", "context", "incomplete"]
        assert (await client.get("/v1/conversations/full/items")).status_code == 404  # no turn


async def test_too_little_space_for_the_journal_is_not_ready_and_a_failed_journal_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With less than the journal's 2 MiB free, /readyz said ready while the first turn got a
    503, and the half-zeroed journal it left took the rest of the disk."""
    import gateway.store.jsonl.journal as journal_module
    import gateway.store.jsonl.store as store_module

    settings = make_settings(tmp_path)
    store = JsonlStore(tmp_path / "var")
    await store.open()
    real_statvfs, real_zero = store_module.os.statvfs, journal_module.zero

    class Tight:
        def __init__(self, stat: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = stat.f_frsize, (1 << 20) // stat.f_frsize  # 1 MiB free

    def zero(fd: int, start: int, end: int) -> None:
        real_zero(fd, start, start + (end - start) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.os, "statvfs", lambda path: Tight(real_statvfs(path)))
    monkeypatch.setattr(journal_module, "zero", zero)
    body = {"model": "mock/m", "conversation_id": "tight", "messages": [{"role": "user", "content": "hi"}]}
    async with build_client(settings, store, MockUpstream()) as client:
        services = app_of(client).state.services
        reason = await services.readiness()  # (what /readyz asks)
        assert reason is not None and "journal" in str(reason), reason
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 503
        assert list((tmp_path / "var" / "logs" / "journal").glob("*.wal")) == []  # nothing kept
        monkeypatch.setattr(store_module.os, "statvfs", real_statvfs)
        monkeypatch.setattr(journal_module, "zero", real_zero)
        services._probed_at = None  # (probes are at most every few seconds)
        assert await services.readiness() is None
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


async def test_a_folder_turns_write_to_replaced_by_a_file_is_not_ready_until_it_is_back(
    tmp_path: Path,
) -> None:
    """The probe file is made in the locks folder: with `logs` replaced by a file, /readyz said
    ready while every turn got a 503."""
    store = JsonlStore(tmp_path / "var")
    await store.open()
    body = {"model": "mock/m", "conversation_id": "gone", "messages": [{"role": "user", "content": "hi"}]}
    logs = tmp_path / "var" / "logs"
    async with build_client(make_settings(tmp_path), store, MockUpstream()) as client:
        services = app_of(client).state.services
        assert await services.readiness() is None
        logs.rename(tmp_path / "logs.away")
        logs.write_text("")
        services._probed_at = None  # (probes are at most every few seconds)
        reason = await services.readiness()
        assert reason is not None and "responses" in str(reason), reason
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 503
        logs.unlink()
        (tmp_path / "logs.away").rename(logs)
        services._probed_at = None
        assert await services.readiness() is None
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
