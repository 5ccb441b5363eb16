"""The ``mig-spawner`` command run in-process, as its process would end."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import traceback
from pathlib import Path

from mig_spawner.cli.main import main


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``mig-spawner *args`` in ``cwd``, as its process would end: the status, stdout
    and stderr (an exception that escapes ``main`` is a traceback and status 1)."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                status = e.code if isinstance(e.code, int) else 1
            except Exception:  # what the interpreter does with it
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["mig-spawner", *args], status or 0,
                                       out.getvalue(), err.getvalue())
