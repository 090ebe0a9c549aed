"""The embedded store: JSONL files under the data dir.

The layout and rules are in `gateway.store.jsonl.store`.
"""

from gateway.store.base import SIDE_LOGS
from gateway.store.jsonl.files import parse_index, parse_jsonl
from gateway.store.jsonl.store import JsonlStore

__all__ = ["SIDE_LOGS", "JsonlStore", "parse_index", "parse_jsonl"]
