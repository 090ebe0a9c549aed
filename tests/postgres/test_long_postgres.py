"""A long-conversation test of test_context.py, run unchanged on the PostgreSQL store: rolling
summaries recall turn 3 at turn 300 (300 locked turns, summary versions in a side log).
(The 300-turn truncation test passes too, `long_tests.test_three_hundred_turns_in_a_4k_window_truncate`;
it adds ~8 s and nothing the store does not already show here, so it is left to the JSONL run.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.app.test_context as long_tests
from gateway.store.postgres import PostgresStore


@pytest.fixture
def postgres_stores(monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> Iterator[list[PostgresStore]]:
    """Where test_context builds a JsonlStore, build a PostgresStore on a fresh database."""
    stores: list[PostgresStore] = []

    def make(data_dir: Any, *, durability: str = "fsync", **_: Any) -> PostgresStore:
        stores.append(PostgresStore(pg_dsn, durability=durability))
        return stores[-1]

    monkeypatch.setattr(long_tests, "JsonlStore", make)
    yield stores


async def test_summary_recalls_turn_3_at_turn_300(
    postgres_stores: list[PostgresStore], tmp_path: Path
) -> None:
    await long_tests.test_summary_recalls_turn_3_at_turn_300(tmp_path)
    assert postgres_stores and not (tmp_path / "var" / "logs" / "summaries").exists()
    for store in postgres_stores:
        await store.close()
