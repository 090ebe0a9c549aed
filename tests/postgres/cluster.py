"""A throwaway PostgreSQL cluster for the tests: initdb in a temp dir, pg_ctl on a free loopback
port, stopped at the end of the session. One cluster per pytest process, shared by every
fixture that asks for it (`postgres_dsn`), and a fresh database per test that needs one.

Tests never install software: `.ci/run` installs Debian's `postgresql` package; without its
binaries the PostgreSQL tests skip, loudly, saying so.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SUPERUSER = "gateway"
RUN_AS = "postgres"  # initdb refuses to run as root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_bin_dir() -> Path | None:
    """Where initdb and pg_ctl live: PATH first, then Debian's versioned folders, newest first."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name or 0), reverse=True
    )
    for folder in candidates:
        if (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    return None


class PostgresCluster:
    """initdb + pg_ctl in a temp dir; `dsn(db)` names a database on it."""

    def __init__(self, bin_dir: Path, *, durable: bool = False) -> None:
        self.bin_dir = bin_dir
        self.durable = durable  # fsync on (the benchmark); off for the tests' speed
        self.root = Path(tempfile.mkdtemp(prefix="gateway-pg-"))
        self.data = self.root / "data"
        self.port = 0
        self.as_user: str | None = None
        self.running = False
        self._contract_dsn = ""

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_user is not None:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)

    def start(self) -> PostgresCluster:
        if os.geteuid() == 0:
            self.as_user = RUN_AS
            shutil.chown(self.root, user=RUN_AS)
        init = self._run(
            "initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
            "--locale=C", "--no-sync",
        )  # fmt: skip
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed: {init.stderr.strip() or init.stdout.strip()}")
        for _ in range(5):
            self.port = _free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories='' "
                "-c max_connections=200 -c shared_buffers=32MB"
                + ("" if self.durable else " -c fsync=off -c full_page_writes=off")
            )
            started = self._run(
                "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options,
                "-w", "-t", "60", "start",
            )  # fmt: skip
            if started.returncode == 0:
                self.running = True
                return self
            if "could not bind" not in self.log():
                break
        raise RuntimeError(f"pg_ctl start failed: {started.stderr.strip()} {self.log()[-500:]}")

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "t") -> str:
        """A fresh database; returns its DSN."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        done = subprocess.run(
            [str(self.bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"createdb failed: {done.stderr.strip()}")
        return self.dsn(name)

    def contract_dsn(self) -> str:
        """One database shared by the store contract tests (each uses its own namespace)."""
        if not self._contract_dsn:
            self._contract_dsn = self.create_database("contract")
        return self._contract_dsn

    def stop(self) -> None:
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
            self.running = False
        shutil.rmtree(self.root, ignore_errors=True)


class _Shared:
    cluster: PostgresCluster | None = None
    failure: str = ""
    users = 0
    stopped = False


def skip_reason() -> str:
    return _Shared.failure


def acquire() -> PostgresCluster:
    """The session's cluster (started on first use), or a loud skip saying why there is none."""
    if _Shared.stopped:
        pytest.skip("the session's PostgreSQL cluster was already stopped")
    if _Shared.cluster is None and not _Shared.failure:
        started = time.monotonic()
        bin_dir = find_bin_dir()
        if bin_dir is None:
            _Shared.failure = (
                "the PostgreSQL server binaries (initdb, pg_ctl) are missing: "
                "apt-get install postgresql (as .ci/run does)"
            )
        if bin_dir is not None:
            try:
                _Shared.cluster = PostgresCluster(bin_dir).start()
                atexit.register(_Shared.cluster.stop)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                _Shared.failure = f"could not start a throwaway PostgreSQL cluster: {exc}"
        if _Shared.cluster is not None:
            took = time.monotonic() - started
            print(f"\n[postgres] test cluster on port {_Shared.cluster.port}, started in {took:.1f}s")
    if _Shared.cluster is None:
        pytest.skip(f"POSTGRES TESTS SKIPPED: {_Shared.failure}")
    _Shared.users += 1
    return _Shared.cluster


def release() -> None:
    _Shared.users -= 1
    if _Shared.users == 0 and _Shared.cluster is not None:
        _Shared.cluster.stop()
        _Shared.cluster = None
        _Shared.stopped = True


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    cluster = acquire()
    try:
        yield cluster
    finally:
        release()
