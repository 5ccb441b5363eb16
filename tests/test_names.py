"""One name, one place: the package writes no state, rule or code of a lifecycle as a
string outside the module that defines it; everything else names the enum member.

A string counts where it stands for such a name: compared with something named like a
state (``lease.state == "releasing"``, ``entry.state != "abandoned"``), passed as a
keyword or default named so (``state="abandoned"``, ``rule="drain"``), assigned to a
name so named (``DRAIN_RULE = "drain"``), given as a metric label, or listed with others
of the same vocabulary (a tuple of ``"pending", "draining", "applying"``, a dict keyed by
rules). The same word in another vocabulary (JupyterHub's ``state=active`` filter, MIG
Manager's label values, a policy key named ``budget``) is not named so and is left alone.

To check another vocabulary (the kinds, once their names live in the kinds modules
alone), add a line to :data:`VOCABULARIES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from enum import StrEnum
from pathlib import Path

import pytest

from mig_spawner.core.keep import KeepOutcome
from mig_spawner.core.layout import PlanState
from mig_spawner.core.lifecycle import (
    LeaseState,
    ReleaseCode,
    StopRule,
    WaitState,
    WarningEvent,
    WarningState,
)
from mig_spawner.observe.slice_state import SLICE_STATES

PACKAGE = Path(__file__).resolve().parents[1] / "mig_spawner"
LIFECYCLE = "mig_spawner/core/lifecycle.py"

#: Each vocabulary: its names, and the modules that may write them as strings.
VOCABULARIES: dict[str, tuple[Iterable[str], tuple[str, ...]]] = {
    "LeaseState": (LeaseState, (LIFECYCLE,)),
    "WaitState": (WaitState, (LIFECYCLE,)),
    "WarningState": (WarningState, (LIFECYCLE,)),
    "WarningEvent": (WarningEvent, (LIFECYCLE,)),
    "StopRule": (StopRule, (LIFECYCLE,)),
    "ReleaseCode": (ReleaseCode, (LIFECYCLE,)),
    "PlanState": (PlanState, ("mig_spawner/core/layout.py",)),
    "KeepOutcome": (KeepOutcome, ("mig_spawner/core/keep.py",)),
    "slice map states": (SLICE_STATES, ("mig_spawner/observe/slice_state.py",)),
    # "Kind": (Kind, ("mig_spawner/core/kinds.py", "mig_spawner/kinds.py")),
}
#: Frozen history: a migration writes the values as they were.
SKIPPED = ("mig_spawner/ledger/migrations/",)
#: What a name that stands for a lifecycle's name contains.
NAMED = ("state", "warning", "rule", "outcome", "code", "event")


def _words(vocabulary: Iterable[str]) -> set[str]:
    return {str(v.value) if isinstance(v, StrEnum) else str(v) for v in vocabulary}


VOCABULARY_OF = {name: _words(words) for name, (words, _) in VOCABULARIES.items()}
HOMES = {name: homes for name, (_, homes) in VOCABULARIES.items()}


def _named(name: str) -> bool:
    return any(word in name.lower() for word in NAMED)


def _names_a_state(node: ast.expr) -> bool:
    """``x.state``, ``state``, ``lease.warning`` (``.value`` of one too)."""
    while isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    if isinstance(node, ast.Attribute):
        return _named(node.attr)
    return isinstance(node, ast.Name) and _named(node.id)


def _strings(node: ast.expr | None) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _standing_for_names(tree: ast.AST) -> Iterator[tuple[ast.Constant, str]]:
    """Every string of ``tree`` that stands for a name, and how."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_names_a_state, sides)):
                yield from ((s, "compared") for side in sides for s in _strings(side))
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg and _named(keyword.arg):
                    yield from ((s, f"{keyword.arg}=") for s in _strings(keyword.value))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "labels":
                yield from ((s, "metric label") for a in node.args for s in _strings(a))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(map(_names_a_state, targets)):
                yield from ((s, "assigned") for s in _strings(node.value))
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            pairs = [*zip(positional[len(positional) - len(node.defaults):], node.defaults,
                          strict=True),
                     *zip(node.kwonlyargs, node.kw_defaults, strict=True)]
            for arg, default in pairs:
                if _named(arg.arg):
                    yield from ((s, "default") for s in _strings(default))
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            elements = node.keys if isinstance(node, ast.Dict) else node.elts
            strings = [s for e in elements for s in _strings(e)]
            if len(strings) >= 2 and len(strings) == len(elements) and any(
                    {s.value for s in strings} <= words for words in VOCABULARY_OF.values()):
                yield from ((s, "listed") for s in strings)


def stray_names(source: str, module: str) -> list[str]:
    """``line: 'name' (how)`` for each lifecycle name ``source`` writes as a string where
    ``module`` is not a home of its vocabulary."""
    found = []
    for string, how in _standing_for_names(ast.parse(source)):
        vocabularies = [v for v, words in VOCABULARY_OF.items() if string.value in words]
        if vocabularies and not any(module in HOMES[v] for v in vocabularies):
            found.append(f"{string.lineno}: {string.value!r} ({how}; {', '.join(vocabularies)})")
    return found


@pytest.mark.parametrize("snippet", [
    'if lease.state == "releasing": pass',
    'if entry.state.value != "abandoned": pass',
    'ledger.waits.cancel(entry.id, "gone", state="abandoned")',
    'DRAIN_RULE = "drain"',
    'def warn(rule="server_idle"): pass',
    'metrics.reclaimed.labels("orphan", group).inc()',
    'for state in ("pending", "draining", "applying"): pass',
    'REASONS = {"server_idle": "idle", "budget": "spent"}',
])
def test_the_check_finds_a_name_written_as_a_string(snippet):
    assert stray_names(snippet, "mig_spawner/elsewhere.py"), snippet


@pytest.mark.parametrize("snippet", [
    'labels.get(CONFIG_STATE_LABEL) == "success"',  # not a lifecycle's word
    'iter_users(state=ACTIVE_USERS)',
    '{"budget": 1, "user_budget": 2}',  # policy keys, not listed as one vocabulary
    'if lease.state is LeaseState.RELEASING: pass',
])
def test_the_check_leaves_other_words_and_members_alone(snippet):
    assert stray_names(snippet, "mig_spawner/elsewhere.py") == []


def test_the_package_writes_no_lifecycle_name_as_a_string_outside_its_home():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).as_posix()
        if module.startswith(SKIPPED):
            continue
        found += [f"{module}:{line}" for line in stray_names(path.read_text(), module)]
    assert found == [], "name the enum member instead:\n" + "\n".join(found)
