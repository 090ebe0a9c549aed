"""Where each file of a JSONL data dir lives: the only place ids become file names.

    {root}/logs/responses/{response_id}.jsonl        request, context, response, commit
    {root}/logs/conversations/{conversation_id}.jsonl  one response id per line (the index)
    {root}/logs/{kind}/{key}.jsonl                   side logs (summaries, lifecycle, metadata)
    {root}/logs/journal/                             write-ahead journals (journal.py, recovery.py)
    {root}/locks/                                    conversation, journal and catalog locks
    {root}/catalog/                                  the conversation and response catalogs
    {root}/archive/{conversation_id}-{ms}/           archived conversations
    {root}/spare/                                    empty files made ahead of need (spares.py)

A `DataDir` builds these paths, checking each id first, and names a file to clients relative to
the data dir; it opens nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from gateway.exceptions import NotFound
from gateway.ids import check_conversation_id, check_side_key, is_valid_response_id
from gateway.store.base import SIDE_LOGS
from gateway.store.jsonl.files import NamedFiles


class DataDir:
    """The paths of one data dir; index paths of the last `4 x cache_size` conversations kept."""

    def __init__(self, root: Path, *, cache_size: int = 1024) -> None:
        self.root = root
        self._root_prefix = os.path.join(str(root), "")
        self.logs_dir = root / "logs"
        self.responses_dir = self.logs_dir / "responses"
        self.conversations_dir = self.logs_dir / "conversations"
        self.summaries_dir = self.logs_dir / "summaries"
        self.journal_dir = self.logs_dir / "journal"
        self.locks_dir = root / "locks"
        self.catalog_dir = root / "catalog"
        self.archive_dir = root / "archive"
        self.spare_dir = root / "spare"
        self.journal_lock = self.locks_dir / "journal.lock"
        self._index_paths = NamedFiles(self.conversations_dir, check_conversation_id, 4 * cache_size)

    def create(self) -> None:
        """Make the folders every store of this data dir writes to."""
        for folder in (self.responses_dir, self.conversations_dir, self.locks_dir, self.summaries_dir):
            folder.mkdir(parents=True, exist_ok=True)

    def shown(self, path: Path) -> str:
        """A file as errors name it to clients: relative to the data dir (no server paths)."""
        text = str(path)
        if text.startswith(self._root_prefix):  # (what `relative_to` says, for a fraction of its cost)
            return text[len(self._root_prefix) :]
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return path.name

    def index_path(self, conversation_id: str) -> Path:
        """A conversation's index (InvalidRequest for an id that is not one)."""
        return self._index_paths(conversation_id)

    def response_path(self, response_id: str) -> Path:
        """A response's log (NotFound for an id that is not one: no such response can exist)."""
        if not is_valid_response_id(response_id):
            raise NotFound(f"No response {response_id!r}", param="response_id")
        return self.responses_dir / f"{response_id}.jsonl"

    def side_path(self, kind: str, key: str) -> Path:
        """A side log: `kind` one of SIDE_LOGS, `key` a conversation or response id."""
        if kind not in SIDE_LOGS:
            raise ValueError(f"unknown side log {kind!r}")
        return self.logs_dir / kind / f"{check_side_key(key)}.jsonl"

    def summary_path(self, conversation_id: str) -> Path:
        return self.side_path("summaries", conversation_id)
