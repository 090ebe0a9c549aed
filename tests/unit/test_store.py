"""The store contract, run against every backend, plus the JSONL store's on-disk promises."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.exceptions import (
    ConversationBusy,
    CorruptRecord,
    GatewayError,
    InvalidRequest,
    NotFound,
    StorageError,
)
from gateway.ids import mint_response_id
from gateway.store.base import Store, Version, now
from gateway.store.jsonl import JsonlStore, parse_index, parse_jsonl
from gateway.store.jsonl.files import read_index_lines, read_records, read_turn_records
from gateway.store.memory import MemoryStore
from gateway.store.postgres import PostgresStore
from gateway.writers import writer
from tests.conftest import REPO
from tests.helpers import commit_turn, commit_with_row, reply, request_record, user
from tests.postgres.cluster import postgres_cluster  # noqa: F401 - the session's PostgreSQL, for "postgres"
from tests.views import list_conversations, load


async def make_store(kind: str, data_dir: Path) -> Store:
    store: Store = MemoryStore() if kind == "memory" else JsonlStore(data_dir)
    await store.open()
    return store


async def open_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if kind == "postgres":
        # One database for the contract suite; each test gets its own namespace (tenant) in it.
        dsn = request.getfixturevalue("postgres_cluster").contract_dsn()
        s: Store = PostgresStore(dsn, namespace=f"t{os.urandom(8).hex()}")
        await s.open()
        return s
    return await make_store(kind, tmp_path / "var")


@pytest.fixture(params=["memory", "jsonl", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    s = await open_backend(request.param, request, tmp_path)
    yield s
    await s.close()


@pytest.fixture
async def second(store: Store, tmp_path: Path) -> AsyncIterator[Store]:
    """Another instance on the same data, as another worker process or replica opens it (the
    memory store has no other process: its second instance is itself)."""
    if isinstance(store, MemoryStore):
        yield store
        return
    other: Store = (
        JsonlStore(store.root)
        if isinstance(store, JsonlStore)
        else PostgresStore(store.dsn, namespace=store.namespace)  # type: ignore[attr-defined]
    )
    await other.open()
    yield other
    await other.close()


@pytest.fixture(params=["jsonl", "postgres"])
async def durable_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """The backends that keep a bounded per-process cache of side logs."""
    s = await open_backend(request.param, request, tmp_path)
    yield s
    await s.close()


def on_index_append(
    monkeypatch: pytest.MonkeyPatch, store: JsonlStore, action: Callable[[Path], None]
) -> None:
    """Run `action` whenever the JSONL store opens an index file to append to it (after the
    response file is complete and durable, before the index names it)."""
    real_open = os.open

    def opening(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_APPEND and Path(path).parent == store.data_dir.conversations_dir:
            action(Path(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", opening)


def fail_next_commits(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the store's commits fail the way its backend fails (disk full, lost connection),
    through the steps it really takes; `monkeypatch.undo()` heals it."""
    if isinstance(store, MemoryStore):
        monkeypatch.setattr(store, "fail_commit", StorageError("injected storage failure"))
    elif isinstance(store, JsonlStore):

        def disk_full(path: Path) -> None:
            raise OSError(28, "No space left on device")

        on_index_append(monkeypatch, store, disk_full)
    else:
        assert isinstance(store, PostgresStore)

        async def connection_lost(*args: object) -> tuple[int, int]:
            raise OSError(104, "Connection reset by peer")

        monkeypatch.setattr(store.db, "append_entry", connection_lost)


# -- contract: every backend -------------------------------------------------------------------


async def test_roundtrip_start_append_commit_load(store: Store) -> None:
    assert (await load(store, "conv-1")).history == []
    r1 = await commit_turn(
        store, "conv-1", "héllo ✓", "hi there", system=[{"role": "system", "content": "S"}]
    )
    r2 = await commit_turn(store, "conv-1", "second", "ok")
    view = await load(store, "conv-1")
    assert view.system == [{"role": "system", "content": "S"}]
    assert view.history == [user("héllo ✓"), reply("hi there"), user("second"), reply("ok")]
    assert view.response_ids == [r1, r2]
    assert view.turns == 2
    assert await store.read_index("conv-1") == [r1, r2]
    records = await store.read_response(r2)
    assert [r["type"] for r in records] == ["request", "context", "response", "commit"]
    assert records[0]["input"] == [user("second")]
    assert records[2]["message"] == reply("ok")
    # Conversations are independent.
    assert (await load(store, "conv-2")).history == []


async def test_tool_calls_and_results_are_replayed_exactly(store: Store) -> None:
    calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    await commit_turn(store, "tools", "", output=calls, inputs=[user("compute")])
    await commit_turn(store, "tools", "", output=reply("It is 42."), inputs=[result])
    view = await load(store, "tools")
    assert view.history == [user("compute"), calls, result, reply("It is 42.")]


async def test_feedback_is_stored_but_not_replayed(store: Store) -> None:
    await commit_turn(store, "fb", "hi", "hello")
    fid = await commit_turn(
        store, "fb", "", output=reply("thanks!"), inputs=[user("great", is_feedback=True)]
    )
    view = await load(store, "fb")
    assert view.history == [user("hi"), reply("hello")]
    assert fid in view.response_ids
    assert (await store.read_response(fid))[0]["input"] == [user("great", is_feedback=True)]


async def test_commit_without_conversation_is_logged_but_indexed_nowhere(store: Store) -> None:
    rid = await commit_turn(store, None, "stateless")
    assert (await store.read_response(rid))[-1]["type"] == "commit"
    assert await list_conversations(store) == []


async def test_abandoned_response_never_enters_index_or_view(store: Store) -> None:
    kept = await commit_turn(store, "conv", "first", "one")
    rid = mint_response_id("test/model")
    log = store.start(rid, request_record(rid, "conv", [user("doomed")]))
    log.append({"type": "context", "stored_messages": 2, "sent_messages": 3})
    await log.abandon("error", {"message": "upstream timed out", "type": "upstream_error"})
    records = await store.read_response(rid)
    assert records[0]["type"] == "request"
    assert records[-1] == {
        "type": "incomplete",
        "reason": "error",
        "error": {"message": "upstream timed out", "type": "upstream_error"},
    }
    assert await store.read_index("conv") == [kept]
    view = await load(store, "conv")
    assert view.response_ids == [kept]
    assert view.history == [user("first"), reply("one")]


async def test_abandoned_first_turn_creates_no_conversation(store: Store) -> None:
    rid = mint_response_id("test/model")
    log = store.start(rid, request_record(rid, "never", [user("doomed")]))
    await log.abandon("cancelled")
    with pytest.raises(NotFound):
        await store.read_index("never")
    assert (await load(store, "never")).turns == 0
    assert await list_conversations(store) == []


async def test_abandon_after_commit_does_not_uncommit(store: Store, request: pytest.FixtureRequest) -> None:
    rid = mint_response_id("test/model")
    log = store.start(rid, request_record(rid, "conv", [user("q")]))
    log.append({"type": "response", "message": reply("a"), "finish_reason": "stop", "usage": None})
    await log.commit("conv")
    await log.abandon("cancelled")
    assert (await store.read_response(rid))[-1]["type"] == "commit"
    assert (await load(store, "conv")).response_ids == [rid]


async def test_failed_commit_adds_nothing(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = await commit_turn(store, "conv", "first", "one")
    await load(store, "conv")  # warm any cache
    fail_next_commits(store, monkeypatch)
    with pytest.raises(StorageError):
        await commit_turn(store, "conv", "lost")
    monkeypatch.undo()
    assert await store.read_index("conv") == [kept]
    assert (await load(store, "conv")).response_ids == [kept]
    later = await commit_turn(store, "conv", "after", "two")
    view = await load(store, "conv")
    assert view.response_ids == [kept, later]
    assert view.history == [user("first"), reply("one"), user("after"), reply("two")]


async def test_markers_and_turns_share_one_ordered_index(store: Store) -> None:
    """A marker creates the conversation, is durable, and sits in the index in append order;
    each append moves the version on, and a reader at `before` sees exactly the new entry."""
    created = {"type": "conversation", "created_at": now(), "metadata": {"k": "v"}}
    first = await store.append_marker("marked", created)
    rid = await commit_turn(store, "marked", "hello")
    reset = {"type": "reset", "at": now(), "keep_system_message": True}
    last = await store.append_marker("marked", reset)
    index = await store.read_index("marked")
    assert [e if isinstance(e, str) else e["type"] for e in index] == ["conversation", rid, "reset"]
    assert index[0] == created and index[2] == reset
    assert last.after.position > last.before.position > first.after.position > first.before.position
    whole = await store.read_conversation("marked")
    assert whole.restarted and whole.version == last.after
    assert [(e.response_id, e.marker) for e in whole.entries] == [(None, created), (rid, None), (None, reset)]
    tail = await store.read_conversation("marked", after=last.before)
    assert not tail.restarted and [e.marker for e in tail.entries] == [reset]
    unchanged = await store.read_conversation("marked", after=last.after)
    assert unchanged.entries == [] and not unchanged.restarted and unchanged.version == last.after
    view = await load(store, "marked")
    assert view.metadata == {"k": "v"} and view.history == []  # the reset cleared the turn


async def test_the_index_alone_and_the_turns_it_names_read_apart(store: Store) -> None:
    """`read_entries` gives what `read_conversation` gives, at the same version, without having
    to read every response; `read_turns` gives the named responses' records, in the order
    asked, context snapshots left out (as `read_conversation` gives them; empty if missing)."""
    await store.append_marker("split", {"type": "conversation", "created_at": now(), "metadata": {}})
    rids = [await commit_turn(store, "split", f"turn {n}") for n in range(3)]
    whole = await store.read_conversation("split")
    alone = await store.read_entries("split")
    assert alone.version == whole.version
    assert alone.entries == [e.marker if e.marker is not None else e.response_id for e in whole.entries]
    assert alone.entries == await store.read_index("split")
    missing = mint_response_id("test/model")
    turns = await store.read_turns([rids[2], missing, rids[0]])
    assert turns == [whole.entries[3].records, [], whole.entries[1].records]
    assert [r["type"] for r in turns[0]] == ["request", "response", "commit"]
    assert (await store.read_entries("nothing-here")).version is None


async def test_a_replaced_index_restarts_its_readers(store: Store) -> None:
    await commit_turn(store, "again", "one")
    seen = (await store.read_conversation("again")).version
    assert await store.delete_conversation("again")
    assert (await store.read_conversation("again", after=seen)).version is None  # gone
    rid = await commit_turn(store, "again", "two")
    fresh = await store.read_conversation("again", after=seen)
    assert fresh.restarted and [e.response_id for e in fresh.entries] == [rid]


async def test_fork_copies_the_prefix_and_then_goes_its_own_way(store: Store) -> None:
    r1 = await commit_turn(store, "trunk", "one")
    await store.append_marker("trunk", {"type": "metadata", "at": now(), "metadata": {"a": "b"}})
    r2 = await commit_turn(store, "trunk", "two")
    branch = f"trunk.fork-{os.urandom(6).hex()}"
    await store.fork("trunk", branch, r1)
    assert await store.read_index(branch) == [r1]
    r3 = await commit_turn(store, branch, "three")
    assert (await load(store, branch)).response_ids == [r1, r3]
    assert (await load(store, "trunk")).response_ids == [r1, r2]  # the source is untouched
    with pytest.raises(NotFound):
        await store.fork("trunk", f"trunk.fork-{os.urandom(6).hex()}", r3)  # not in the source
    with pytest.raises(NotFound):
        await store.fork("no-such-trunk", f"x.fork-{os.urandom(6).hex()}", r1)


async def test_a_tombstone_ends_the_log_and_the_index_keeps_its_name(store: Store) -> None:
    kept = await commit_turn(store, "tomb", "one")
    gone = await commit_turn(store, "tomb", "two")
    await store.tombstone(gone)
    records = await store.read_response(gone)
    assert [r["type"] for r in records][-2:] == ["commit", "deleted"]
    assert (await store.read_response(kept))[-1]["type"] == "commit"
    assert await store.read_index("tomb") == [kept, gone]  # the service adds the marker
    with pytest.raises(NotFound):
        await store.tombstone(mint_response_id("test/model"))


@pytest.mark.parametrize("archive", [False, True])
async def test_delete_takes_the_index_its_responses_and_side_logs(store: Store, archive: bool) -> None:
    rid = await commit_turn(store, "doomed", "one")
    other = await commit_turn(store, "spared", "two")
    for cid in ("doomed", "spared"):
        await store.append_side("summaries", cid, {"type": "summary", "version": 1})
        await store.append_side("lifecycle", cid, {"state": "processed", "at": 1.0})
    for response in (rid, other):  # metadata set on a stored chat completion
        await store.append_side("metadata", response, {"metadata": {"k": "v"}, "at": 1.0})
    assert await store.delete_conversation("doomed", archive=archive)
    assert not await store.delete_conversation("doomed", archive=archive)  # once only
    with pytest.raises(NotFound):
        await store.read_index("doomed")
    with pytest.raises(NotFound):
        await store.read_response(rid)
    assert await store.read_side("summaries", "doomed") == []
    assert await store.read_side("lifecycle", "doomed") == []
    assert await store.read_sides("metadata", [rid, other]) == [[], [{"metadata": {"k": "v"}, "at": 1.0}]]
    assert [cid for cid, _ in await store.conversation_ids()] == ["spared"]
    assert await store.read_index("spared") == [other]
    assert await store.read_side("summaries", "spared") == [{"type": "summary", "version": 1}]


@pytest.mark.parametrize("archive", [False, True])
async def test_the_metadata_of_a_response_a_fork_still_names_stays(store: Store, archive: bool) -> None:
    shared = await commit_turn(store, "trunk", "one")
    own = await commit_turn(store, "trunk", "two")
    await store.fork("trunk", "trunk.fork-0123456789ab", shared)
    record = {"metadata": {"k": "v"}, "at": 1.0}
    for rid in (shared, own):
        await store.append_side("metadata", rid, record)
    assert await store.delete_conversation("trunk", archive=archive)
    assert await store.read_sides("metadata", [shared, own]) == [[record], []]


async def test_side_logs_are_kept_per_kind_and_key_in_order(store: Store) -> None:
    await store.append_side("users", "u1", {"conversation_id": "a", "at": 1.0})
    await store.append_side("users", "u1", {"conversation_id": "b", "at": 2.0})
    await store.append_side("users", "u2", {"conversation_id": "c", "at": 3.0})
    await store.append_side("digests", "u1", {"summary": "s", "at": 4.0})
    await store.append_side("models", "mmock--m", {"ratio": 1.1, "nested": {"x": [1, "é"]}})
    assert [r["conversation_id"] for r in await store.read_side("users", "u1")] == ["a", "b"]
    assert await store.read_side("users", "u2") == [{"conversation_id": "c", "at": 3.0}]
    assert await store.read_side("digests", "u1") == [{"summary": "s", "at": 4.0}]
    assert await store.read_side("models", "mmock--m") == [{"ratio": 1.1, "nested": {"x": [1, "é"]}}]
    assert await store.read_side("digests", "nobody") == []


async def test_commits_enter_the_index_in_commit_order(store: Store) -> None:
    """The stale-commit rule, for every backend: a response enters the index when it commits,
    after whatever is there by then (a log started earlier but committed later comes later),
    and nothing already there is lost. Refusing a commit built on a view that changed under a
    held lock is the PostgreSQL store's extra (its advisory lock can be lost with its session:
    tests/postgres), and the services never commit without the lock."""
    slow = mint_response_id("test/model")
    log = store.start(slow, request_record(slow, "order", [user("slow")]))
    log.append({"type": "response", "message": reply("late"), "finish_reason": "stop", "usage": None})
    fast = await commit_turn(store, "order", "fast")
    await log.commit("order")
    assert await store.read_index("order") == [fast, slow]
    assert [m["content"] for m in (await load(store, "order")).history] == [
        "fast",
        "re: fast",
        "slow",
        "late",
    ]


async def test_unknown_ids_are_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.read_index("no-such-conversation")
    with pytest.raises(NotFound):
        await store.read_response(mint_response_id("test/model"))


async def test_list_conversations_most_recent_first(store: Store) -> None:
    assert await list_conversations(store) == []
    await commit_turn(store, "alpha", "a1")
    await asyncio.sleep(0.03)  # file mtimes have jiffy resolution
    await commit_turn(store, "beta", "b1")
    await asyncio.sleep(0.03)
    await commit_turn(store, "gamma", "g1")
    await asyncio.sleep(0.03)
    await commit_turn(store, "alpha", "a2")
    listed = await list_conversations(store)
    assert [s.conversation_id for s in listed] == ["alpha", "gamma", "beta"]
    alpha = listed[0]
    assert (alpha.turns, alpha.messages) == (2, 4)
    assert listed[0].last_activity >= listed[1].last_activity >= listed[2].last_activity


async def test_list_pages_newest_first_with_a_cursor(store: Store, second: Store) -> None:
    """`list_conversations`: keyset pages, newest change first, `after` a conversation id; what
    one instance (process, replica) writes, another lists."""
    assert await store.list_conversations(5) == ([], False)
    for cid in ("c1", "c2", "c3", "c4", "c5"):
        await commit_turn(store, cid, "hi")
        await asyncio.sleep(0.02)  # beyond the file system's timestamp granularity (a few ms)
    await commit_turn(store, "c2", "again")  # a change moves it to the front
    page, more = await second.list_conversations(2)
    assert [cid for cid, _ in page] == ["c2", "c5"] and more
    assert page[0][1] >= page[1][1]
    page, more = await second.list_conversations(2, after="c5")
    assert [cid for cid, _ in page] == ["c4", "c3"] and more
    page, more = await second.list_conversations(2, after="c3")
    assert [cid for cid, _ in page] == ["c1"] and not more
    assert await second.list_conversations(2, after="c1") == ([], False)
    with pytest.raises(NotFound):
        await second.list_conversations(2, after="no-such-conversation")
    await store.delete_conversation("c5")
    await store.fork("c4", "c4.fork-0123456789ab", (await store.read_index("c4"))[0])  # type: ignore[arg-type]
    page, more = await second.list_conversations(10)
    assert [cid for cid, _ in page] == ["c4.fork-0123456789ab", "c2", "c4", "c3", "c1"] and not more
    assert [cid for cid, _ in await second.conversation_ids()] == [cid for cid, _ in page]


async def logged(
    store: Store,
    cid: str | None,
    created: float,
    *,
    model: str = "test/model",
    end: str = "commit",
    **extra: Any,
) -> str:
    """A response log whose request was made at `created` (`extra`: more request fields), ended
    with `end`: commit, incomplete, or none (still under way)."""
    rid = mint_response_id(model)
    request = {**request_record(rid, cid, [user("hi")]), "created": created, "model": model, **extra}
    log = store.start(rid, request)
    log.append({"type": "context", "stored_messages": 0, "sent_messages": 1})
    log.meanwhile()
    if end == "commit":
        log.append({"type": "response", "message": reply("hello"), "finish_reason": "stop", "usage": None})
        await log.commit(cid)
    elif end == "incomplete":
        await log.abandon("upstream_error")
    return rid


async def test_list_responses_by_request_time_api_and_model(store: Store, second: Store) -> None:
    """`list_responses`: the committed responses not deleted of one API (and model), in the
    order of their request's time, ties by id, keyset pages both ways, `after` any response
    with a request (a deleted one too); what one instance writes another lists."""
    t = 1_700_000_000.0
    a = await logged(store, "conv", t + 1, model="m1")
    b = await logged(store, "conv", t + 2, model="m2")
    b2 = await logged(store, None, t + 2, model="m1")  # stateless, at the same time as b
    await logged(store, "conv", t + 3, responses={"instructions": None})  # a Responses API turn
    message = await logged(store, "conv", t + 3.5, api="messages")  # an Anthropic Messages turn
    items = await logged(store, "conv", t + 4, kind="items")  # items added to a conversation
    await logged(store, "conv", t + 5, end="incomplete")  # failed
    under_way = await logged(store, "conv", t + 6, end="")
    gone = await logged(store, "conv", t + 7)
    await store.tombstone(gone)
    last = await logged(store, None, t + 8, model="m2")
    chat = sorted([(t + 1, a), (t + 2, b), (t + 2, b2), (t + 8, last)])
    ids = [rid for _, rid in chat]
    for s in (store, second):
        assert await s.list_responses(10, api="chat") == (ids, False)
        assert await s.list_responses(10, api="chat", descending=True) == (ids[::-1], False)
        assert await s.list_responses(2, api="chat") == (ids[:2], True)
        assert await s.list_responses(2, api="chat", after=ids[1]) == (ids[2:], False)
        assert await s.list_responses(1, api="chat", after=ids[2], descending=True) == ([ids[1]], True)
        assert await s.list_responses(10, api="chat", model="m2") == ([b, last], False)
        assert await s.list_responses(10, api="chat", model="m2", descending=True) == ([last, b], False)
        assert await s.list_responses(10, api="chat", model="none") == ([], False)
        assert await s.list_responses(10, api="items") == ([items], False)
        assert len((await s.list_responses(10, api="responses"))[0]) == 1
        assert await s.list_responses(10, api="messages") == ([message], False)
        # A cursor deleted since, failed, or of another API keeps its place.
        assert await s.list_responses(10, api="chat", after=gone) == ([last], False)
        before = await s.list_responses(10, api="chat", after=under_way, descending=True)
        assert before == (ids[:3][::-1], False)
        assert await s.list_responses(10, api="chat", after=ids[-1]) == ([], False)
        for unknown in (mint_response_id("test/model"), "not a response id", "../etc"):
            with pytest.raises(NotFound):
                await s.list_responses(10, api="chat", after=unknown)
    later = await logged(second, "conv", t + 9)
    assert await store.list_responses(10, api="chat", after=last) == ([later], False)
    assert await store.delete_conversation("conv")
    assert await second.list_responses(10, api="chat") == ([b2, last], False)
    with pytest.raises(NotFound):
        await store.list_responses(10, api="chat", after=a)


async def test_exists_follows_creation_and_deletion(store: Store, second: Store) -> None:
    assert not await store.exists("maybe")
    await store.append_marker("maybe", {"type": "conversation", "created_at": 1, "metadata": {}})
    assert await second.exists("maybe")
    await store.delete_conversation("maybe")
    assert not await second.exists("maybe")


async def test_read_many_is_read_conversation_of_each(store: Store, second: Store) -> None:
    """A page's conversations and lifecycle logs read in one go, each after its own version."""
    await commit_turn(store, "m1", "one")
    await store.append_marker("m2", {"type": "conversation", "created_at": 1, "metadata": {"k": "v"}})
    await store.append_side("lifecycle", "m1", {"state": "processed", "at": 1.0})
    v1 = (await second.read_conversation("m1")).version
    await commit_turn(store, "m1", "two")
    await store.delete_conversation("m2")
    await store.append_marker("m2", {"type": "conversation", "created_at": 2, "metadata": {}})
    wanted = [("m1", v1), ("m1", None), ("m2", Version("stale", 1)), ("nobody", None)]
    reads = await second.read_many(wanted)
    singles = [await second.read_conversation(cid, after) for cid, after in wanted]
    assert reads == singles
    assert [len(r.entries) for r in reads] == [1, 2, 1, 0] and reads[3].version is None
    assert reads[2].restarted and reads[2].entries[0].marker == {
        "type": "conversation",
        "created_at": 2,
        "metadata": {},
    }
    assert await second.read_sides("lifecycle", ["m1", "m2"]) == [[{"state": "processed", "at": 1.0}], []]


async def test_lock_serializes_second_acquirer_waits(store: Store) -> None:
    events: list[str] = []

    async def second() -> None:
        async with store.lock("conv", timeout=5):
            events.append("second acquired")

    async with store.lock("conv", timeout=5):
        task = asyncio.create_task(second())
        await asyncio.sleep(0.1)
        assert not task.done()
        events.append("first released")
    await asyncio.wait_for(task, 5)
    assert events == ["first released", "second acquired"]


async def test_lock_times_out_with_conversation_busy(store: Store) -> None:
    async with store.lock("conv", timeout=5):
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ConversationBusy):
            async with store.lock("conv", timeout=0.1):
                pytest.fail("acquired a held lock")
        assert 0.05 <= loop.time() - started < 2
        # Other conversations are not blocked.
        async with store.lock("other", timeout=0.5):
            pass
    # The timed-out waiter left nothing behind: the lock is free again.
    async with store.lock("conv", timeout=0.5):
        pass


async def test_lock_admits_waiters_in_arrival_order(store: Store) -> None:
    order: list[int] = []

    async def waiter(i: int) -> None:
        async with store.lock("conv", timeout=5):
            order.append(i)

    async with store.lock("conv", timeout=5):
        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(0.01)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2, 3]


# -- JSONL: on-disk layout ----------------------------------------------------------------------


async def test_jsonl_file_layout_is_plain_json(jstore: JsonlStore, tmp_path: Path) -> None:
    r1 = await commit_turn(jstore, "my-conv_1.x", "hi", "hello")
    r2 = await commit_turn(jstore, "my-conv_1.x", "again", "sure")
    data = tmp_path / "var"
    index = data / "logs" / "conversations" / "my-conv_1.x.jsonl"
    assert index.read_text(encoding="utf-8") == f"{r1}\n{r2}\n"
    for rid, text in ((r1, "hi"), (r2, "again")):
        path = data / "logs" / "responses" / f"{rid}.jsonl"
        raw = path.read_text(encoding="utf-8")
        assert raw.endswith("\n")
        records = [json.loads(line) for line in raw.splitlines()]
        assert [r["type"] for r in records] == ["request", "context", "response", "commit"]
        assert records[0]["response_id"] == rid
        assert records[0]["input"] == [user(text)]
        assert records[-1]["status"] == "complete"
    assert sorted(p.name for p in (data / "logs" / "responses").iterdir()) == sorted(
        [f"{r1}.jsonl", f"{r2}.jsonl"]
    )


async def test_jsonl_list_survives_a_stray_file(jstore: JsonlStore, tmp_path: Path) -> None:
    await commit_turn(jstore, "real", "hi")
    stray = tmp_path / "var" / "logs" / "conversations" / "real.jsonl~"
    stray.write_bytes(b"junk\n")
    assert [s.conversation_id for s in await list_conversations(jstore)] == ["real"]


async def test_jsonl_list_skips_files_that_are_not_conversation_ids(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    await commit_turn(jstore, "real", "hi")
    conversations = tmp_path / "var" / "logs" / "conversations"
    (conversations / "copy of real.jsonl").write_bytes(b"")
    (conversations / ".hidden.jsonl").write_bytes(b"")
    assert [s.conversation_id for s in await list_conversations(jstore)] == ["real"]


# -- JSONL: torn writes -------------------------------------------------------------------------


@pytest.mark.parametrize("torn", [b"test-model-0123", b'{"type": "res', b"\xff\xfe"])
@pytest.mark.parametrize("warm_cache", [False, True])
async def test_torn_index_line_is_ignored_and_repaired(
    jstore: JsonlStore, tmp_path: Path, torn: bytes, warm_cache: bool
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    if warm_cache:
        await load(jstore, "conv")
    index = tmp_path / "var" / "logs" / "conversations" / "conv.jsonl"
    with open(index, "ab") as f:
        f.write(torn)  # a crash in the middle of an index append
    assert await jstore.read_index("conv") == [r1]
    assert index.read_bytes().endswith(torn)  # reading alone does not write
    store = jstore if warm_cache else JsonlStore(tmp_path / "var")
    view = await load(store, "conv")
    assert view.response_ids == [r1]
    assert index.read_bytes().endswith(torn)  # a reader without the lock never repairs
    async with store.lock("conv", timeout=1):
        view = await load(store, "conv")  # the lock's holder does (as every turn does first)
    assert view.response_ids == [r1]
    assert index.read_bytes() == f"{r1}\n".encode()  # repaired
    r2 = await commit_turn(store, "conv", "two")
    assert index.read_bytes() == f"{r1}\n{r2}\n".encode()
    assert (await load(JsonlStore(tmp_path / "var"), "conv")).response_ids == [r1, r2]


@pytest.mark.parametrize("cut", [1, 10])
async def test_torn_response_file_is_not_committed(jstore: JsonlStore, tmp_path: Path, cut: int) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    r2 = await commit_turn(jstore, "conv", "two")
    path = tmp_path / "var" / "logs" / "responses" / f"{r2}.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[:-cut])  # the commit record was torn by a crash
    fresh = JsonlStore(tmp_path / "var")
    view = await load(fresh, "conv")
    assert view.response_ids == [r1]
    assert view.history == [user("one"), reply("re: one")]
    assert [r["type"] for r in await fresh.read_response(r2)] == ["request", "context", "response"]


async def test_a_torn_last_line_is_cut_on_read_once_nothing_can_be_writing_it(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    """SPEC 6: a torn last line is tolerated and repaired on read. A response log's is cut when
    the log has ended (nothing is written after its commit) or its writer process is gone; an
    attempt in progress is only read around (the "torn" line may be its write under way)."""
    responses = tmp_path / "var" / "logs" / "responses"
    torn = b'{"type":"incomplete","rea'
    ended = await commit_turn(jstore, "conv", "one")
    whole = (responses / f"{ended}.jsonl").read_bytes()
    with open(responses / f"{ended}.jsonl", "ab") as f:
        f.write(torn)
    assert [r["type"] for r in await jstore.read_response(ended)][-1] == "commit"
    assert (responses / f"{ended}.jsonl").read_bytes() == whole  # repaired: jq reads it again

    def attempt(writer_name: str) -> Path:
        rid = mint_response_id("test/model")
        log = jstore.start(rid, {**request_record(rid, "conv", [user("q")]), "writer": writer_name})
        log.append({"type": "context", "messages": [user("q")]})
        log.meanwhile()
        with open(responses / f"{rid}.jsonl", "ab") as f:
            f.write(torn)
        return responses / f"{rid}.jsonl"

    in_progress = attempt(writer())  # this process: it may still be writing
    assert [r["type"] for r in await jstore.read_response(in_progress.stem)] == ["request", "context"]
    assert in_progress.read_bytes().endswith(torn)
    dead = attempt(f"{socket.gethostname()}/999999999/1")  # a process that is gone
    assert [r["type"] for r in await jstore.read_response(dead.stem)] == ["request", "context"]
    assert dead.read_bytes().endswith(b'"context","messages":[{"role":"user","content":"q"}]}\n')


async def test_an_attempt_in_flight_shows_what_was_sent(store: Store) -> None:
    """SPEC 7: the context snapshot is on record once the provider has the request, so an
    attempt in flight (or cut short by a crash) shows what was sent."""
    rid = mint_response_id("test/model")
    log = store.start(rid, request_record(rid, "conv", [user("q")]))
    log.append({"type": "context", "sent_messages": 1, "messages": [user("q")]})
    log.meanwhile()  # the provider has the request
    records: list[dict[str, Any]] = []
    for _ in range(200):  # (PostgreSQL writes it in a task of its own)
        try:
            records = await store.read_response(rid)
        except NotFound:
            records = []
        if len(records) == 2:
            break
        await asyncio.sleep(0.01)
    assert [r["type"] for r in records] == ["request", "context"]
    assert records[1]["messages"] == [user("q")]
    log.append({"type": "response", "message": reply("a"), "finish_reason": "stop", "usage": None})
    await log.commit("conv")
    assert [r["type"] for r in await store.read_response(rid)] == ["request", "context", "response", "commit"]
    assert (await load(store, "conv")).history == [user("q"), reply("a")]


# -- JSONL: the ordering rule ---------------------------------------------------------------------


async def test_response_is_durable_before_index_names_it(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    seen: list[dict[str, list[str]]] = []
    responses = tmp_path / "var" / "logs" / "responses"

    def observe(index: Path) -> None:
        # At this moment the new response file must already be complete on disk...
        named = index.read_text().split()
        seen.append(
            {
                path.stem: [json.loads(line)["type"] for line in path.read_text().splitlines()]
                for path in responses.glob("*.jsonl")
                if path.stem not in named  # ... and the index must not name it yet.
            }
        )

    on_index_append(monkeypatch, jstore, observe)
    r2 = await commit_turn(jstore, "conv", "two")
    assert seen == [{r2: ["request", "context", "response", "commit"]}]
    assert await jstore.read_index("conv") == [r1, r2]


async def test_failure_before_index_append_leaves_the_response_unindexed_and_marked_failed(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its log was left ending with its commit: the turn the client was told failed read back
    as a completed response (GET /v1/responses, the stored chat completions)."""
    r1 = await commit_turn(jstore, "conv", "one")
    await load(jstore, "conv")

    def boom(index: Path) -> None:
        raise OSError(5, "Input/output error")

    on_index_append(monkeypatch, jstore, boom)
    with pytest.raises(StorageError):
        await commit_turn(jstore, "conv", "two")
    monkeypatch.undo()
    (r2,) = [p.stem for p in (tmp_path / "var" / "logs" / "responses").glob("*.jsonl") if p.stem != r1]
    path = tmp_path / "var" / "logs" / "responses" / f"{r2}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records[-2:]] == ["commit", "incomplete"]  # written, then failed ...
    assert records[-1]["reason"] == "storage_error"
    index = tmp_path / "var" / "logs" / "conversations" / "conv.jsonl"
    assert index.read_text() == f"{r1}\n"  # ... but never named by the index
    assert (await load(jstore, "conv")).response_ids == [r1]
    assert (await load(JsonlStore(tmp_path / "var"), "conv")).response_ids == [r1]


async def test_a_response_file_is_made_while_the_provider_works(jstore: JsonlStore, tmp_path: Path) -> None:
    """`start` writes nothing: the file and its request record are made by `meanwhile` (called
    once the provider has the request), and by a commit or an abandon that came without it."""
    responses = tmp_path / "var" / "logs" / "responses"

    def types(rid: str) -> list[str]:
        return [json.loads(line)["type"] for line in (responses / f"{rid}.jsonl").read_text().splitlines()]

    answer = {"type": "response", "message": reply("a"), "finish_reason": "stop", "usage": None}
    rid = mint_response_id("test/model")
    log = jstore.start(rid, request_record(rid, "conv", [user("q")]))
    assert not (responses / f"{rid}.jsonl").exists()
    log.meanwhile()
    assert types(rid) == ["request"]
    log.meanwhile()  # once only
    log.append(answer)
    await log.commit("conv")
    assert types(rid) == ["request", "response", "commit"]

    committed = mint_response_id("test/model")  # the conversations API: no provider call
    log = jstore.start(committed, request_record(committed, "conv", [user("q2")]))
    log.append(answer)
    await log.commit("conv")
    abandoned = mint_response_id("test/model")  # the provider failed before it had the request
    await jstore.start(abandoned, request_record(abandoned, "conv", [user("q3")])).abandon("error")
    assert types(committed) == ["request", "response", "commit"]
    assert types(abandoned) == ["request", "incomplete"]
    assert await jstore.read_index("conv") == [rid, committed]
    assert (await load(JsonlStore(tmp_path / "var"), "conv")).response_ids == [rid, committed]


# -- JSONL: several processes on one data dir ---------------------------------------------------------


async def test_second_instance_sees_commits_via_load(store: Store, second: Store) -> None:
    jstore, other = store, second
    r1 = await commit_turn(jstore, "conv", "one")
    assert (await load(other, "conv")).response_ids == [r1]  # now cached in `other`
    r2 = await commit_turn(jstore, "conv", "two")
    view = await load(other, "conv")
    assert view.response_ids == [r1, r2]
    assert view.history == [user("one"), reply("re: one"), user("two"), reply("re: two")]
    await load(jstore, "conv")
    r3 = await commit_turn(other, "conv", "three")
    assert (await load(jstore, "conv")).response_ids == [r1, r2, r3]
    assert (await load(other, "conv")).response_ids == [r1, r2, r3]
    await other.append_marker("conv", {"type": "reset", "at": now(), "keep_system_message": False})
    assert (await load(jstore, "conv")).history == []
    assert await other.delete_conversation("conv")
    assert (await store.read_conversation("conv")).version is None
    assert (await load(jstore, "conv")).turns == 0


async def test_a_new_index_at_a_reused_inode_is_not_taken_for_the_old_one(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    """Deleted files' inodes are reused: an index deleted and begun anew may sit at the inode
    a reader saw, at the same size. The reader must still read the new one afresh."""
    await commit_turn(jstore, "reborn", "old")
    seen = (await jstore.read_conversation("reborn")).version
    other = JsonlStore(tmp_path / "var")  # another process
    await other.open()
    new = await commit_turn(other, "elsewhere", "new")
    index = jstore.data_dir.index_path("reborn")
    with open(index, "r+b") as f:  # the same inode, the same size, another conversation
        f.write(new.encode() + b"\n")
    again = await jstore.read_conversation("reborn", after=seen)
    assert again.restarted and [e.response_id for e in again.entries] == [new]


async def test_second_instance_notices_a_shrunk_index(jstore: JsonlStore, tmp_path: Path) -> None:
    r1 = await commit_turn(jstore, "conv", "one")
    await commit_turn(jstore, "conv", "two")
    assert len((await load(jstore, "conv")).response_ids) == 2
    index = tmp_path / "var" / "logs" / "conversations" / "conv.jsonl"
    index.write_text(f"{r1}\n")  # e.g. an operator restored a backup
    assert (await load(jstore, "conv")).response_ids == [r1]


async def test_lock_is_shared_across_instances(store: Store, second: Store) -> None:
    jstore, other = store, second
    async with jstore.lock("conv", timeout=5):
        with pytest.raises(ConversationBusy):
            async with other.lock("conv", timeout=0.1):
                pytest.fail("two instances held one conversation")
        async with other.lock("another", timeout=0.5):
            pass
    async with other.lock("conv", timeout=0.5):
        pass


# -- JSONL: ids never escape data_dir -------------------------------------------------------------

BAD_IDS = [
    "../x",
    "..",
    ".",
    "../../etc/passwd",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "",
    "a\x00b",
    "\x00",
    ".hidden",
    "-rf",
    "x\n",
    "%2e%2e",
    "a" * 129,
    "ａｂｃ",
]


@pytest.mark.parametrize("bad", BAD_IDS)
async def test_bad_conversation_ids_are_rejected(jstore: JsonlStore, bad: str) -> None:
    with pytest.raises(InvalidRequest):
        jstore.data_dir.index_path(bad)
    with pytest.raises(InvalidRequest):
        await jstore.read_index(bad)
    with pytest.raises(InvalidRequest):
        await load(jstore, bad)


@pytest.mark.parametrize("bad", [*BAD_IDS, "..-0123456789ab", "../m-0123456789ab", "m-0123456789ab/"])
async def test_bad_response_ids_are_rejected(jstore: JsonlStore, tmp_path: Path, bad: str) -> None:
    with pytest.raises(NotFound):
        jstore.data_dir.response_path(bad)
    with pytest.raises(NotFound):
        await jstore.read_response(bad)
    with pytest.raises(GatewayError):
        jstore.start(bad, request_record(bad, None, []))
    # Nothing was created anywhere: only the folders `open()` made exist.
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "var",
        "var/locks",
        "var/logs",
        "var/logs/conversations",
        "var/logs/responses",
        "var/logs/summaries",
    ]


_ROOT = Path("/nonexistent-gateway-data")  # paths only: nothing is read or written here
_path_store = JsonlStore(_ROOT)
_id_chars = st.sampled_from(list("aZ09._-/\\\x00 %~\n") + ["..", "ａ", "é"])


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=140), st.lists(_id_chars, max_size=20).map("".join)))
def test_ids_never_produce_paths_outside_data_dir(value: str) -> None:
    for make, folder, error in (
        (_path_store.data_dir.index_path, _path_store.data_dir.conversations_dir, InvalidRequest),
        (_path_store.data_dir.response_path, _path_store.data_dir.responses_dir, NotFound),
    ):
        try:
            path = make(value)
        except error:
            continue
        assert path.parent == folder
        assert path.name == f"{value}.jsonl"
        assert not path.name.startswith(".")
        assert os.path.normpath(path) == str(path)
        assert Path(os.path.normpath(path)).is_relative_to(_ROOT)


# -- JSONL: decoding at the edge ----------------------------------------------------------------------

_line_parts = st.sampled_from(
    [
        b"{",
        b"}",
        b"[",
        b"]",
        b"\n",
        b'"',
        b":",
        b",",
        b" ",
        b"1",
        b"null",
        b"\xff",
        b"\x00",
        b"m-0123456789ab",
        b'{"type": "reset"}',
        b"[1]",
        b"\r",
        b"\\u",
        b"\xed\xa0\x80",
        b'"\\ud800"',
        b"123456789012345678901234567890",
        b"1e999",
    ]
)
_random_jsonl = st.one_of(st.binary(max_size=300), st.lists(_line_parts, max_size=30).map(b"".join))


@settings(max_examples=200, deadline=None)
@given(_random_jsonl)
def test_parsers_raise_only_corrupt_record(data: bytes) -> None:
    for parse in (parse_jsonl, parse_index):
        try:
            values, consumed = parse(data, path="x.jsonl")
        except CorruptRecord as exc:
            assert exc.path == "x.jsonl"
            assert exc.lineno >= 1
            continue
        # Only whole lines are consumed: a torn tail is left for repair.
        assert consumed == data.rfind(b"\n") + 1
        assert isinstance(values, list)


_index_lines = st.sampled_from(
    [
        b"m-0123456789ab\n",
        b"gpt-4o.mini_x-00112233aabb\n",
        b"a" * 100 + b"-0123456789ab\n",
        b"a" * 101 + b"-0123456789ab\n",  # a prefix too long
        b".m-0123456789ab\n",  # a leading dot
        b"m-0123456789AB\n",  # not lower-case hex
        b"m-0123456789a\n",
        b"-0123456789ab\n",
        b" m-0123456789ab \n",
        b"\n",
        b'{"type":"reset","at":1}\n',
        b' {"type":"metadata","metadata":{"k":"v"}}\n',
        b"{not json\n",
        b"[1]\n",
        b"m-0123456789ab",  # a torn last line
        b"m\xff-0123456789ab\n",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_index_lines, max_size=12).map(b"".join))
def test_the_fast_index_reader_reads_what_parse_index_reads(data: bytes) -> None:
    """`read_index_lines` (runs of ids checked at once) gives parse_index's entries, or its
    error with the same line."""
    try:
        expected: Any = parse_index(data, path="x.jsonl")
    except CorruptRecord as exc:
        expected = (exc.path, exc.lineno)
    try:
        got: Any = read_index_lines(data, path="x.jsonl")
    except CorruptRecord as exc:
        got = (exc.path, exc.lineno)
    assert got == expected


@pytest.mark.parametrize(
    "shape", ["big context", "refit", "big reply", "big request", "tombstoned", "small", "torn", "no context"]
)
def test_a_turn_read_from_its_head_and_tail_is_the_whole_log_without_context(
    shape: str, tmp_path: Path
) -> None:
    """`read_turn_records` skips the context snapshot by reading around it; every other shape
    is read whole: the records are those of read_records(skip_context=True)."""
    big = "x" * 40_000
    request = {"type": "request", "input": [user(big if shape == "big request" else "hi")]}
    context = {"type": "context", "messages": [user(big if shape != "small" else "s")]}
    response = {"type": "response", "message": reply(big if shape == "big reply" else "ok")}
    records: list[dict[str, Any]] = [request, context]
    records += [context] if shape == "refit" else []
    records += [response, {"type": "commit"}]
    if shape == "no context":
        records = [request, {"type": "note", "pad": big}, response, {"type": "commit"}]
    if shape == "tombstoned":
        records.append({"type": "deleted", "at": 1.0})
    data = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)
    if shape == "torn":
        data += b'{"type":"dele'
    path = tmp_path / "r.jsonl"
    path.write_bytes(data)
    expected = read_records(path, "r.jsonl", skip_context=True)
    assert read_turn_records(path, "r.jsonl") == expected
    assert all(r["type"] != "context" for r in expected) and expected[0] == request


def test_parsers_reject_deep_nesting_as_corrupt() -> None:
    deep = b"[" * 5000 + b"]" * 5000 + b"\n"
    with pytest.raises(CorruptRecord):
        parse_jsonl(deep)
    with pytest.raises(CorruptRecord):
        parse_index(b"{" + b'"a":' * 3000 + b"1" + b"}" * 3000 + b"\n")


def test_parse_index_reports_line_numbers() -> None:
    data = b'm-0123456789ab\n\n{"type": "reset"}\nnot an id\n'
    with pytest.raises(CorruptRecord) as info:
        parse_index(data, path="conv.jsonl")
    assert info.value.lineno == 4
    assert info.value.path == "conv.jsonl"
    entries, consumed = parse_index(data[: data.index(b"not")])
    assert entries == ["m-0123456789ab", {"type": "reset"}]
    assert consumed == data.index(b"not")


def test_parse_jsonl_reports_line_numbers_and_keeps_torn_tail() -> None:
    values, consumed = parse_jsonl(b'{"a": 1}\n[2]\n{"torn', start_line=1)
    assert values == [{"a": 1}, [2]]
    assert consumed == len(b'{"a": 1}\n[2]\n')
    with pytest.raises(CorruptRecord) as info:
        parse_jsonl(b'{"a": 1}\n{oops}\n', path="r.jsonl", start_line=10)
    assert info.value.lineno == 11


async def test_commit_after_an_unseen_append_does_not_corrupt_the_cache(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    """If another writer appended between our load and our commit, our cached view must not
    silently skip its turn: the cache is dropped and rebuilt from disk."""
    other = JsonlStore(tmp_path / "var")
    await other.open()
    r1 = await commit_turn(jstore, "conv", "one")
    await load(jstore, "conv")
    r2 = await commit_turn(other, "conv", "two")  # jstore has not seen this
    r3 = await commit_turn(jstore, "conv", "three")
    view = await load(jstore, "conv")
    assert view.response_ids == [r1, r2, r3]
    assert [m["content"] for m in view.history if m["role"] == "user"] == ["one", "two", "three"]


async def test_side_log_cache_is_bounded(durable_store: Store) -> None:
    """Reading a side log of every conversation must not grow the per-process cache with the
    number of conversations ever seen; what scans read (`keep=False`: the processor's pass and
    the lists read every conversation's lifecycle log) is not added to it at all."""
    store = durable_store
    cache = store._side  # type: ignore[attr-defined]
    cache.limit = limit = 20
    for n in range(limit + 5):
        await store.append_side("summaries", f"conv-{n}", {"type": "summary", "at": float(n)})
        assert await store.read_side("summaries", f"conv-{n}") == [{"type": "summary", "at": float(n)}]
        await store.append_side("lifecycle", f"conv-{n}", {"state": "active", "at": float(n)})
        lifecycle = await store.read_side("lifecycle", f"conv-{n}", keep=False)
        assert lifecycle == [{"state": "active", "at": float(n)}]
    assert len(cache) == limit
    assert not any(kind == "lifecycle" for kind, _ in cache)
    # An evicted entry is read again, correctly, from storage.
    assert await store.read_side("summaries", "conv-0") == [{"type": "summary", "at": 0.0}]


@pytest.mark.parametrize("archive", [False, True])
async def test_deleting_a_conversation_keeps_what_its_forks_share(store: Store, archive: bool) -> None:
    """A fork shares its prefix's responses with its source. Deleting either one must not take
    the other's history with it."""
    source = "family"
    r1 = await commit_turn(store, source, "one")
    r2 = await commit_turn(store, source, "two")
    fork = f"{source}.fork-{os.urandom(6).hex()}"
    await store.fork(source, fork, r1)
    r3 = await commit_turn(store, fork, "three")
    await commit_turn(store, source, "four")

    assert await store.delete_conversation(source, archive=archive)
    view = await load(store, fork)
    assert view.response_ids == [r1, r3]
    assert [m["content"] for m in view.history if m["role"] == "user"] == ["one", "three"]
    assert await store.read_response(r1)
    with pytest.raises(NotFound):
        await store.read_response(r2)  # the source's own turns went with it

    again = f"{fork[:100]}.fork-{os.urandom(6).hex()}"
    await store.fork(fork, again, r1)
    assert await store.delete_conversation(fork, archive=archive)
    assert (await load(store, again)).response_ids == [r1]
    assert await store.read_response(r1)
    with pytest.raises(NotFound):
        await store.read_response(r3)


# -- JSONL: every OS failure is a StorageError (a 503), never a crash -------------------------------
def _break(path: Path) -> None:
    """Make a folder unusable even for root: a file where the folder was (ENOTDIR)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a folder")


JSONL_OPERATIONS = {
    "start+commit": lambda s, rid: commit_turn(s, "conv", "again"),
    "read_conversation": lambda s, rid: s.read_conversation("conv"),
    "read_index": lambda s, rid: s.read_index("conv"),
    "read_response": lambda s, rid: s.read_response(rid),
    "append_marker": lambda s, rid: s.append_marker(
        "conv", {"type": "metadata", "at": now(), "metadata": {}}
    ),
    "tombstone": lambda s, rid: s.tombstone(rid),
    "fork": lambda s, rid: s.fork("conv", "conv.fork-0123456789ab", rid),
    "delete": lambda s, rid: s.delete_conversation("conv"),
    "archive": lambda s, rid: s.delete_conversation("conv", archive=True),
    "append_side": lambda s, rid: s.append_side("lifecycle", "conv", {"state": "active"}),
    "read_side": lambda s, rid: s.read_side("summaries", "conv"),
    "conversation_ids": lambda s, rid: s.conversation_ids(),
    "list_conversations": lambda s, rid: s.list_conversations(20),
    "exists": lambda s, rid: s.exists("conv"),
}
BROKEN_FOLDERS = {
    "responses": ("logs", "responses"),
    "conversations": ("logs", "conversations"),
    "side logs": ("logs", "summaries"),
    "archive": ("archive",),
}


@pytest.mark.parametrize("folder", BROKEN_FOLDERS, ids=list(BROKEN_FOLDERS))
async def test_os_failures_are_storage_errors_without_paths(
    jstore: JsonlStore, tmp_path: Path, folder: str
) -> None:
    """Whatever the OS refuses (here ENOTDIR: a folder replaced by a file, which stops root too),
    each store operation fails with StorageError (503 storage_unavailable), or succeeds when it
    does not touch that folder; nothing else escapes, and no message shows a server path."""
    rid = await commit_turn(jstore, "conv", "one")
    await jstore.append_side("summaries", "conv", {"type": "summary", "version": 1})
    _break(tmp_path.joinpath("var", *BROKEN_FOLDERS[folder]))
    for name, operation in JSONL_OPERATIONS.items():
        fresh = JsonlStore(tmp_path / "var")  # no cache to answer from
        try:
            await operation(fresh, rid)
        except (StorageError, NotFound) as exc:
            assert str(tmp_path) not in exc.message, (name, exc.message)
        except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
            raise AssertionError(f"{name} with broken {folder}: {type(exc).__name__}: {exc}") from exc


# A waiter in another process (another worker, another replica): it asks for the conversation,
# reports when it has it, holds it a moment.
_OTHER_PROCESS = """
import asyncio, sys, time
from gateway.store.jsonl import JsonlStore
from gateway.store.postgres import PostgresStore

from gateway.store.jsonl.locks import CrossProcessLock
from gateway.store.postgres.backend import SharedBackend

def in_line(real):  # says when this process's waiter stands in line (once)
    def wrapped(*args):
        result = real(*args)
        if not getattr(wrapped, "said", False):
            wrapped.said = True
            print("in line", flush=True)
        return result
    return wrapped

async def stand(self, line, real=SharedBackend.stand_in_line):
    await real(self, line)
    print("in line", flush=True)

CrossProcessLock.wait_in_line = in_line(CrossProcessLock.wait_in_line)
SharedBackend.stand_in_line = stand

async def main():
    kind, where, namespace = sys.argv[1:4]
    store = JsonlStore(where) if kind == "jsonl" else PostgresStore(where, namespace=namespace)
    await store.open()
    async with store.lock("conv", timeout=10):
        print("acquired", time.monotonic(), flush=True)
        await asyncio.sleep(0.2)
    await store.close()

asyncio.run(main())
"""


async def test_a_waiter_in_another_process_keeps_its_place_in_line(durable_store: Store) -> None:
    """SPEC 5.1: serialized in arrival order, also across worker processes and replicas. A
    request that arrives in this process after another process's waiter must not take the
    conversation first when it is released (this process's own queue used to hand it over at
    once, while the other process was polling)."""
    import subprocess
    import sys
    import time

    store = durable_store  # (the memory store has no other process)
    if isinstance(store, JsonlStore):
        args = ["jsonl", str(store.root), ""]
    else:
        args = ["postgres", store.dsn, store.namespace]  # type: ignore[attr-defined]
    other = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OTHER_PROCESS, *args, cwd=REPO, stdout=subprocess.PIPE
    )
    assert other.stdout is not None
    try:
        async with store.lock("conv", timeout=30):
            # the other process's waiter stands in line (and polls)
            assert (await asyncio.wait_for(other.stdout.readline(), 30)).strip() == b"in line"

            async def later() -> float:
                async with store.lock("conv", timeout=10):
                    return time.monotonic()

            mine = asyncio.create_task(later())  # arrives after the other process's waiter
            await asyncio.sleep(0.05)
        line = (await asyncio.wait_for(other.stdout.readline(), 30)).split()
        assert line[0] == b"acquired"
        acquired_later = await asyncio.wait_for(mine, 10)
        assert float(line[1]) < acquired_later, "the later arrival took the conversation first"
    finally:
        if other.returncode is None:
            other.kill()
        await other.wait()


async def test_a_waiter_queued_behind_its_own_process_keeps_its_place_too(durable_store: Store) -> None:
    """A request queued behind another turn of its own process stands in line at once: when the
    conversation is released, another process's later waiter must not slip in before it (even
    while this process is too busy to run the queued request at once)."""
    import subprocess
    import sys
    import time

    store = durable_store
    if isinstance(store, JsonlStore):
        args = ["jsonl", str(store.root), ""]
    else:
        args = ["postgres", store.dsn, store.namespace]  # type: ignore[attr-defined]

    async def queued() -> float:
        async with store.lock("conv", timeout=30):
            return time.monotonic()

    other = None
    try:
        async with store.lock("conv", timeout=30):
            mine = asyncio.create_task(queued())  # behind this turn, in this process
            await asyncio.sleep(0.1)
            other = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _OTHER_PROCESS, *args, cwd=REPO, stdout=subprocess.PIPE
            )
            assert other.stdout is not None
            assert (await asyncio.wait_for(other.stdout.readline(), 30)).strip() == b"in line"
        time.sleep(0.3)  # released, and this process is busy: the queued request cannot run yet
        acquired_here = await asyncio.wait_for(mine, 10)
        line = (await asyncio.wait_for(other.stdout.readline(), 30)).split()
        assert line[0] == b"acquired"
        assert acquired_here < float(line[1]), "the other process's later waiter went first"
    finally:
        if other is not None:
            if other.returncode is None:
                other.kill()
            await other.wait()


# -- list rows: kept with the append that describes them, handed out only for that version ------


async def row_of(store: Store, cid: str) -> Any:
    page, _ = await store.list_rows(20)
    return next(listed.row for listed in page if listed.conversation_id == cid)


async def test_a_list_row_is_handed_out_only_for_its_version(store: Store, second: Store) -> None:
    await store.append_marker("c", {"type": "conversation", "created_at": 1, "metadata": {}}, {"n": 0})
    await store.list_rows(20)  # (a JSONL data dir gets its catalog at its first list)
    await commit_with_row(store, "c", {"n": 1})
    assert await row_of(store, "c") == {"n": 1}
    assert await row_of(second, "c") == {"n": 1}  # another process (or replica) reads it too
    await store.append_marker("c", {"type": "metadata", "metadata": {"k": "v"}, "at": now()})
    assert await row_of(store, "c") is None and await row_of(second, "c") is None  # a change without one
    await store.append_marker("c", {"type": "metadata", "metadata": {}, "at": now()}, {"n": 2})
    assert await row_of(second, "c") == {"n": 2}
    [listed], _ = await store.list_rows(1)
    await commit_with_row(store, "c", None)  # moved on since that version was listed
    await store.keep_rows([("c", listed.version, {"n": 3})])  # type: ignore[list-item]
    assert await row_of(second, "c") is None  # a row for another version is never handed out
    [listed], _ = await second.list_rows(1)
    assert listed.version is not None
    await second.keep_rows([("c", listed.version, {"n": 4})])
    assert await row_of(store, "c") == {"n": 4} and await row_of(second, "c") == {"n": 4}
    assert await store.delete_conversation("c")
    await commit_with_row(store, "c", None)  # begun anew: nothing of the old one
    assert await row_of(second, "c") is None


@pytest.mark.parametrize("skip_context", [False, True])
def test_a_damaged_line_after_a_context_line_is_named_by_its_own_number(
    tmp_path: Path, skip_context: bool
) -> None:
    """Read without its context lines (as history is rebuilt), a response log named a damaged
    line after one by the line number it had with them left out: `:2` for its third line."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(
        b'{"type":"request","input":[]}\n{"type":"context","messages":[]}\n{"type":"response", broken\n'
    )
    with pytest.raises(CorruptRecord) as raised:
        read_records(path, "logs/responses/r.jsonl", skip_context=skip_context)
    assert (raised.value.path, raised.value.lineno) == ("logs/responses/r.jsonl", 3)
