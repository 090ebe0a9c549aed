"""Which process wrote a response log, and whether it is gone (a killed writer's attempt is read
as interrupted, not in progress)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from gateway.writers import gone, start_time, writer


def test_a_writer_is_gone_once_its_process_stopped_even_before_it_is_reaped() -> None:
    assert not gone(writer())  # this process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    name = f"{socket.gethostname()}/{child.pid}/{start_time(child.pid)}"
    assert not gone(name)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped: a zombie
    assert gone(name)  # a zombie (exited, not yet reaped) has stopped
    child.wait()
    assert gone(name)
    # Another host, a malformed or missing name: it cannot be told, so not gone.
    assert not gone(f"elsewhere/{child.pid}/1") and not gone("junk") and not gone(None)
