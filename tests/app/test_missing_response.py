"""One rule for an index line naming a response file that is missing or empty: every reader of
the conversation leaves that turn out, with one warning in the log, and a direct read of that
response is a 404."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gateway.exceptions import NotFound
from gateway.services.cache import WARNED_LIMIT, ConversationCache
from gateway.store.jsonl import JsonlStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings
from tests.helpers import say_each


async def _seed(tmp_path: Path) -> list[str]:
    settings = make_settings(tmp_path, durability="none")
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    async with build_client(settings, store, MockUpstream()) as client:
        return await say_each(client, "c", [f"message {n}" for n in range(3)])


@pytest.mark.parametrize("damage", ["missing", "empty", "uncommitted"])
async def test_every_reader_skips_the_turn_and_a_direct_read_is_404(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    first, second, third = await _seed(tmp_path)
    path = tmp_path / "var" / "logs" / "responses" / f"{second}.jsonl"
    if damage == "missing":
        path.unlink()
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # the commit record lost (a damaged file): not "in progress" for ever
        lines = path.read_bytes().splitlines(keepends=True)
        assert b'"type":"commit"' in lines[-1]
        path.write_bytes(b"".join(lines[:-1]))
    store = JsonlStore(tmp_path / "var", durability="none")  # a fresh process: nothing cached
    await store.open()
    upstream = MockUpstream()
    settings = make_settings(tmp_path, durability="none")
    with caplog.at_level(logging.WARNING, logger="gateway"):
        async with build_client(settings, store, upstream) as client:
            items = await client.get("/v1/conversations/c/items?order=asc")
            inspector = await client.get("/ui/api/conversations/c")
            context = await client.get("/v1/conversations/c/context")
            direct = await client.get(f"/v1/responses/{second}")
            input_items = await client.get(f"/v1/responses/{second}/input_items")
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock/m",
                    "conversation_id": "c",
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            queries = app_of(client).state.services.queries
            shown = [turn.response_id for turn in await queries.turns("", "c")]  # gateway show
            if damage == "uncommitted":  # gateway context RESPONSE_ID: what the file still holds
                assert [r["type"] for r in await queries.records("", second)][0] == "request"
            else:
                with pytest.raises(NotFound):
                    await queries.records("", second)
            again = await client.get("/ui/api/conversations/c")

    assert items.status_code == 200
    texts = [part["text"] for item in items.json()["data"] for part in item["content"]]
    assert "message 0" in texts and "message 2" in texts and "message 1" not in texts
    assert inspector.status_code == 200 and again.status_code == 200
    turns = inspector.json()["turns"]
    if damage == "uncommitted":  # the inspector shows it, marked (docs/storage.md, "Damaged files")
        assert [t["response_id"] for t in turns] == [first, second, third]
    else:
        assert [t["response_id"] for t in turns] == [first, third]
        assert [t["index"] for t in turns] == [0, 2]  # positions in the index are kept
    assert context.status_code == 200 and context.json()["response_id"] == third
    for reply in (direct, input_items):
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found", reply.text
    assert chat.status_code == 200
    sent = [m["content"] for m in upstream.requests[-1]["messages"]]
    assert "message 0" in sent and "message 2" in sent and "message 1" not in sent
    assert shown == [first, third, chat.json()["id"]]
    warnings = [r.getMessage() for r in caplog.records if second in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per process, however many readers
    why = "not a committed turn" if damage == "uncommitted" else "missing or empty"
    assert f"{why}: skipped" in warnings[0]


def test_the_warned_set_stays_bounded() -> None:
    cache = ConversationCache(8)
    for n in range(WARNED_LIMIT * 3):
        cache.skipped("c", f"m-{n:012x}", [])
    assert len(cache._warned) == WARNED_LIMIT


async def test_an_attempt_its_conversation_moved_on_from_is_not_in_progress(
    app_client: Any, memory_store: Any
) -> None:
    """An attempt whose process died on another host (a replica of its own, on PostgreSQL)
    read as `in_progress` for ever on every other replica: its process could not be seen. The
    conversation's index grew after it began, so its lock was let go: the attempt is over."""
    from tests.helpers import request_record, user

    await say_each(app_client, "moved", ["one"])
    rid = "mock-m-0123456789ab"
    record = {**request_record(rid, "moved", [user("lost")]), "before": {"entries": 1}}
    record["writer"] = "another-host/4242/1"  # (a process this host cannot see)
    await memory_store.start(rid, record).abandon("cancelled")  # then made unended again:
    memory_store.responses[rid] = memory_store.responses[rid][:1]
    in_progress = await app_client.get(f"/v1/responses/{rid}")
    assert in_progress.json()["status"] == "in_progress"  # nothing says otherwise yet
    await say_each(app_client, "moved", ["two"])  # the conversation moved on: the lock was let go
    over = (await app_client.get(f"/v1/responses/{rid}")).json()
    assert over["status"] == "failed" and over["error"]["code"] == "interrupted", over


async def test_a_response_committed_between_the_reads_of_its_log_and_index_is_not_damaged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its log was read in progress, then its index with it committed: `GET /v1/responses/{id}`
    said the log was damaged ("not complete"), though nothing was."""
    from gateway.api.validation import parse_chat
    from gateway.store.memory import MemoryStore

    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream()) as client:
        turns = app_of(client).state.services.turns
        body = {"model": "mock/m", "conversation_id": "r1", "messages": [{"role": "user", "content": "hi"}]}
        turn = await turns.prepare(parse_chat(body))
        real_index = store.read_index

        async def committed_meanwhile(cid: str) -> Any:
            if not turn.done:  # the commit lands between the two reads
                async with turns.closing(turn):
                    await turns.complete(turn)
            return await real_index(cid)

        monkeypatch.setattr(store, "read_index", committed_meanwhile)
        found = await client.get(f"/v1/responses/{turn.response_id}")
    assert found.status_code == 200, found.text
    assert found.json()["status"] == "completed"


async def test_an_attempt_its_client_left_reads_back_failed_with_an_error(
    app_client: Any, memory_store: Any
) -> None:
    """It read back `status: "failed"` with `error: null`: code written for OpenAI's shape, where a
    failed response carries its error, broke on `response.error.message`."""
    from tests.helpers import request_record, user

    rid = "mock-m-0123456789ac"
    await memory_store.start(rid, request_record(rid, None, [user("left")])).abandon("cancelled")
    failed = (await app_client.get(f"/v1/responses/{rid}")).json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "cancelled", failed
    assert "nothing was added to the conversation" in failed["error"]["message"]
