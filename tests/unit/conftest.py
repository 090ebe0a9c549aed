"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.store.jsonl import JsonlStore


@pytest.fixture
async def jstore(tmp_path: Path) -> AsyncIterator[JsonlStore]:
    """A JSONL store in a fresh data dir, open for the test."""
    s = JsonlStore(tmp_path / "var")
    await s.open()
    yield s
    await s.close()
