"""Real-model tests: one llama.cpp server (SmolLM2-135M, n_ctx 512) per session, and real
`gateway serve` processes in front of it. Everything here is marked `realmodel`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realmodel.helpers import gateway_for
from tests.realmodel.llama import LlamaServer

__all__ = ["gateway_for"]

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.realmodel)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with LlamaServer(n_ctx=512, log_dir=tmp_path_factory.mktemp("llama")) as server:
        yield server
