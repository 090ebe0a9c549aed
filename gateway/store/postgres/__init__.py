"""The shared store for several gateway replicas: PostgreSQL through an asyncpg pool.

Same contract as the JSONL store, in tables instead of files, one namespace per tenant:

    gateway_responses      (namespace, response_id, seq)      kind, record   one row per record
    gateway_conversations  (namespace, conversation_id)       incarnation, last_seq, updated_at
    gateway_index          (namespace, conversation_id, seq)  response_id | marker
    gateway_side           (namespace, kind, key, id)         record   summaries, lifecycle, users,
                                                                       digests, models
    gateway_archive        (namespace, archive_id, path)      content  deleted conversations, as files

Records are `json`, not `jsonb`: json keeps the exact text (key order, `\\u0000`), so an export
gives back byte for byte what JSONL wrote. A turn's records, its commit record and its index row
are written in one transaction, so the index never names an incomplete response. Turns on one
conversation are serialized across replicas by a session advisory lock held on one dedicated
connection per process (released by PostgreSQL if the process dies), and every append checks
the tail the turn was built on, so even a lost lock can never fork a history (409 instead).
A reader gets the entries after a `Version` (incarnation, last seq): one query, one round trip.
"""

from gateway.store.postgres.schema import SCHEMA_VERSION, SIDE_LOGS, map_errors, migrate, redact
from gateway.store.postgres.store import PostgresStore

__all__ = ["SCHEMA_VERSION", "SIDE_LOGS", "PostgresStore", "map_errors", "migrate", "redact"]
