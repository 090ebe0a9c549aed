"""PostgreSQL outages are two log lines, not a traceback per operation."""

from __future__ import annotations

import json
import logging

import asyncpg
import pytest

from gateway.exceptions import StorageError
from gateway.store.postgres.outage import Outage, QuietFloor
from gateway.store.postgres.schema import map_errors


def events(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith("{")]


def test_an_outage_is_one_line_when_it_starts_and_one_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    outage = Outage("postgresql://gateway@127.0.0.1/x", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="gateway.store")
    for _ in range(8):
        with pytest.raises(StorageError), map_errors("a query", outage):
            raise ConnectionRefusedError(111, "Connection refused")
    now[0] += 12
    with map_errors("a query", outage):
        pass
    with map_errors("a query", outage):  # (nothing more: it is not away)
        pass
    logged = events(caplog)
    assert [e["event"] for e in logged] == ["postgres_unreachable", "postgres_back"]
    assert logged[1]["failed_operations"] == 8 and logged[1]["after_s"] == 12.0
    assert not any(r.exc_info for r in caplog.records)


def test_a_refused_statement_is_no_outage_and_ends_one(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage("pg")
    caplog.set_level(logging.INFO, logger="gateway.store")
    with pytest.raises(StorageError), map_errors("a write", outage):
        raise asyncpg.exceptions.ReadOnlySQLTransactionError(
            "cannot execute INSERT in a read-only transaction"
        )
    assert not outage.ongoing and events(caplog) == []
    with pytest.raises(StorageError), map_errors("a write", outage):
        raise asyncpg.exceptions.CannotConnectNowError("the database system is starting up")
    assert outage.ongoing
    with pytest.raises(StorageError), map_errors("a write", outage):  # answered: it is back
        raise asyncpg.exceptions.ReadOnlySQLTransactionError("read-only")
    assert [e["event"] for e in events(caplog)] == ["postgres_unreachable", "postgres_back"]


def test_asyncpg_pools_floor_retries_are_left_to_the_outage_lines() -> None:
    record = logging.LogRecord(
        "asyncpg.pool",
        logging.WARNING,
        "",
        0,
        "Failed to restore the pool connection floor; retrying",
        (),
        None,
    )
    other = logging.LogRecord("asyncpg.pool", logging.WARNING, "", 0, "something else", (), None)
    assert not QuietFloor().filter(record) and QuietFloor().filter(other)
