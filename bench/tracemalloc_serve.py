"""`gateway serve` with tracemalloc on, for bench/memory.py's `--tracemalloc`.

    python bench/tracemalloc_serve.py serve --config ... (gateway serve's arguments)

A file of its own, importing nothing of bench/: it is run as a script from the checkout being
measured, whose `gateway` it imports.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def serve_traced(argv: list[str]) -> None:
    """The gateway with tracemalloc on: SIGUSR1 dumps a snapshot named by the file
    $GATEWAY_TRACE_DIR/next (written by the driver before it signals)."""
    import tracemalloc

    tracemalloc.start(int(os.environ.get("GATEWAY_TRACE_FRAMES", "1")))
    folder = Path(os.environ["GATEWAY_TRACE_DIR"])

    def dump(signum: int, frame: object) -> None:
        name = (folder / "next").read_text().strip()
        tracemalloc.take_snapshot().dump(str(folder / f"{name}.snapshot.tmp"))
        os.replace(folder / f"{name}.snapshot.tmp", folder / f"{name}.snapshot")

    signal.signal(signal.SIGUSR1, dump)
    from gateway.cli import main as gateway_main

    gateway_main(argv, prog_name="gateway")


if __name__ == "__main__":
    serve_traced(sys.argv[1:])
