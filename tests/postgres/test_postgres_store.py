"""What only the PostgreSQL store has to prove: migrations, exact records, several replicas (two
stores with their own pools and lock sessions stand in for two processes), cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from gateway.exceptions import ConversationBusy, InvalidRequest, NotFound, StorageError
from gateway.store.postgres import SCHEMA_VERSION, PostgresStore, migrate
from gateway.store.postgres.schema import map_errors, responses_walk
from tests.helpers import commit_turn, reply, request_record, user
from tests.views import load


def replica_dsn(dsn: str, name: str) -> str:
    """The same database under another DSN string: a separate pool and lock session."""
    return f"{dsn}?application_name={name}"


@pytest.fixture
async def replicas(pg_dsn: str) -> AsyncIterator[tuple[PostgresStore, PostgresStore]]:
    a, b = PostgresStore(replica_dsn(pg_dsn, "a")), PostgresStore(replica_dsn(pg_dsn, "b"))
    await asyncio.gather(a.open(), b.open())  # two replicas migrating at once
    yield a, b
    await a.close()
    await b.close()


async def server_state(dsn: str) -> tuple[int, int]:
    """(sessions idle in a transaction, advisory locks held) across the database."""
    conn = await asyncpg.connect(dsn)
    try:
        idle = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
        )
        locks = await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return int(idle), int(locks)
    finally:
        await conn.close()


async def test_migrations_are_versioned_and_idempotent(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await migrate(conn) == SCHEMA_VERSION
        assert await migrate(conn) == SCHEMA_VERSION  # again: nothing to do, no error
        versions = await conn.fetch("SELECT version FROM gateway_schema ORDER BY version")
        assert [r["version"] for r in versions] == list(range(1, SCHEMA_VERSION + 1))
        await conn.execute("INSERT INTO gateway_schema (version) VALUES ($1)", SCHEMA_VERSION + 1)
    finally:
        await conn.close()
    newer = PostgresStore(pg_dsn)
    with pytest.raises(Exception, match="newer than this gateway"):
        await newer.open()


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("after", [False, True])
async def test_a_page_of_responses_is_a_walk_of_their_created_index(
    pg_store: PostgresStore, pg_dsn: str, after: bool, descending: bool
) -> None:
    """Each walk of the listing is an ordered scan of `gateway_responses_created` (its key
    written as the index's expression) that stops at its LIMIT: never a sort of every request."""
    for n in range(300):
        await commit_turn(pg_store, f"c{n % 5}", "hi")
    args: list[object] = ["", 21, *([2e9 if descending else 0.0, ""] if after else [])]
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("ANALYZE")
        sql = responses_walk(after=after, descending=descending)
        plan = "\n".join(row[0] for row in await conn.fetch(f"EXPLAIN ANALYZE {sql}", *args))
        assert len(await conn.fetch(sql, *args)) == 21
    finally:
        await conn.close()
    assert "Index Scan" in plan and "gateway_responses_created" in plan and "Sort" not in plan, plan
    assert "Seq Scan" not in plan, plan
    assert "rows=21 loops=1" in plan.splitlines()[1], plan


async def test_a_page_walks_on_past_what_it_leaves_out(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page is filled from as many walks as it takes (here of 3 rows: `limit` is 1)."""
    import gateway.store.postgres.store as module

    monkeypatch.setattr(module, "WALK_BATCH", 3)
    wanted = []
    for n in range(12):
        rid = await commit_turn(pg_store, "c", f"{n}")
        if n % 4 == 3:
            wanted.append(rid)
        else:
            await pg_store.tombstone(rid)
    pages, after = [], None
    while True:
        page, more = await pg_store.list_responses(1, api="chat", after=after)
        pages += page
        if not more:
            break
        after = page[-1]
    assert pages == wanted
    assert (await pg_store.list_responses(2, api="chat", descending=True))[0] == wanted[::-1][:2]


async def test_a_request_holding_a_nul_character_is_stored_and_not_listed(pg_store: PostgresStore) -> None:
    """PostgreSQL's json operators refuse text holding `\\u0000`, which `json` keeps: the index of
    request times must not fail such a turn's insert; it is left out of lists (and read by id)."""
    listed = await commit_turn(pg_store, "c", "plain")
    nul = await commit_turn(pg_store, "c", "a\x00b")
    assert (await pg_store.read_response(nul))[0]["input"] == [user("a\x00b")]
    assert await pg_store.list_responses(10, api="chat") == ([listed], False)
    with pytest.raises(NotFound):
        await pg_store.list_responses(10, api="chat", after=nul)


async def test_records_round_trip_exactly(pg_store: PostgresStore) -> None:
    """Key order, NUL characters and odd numbers come back as they went in (json, not jsonb)."""
    rid = await commit_turn(pg_store, "c", "nul \u0000 and ✓", "ok")
    log_rid = "m-0123456789ab"
    log = pg_store.start(log_rid, {"type": "request", "zeta": 1, "alpha": {"b": 2, "a": 1.5e300}, "n": 2**63})
    log.append({"type": "response", "message": reply("x"), "finish_reason": "stop"})
    await log.abandon("cancelled")
    records = await pg_store.read_response(log_rid)
    assert [list(r) for r in records][0] == ["type", "zeta", "alpha", "n"]
    assert records[0]["alpha"] == {"b": 2, "a": 1.5e300} and records[0]["n"] == 2**63
    assert (await pg_store.read_response(rid))[0]["input"] == [user("nul \u0000 and ✓")]


async def test_a_turn_written_by_one_replica_is_read_by_the_other(
    replicas: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = replicas
    r1 = await commit_turn(a, "conv", "one")
    assert (await load(b, "conv")).response_ids == [r1]  # now cached in b
    r2 = await commit_turn(a, "conv", "two")
    await a.append_marker("conv", {"type": "metadata", "metadata": {"k": "v"}, "at": 1.0})
    view = await load(b, "conv")  # revalidated by last seq: sees the turn and the marker
    assert view.response_ids == [r1, r2] and view.metadata == {"k": "v"}
    r3 = await commit_turn(b, "conv", "three")
    assert (await load(a, "conv")).response_ids == [r1, r2, r3]
    # Deleted and started anew on one replica: the other's cache must not survive it, even
    # when the new conversation reaches the same length.
    async with a.lock("conv", timeout=5):
        assert await a.delete_conversation("conv")
    n1 = await commit_turn(a, "conv", "new one")
    n2 = await commit_turn(a, "conv", "new two")
    n3 = await commit_turn(a, "conv", "new three")
    view = await load(b, "conv")
    assert view.response_ids == [n1, n2, n3]
    assert [m["content"] for m in view.history if m["role"] == "user"] == ["new one", "new two", "new three"]


async def test_side_logs_seen_across_replicas_and_their_deletion_too(
    replicas: tuple[PostgresStore, PostgresStore],
) -> None:
    a, b = replicas
    await commit_turn(a, "conv", "one")
    await a.append_side("summaries", "conv", {"type": "summary", "version": 1})
    assert [r["version"] for r in await b.read_side("summaries", "conv")] == [1]
    await a.append_side("summaries", "conv", {"type": "summary", "version": 2})
    assert [r["version"] for r in await b.read_side("summaries", "conv")] == [1, 2]
    async with a.lock("conv", timeout=5):
        await a.delete_conversation("conv")
    assert await b.read_side("summaries", "conv") == []
    await a.append_side("summaries", "conv", {"type": "summary", "version": 9})
    assert [r["version"] for r in await b.read_side("summaries", "conv")] == [9]


async def test_the_lock_is_shared_across_replicas(replicas: tuple[PostgresStore, PostgresStore]) -> None:
    a, b = replicas
    async with a.lock("conv", timeout=5):
        with pytest.raises(ConversationBusy):
            async with b.lock("conv", timeout=0.2):
                pytest.fail("two replicas held one conversation")
        async with b.lock("another", timeout=1):
            pass
    async with b.lock("conv", timeout=1):
        pass


async def test_a_turn_built_on_a_stale_history_is_refused_not_forked(
    replicas: tuple[PostgresStore, PostgresStore],
) -> None:
    """If the lock was lost (its session dropped), another replica may append meanwhile: the
    commit checks the tail it was built on and refuses (409) instead of forking the history."""
    a, b = replicas
    r1 = await commit_turn(a, "conv", "one")
    async with a.lock("conv", timeout=5):
        assert (await load(a, "conv")).response_ids == [r1]
        sneaky = await commit_turn(b, "conv", "sneaked in")  # no lock: as if a's lock was lost
        with pytest.raises(ConversationBusy, match="changed"):
            await commit_turn(a, "conv", "stale")
        with pytest.raises(ConversationBusy):
            await a.append_marker("conv", {"type": "reset", "at": 1.0})
    assert await a.read_index("conv") == [r1, sneaky]
    index = await a.read_index("conv")
    refused = [r for r in await _all_responses(a) if r not in index]
    assert len(refused) == 1
    assert (await a.read_response(refused[0]))[-1]["reason"] == "conflict"
    # Under the lock again, with a fresh load, the next turn goes through.
    async with a.lock("conv", timeout=5):
        await load(a, "conv")
        r3 = await commit_turn(a, "conv", "three")
    assert (await load(b, "conv")).response_ids == [r1, sneaky, r3]


async def _all_responses(store: PostgresStore) -> list[str]:
    rows = await store.db.fetch(
        "list", "SELECT DISTINCT response_id FROM gateway_responses WHERE namespace = $1", store.namespace
    )
    return [r["response_id"] for r in rows]


async def test_cancellation_leaves_no_transaction_and_no_lock_behind(
    pg_dsn: str, pg_store: PostgresStore
) -> None:
    """Requests cancelled while waiting for the lock, while holding it, and in the middle of a
    commit: afterwards no pooled session is mid-transaction and no advisory lock is held."""
    await commit_turn(pg_store, "conv", "one")

    async def hold_forever() -> None:
        async with pg_store.lock("conv", timeout=5):
            await load(pg_store, "conv")
            await asyncio.sleep(60)

    holder = asyncio.create_task(hold_forever())
    await asyncio.sleep(0.1)
    waiters = [asyncio.create_task(commit_under_lock(pg_store, f"w{i}")) for i in range(5)]
    await asyncio.sleep(0.1)
    for task in [holder, *waiters]:
        task.cancel()
    await asyncio.gather(holder, *waiters, return_exceptions=True)
    committing = []
    for i in range(20):  # cancel commits at various points of their transaction
        task = asyncio.create_task(commit_under_lock(pg_store, f"c{i}"))
        committing.append(task)
        await asyncio.sleep(0.001 * (i % 5))
        task.cancel()
    await asyncio.gather(*committing, return_exceptions=True)
    await asyncio.sleep(0.2)  # shielded writes finish on their own
    assert await server_state(pg_dsn) == (0, 0)
    async with pg_store.lock("conv", timeout=1):
        view = await load(pg_store, "conv")
    # Whatever was committed is whole: every indexed turn has its reply.
    assert len(view.history) == 2 * view.turns


async def commit_under_lock(store: PostgresStore, text: str) -> None:
    async with store.lock("conv", timeout=5):
        await load(store, "conv")
        await commit_turn(store, "conv", text)


async def test_fork_tombstone_and_archive(pg_store: PostgresStore) -> None:
    r1 = await commit_turn(pg_store, "src", "one")
    r2 = await commit_turn(pg_store, "src", "two")
    await commit_turn(pg_store, "src", "three")
    await pg_store.fork("src", "branch", r2)
    assert await pg_store.read_index("branch") == [r1, r2]
    r4 = await commit_turn(pg_store, "branch", "four")
    assert (await load(pg_store, "branch")).response_ids == [r1, r2, r4]
    with pytest.raises(InvalidRequest):
        await pg_store.fork("src", "branch", r1)
    with pytest.raises(NotFound):
        await pg_store.fork("src", "other", r4)
    with pytest.raises(NotFound):
        await pg_store.fork("nothing", "other", r1)
    await pg_store.tombstone(r4)
    assert (await pg_store.read_response(r4))[-1]["type"] == "deleted"
    fresh = PostgresStore(pg_store.dsn)  # (a warm cache learns of it from the service's marker)
    assert (await load(fresh, "branch")).response_ids == [r1, r2]  # as JSONL: index kept, turn skipped
    await fresh.close()
    with pytest.raises(NotFound):
        await pg_store.tombstone("m-0123456789ab")
    assert await pg_store.delete_conversation("branch", archive=True)
    assert not await pg_store.exists("branch")
    rows = await pg_store.db.fetch("archive", "SELECT archive_id, path, content FROM gateway_archive")
    paths = sorted(r["path"] for r in rows)
    assert paths == sorted(["conversation.jsonl", *(f"responses/{r}.jsonl" for r in (r1, r2, r4))])
    assert all(r["archive_id"].startswith("branch-") for r in rows)
    index = next(r["content"] for r in rows if r["path"] == "conversation.jsonl")
    assert index == f"{r1}\n{r2}\n{r4}\n"


async def test_tenants_are_namespaces(pg_dsn: str) -> None:
    one, two = PostgresStore(pg_dsn, namespace="tone"), PostgresStore(pg_dsn, namespace="ttwo")
    try:
        rid = await commit_turn(one, "same-id", "secret of one")
        assert await two.exists("same-id") is False
        with pytest.raises(NotFound):
            await two.read_response(rid)
        await commit_turn(two, "same-id", "two's own")
        assert [m["content"] for m in (await load(two, "same-id")).history][0] == "two's own"
        assert await one.namespaces() == ["tone", "ttwo"]
    finally:
        await one.close()
        await two.close()


async def test_conversation_ids_newest_first(pg_store: PostgresStore) -> None:
    await commit_turn(pg_store, "a", "x")
    await commit_turn(pg_store, "b", "y")
    ids = await pg_store.conversation_ids()
    assert [cid for cid, _ in ids] == ["b", "a"] and ids[0][1] >= ids[1][1] > 0


async def test_start_writes_the_request_at_once(pg_store: PostgresStore) -> None:
    """An attempt is visible while the provider works (and after a crash), like a JSONL file."""
    rid = "m-0123456789ab"
    log = pg_store.start(rid, request_record(rid, "c", [user("q")]))
    for _ in range(100):
        try:
            records = await pg_store.read_response(rid)
            break
        except NotFound:
            await asyncio.sleep(0.01)
    assert [r["type"] for r in records] == ["request"]
    await log.abandon("cancelled")
    assert [r["type"] for r in await pg_store.read_response(rid)] == ["request", "incomplete"]


async def test_a_database_that_takes_no_writes_is_not_ready(pg_store: PostgresStore, pg_dsn: str) -> None:
    """A hot standby (or `default_transaction_read_only`) answers `SELECT 1`: `/readyz` said
    ready while every turn was a 503 (and the provider was asked first)."""
    await pg_store.probe()
    conn = await asyncpg.connect(pg_dsn)
    try:
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    finally:
        await conn.close()
    pool = (await pg_store.db.backend()).open_pool
    await pool.expire_connections()  # (a setting new sessions get)
    with pytest.raises(StorageError, match="takes no writes"):
        await pg_store.probe()
    # A turn is then refused before its provider is asked (it was asked, and its answer lost).
    with pytest.raises(StorageError, match="takes no writes"):
        pg_store.refuse_if_failed()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("SET default_transaction_read_only = off")  # (this session only)
        await conn.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
    finally:
        await conn.close()
    await pool.expire_connections()
    await pg_store.probe()  # writable again: turns go on
    pg_store.refuse_if_failed()


async def test_a_commit_whose_reply_was_lost_is_a_commit(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The COMMIT reached PostgreSQL and only its reply was lost (a connection cut, a restart):
    the client got a 503 for a turn that was in the conversation, and its retry stored it twice."""
    await commit_turn(pg_store, "lost-ack", "one")
    rid = "test-model-0123456789ab"
    log = pg_store.start(rid, request_record(rid, "lost-ack", [user("two")]))
    log.append({"type": "response", "message": reply("re: two"), "finish_reason": "stop", "usage": None})
    log.meanwhile()
    await asyncio.sleep(0.2)  # (the request row is in)
    done = asyncpg.transaction.Transaction.__aexit__
    lost = []

    async def reply_lost(self: Any, *exc: Any) -> Any:
        result = await done(self, *exc)
        if exc[0] is None and not lost:
            lost.append(True)
            raise asyncpg.exceptions.ConnectionDoesNotExistError(
                "connection was closed in the middle of operation"
            )
        return result

    monkeypatch.setattr(asyncpg.transaction.Transaction, "__aexit__", reply_lost)
    appended = await log.commit("lost-ack")  # a success, not a StorageError
    assert lost and appended is not None
    entries = await pg_store.read_index("lost-ack")
    assert entries.count(rid) == 1 and entries[-1] == rid
    assert [r["type"] for r in await pg_store.read_response(rid)][-1] == "commit"


async def test_unreachable_database_is_a_storage_error_without_the_password() -> None:
    store = PostgresStore("postgresql://gateway:s3cret@127.0.0.1:1/nothing")
    with pytest.raises(Exception) as info:
        await store.open()
    assert type(info.value).__name__ == "StorageError"
    assert "s3cret" not in str(info.value) and "127.0.0.1:1/nothing" in str(info.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port=1 user=gateway password=s3cret-kv dbname=nothing",  # libpq keyword form
        "postgresql://gateway:s3cret/kv@127.0.0.1:1/nothing",  # an unescaped / in the password
    ],
)
async def test_a_dsn_asyncpg_cannot_read_is_a_storage_error_without_the_password(dsn: str) -> None:
    """The keyword form was echoed whole, password included; the other was a traceback (asyncpg's
    own ValueError) quoting the password's start."""
    store = PostgresStore(dsn)
    with pytest.raises(StorageError) as info:
        await store.open()
    assert "s3cret" not in str(info.value) and "invalid DSN" in str(info.value)
    # and any message that would quote it, whoever words it
    assert "s3cret-kv" not in StorageError("asyncpg said: password=s3cret-kv").message


def test_a_connection_the_server_dropped_mid_operation_is_a_storage_error() -> None:
    """asyncpg's InternalClientError ("cannot switch to state 15; another operation is in
    progress") when PostgreSQL stops under load was not translated: a 500."""
    with pytest.raises(StorageError):
        with map_errors("could not record the response durably"):
            raise asyncpg.InternalClientError("cannot switch to state 15; another operation is in progress")


async def test_an_ending_the_database_could_not_take_is_written_once_it_can(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt that failed while the database was down read `in_progress` for good."""
    import gateway.store.postgres.log as module

    monkeypatch.setattr(module, "MARK_RETRY_SECONDS", 0.05)
    rid = "m-00000000dead"
    log = pg_store.start(rid, request_record(rid, "c", [user("q")]))
    insert = pg_store.db.insert
    down = True

    async def flaky(*args: object, **kwargs: object) -> None:
        if down and kwargs.get("unless_committed"):
            raise StorageError("cannot reach the database: connection refused")
        await insert(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pg_store.db, "insert", flaky)
    await log.abandon("storage_error")
    await asyncio.sleep(0.2)
    assert [r["type"] for r in await pg_store.read_response(rid)] == ["request"]  # still down
    down = False
    for _ in range(100):
        if [r["type"] for r in await pg_store.read_response(rid)] == ["request", "incomplete"]:
            break
        await asyncio.sleep(0.02)
    assert [r["type"] for r in await pg_store.read_response(rid)] == ["request", "incomplete"]


async def test_a_deleted_response_leaves_the_summaries_of_branches_on_postgres(
    pg_store: PostgresStore,
) -> None:
    """As `test_a_deleted_response_leaves_the_summaries_of_branches_that_share_it` (the JSONL
    and memory twins): the branches sharing a response are found with one query."""
    from tests.app.test_summary_deletions import Model, branch_summary_deletion, settings
    from tests.conftest import build_client

    model = Model()
    async with build_client(settings(), pg_store, model) as client:
        ids = await branch_summary_deletion(client, model)
    named = await pg_store.sharing("nobody", ids[2])
    assert len(named) == 2 and named[1] == f"{named[0]}.fork-{named[1].rsplit('-', 1)[1]}"  # source, branch


def slow_request_rows(pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch, seconds: float = 0.3) -> None:
    """A database slow to take a response's first rows (those its log writes when it opens)."""
    real = pg_store.db.insert

    async def slow(response_id: str, rows: Any, first_seq: int, *, unless_committed: bool = False) -> None:
        if first_seq == 0 and not unless_committed:
            await asyncio.sleep(seconds)
        await real(response_id, rows, first_seq, unless_committed=unless_committed)

    monkeypatch.setattr(pg_store.db, "insert", slow)


async def test_a_background_response_is_found_the_moment_its_id_is_handed_out(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`queued` came back while its request rows were still on their way: a GET or a cancel
    right after it was a 404 (JSONL creates the file first)."""
    from gateway.upstream.mock import MockUpstream
    from tests.conftest import build_client, make_settings

    slow_request_rows(pg_store, monkeypatch)
    async with build_client(make_settings(), pg_store, MockUpstream()) as client:
        body = {"model": "mock/m", "input": "hello", "background": True}
        queued = await client.post("/v1/responses", json=body)
        assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text
        found = await client.get(f"/v1/responses/{queued.json()['id']}")
    assert found.status_code == 200, found.text
    assert found.json()["status"] in ("queued", "in_progress", "completed")


async def test_a_stream_names_its_response_only_once_it_can_be_read(
    pg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's head (X-Response-Id) went out while the request rows were on their way."""
    from gateway.api.validation import parse_chat
    from gateway.upstream.mock import MockUpstream
    from tests.conftest import app_of, build_client, make_settings

    slow_request_rows(pg_store, monkeypatch)
    async with build_client(make_settings(), pg_store, MockUpstream()) as client:
        turns = app_of(client).state.services.turns
        body = {"model": "mock/m", "stream": True, "conversation_id": "s1", "messages": [user("hi")]}
        turn = await turns.prepare(parse_chat(body))
        async with turns.closing(turn):
            stream = await turns.open_chunks(turn)
            records = await pg_store.read_response(turn.response_id)  # what a GET reads now
            assert [r["type"] for r in records][:2] == ["request", "context"]
            async for _ in stream:
                pass
