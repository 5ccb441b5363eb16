"""The test kit keeps its own rules: helpers live in tests/support (no test module
imports another), there is one way to wait (tests/support/polling.py), and the tests
that share a module's (or a class's) hub run on one xdist worker
(tests/support/scheduling.py)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

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
