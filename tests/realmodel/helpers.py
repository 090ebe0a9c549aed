"""Helpers for the real-model tests."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import GatewayProcess
from tests.realmodel.llama import LlamaServer


def write_llama_config(path: Path, llama: LlamaServer, extra_toml: str = "") -> Path:
    """A gateway config whose only provider is the llama server. No context window is set:
    the gateway has to discover it. `extra_toml` is appended verbatim (e.g. a [context] table)."""
    path.write_text(
        f"""default_provider = "llama"

[storage]
durability = "fsync"

[sessions]
recap = false

[providers.llama]
kind = "openai"
base_url = "{llama.base_url}"
timeout = 120

{extra_toml}
"""
    )
    return path


def gateway_for(tmp_path: Path, llama: LlamaServer, extra_toml: str = "") -> GatewayProcess:
    """A started `gateway serve` (1 worker) in front of `llama`; the caller stops it."""
    config = write_llama_config(tmp_path / "gateway.toml", llama, extra_toml)
    return GatewayProcess(config, tmp_path / "var").start()
