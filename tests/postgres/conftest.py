"""PostgreSQL tests: a throwaway cluster for the session (see cluster.py), a fresh database
per test that needs one, and a loud note in the summary when the cluster could not be had."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.store.postgres import PostgresStore
from tests.postgres.cluster import PostgresCluster, postgres_cluster, skip_reason

__all__ = ["postgres_cluster"]


@pytest.fixture
def pg_dsn(postgres_cluster: PostgresCluster) -> str:
    """A fresh, empty database."""
    return postgres_cluster.create_database()


@pytest.fixture
async def pg_store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(pg_dsn)
    await store.open()
    yield store
    await store.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if skip_reason():
        terminalreporter.write_sep("!", "POSTGRES TESTS SKIPPED", red=True, bold=True)
        terminalreporter.write_line(skip_reason(), red=True)
