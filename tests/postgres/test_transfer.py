"""`gateway export` / `gateway import`: JSONL -> PostgreSQL -> JSONL gives back every file, byte
for byte, and the conversations read the same from either backend."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gateway.cli import main
from gateway.ids import mint_response_id
from gateway.store.jsonl import JsonlStore
from gateway.store.postgres import PostgresStore
from tests.helpers import commit_turn, reply, request_record, user
from tests.views import list_conversations, load

TENANT = "t0123456789abcdef"


async def build_jsonl_data(root: Path) -> dict[str, Any]:
    """A data dir with every kind of thing the JSONL store writes."""
    store = JsonlStore(root)
    await store.open()
    system = [{"role": "system", "content": "Be brief ✓"}]
    r1 = await commit_turn(store, "c1", "héllo ✓ \u0000 nul", "hi", system=system)
    calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    r2 = await commit_turn(store, "c1", "", output=calls, inputs=[user("compute")])
    await store.append_marker("c1", {"type": "metadata", "metadata": {"topic": "x"}, "at": 1.5})
    await commit_turn(
        store,
        "c1",
        "",
        output=reply("42"),
        inputs=[{"role": "tool", "tool_call_id": "call_1", "content": "42"}],
    )
    await store.append_marker("c1", {"type": "reset", "keep_system_message": True, "at": 2.5})
    await commit_turn(store, "c1", "after reset", "ok")
    await store.append_side("summaries", "c1", {"type": "summary", "version": 1, "covers_through": r1})
    await store.append_side("lifecycle", "c1", {"state": "processed", "at": 3.0, "attempts": 0})
    await store.append_side("users", "u0123abcd", {"conversation_id": "c1", "at": 1.0})
    await store.append_side("digests", "u0123abcd.2026-11-22", {"conversation_id": "c1", "summary": "s"})
    await store.fork("c1", "c1-branch", r2)
    # c2: one turn, an abandoned attempt, a deleted response, a stateless response, one in flight.
    await commit_turn(store, "c2", "two", "deux")
    doomed = mint_response_id("test/model")
    log = store.start(doomed, request_record(doomed, "c2", [user("doomed")]))
    await log.abandon("error", {"message": "upstream timed out"})
    tomb = await commit_turn(store, "c2", "forget me")
    await store.tombstone(tomb)
    await commit_turn(store, None, "stateless")
    flying = mint_response_id("test/model")
    store.start(flying, request_record(flying, "c2", [user("in flight")]))
    # An archived (deleted) conversation.
    await commit_turn(store, "gone", "bye")
    await store.append_side("summaries", "gone", {"type": "summary", "version": 1})
    await store.delete_conversation("gone", archive=True)
    await asyncio.sleep(0.05)  # let the in-flight response file be created
    await store.close()
    tenant = JsonlStore(root / "tenants" / TENANT)
    await tenant.open()
    rid = mint_response_id("test/model")
    log = tenant.start(rid, request_record(rid, "c1", [user("tenant secret")]))
    log.append({"type": "response", "message": reply("ok"), "finish_reason": "stop"})
    await log.commit("c1")
    await tenant.close()
    return {"tomb": tomb, "flying": flying}


def data_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        # Locks, the conversation catalog and the write-ahead journals are derived or recovery
        # state, not data: never exported.
        if p.is_file() and not {"locks", "catalog", "journal"} & set(p.relative_to(root).parts)
    }


def run_cli(args: list[str], env: dict[str, str]) -> str:
    result = CliRunner().invoke(main, args, env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_jsonl_to_postgres_to_jsonl_gives_back_every_file(tmp_path: Path, pg_dsn: str) -> None:
    source = tmp_path / "var"
    asyncio.run(build_jsonl_data(source))
    env = {"GATEWAY_STORAGE__BACKEND": "postgres", "GATEWAY_STORAGE__DSN": pg_dsn}
    config = str(Path(__file__).resolve().parents[1] / "empty.toml")
    out = run_cli(["import", "--config", config, "--from", str(source)], env)
    assert "imported 4 conversations" in out and "(2 tenants)" in out
    exported = tmp_path / "exported"
    out = run_cli(["export", "--config", config, "--to", str(exported)], env)
    assert "exported 4 conversations" in out
    before, after = data_files(source), data_files(exported)
    assert sorted(after) == sorted(before)
    for name, data in before.items():
        assert after[name] == data, name
    assert any(name.startswith("archive/gone-") for name in before)
    assert f"tenants/{TENANT}/logs/conversations/c1.jsonl" in before
    # Index mtimes (the conversations' last activity) survive too.
    for name in before:
        if "/conversations/" in name:
            assert abs((source / name).stat().st_mtime - (exported / name).stat().st_mtime) < 0.001

    async def compare() -> None:
        jsonl = JsonlStore(source)
        pg = PostgresStore(pg_dsn)
        try:
            for cid in ("c1", "c1-branch", "c2"):
                a, b = await load(jsonl, cid), await load(pg, cid)
                assert (a.system, a.history, a.response_ids, a.metadata) == (
                    b.system,
                    b.history,
                    b.response_ids,
                    b.metadata,
                )
                assert await jsonl.read_index(cid) == await pg.read_index(cid)
            for rid in [e for e in await jsonl.read_index("c2") if isinstance(e, str)]:
                assert await jsonl.read_response(rid) == await pg.read_response(rid)
            assert await jsonl.read_side("summaries", "c1") == await pg.read_side("summaries", "c1")

            def listing(rows: list[Any]) -> list[tuple[str, int, int, float]]:
                # Sorted here too: file times can tie, and ties may come in either order.
                return sorted(
                    (s.conversation_id, s.turns, s.messages, round(s.last_activity, 3)) for s in rows
                )

            assert listing(await list_conversations(pg)) == listing(await list_conversations(jsonl))
        finally:
            await pg.close()

    asyncio.run(compare())
    # A second import finds the conversations already there and changes nothing.
    result = CliRunner().invoke(main, ["import", "--config", config, "--from", str(source)], env=env)
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    # It names what is there (not the database's key) and says nothing was imported.
    assert re.search(
        r"(response|conversation) '[^']+' \(tenant \w+\) is already in the database", result.output
    )
    assert "nothing of its tenant was imported" in result.output and "Key (" not in result.output
    again = tmp_path / "again"
    run_cli(["export", "--config", config, "--to", str(again)], env)
    assert data_files(again) == after


def test_export_refuses_a_folder_with_data_and_import_an_empty_one(tmp_path: Path, pg_dsn: str) -> None:
    env = {"GATEWAY_STORAGE__BACKEND": "postgres", "GATEWAY_STORAGE__DSN": pg_dsn}
    config = str(Path(__file__).resolve().parents[1] / "empty.toml")
    (tmp_path / "full" / "logs" / "conversations").mkdir(parents=True)
    (tmp_path / "full" / "logs" / "conversations" / "c.jsonl").write_text("m-0123456789ab\n")
    result = CliRunner().invoke(main, ["export", "--config", config, "--to", str(tmp_path / "full")], env=env)
    assert result.exit_code == 1 and "already holds gateway data" in result.output
    # Any other content too, as `--to`'s help says ("empty or new"): not a checkout, not $HOME.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("keep me")
    other = ["export", "--config", config, "--to", str(tmp_path / "other")]
    result = CliRunner().invoke(main, other, env=env)
    assert result.exit_code == 1 and "is not empty" in result.output
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["precious.txt"]
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        main, ["import", "--config", config, "--from", str(tmp_path / "empty")], env=env
    )
    assert result.exit_code == 1 and "holds no gateway data" in result.output


def test_reading_a_database_without_gateway_data_is_an_error(tmp_path: Path, pg_dsn: str) -> None:
    """Export exited 0 with "exported 0 conversations ... to DIR" (no DIR made), and the read-only
    command made the gateway's six tables in that database (a DSN naming another database)."""
    import asyncpg

    env = {"GATEWAY_STORAGE__BACKEND": "postgres", "GATEWAY_STORAGE__DSN": pg_dsn}
    config = str(Path(__file__).resolve().parents[1] / "empty.toml")
    target = ["export", "--config", config, "--to", str(tmp_path / "out")]
    result = CliRunner().invoke(main, target, env=env)
    assert result.exit_code == 1 and "holds no gateway data" in result.output, result.output

    async def tables() -> list[str]:
        conn = await asyncpg.connect(pg_dsn)
        try:
            return [
                r[0] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            ]
        finally:
            await conn.close()

    assert asyncio.run(tables()) == []
    # Nor do the commands that only read: each made the six tables, and fsck found "no damage".
    commands = [["conversations"], ["show", "c1"], ["context", "m-0123456789ab"], ["fsck"]]
    commands += [["fsck", "--repair"], ["reset", "c1"], ["delete", "c1", "--yes"]]  # (these too)
    for command in commands:
        result = CliRunner().invoke(main, [*command, "--config", config], env=env)
        assert result.exit_code == 1 and "holds no gateway data" in result.output, (command, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert asyncio.run(tables()) == []
    # `tail` waits for such a database, as for a data dir with nothing in it yet.
    tail = subprocess.Popen(
        [sys.executable, "-m", "gateway", "tail", "c1", "--poll", "0.1", "--config", config],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(3)
        assert tail.poll() is None  # still waiting
    finally:
        tail.kill()
    said = tail.communicate()[0]
    assert "holds no gateway data" in said and "waiting for its first turn" in said, said
    assert asyncio.run(tables()) == []
    asyncio.run(_open_and_close(pg_dsn))  # the gateway's tables, no conversation yet
    result = CliRunner().invoke(main, target, env=env)
    assert result.exit_code == 1 and "holds no gateway data" in result.output, result.output


async def _open_and_close(dsn: str) -> None:
    store = PostgresStore(dsn)
    await store.open()
    await store.close()


@pytest.mark.parametrize("direction", ["export", "import"])
def test_jsonl_backend_copies_files(tmp_path: Path, direction: str) -> None:
    """With the jsonl backend, export and import copy the data dir's files, refusing clashes."""
    source = tmp_path / "var"
    asyncio.run(build_jsonl_data(source))
    config = str(Path(__file__).resolve().parents[1] / "empty.toml")
    other = tmp_path / "other"
    journal = source / "logs" / "journal" / "4242-abcd-a.wal"  # as a running gateway has one
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_bytes(bytes(64))
    if direction == "export":
        args = ["export", "--config", config, "--data-dir", str(source), "--to", str(other)]
    else:
        args = ["import", "--config", config, "--data-dir", str(other), "--from", str(source)]
    run_cli(args, {})
    assert data_files(other) == data_files(source)
    assert not (other / "logs" / "journal").exists()  # recovery state, never copied
    if direction == "import":
        result = CliRunner().invoke(main, args, env={})
        assert result.exit_code == 1 and "already exist" in result.output
