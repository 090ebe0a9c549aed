"""The lifecycle pass reads the lifecycle logs of recent conversations only: one settled at an
earlier pass and unchanged since is not read again (its index is older than the pass's
watermark), so a data dir of many old conversations costs a listing, not a read of each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.context.lifecycle import PROCESSED
from tests.app.test_lifecycle import make, say


def count_reads(store: Any) -> dict[str, int]:
    reads: dict[str, int] = {}
    original = store.read_side

    async def read_side(kind: str, key: str, **options: Any) -> Any:
        if kind == "lifecycle":
            reads[key] = reads.get(key, 0) + 1
        return await original(kind, key, **options)

    store.read_side = read_side
    return reads


async def test_settled_conversations_are_not_read_again_until_they_change(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path)
    processor = app.state.processor
    for cid in ("a", "b", "c"):
        await say(client, cid, f"my name is {cid}")
    await client.post("/v1/conversations", json={"id": "empty"})  # no turn: nothing to process
    clock.offset = 61
    await processor.run_once()
    for cid in ("a", "b", "c"):
        assert (await processor.state_of("", cid)).state == PROCESSED
    reads = count_reads(store)
    for _ in range(3):
        await processor.run_once()
    assert reads == {}  # all settled (or with nothing to do), none read again
    clock.offset = 62
    await say(client, "b", "hello again")  # b changes: read, and processed again once idle
    clock.stamp(store, "b")
    clock.offset = 124
    await processor.run_once()
    assert reads == {"b": 2}  # the pass's check, then the visit's
    await processor.run_once()
    assert reads == {"b": 2}
    assert (await processor.state_of("", "b")).state == PROCESSED
    await client.aclose()


async def test_an_unsettled_conversation_holds_the_watermark_back(tmp_path: Path) -> None:
    app, store, clock, model, client = await make(tmp_path)
    processor = app.state.processor
    await say(client, "failing", "my name is F")
    model.fail = True  # post-processing fails: active again, retried idle_after later
    clock.offset = 61
    await processor.run_once()
    reads = count_reads(store)
    clock.offset += 60
    await processor.run_once()
    assert reads.get("failing", 0) >= 1
    state = await processor.state_of("", "failing")
    assert state.attempts == 2
    await client.aclose()


async def test_a_pass_over_idle_conversations_adds_nothing_to_the_caches(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path)
    processor = app.state.processor
    for n in range(20):
        await say(client, f"idle-{n}", f"my name is N{n}")
    views = app.state.services.cache._views
    views.clear()  # long idle: no longer cached
    store._side.clear()
    clock.offset = 61
    await processor.run_once()
    for n in range(20):
        assert (await processor.state_of("", f"idle-{n}")).state == PROCESSED
    assert len(views) == 0 and len(store._side) == 0  # read, processed, and not kept
    await client.aclose()
