"""Nothing the tests start outlives the test run, even a run that is interrupted.

Every process a test run starts carries the run's mark in its environment
(:data:`MARK`, set by the pytest process that leads the run and inherited by its xdist
workers; a hub under test passes it on to its servers, see ``hub_harness``). The
harness starts its long-lived processes (hubs with their proxies, slice services) in
process groups of their own with :func:`start`, which registers them here and asks the
kernel to send them SIGTERM when the thread that started them dies
(``PR_SET_PDEATHSIG``): a worker killed with ``kill -9`` takes its hubs down with it.
PostgreSQL clusters are registered by ``pg_fixture``, and made in the run's folder
(:func:`run_dir`), which goes with the run.

:func:`reap` ends them: the registered groups and clusters, everything this process
started (its descendants), and, in the process that leads the run, every process that
carries the run's mark (a server whose hub was killed is no one's child). SIGTERM
first, SIGKILL after :data:`GRACE` seconds. It runs

* on SIGTERM, in every pytest process of the run, before the process dies of it;
* when pytest ends, interrupted (SIGINT: pytest tears the fixtures down first) or not;
* at interpreter exit, in case pytest could not get that far;
* at the start of a run, for the marked processes of earlier runs whose leading pytest
  process is gone (killed with ``kill -9``): they are ended then, and said so.

The marks of two runs differ, so a run never touches another run's processes (another
worktree's suite, a test that runs pytest inside pytest).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
import pytest

#: The environment variable that marks a run's processes: ``<pid>:<start>:<random>`` of
#: the pytest process that leads the run.
MARK = "MIG_TEST_RUN"
#: Names the run's folder (in the system's temporary folder, named after the mark).
RUN_DIR = "MIG_TEST_RUN_DIR"
RUN_DIR_PREFIX = "mig-test-run-"
#: Seconds the processes have between SIGTERM and SIGKILL.
GRACE = 5.0
PR_SET_PDEATHSIG = 1
#: A cluster of pg_fixture's, as its postmaster's command line names it.
CLUSTER_DIR = re.compile(r"-D\s+(\S*/mig-spawner-pg-[^/\s]+)/data")

_started: dict[int, tuple[subprocess.Popen, str]] = {}
_clusters: dict[Path, str] = {}
_lock = threading.Lock()
_leads_run = False


def mark() -> str:
    """This run's mark (empty outside a test run)."""
    return os.environ.get(MARK, "")


def run_dir() -> Path | None:
    """The run's folder, for what must go when the run ends even if the process that
    made it was killed (a PostgreSQL cluster's files); ``None`` outside a test run."""
    folder = os.environ.get(RUN_DIR)
    return Path(folder) if folder else None


def start(args: list[str], what: str, *, interruptible: bool = False,
          **kw) -> subprocess.Popen:
    """``subprocess.Popen(args, **kw)`` in a process group of its own, sent SIGTERM when
    the calling thread dies, and ended by :func:`reap` if it is still running then.
    ``interruptible``: the process gets SIGINT at its default, as a terminal gives it,
    whatever this process inherited (a run started in the background, ``make test &``,
    ignores SIGINT, and so would its children)."""
    kw.setdefault("start_new_session", True)
    preexec = _dies_with(os.getpid()) if _on_main_thread() else None
    kw["preexec_fn"] = _default_sigint(preexec) if interruptible else preexec
    proc = subprocess.Popen(args, **kw)
    with _lock:
        _started[proc.pid] = (proc, what)
    return proc


def register_cluster(data_dir: Path) -> None:
    """A PostgreSQL cluster (its data directory) that :func:`reap` stops, if running."""
    with _lock:
        _clusters[data_dir] = "PostgreSQL"


def forget_cluster(data_dir: Path) -> None:
    """The cluster is stopped and deleted: nothing left to reap."""
    with _lock:
        _clusters.pop(data_dir, None)


def reap(*, marked: bool = False, earlier_runs: bool = False) -> list[str]:
    """End what this process started (registered or not) that still runs; with
    ``marked``, every other process carrying this run's mark too; with
    ``earlier_runs``, only the marked processes of runs whose leading pytest process
    is gone. Returns what was ended, in words (empty when nothing was left)."""
    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    groups: dict[int, str] = {}
    targets: dict[int, psutil.Process] = {}
    clusters: list[Path] = []
    if not earlier_runs:
        with _lock:
            started, clusters = list(_started.values()), list(_clusters)
        # Not waited for: its PID, and so its group's, is still its own.
        groups = {proc.pid: what for proc, what in started if proc.poll() is None}
        for postmaster in filter(None, map(_postmaster, clusters)):
            targets[postmaster.pid] = postmaster
        for child in _quietly(lambda: me.children(recursive=True), []):
            if not _interpreters_own(child):
                targets[child.pid] = child
    if marked or earlier_runs:
        for process in _marked(None if earlier_runs else mark()):
            targets[process.pid] = process
    for pid in spared:
        targets.pop(pid, None)
    ended = [f"{what} (PID {pid})" for pid, what in groups.items()]
    ended += [_describe(p) for pid, p in targets.items() if pid not in groups]
    _signal(groups, targets.values(), signal.SIGTERM)
    _, alive = psutil.wait_procs(list(targets.values()), timeout=GRACE)
    _signal(groups, alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=GRACE)
    for data_dir in _cluster_dirs(targets.values()) | set(clusters):
        if _postmaster(data_dir) is None:
            shutil.rmtree(data_dir.parent, ignore_errors=True)
            forget_cluster(data_dir)
    if marked and (folder := run_dir()) is not None:
        shutil.rmtree(folder, ignore_errors=True)  # nothing of the run runs any more
    if earlier_runs:
        for folder in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
            if not _leader_alive(folder.name.removeprefix(RUN_DIR_PREFIX).replace("_", ":")):
                shutil.rmtree(folder, ignore_errors=True)
    return ended


# --- pytest ---------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Mark the run (in the process that leads it), end what earlier runs killed with
    ``kill -9`` left, and reap on SIGTERM and at exit."""
    global _leads_run
    if not hasattr(config, "workerinput"):  # not an xdist worker: this process leads
        _leads_run = True
        left = reap(earlier_runs=True)
        if left:
            _say(f"ended what killed test runs left: {'; '.join(left)}")
        me = psutil.Process()
        os.environ[MARK] = f"{me.pid}:{me.create_time():.2f}:{uuid.uuid4().hex[:8]}"
        folder = Path(tempfile.gettempdir()) / (RUN_DIR_PREFIX + mark().replace(":", "_"))
        folder.mkdir()
        folder.chmod(0o711)  # a cluster inside runs as the postgres user
        os.environ[RUN_DIR] = str(folder)
    if _on_main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(reap, marked=_leads_run)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over (its workers too, in the process that leads it): end what is
    left, and say what that was."""
    left = reap(marked=_leads_run)
    if left:
        _say(f"ended what the tests left running: {'; '.join(left)}")


def _on_sigterm(signum: int, frame: object) -> None:
    reap(marked=_leads_run)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _say(message: str) -> None:
    print(f"\n[tests/support/reaper] {message}", file=sys.stderr, flush=True)


# --- processes ------------------------------------------------------------------------


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _dies_with(parent: int) -> Callable[[], None]:
    """Run in the child before it execs: SIGTERM when the parent's thread dies (the
    main thread here: one that ends with its work would take the child with it)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return preexec


def _default_sigint(then: Callable[[], None] | None) -> Callable[[], None]:
    """Run in the child before it execs: SIGINT back at its default, then ``then``."""

    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if then is not None:
            then()

    return preexec


def marked(run: str | None) -> list[psutil.Process]:
    """The processes carrying the mark ``run`` (:func:`mark` gives this run's); with
    ``None``, those of the runs whose leading pytest process is gone."""
    return list(_marked(run))


def _marked(run: str | None) -> Iterable[psutil.Process]:
    """The processes carrying ``run``'s mark; with ``None``, those whose run's leading
    process is gone (its PID free, or another process's now)."""
    needle = f"{MARK}=".encode()
    for process in psutil.process_iter():
        try:
            environ = Path(f"/proc/{process.pid}/environ").read_bytes()
        except OSError:
            continue
        at = environ.find(needle)
        if at < 0 or (at > 0 and environ[at - 1] != 0):
            continue
        value = environ[at + len(needle):].split(b"\0", 1)[0].decode(errors="replace")
        if (value == run) if run is not None else not _leader_alive(value):
            yield process


def _leader_alive(value: str) -> bool:
    try:
        pid, created, _ = value.split(":")
        return f"{psutil.Process(int(pid)).create_time():.2f}" == created
    except (ValueError, psutil.Error):
        return False


def _interpreters_own(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker (or fork server): Python's own helper, which
    ends with the process that started it, not something a test left."""
    return any("multiprocessing." in part for part in _quietly(process.cmdline, []))


def _postmaster(data_dir: Path) -> psutil.Process | None:
    """The running postmaster of the cluster in ``data_dir``, if any."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        process = psutil.Process(pid)
        return process if str(data_dir) in " ".join(process.cmdline()) else None
    except (OSError, ValueError, psutil.Error):
        return None


def _cluster_dirs(processes: Iterable[psutil.Process]) -> set[Path]:
    found = set()
    for process in processes:
        cmdline = " ".join(_quietly(process.cmdline, []))
        if match := CLUSTER_DIR.search(cmdline):
            found.add(Path(match.group(1)) / "data")
    return found


def _describe(process: psutil.Process) -> str:
    name = " ".join(_quietly(process.cmdline, [])[:3]) or "?"
    return f"{name[:80]} (PID {process.pid})"


def _signal(groups: dict[int, str], processes: Iterable[psutil.Process], signum: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signum)


def _quietly(call: Callable, default):
    try:
        return call()
    except psutil.Error:
        return default
