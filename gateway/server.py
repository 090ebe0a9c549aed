"""Running the app: `serve` (uvicorn, one or more workers) and an in-thread server for `demo`."""

from __future__ import annotations

import copy
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from gateway.config import Settings
from gateway.exceptions import GatewayError
from gateway.redact import RedactingFormatter

STARTUP_FAILURE = 3  # uvicorn's exit status when the app's startup fails
# `serve --log-level`, for worker processes (each starts a fresh interpreter).
LOG_LEVEL_ENV = "GATEWAY_SERVE_LOG_LEVEL"
# The `serve` process's pid, for its workers: they stop when it is gone.
SERVE_PID_ENV = "GATEWAY_SERVE_PID"


def configure_worker_logging() -> None:
    """In a worker process of `serve --workers N`: the same logging as a single process."""
    level = os.environ.get(LOG_LEVEL_ENV)
    if level and not logging.getLogger("gateway").handlers:
        configure_logging(level)


def follow_supervisor() -> None:
    """In a worker process of `serve --workers N`: stop (as on SIGTERM) when the supervisor is gone.

    The supervisor may be killed with SIGKILL, for example; the worker stops instead of serving on
    as an orphan that holds the port.
    """
    serve_pid = os.environ.get(SERVE_PID_ENV, "")  # (set by `serve` for its workers only)
    if not serve_pid.isdigit():
        return
    parent = int(serve_pid)  # (a worker that starts after its serve process died sees pid 1 here)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        logging.getLogger("gateway").warning("the serve process is gone: this worker stops")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(message)s"))
    root = logging.getLogger("gateway")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # Our lines are "%(message)s" (JSON built by the caller): skip what each log record would
    # otherwise look up (the caller's frame, the process id, the thread and process names), as
    # the logging HOWTO's "Optimization" section describes. One record per request costs less.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def set_head_timeout(settings: Settings) -> None:
    """Give the request head the deadline of the body: `server.body_timeout`, which both share.

    Called by `app_from_env`, which every serving process (worker) runs.
    """
    try:
        from gateway.protocol import HeadDeadlineProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol, without the deadline
        return
    HeadDeadlineProtocol.head_timeout = float(settings.server.body_timeout)


def loop_and_http() -> dict[str, Any]:
    """uvicorn's event loop and HTTP protocol options: the fastest installed (uvloop, httptools)."""
    opts: dict[str, Any] = {}
    try:
        import uvloop  # noqa: F401

        # uvloop, taking a burst of connections in a few passes (see gateway/listener.py)
        opts["loop"] = "gateway.listener:AcceptingLoop"
    except ImportError:
        opts["loop"] = "asyncio"
    try:
        import httptools  # noqa: F401

        from gateway.protocol import HeadDeadlineProtocol

        opts["http"] = HeadDeadlineProtocol
    except ImportError:
        opts["http"] = "h11"
    return opts


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket (as uvicorn binds one), or one clear line.

    A taken port is reported before anything claims to be listening.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            reason = "address already in use (try another --port)"
        else:
            reason = (exc.strerror or str(exc)).lower()
        raise GatewayError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def uvicorn_logging(access_log: bool) -> dict[str, Any]:
    """uvicorn's logging: its own lines from warnings up; its access lines (INFO) when asked for.

    A `log_level` would set the access logger's level too, and drop every access line."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["uvicorn"]["level"] = "WARNING"
    config["loggers"]["uvicorn.error"]["level"] = "WARNING"
    config["loggers"]["uvicorn.access"]["level"] = "INFO" if access_log else "WARNING"
    return config


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The options `serve` runs uvicorn with (the app from `gateway.app:app_from_env`)."""
    return {
        "factory": True,
        "access_log": settings.server.access_log,
        "log_config": uvicorn_logging(settings.server.access_log),
        "log_level": None,
        "timeout_graceful_shutdown": settings.server.shutdown_timeout,
        # Nothing reads the client's address or the scheme: no X-Forwarded-* layer per request.
        "proxy_headers": False,
        **loop_and_http(),
    }


def serve(settings: Settings, *, workers: int = 1, log_level: str = "info") -> None:
    """Run the gateway in the foreground. Workers re-read settings from the environment."""
    configure_logging(log_level)
    host, port = settings.server.host, settings.server.port
    sock = bind(host, port)
    options = uvicorn_options(settings)
    os.environ.pop(LOG_LEVEL_ENV, None)  # only the workers of this serve are told they are
    os.environ.pop(SERVE_PID_ENV, None)
    if workers > 1:
        os.environ[LOG_LEVEL_ENV] = log_level  # worker processes configure their own logging
        os.environ[SERVE_PID_ENV] = str(os.getpid())
        # uvicorn's supervisor binds the socket itself (its API for a given socket is
        # internal): ours only proved the port free, so the line below may precede it by a moment.
        sock.close()
        _listening(settings, port, workers)
        uvicorn.run("gateway.app:app_from_env", host=host, port=port, workers=workers, **options)
        return
    # One process: serve on the socket bound above, so "listening" is true when it is printed
    # (connections wait in the backlog while the app starts).
    sock.listen(2048)
    _listening(settings, sock.getsockname()[1], workers)
    server = uvicorn.Server(uvicorn.Config("gateway.app:app_from_env", **options))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def _listening(settings: Settings, port: int, workers: int) -> None:
    logging.getLogger("gateway").info(
        "gateway listening on http://%s:%s (%s, %d worker%s)",
        settings.server.host,
        port,
        settings.storage.where(),
        workers,
        "" if workers == 1 else "s",
    )


@contextmanager
def running_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` in a thread on `port` (0: a free one); yields its base URL."""
    sock = bind(host, port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", **loop_and_http())
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
