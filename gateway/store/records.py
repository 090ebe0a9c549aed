"""Response-log record kinds (a committed log becomes a `Turn` in `gateway.context.records`).

{"type": "request",  "response_id", "conversation_id", "created", "model", "stream",
                     "params", "system", "input"}
{"type": "context",  "stored_messages", "sent_messages", ...}
{"type": "response", "message", "finish_reason", "usage", "timings"}
{"type": "commit",   "status": "complete", "committed"}
{"type": "incomplete", "reason", "error"}
"""

from __future__ import annotations

from gateway.types import Record


def is_committed(records: list[Record]) -> bool:
    return bool(records) and records[-1].get("type") == "commit"


def is_marker(entry: object) -> bool:
    return isinstance(entry, dict)
