"""Running the app: `serve` (uvicorn, one or more workers) and an in-thread server for `demo`."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from gateway.config import Settings


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("gateway")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def set_head_timeout(settings: Settings) -> None:
    """The request head shares `server.body_timeout`. Called by `app_from_env`, which every
    serving process (worker) runs."""
    try:
        from gateway.protocol import HeadDeadlineProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol, without the deadline
        return
    HeadDeadlineProtocol.head_timeout = float(settings.server.body_timeout)


def _loop_and_http() -> dict[str, Any]:
    opts: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        opts["loop"] = "uvloop"
    except ImportError:
        opts["loop"] = "asyncio"
    try:
        import httptools  # noqa: F401

        from gateway.protocol import HeadDeadlineProtocol

        opts["http"] = HeadDeadlineProtocol
    except ImportError:
        opts["http"] = "h11"
    return opts


def serve(settings: Settings, *, workers: int = 1, log_level: str = "info") -> None:
    """Run the gateway in the foreground. Workers re-read settings from the environment."""
    configure_logging(log_level)
    logging.getLogger("gateway").info(
        "gateway listening on http://%s:%s (data dir %s, %d worker%s)",
        settings.server.host,
        settings.server.port,
        settings.storage.data_dir,
        workers,
        "" if workers == 1 else "s",
    )
    uvicorn.run(
        "gateway.app:app_from_env",
        factory=True,
        host=settings.server.host,
        port=settings.server.port,
        workers=workers,
        access_log=settings.server.access_log,
        log_level="warning",
        timeout_graceful_shutdown=5,
        **_loop_and_http(),
    )


@contextmanager
def running_in_thread(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve `app` on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", **_loop_and_http())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process gateway did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
