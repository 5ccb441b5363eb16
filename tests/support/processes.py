"""Processes the tests start, and what the tests read of them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.polling import until


def past_exec(proc: subprocess.Popen, timeout: float = 30) -> subprocess.Popen:
    """``proc`` once its ``/proc/<pid>/environ`` is its own: ``Popen`` returns as the
    child execs, and for a moment after, that file reads empty (seen in 3 of 4 reads
    made at once); a holder check would then find nothing in it."""
    until(lambda: Path(f"/proc/{proc.pid}/environ").read_bytes(), timeout,
          f"PID {proc.pid} past its exec", every=0.005)
    return proc
