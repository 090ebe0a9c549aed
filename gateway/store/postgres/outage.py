"""PostgreSQL outages in the log: one line when the database goes, one when it is back.

The second says how long it was away and how many operations failed meanwhile; no tracebacks.

Clients already get a clean 503 for each failed operation; the log's reader needs to know that
the database went away and came back, not each of the operations that met it away."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import asyncpg
import orjson

log = logging.getLogger("gateway.store")

# Errors that say the database cannot be reached (not that it refused a statement).
UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
)


class Outage:
    """Whether the database is away, said once when it goes and once when it is back."""

    def __init__(self, where: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.where = where  # the DSN without its password
        self.clock = clock
        self.since: float | None = None
        self.failed_operations = 0

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, detail: str) -> None:
        """An operation could not reach the database."""
        self.failed_operations += 1
        if self.since is None:
            self.since = self.clock()
            log.error(
                orjson.dumps({"event": "postgres_unreachable", "at": self.where, "error": detail}).decode()
            )

    def reached(self) -> None:
        """An operation reached the database (whatever it answered)."""
        if self.since is None:
            return
        away, failed = self.clock() - self.since, self.failed_operations
        self.since, self.failed_operations = None, 0
        log.warning(
            orjson.dumps(
                {
                    "event": "postgres_back",
                    "at": self.where,
                    "after_s": round(away, 1),
                    "failed_operations": failed,
                }
            ).decode()
        )


class QuietFloor(logging.Filter):
    """Drop asyncpg's lines about failing to restore the pool's floor of connections.

    The pool logs each failed attempt with a traceback, several a second while the database is
    away: the outage's lines say it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to restore the pool connection floor")


def quiet_asyncpg_pool() -> None:
    """Install `QuietFloor` on asyncpg's pool logger, once."""
    pool_log = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, QuietFloor) for f in pool_log.filters):
        pool_log.addFilter(QuietFloor())
