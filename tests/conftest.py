"""Shared fixtures: a real mock upstream over HTTP, real `gateway serve` processes, and
in-process apps built on the twins (MemoryStore / JsonlStore + MockUpstream)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from bench import harness
from bench.procs import free_port
from gateway.app import create_app
from gateway.config import Settings, load_settings
from gateway.store.base import Store
from gateway.store.memory import MemoryStore
from gateway.tracing import Tracing
from gateway.upstream import Router
from gateway.upstream.mock import MockUpstream
from tests.mockserver import MockServer, mock_server

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets a node id of its own. Schemathesis names its items per API operation but,
    under pytest 9, gives them all the function's node id; xdist keys its schedule by node id,
    so all but one operation would silently not run. The operation goes into the id here, and
    any other duplicate stops the run."""
    for item in items:
        label = getattr(item, "operation_label", None)
        node_id = getattr(item, "_id", None)  # pytest 9's structured node id
        if label and node_id is not None and getattr(node_id, "params", "") is None:
            item._id = node_id.with_params(label)
    dupes = sorted(nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1)
    if dupes:
        raise pytest.UsageError(f"tests with the same node id (xdist would run one of each): {dupes[:5]}")


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[MockServer]:
    with mock_server() as server:
        yield server


@pytest.fixture
def upstream(upstream_server: MockServer) -> Iterator[MockServer]:
    upstream_server.reset()
    yield upstream_server
    upstream_server.reset()


def sdk(
    gateway: GatewayProcess, key: str = "client-key-not-forwarded", *, timeout: float | None = None
) -> OpenAI:
    """The official SDK pointed at a gateway process (no retries: a test sees every failure)."""
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=timeout)


class GatewayProcess:
    """`gateway serve` as a real subprocess on a free loopback port."""

    def __init__(
        self, config: Path, data_dir: Path, *, workers: int = 1, env: dict[str, str] | None = None
    ) -> None:
        self.config = config
        self.data_dir = data_dir
        self.workers = workers
        self.env = {**os.environ, **(env or {})}
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"gateway-{id(self)}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> GatewayProcess:
        """Spawn `gateway serve` and wait until it is ready."""
        from tests.helpers import wait_healthy

        self.spawn()
        if wait_healthy(self.proc, f"{self.url}/readyz", timeout, "gateway", self.log):
            return self
        self.stop()
        raise RuntimeError(f"gateway did not become ready: {self.log()}")

    def spawn(self) -> GatewayProcess:
        """Start `gateway serve` (in a session of its own) without waiting for it."""
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(self.config),
            "--data-dir",
            str(self.data_dir),
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if hasattr(self, "_log"):
            self._log.close()


def write_config(path: Path, upstream_url: str, *, extra: str = "") -> Path:
    """The tests' gateway config (bench.harness's writer): the mock upstream at `upstream_url`,
    fsync, short timeouts, and the demo provider; `extra`: more TOML."""
    sections = {
        "storage": {"durability": "fsync", "lock_timeout": 10},
        "providers.mock": {
            "kind": "openai",
            "base_url": f"{upstream_url}/v1",
            "timeout": 5,
            "connect_timeout": 2,
        },
        "providers.demo": {"kind": "demo"},
    }
    return harness.write_config(path, "mock", sections, extra=extra)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, upstream_server: MockServer
) -> Iterator[GatewayProcess]:
    """One `gateway serve` per test module against the mock upstream (reset for each test by
    the `upstream` fixture): tests use conversation ids of their own and look only at those."""
    root = tmp_path_factory.mktemp("gateway")
    config = write_config(root / "gateway.toml", upstream_server.url)
    proc = GatewayProcess(config, root / "var").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def mock_upstream() -> MockUpstream:
    return MockUpstream(name="mock")


def make_settings(tmp_path: Path | None = None, **storage: Any) -> Settings:
    overrides: dict[str, Any] = {
        "default_provider": "mock",
        "providers": {"mock": {"kind": "openai", "base_url": "http://mock.invalid/v1"}},
        "storage": {"backend": "jsonl" if tmp_path else "memory", "lock_timeout": 2, **storage},
    }
    if tmp_path is not None:
        overrides["storage"]["data_dir"] = str(tmp_path / "var")
    return load_settings(REPO / "tests" / "empty.toml", environ={}, overrides=overrides)


@pytest.fixture
def memory_store() -> MemoryStore:
    return MemoryStore()


def build_client(
    settings: Settings, store: Store | None, upstream: MockUpstream, *, tracing: Tracing | None = None
) -> httpx.AsyncClient:
    app = create_app(settings, store=store, router=Router({"mock": upstream}, "mock"), tracing=tracing)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway.test")


def app_of(client: httpx.AsyncClient) -> Any:
    """The app behind a `build_client` client (its state: summarizer, processor, ...)."""
    return client._transport.app  # type: ignore[attr-defined]


@pytest.fixture
async def app_client(
    memory_store: MemoryStore, mock_upstream: MockUpstream
) -> AsyncIterator[httpx.AsyncClient]:
    async with build_client(make_settings(), memory_store, mock_upstream) as client:
        yield client
