"""Which process writes a response log: `host/pid/start` in its request record.

It lets a reader tell an attempt still in progress from one whose process is gone (killed
mid-request: its log was never marked incomplete).
"""

from __future__ import annotations

import os
import socket

_HOST = socket.gethostname()
_mine: tuple[int, str] | None = None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in (b"Z", b"X"):  # a zombie: it has stopped, not yet reaped
        return None
    return fields[19].decode() if len(fields) > 19 else None


def writer() -> str:
    """This process, as its request records name it (computed once per process)."""
    global _mine
    pid = os.getpid()
    if _mine is None or _mine[0] != pid:  # (a forked worker is another process)
        _mine = (pid, f"{_HOST}/{pid}/{start_time(pid) or '?'}")
    return _mine[1]


def gone(name: object) -> bool:
    """Is the named writer a process of this host that no longer runs?

    False when it may still run, or cannot be told (another host, an unreadable /proc, an older
    record without it).
    """
    if not isinstance(name, str):
        return False
    host, _, rest = name.partition("/")
    pid, _, start = rest.partition("/")
    if host != _HOST or not pid.isdigit() or start in ("", "?"):
        return False
    if not os.path.isdir("/proc/self"):
        return False
    return start_time(int(pid)) != start
