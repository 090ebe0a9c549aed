"""What the benchmark and the tests share: the gateway config writer and an OTLP/HTTP receiver.

The tests import from here (`tests.conftest.write_config` is this writer with the tests' own
sections, the tracing tests' receiver is `OtlpReceiver`); nothing here imports the tests.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson

Sections = Mapping[str, Mapping[str, object] | None]


def toml_value(value: object) -> str:
    """A TOML value: a string (JSON's escapes are TOML's), a boolean or a number."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return orjson.dumps(str(value)).decode()


def gateway_toml(default_provider: str, sections: Sections, *, header: str = "", extra: str = "") -> str:
    """A gateway config: `default_provider`, then each non-empty section (`providers.mock`,
    `storage`, ...) in order; `extra`: more TOML text at the end."""
    lines = [f"# {header}"] if header else []
    lines.append(f"default_provider = {toml_value(default_provider)}")
    for name, keys in sections.items():
        if keys:
            lines += ["", f"[{name}]", *(f"{key} = {toml_value(value)}" for key, value in keys.items())]
    return "\n".join(lines) + "\n" + extra


def write_config(
    path: Path, default_provider: str, sections: Sections, *, header: str = "", extra: str = ""
) -> Path:
    """Write `gateway_toml(...)` to `path`; `path`."""
    path.write_text(gateway_toml(default_provider, sections, header=header, extra=extra))
    return path


class OtlpReceiver:
    """A loopback OTLP/HTTP endpoint that answers every POST 200 (what a collector answers),
    in a thread of this process; `keep`: the (path, decompressed body) of each POST is kept."""

    def __init__(self, *, keep: bool = True) -> None:
        self.posts: list[tuple[str, bytes]] = []
        self.count = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if keep and self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver.lock:
                    receiver.count += 1
                    if keep:
                        receiver.posts.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def bodies(self, path: str) -> list[bytes]:
        """The bodies POSTed to `path` so far."""
        with self.lock:
            return [body for p, body in self.posts if p == path]
