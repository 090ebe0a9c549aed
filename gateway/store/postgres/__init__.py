"""The shared store for several gateway replicas: PostgreSQL.

The layout and rules are in `gateway.store.postgres.store`."""

from gateway.store.base import SIDE_LOGS
from gateway.store.postgres.schema import SCHEMA_VERSION, has_schema, map_errors, migrate, require_schema
from gateway.store.postgres.store import PostgresStore

__all__ = [
    "SCHEMA_VERSION",
    "SIDE_LOGS",
    "PostgresStore",
    "has_schema",
    "map_errors",
    "migrate",
    "require_schema",
]
