"""Subprocesses for the benchmark: started on loopback, waited for, measured, always killed.

Every server runs in its own session (process group) with a parent-death signal, and
`Processes.stop_all()` (called from a `finally`) terminates each group it started, by id.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"
RESULTS = Path(__file__).resolve().parent.parent / "var" / "bench"


def write_result(payload: bytes, stamped: str, latest: str) -> str:
    """Write a run's JSON to var/bench/ as `{stamped}-{time}.json` and as `latest`; its name."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"{stamped}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (RESULTS / name).write_bytes(payload)
    (RESULTS / latest).write_bytes(payload)
    return name


_PR_SET_PDEATHSIG = 1


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not given before in this process (servers started one after the
    other bind theirs later: the kernel may offer a port twice meanwhile)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a server: no GATEWAY_* overrides, no proxies for loopback."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GATEWAY_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def http_status(port: int, path: str, timeout: float = 0.5) -> int | None:
    """GET http://127.0.0.1:port/path on a fresh connection; the status, or None if refused."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode())
            data = sock.recv(64)
    except OSError:
        return None
    parts = data.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1])


def process_tree(pid: int) -> Iterator[int]:
    """`pid` and all its live descendants (at most 10,000), each once."""
    todo = [pid]
    seen: set[int] = set()
    while todo and len(seen) < 10_000:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        yield p
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue


def rss_kib(pid: int) -> int:
    """VmRSS of `pid` plus all its descendants, in KiB (0 if gone)."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` plus all its live descendants, in seconds (0 if gone):
    CPU per request stays meaningful when other work shares the cores, unlike req/s."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


class Server:
    def __init__(
        self, name: str, argv: Sequence[str], port: int, log_path: Path, env: Mapping[str, str]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.log_path = log_path
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.ready_seconds = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, cwd: Path) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child keeps it
        try:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def wait_ready(self, path: str, timeout: float) -> float:
        """Poll `path` until it answers 200; return seconds since start."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if http_status(self.port, path) == 200:
                self.ready_seconds = time.perf_counter() - self.started
                return self.ready_seconds
            time.sleep(0.005)
        raise RuntimeError(f"{self.name} was not ready on {path} after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        # The session we created for it: its process group id is its pid. Signal the group even
        # if the leader already exited, so that none of its own children outlive the run.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        if proc.poll() is not None:
            return
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


class Processes:
    def __init__(self) -> None:
        self.servers: list[Server] = []

    def start(self, server: Server, cwd: Path) -> Server:
        self.servers.append(server)
        server.start(cwd)
        return server

    def tell_exited(self) -> None:
        """Print the log tail of every server that exited on its own (a run that failed)."""
        for server in self.servers:
            if server.proc is not None and server.proc.poll() is not None:
                print(f"--- {server.name} exited ({server.proc.returncode}); log tail:\n{server.log_tail()}")

    def stop_all(self) -> None:
        for server in reversed(self.servers):
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"warning: could not stop {server.name}: {exc}")
