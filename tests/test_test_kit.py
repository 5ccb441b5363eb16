"""The test kit keeps its own rules: helpers live in tests/support (no test module
imports another), and there is one way to wait (tests/support/polling.py)."""

from __future__ import annotations

import ast
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
