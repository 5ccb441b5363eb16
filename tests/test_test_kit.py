"""The test kit keeps its own rules: helpers live in tests/support (no test module
imports another), there is one way to wait (tests/support/polling.py), the harness's
failures show the hub's log and the slice service's, the tests that
share a module's (or a class's) hub run on one xdist worker
(tests/support/scheduling.py), and a test run that is interrupted leaves no process
behind (tests/support/reaper.py): shown on a child pytest that runs a real hub, its
proxy, a server, the slice service and a PostgreSQL cluster, and is stopped with
SIGINT, SIGTERM or SIGKILL."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from tests.support import reaper
from tests.support.hub_harness import STARTED, HubError, HubProcess
from tests.support.polling import until

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")])
#: Names a polling helper of its own would have.
POLLER_NAMES = {"until", "until_async", "wait_for", "wait_until", "eventually", "poll_until"}


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_no_test_module_imports_from_another():
    """Shared helpers live in tests/support (or tests/mocking.py): a test module that
    imports another one runs its fixtures and module-level code twice, and hides the
    helper from whoever looks in tests/support."""
    found = [f"{path.relative_to(REPO)}: {name}"
             for path in SOURCES for name in _imported(ast.parse(path.read_text()))
             if any(part.startswith(("test_", "conftest"))
                    for part in name.lstrip(".").split("."))]
    assert found == []


def test_one_way_to_wait():
    """No polling helper beside tests/support/polling.py's ``until``."""
    polling = REPO / "tests" / "support" / "polling.py"
    found = [f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
             for path in SOURCES if path != polling
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
             and node.name in POLLER_NAMES]
    assert found == []


class Refusing(BaseHTTPRequestHandler):
    """A hub API that refuses every request, as a hub in trouble does."""

    def _refuse(self) -> None:
        body = b'{"status": 503, "message": "no"}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _refuse

    def log_message(self, *args: object) -> None:
        pass


def test_a_failing_harness_call_shows_the_hub_and_service_logs(tmp_path):
    """A spawn answered with a status the test did not expect, or a stop refused, fails
    with the hub's log (less the harness's own polls) and the slice service's."""
    (tmp_path / "hub.log").write_text(
        "[E hub] the claim failed: ledger locked\n"
        + "[I hub] 200 GET /hub/api/users/ana (test-harness@127.0.0.1) 5ms\n" * 500)
    (tmp_path / "service.log").write_text("[W service] sweep cut short\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub = HubProcess(tmp_path, tmp_path / "jupyterhub_config.py",
                         f"http://127.0.0.1:{server.server_port}", "t" * 32,
                         beside=[tmp_path / "service.log"])
        for call in (lambda: hub.spawn("ana", {"profile": "small"}, expect=STARTED),
                     lambda: hub.stop_server("ana")):
            with pytest.raises(HubError) as failed:
                call()
            said = str(failed.value)
            assert "503" in said and "ledger locked" in said, said
            assert "sweep cut short" in said and "test-harness@" not in said, said
    finally:
        server.shutdown()
        server.server_close()


def test_every_sleep_in_a_test_says_why():
    """Tests wait on events (``until``); a sleep left in a test module is a user's pace,
    a real clock under test or one turn of the event loop, and its line says which
    (docs/testing.md). A program a test runs (a string) may sleep: that is its work."""
    found = []
    for path in SOURCES:
        if path.parent.name == "support" or "tests" not in path.relative_to(REPO).parts[:1]:
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "sleep" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("time", "asyncio")
                    and "  # " not in lines[node.lineno - 1]):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


#: Three modules: one whose tests share a module's fixture, one whose classes each share
#: a class's, and unit tests.
SHARING = {
    "test_module_hub.py": """
        import pytest

        @pytest.fixture(scope="module")
        def hub():
            return object()

        @pytest.mark.parametrize("n", range(6))
        def test_a(hub, n):
            pass
    """,
    "test_class_hubs.py": """
        import pytest

        @pytest.fixture(scope="class")
        def hub():
            return object()

        class TestOne:
            @pytest.mark.parametrize("n", range(4))
            def test_x(self, hub, n):
                pass

        class TestTwo:
            @pytest.mark.parametrize("n", range(4))
            def test_y(self, hub, n):
                pass
    """,
    "test_units.py": """
        import pytest

        @pytest.mark.parametrize("n", range(12))
        def test_u(n):
            pass
    """,
}


def child_env() -> dict[str, str]:
    """The environment for a pytest run inside this one: none of this run's own."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PYTEST_", "MIG_TEST_"))}


def child_pytest(*args: str) -> list[str]:
    """``pytest ARGS`` on the suite's config and plugins, as a command line."""
    return [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"),
            "--rootdir", str(REPO), "-p", "tests.conftest", "-p", "no:cacheprovider", *args]


def test_tests_sharing_a_hub_run_on_one_worker(tmp_path):
    for name, text in SHARING.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    done = subprocess.run(child_pytest("-n", "2", "-v", str(tmp_path)), cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:]
    workers = defaultdict(set)
    passed = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED \S*?(test_\w+\.py::\w+)", done.stdout)
    for worker, test in passed:
        workers[test].add(worker)
    assert len(workers) == 4, done.stdout[-3000:]
    for group in ("test_module_hub.py::test_a", "test_class_hubs.py::TestOne",
                  "test_class_hubs.py::TestTwo"):
        assert len(workers[group]) == 1, (group, done.stdout[-3000:])


# --- an interrupted run -----------------------------------------------------------------

#: The child run's test: everything the harness starts, then it waits to be interrupted.
INNER = '''
import json, os, time
from pathlib import Path

import pytest

from tests.support import reaper
from tests.support.hub_harness import start_mig_hub
from tests.support.slice_service import SERVICE_CONFIG, Service


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = start_mig_hub(tmp_path_factory.mktemp("hub"), "h200x1:layout=1g.18gb*7",
                        SERVICE_CONFIG)
    hub.create_user("ana", groups=["analysts"])
    yield hub
    hub.close()


def test_runs_until_interrupted(hub, postgres_server):
    service = Service(hub, hub.config_path)
    service.wait_up()
    assert hub.spawn("ana", {"profile": "small"}).status_code in (201, 202)
    hub.wait_ready("ana", timeout=240)
    Path(os.environ["READY_FILE"]).write_text(json.dumps({
        "mark": reaper.mark(), "hub": hub.proc.pid, "service": service.proc.pid,
        "server": hub.server_state("ana")["pid"],
        "cluster": str(postgres_server.data_dir)}))
    time.sleep(3600)
'''


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pytest(tmp_path: Path, *args: str, name: str) -> subprocess.Popen:
    """A pytest run of its own (its own mark), output in ``tmp_path/<name>.log``."""
    # Interruptible: the child is a run as a terminal starts it, even where this run was
    # started in the background (which ignores SIGINT, and its children would too).
    return reaper.start(child_pytest("-q", *args), "a child pytest", interruptible=True,
                        cwd=REPO,
                        env={**child_env(), "READY_FILE": str(tmp_path / "ready.json")},
                        stdout=(tmp_path / f"{name}.log").open("wb"),
                        stderr=subprocess.STDOUT)


@pytest.mark.hub
@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_an_interrupted_run_leaves_no_process_behind(tmp_path, signum):
    """The child run leads with an xdist worker, as the suite runs, and gets the signal
    as ``kill`` sends it (to the run's leading process only). SIGINT: pytest tears down
    and the reaper ends the rest; SIGTERM: the reaper ends everything before the
    process dies of it; SIGKILL: the hub and the service die with the worker, and the
    next run ends what is left (the server, PostgreSQL, the worker)."""
    inner = tmp_path / "test_inner.py"
    inner.write_text(textwrap.dedent(INNER))
    log = tmp_path / "run.log"
    run = _pytest(tmp_path, "-n", "1", str(inner), name="run")
    ready = tmp_path / "ready.json"
    started = {}
    try:
        def up() -> bool:
            assert run.poll() is None, log.read_text()
            return ready.exists() and bool(ready.read_text())

        until(up, 420, "the child run's hub, server, service and cluster", show=log,
              every=0.5)
        started = json.loads(ready.read_text())
        assert reaper.marked(started["mark"])  # what the child run started carries it
        run.send_signal(signum)
        until(lambda: run.poll() is not None, 120, "the child run ended", show=log)
        if signum == signal.SIGKILL:
            after = _pytest(tmp_path, "--collect-only", "-n", "0", str(inner), name="after")
            until(lambda: after.poll() is not None, 120, "the next run", show=log)
            said = (tmp_path / "after.log").read_text()
            assert "ended what killed test runs left" in said, said
        left = [p.pid for p in reaper.marked(started["mark"])]
        assert left == [], log.read_text()[-3000:]
        for what in ("hub", "service", "server"):
            assert not _alive(started[what]), (what, log.read_text()[-3000:])
        assert not Path(started["cluster"]).exists()
        if signum == signal.SIGINT:
            assert run.returncode == pytest.ExitCode.INTERRUPTED, log.read_text()[-3000:]
        else:
            assert run.returncode == -signum
    finally:
        if run.poll() is None:
            run.kill()
        for process in reaper.marked(started["mark"]) if started else ():
            process.kill()
