"""The lock discipline, one race at a time, each made deterministic with a hook at the moment the
race needs (docs/architecture.md, "Locks").

1. A reader without the lock never cuts a "torn" index line: it may be an append in progress.
2. `previous_response_id` is checked against the conversation's newest response under the lock
   the turn then holds: a turn landing meanwhile cannot slip in between.
3. TTL expiry decides again under the lock: a turn landing after the decision is not archived.
4. Cross-process locks are per conversation: an unrelated conversation never waits.
5. A tenant's store is opened once, however many first requests arrive together.
"""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path
from typing import Any

import pytest

from gateway.api.validation import parse_chat
from gateway.exceptions import ConversationBusy
from gateway.services.requests import ChatRequest
from gateway.services.turns import ChatService
from gateway.store import StoreRegistry
from gateway.store.jsonl import JsonlStore
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.app.test_lifecycle import make, say
from tests.conftest import app_of, build_client, make_settings
from tests.helpers import commit_turn
from tests.views import load


async def test_1_a_reader_without_the_lock_never_cuts_an_append_in_progress(tmp_path: Path) -> None:
    store = JsonlStore(tmp_path / "var")
    await store.open()
    await commit_turn(store, "c", "one")
    path = store.data_dir.index_path("c")
    before = path.read_bytes()
    half = b"test-model-0123"  # the first half of another writer's append, not yet finished
    with open(path, "ab") as f:
        f.write(half)
    view = await load(store, "c")  # a reader: no lock held
    assert path.read_bytes() == before + half
    assert len(view.response_ids) == 1
    # The holder of the lock may repair: a torn line it finds is a crash's, never acknowledged.
    async with store.lock("c", timeout=1):
        await load(store, "c")
    assert path.read_bytes() == before


async def test_2_previous_response_id_is_decided_under_the_turns_own_lock() -> None:
    upstream = MockUpstream()
    store = MemoryStore()
    async with build_client(make_settings(), store, upstream) as client:
        service: ChatService = app_of(client).state.service
        first = await client.post("/v1/responses", json={"model": "mock/m", "input": "my colour is blue"})
        assert first.status_code == 200, first.text
        cid = first.headers["x-conversation-id"]
        real_prepare = service.prepare

        async def prepare_after_an_intruder(request: ChatRequest, tenant: str = "") -> Any:
            # Another turn lands on the conversation after the request was read, before its turn.
            service.prepare = real_prepare  # type: ignore[method-assign]
            intruder = await real_prepare(
                parse_chat(
                    {
                        "model": "mock/m",
                        "messages": [{"role": "user", "content": "INTRUDER"}],
                        "conversation_id": cid,
                    }
                ),
                tenant,
            )
            await service.complete(intruder)
            await service.close(intruder)
            return await real_prepare(request, tenant)

        service.prepare = prepare_after_an_intruder  # type: ignore[method-assign]
        second = await client.post(
            "/v1/responses",
            json={
                "model": "mock/m",
                "input": "what is my colour?",
                "previous_response_id": first.json()["id"],
            },
        )
    assert second.status_code == 200, second.text
    sent = [m.get("content") for m in upstream.requests[-1]["messages"]]
    assert "my colour is blue" in sent and "what is my colour?" in sent
    assert "INTRUDER" not in sent  # the reply continues from the response the client named
    assert second.headers["x-conversation-id"] != cid  # on a fork made at that response


async def test_3_expiry_decides_again_under_the_lock(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path, ttl=3600.0)
    await say(client, "c", "my name is Di")
    clock.offset = 3601
    real_lock = store.lock

    def lock_after_a_turn(cid: str, timeout: float) -> Any:
        # The processor decided "expired" without the lock; a turn lands before it gets it.
        store.lock = real_lock  # type: ignore[method-assign]

        class Late:
            async def __aenter__(self) -> None:
                await say(client, "c", "still here")
                self.inner = real_lock(cid, timeout)
                await self.inner.__aenter__()

            async def __aexit__(self, *exc: Any) -> None:
                await self.inner.__aexit__(*exc)

        return Late()

    store.lock = lock_after_a_turn  # type: ignore[method-assign]
    await app.state.processor.visit("", "c")
    # The turn that landed found the conversation expired and started it afresh (expiry is
    # checked on use); the processor, deciding again under the lock, kept that fresh one.
    assert await store.exists("c")
    assert [m["content"] for m in (await load(store, "c")).history if m["role"] == "user"] == ["still here"]
    assert len(list((tmp_path / "var" / "archive").iterdir())) == 1  # only the expired one
    await client.aclose()


async def test_4_an_unrelated_conversation_never_waits_for_another_process(tmp_path: Path) -> None:
    one = JsonlStore(tmp_path / "var")
    other = JsonlStore(tmp_path / "var")  # its own file descriptors: another process to flock()
    await one.open()
    await other.open()

    def bucket(cid: str) -> int:  # the 256 shared lock files conversations used to hash onto
        return zlib.crc32(cid.encode()) % 256

    second = next(f"conv-{i}" for i in range(1, 100_000) if bucket(f"conv-{i}") == bucket("conv-0"))
    async with one.lock("conv-0", timeout=1):
        async with other.lock(second, timeout=0.2):
            pass  # not kept waiting by conv-0's turn
        with pytest.raises(ConversationBusy):
            async with other.lock("conv-0", timeout=0.2):
                pass  # the same conversation is, across processes
    async with other.lock("conv-0", timeout=1):
        pass


class SlowOpen(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.opened = 0

    async def open(self) -> None:
        self.opened += 1
        await asyncio.sleep(0.05)


async def test_5_a_store_is_opened_once_under_concurrent_first_requests() -> None:
    store = SlowOpen()
    registry = StoreRegistry(make_settings(), default=store)
    got = await asyncio.gather(*(registry.get("") for _ in range(5)))
    assert store.opened == 1 and all(s is store for s in got)


async def test_5_a_failed_open_is_tried_again_by_the_next_request(monkeypatch: pytest.MonkeyPatch) -> None:
    store = SlowOpen()
    fail = [True]

    async def open_once_failing() -> None:
        store.opened += 1
        if fail.pop(0) if fail else False:
            raise OSError("disk gone")

    monkeypatch.setattr(store, "open", open_once_failing)
    registry = StoreRegistry(make_settings(), default=store)
    with pytest.raises(OSError):
        await registry.get("")
    assert await registry.get("") is store and store.opened == 2
