"""PostgreSQL tests: a throwaway cluster for the session (see cluster.py), a fresh database
per test that needs one, and a loud note in the summary when the cluster could not be had."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.store.postgres import PostgresStore
from tests.postgres.cluster import PostgresCluster, postgres_cluster, skip_reason

__all__ = ["postgres_cluster"]


@pytest.fixture(autouse=True)
async def no_query_left_cancelling() -> AsyncIterator[None]:
    """Each test's loop ends with no asyncpg task still telling the server to cancel a query.

    The loop's end cancels the tasks left (a query still awaited among them), and asyncpg answers
    each cancelled query with a task of its own, made then and so never awaited: the closed loop
    destroyed it pending, and a later test failed on the warning (a flake). Those tasks are
    cancelled and awaited here, twice: the second round ends the tasks the first one made."""
    yield
    for _ in range(2):
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=5)


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
