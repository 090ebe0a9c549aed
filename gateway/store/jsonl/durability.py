"""When a JSONL store's writes reach the disk, and whether they still may be acknowledged.

With durability "fsync" every acknowledged write is synced first (a turn's commit by the
journal's shared fdatasync, a marker or a side log by its own); with "none" the kernel writes
them back when it will. The first sync that fails latches: the kernel may have dropped the
dirty pages it could not write, and a later sync could then succeed without them, so from then
on no write is acknowledged until a restart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gateway.store.base import writes_refused

log = logging.getLogger("gateway.store")


class Durability:
    """The sync policy of one store (`fsync`) and its failure latch (`failed`)."""

    def __init__(self, *, fsync: bool) -> None:
        self.fsync = fsync
        self.failed: str | None = None  # the first failed sync, as "name: reason"
        # Why the data dir last refused a write (a full disk, a read-only folder), until one goes
        # through: not latched, but turns look first whether it takes writes again.
        self.refused: str | None = None
        self.refused_bytes = 0  # the size of the write it refused (a test write is as large)

    def sync(self, sync: Callable[[Any], None], target: Any) -> None:
        """Run `sync(target)`, latching a failure before raising it.

        `sync` is os.fsync, os.fdatasync, fsync_dir or syncfs: its name says which failed."""
        try:
            sync(target)
        except OSError as exc:
            self.latch(getattr(sync, "__name__", "fsync"), exc)
            raise

    def datasync(self, fd: int) -> None:
        self.sync(os.fdatasync, fd)

    def latch(self, name: str, exc: OSError) -> None:
        """Record that the sync `name` failed: from now on every write is refused."""
        if self.failed is None:
            self.failed = f"{name}: {exc.strerror or exc}"
            log.error("fsync failed, refusing further writes: %s", self.failed)

    def refuse_if_failed(self) -> None:
        """Raise StorageError once a sync has failed."""
        if self.failed is not None:
            raise writes_refused(self.failed)

    def append_sync(self) -> Callable[[int], None] | None:
        """The sync an append makes before it is acknowledged.

        None with durability "none"; raises first when writes are refused."""
        self.refuse_if_failed()
        return self.datasync if self.fsync else None
