"""The embedded store: one JSONL file per response, one append-only JSONL index per conversation.

    {data_dir}/logs/responses/{response_id}.jsonl      request, context, response, commit
    {data_dir}/logs/conversations/{conversation_id}.jsonl  one response id per line
    {data_dir}/logs/summaries/{conversation_id}.jsonl  rolling summary versions (append-only)
    {data_dir}/locks/{conversation_id}.lock           flock() per conversation, across worker processes

A response file is written and fsync'd before its id is appended to the index (then the index
is fsync'd), so the index never names an incomplete response. A reader gets the entries after a
`Version` (the index file's inode and byte offset), so writes by another process are noticed.
"""

from gateway.store.jsonl.files import SIDE_LOGS, parse_index, parse_jsonl
from gateway.store.jsonl.store import JsonlStore

__all__ = ["SIDE_LOGS", "JsonlStore", "parse_index", "parse_jsonl"]
