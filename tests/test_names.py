"""One name, one place: the package writes no state, rule or code of a lifecycle as a
string outside the module that defines it; everything else names the enum member.

A string counts where it stands for such a name: compared with something named like a
state (``lease.state == "releasing"``, ``entry.state != "abandoned"``), passed as a
keyword or default named so (``state="abandoned"``, ``rule="drain"``), assigned to a
name so named (``DRAIN_RULE = "drain"``), given as a metric label, or listed with others
of the same vocabulary (a tuple of ``"pending", "draining", "applying"``, a dict keyed by
rules). The same word in another vocabulary (JupyterHub's ``state=active`` filter, MIG
Manager's label values, a policy key named ``budget``) is not named so and is left alone.

The kinds of slice answer for themselves (docs/architecture.md, "Kinds"): a kind's name
(``"pool"``, ``mig_mode="dynamic"``) and the whole GPU's profile name (``"gpu"``,
``catalog.WHOLE_GPU``) are written, and compared, only in their homes: the two kinds
modules, and the catalog that defines the whole GPU's profile. Elsewhere a comparison
with ``WHOLE_GPU`` or with a ``Kind`` member is a branch on a kind's name
(:func:`kind_comparisons`): the code asks the kind, its ``KindRules``, or
``catalog.is_whole_gpu``.

To check another vocabulary, add a line to :data:`VOCABULARIES`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from enum import StrEnum
from pathlib import Path

import pytest

from mig_spawner.core.catalog import WHOLE_GPU
from mig_spawner.core.keep import KeepOutcome
from mig_spawner.core.kinds import Kind
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
KINDS = ("mig_spawner/core/kinds.py", "mig_spawner/kinds.py")
#: Where the whole GPU's profile name may be written and compared: where it is defined.
WHOLE_GPU_HOMES = ("mig_spawner/core/catalog.py", *KINDS)

#: What a name that stands for a lifecycle's name contains.
LIFECYCLE_NAMED = ("state", "warning", "rule", "outcome", "code", "event")
#: ... for a kind's: ``mig_mode``, ``configured_mode`` (a ``kind=`` is another word's:
#: a metric's label, an offer's kind).
KIND_NAMED = ("mode",)
#: ... for the whole GPU's profile name: ``profile == "gpu"``, ``key = "gpu"``.
PROFILE_NAMED = ("profile", "key", "mode")

#: Each vocabulary: its names, the modules that may write them as strings, and what a
#: name that stands for one of them contains.
VOCABULARIES: dict[str, tuple[Iterable[str], tuple[str, ...], tuple[str, ...]]] = {
    "LeaseState": (LeaseState, (LIFECYCLE,), LIFECYCLE_NAMED),
    "WaitState": (WaitState, (LIFECYCLE,), LIFECYCLE_NAMED),
    "WarningState": (WarningState, (LIFECYCLE,), LIFECYCLE_NAMED),
    "WarningEvent": (WarningEvent, (LIFECYCLE,), LIFECYCLE_NAMED),
    "StopRule": (StopRule, (LIFECYCLE,), LIFECYCLE_NAMED),
    "ReleaseCode": (ReleaseCode, (LIFECYCLE,), LIFECYCLE_NAMED),
    "PlanState": (PlanState, ("mig_spawner/core/layout.py",), LIFECYCLE_NAMED),
    "KeepOutcome": (KeepOutcome, ("mig_spawner/core/keep.py",), LIFECYCLE_NAMED),
    "slice map states": (SLICE_STATES, ("mig_spawner/observe/slice_state.py",),
                         LIFECYCLE_NAMED),
    "Kind": (Kind, KINDS, KIND_NAMED),
    "the whole GPU's profile": ((WHOLE_GPU,), WHOLE_GPU_HOMES, PROFILE_NAMED),
}
#: Frozen history: a migration writes the values as they were.
SKIPPED = ("mig_spawner/ledger/migrations/",)


def _words(vocabulary: Iterable[str]) -> set[str]:
    return {str(v.value) if isinstance(v, StrEnum) else str(v) for v in vocabulary}


VOCABULARY_OF = {name: _words(words) for name, (words, _, _) in VOCABULARIES.items()}
HOMES = {name: homes for name, (_, homes, _) in VOCABULARIES.items()}
NAMED_FOR = {name: named for name, (_, _, named) in VOCABULARIES.items()}
NAMED = tuple({word for named in NAMED_FOR.values() for word in named})


def _named(name: str, named: Iterable[str] = NAMED) -> bool:
    return any(word in name.lower() for word in named)


def _identifier(node: ast.expr) -> str | None:
    """``state`` of ``x.state``, ``state``, ``x.state.value``; else ``None``."""
    while isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _names_a_state(node: ast.expr) -> bool:
    """``x.state``, ``state``, ``lease.warning`` (``.value`` of one too)."""
    name = _identifier(node)
    return name is not None and _named(name)


def _strings(node: ast.expr | None) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for element in node.elts for s in _strings(element)]
    return []


#: A string found standing for a name: the string, how, and the names it stood beside
#: (``None``: listed with others of its vocabulary, or a metric's label: any vocabulary).
Standing = tuple[ast.Constant, str, tuple[str, ...] | None]


def _standing_for_names(tree: ast.AST) -> Iterator[Standing]:
    """Every string of ``tree`` that stands for a name, and how."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = tuple(n for n in map(_identifier, sides) if n is not None and _named(n))
            if names:
                yield from ((s, "compared", names) for side in sides for s in _strings(side))
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg and _named(keyword.arg):
                    yield from ((s, f"{keyword.arg}=", (keyword.arg,))
                                for s in _strings(keyword.value))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "labels":
                yield from ((s, "metric label", None) for a in node.args for s in _strings(a))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = tuple(n for n in map(_identifier, targets) if n is not None and _named(n))
            if names:
                yield from ((s, "assigned", names) for s in _strings(node.value))
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            pairs = [*zip(positional[len(positional) - len(node.defaults):], node.defaults,
                          strict=True),
                     *zip(node.kwonlyargs, node.kw_defaults, strict=True)]
            for arg, default in pairs:
                if _named(arg.arg):
                    yield from ((s, "default", (arg.arg,)) for s in _strings(default))
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            elements = node.keys if isinstance(node, ast.Dict) else node.elts
            strings = [s for e in elements for s in _strings(e)]
            if len(strings) >= 2 and len(strings) == len(elements) and any(
                    {s.value for s in strings} <= words for words in VOCABULARY_OF.values()):
                yield from ((s, "listed", None) for s in strings)


def stray_names(source: str, module: str) -> list[str]:
    """``line: 'name' (how)`` for each lifecycle name ``source`` writes as a string where
    ``module`` is not a home of its vocabulary."""
    found = []
    for string, how, names in _standing_for_names(ast.parse(source)):
        vocabularies = [v for v, words in VOCABULARY_OF.items() if string.value in words
                        and (names is None or any(_named(n, NAMED_FOR[v]) for n in names))]
        if vocabularies and not any(module in HOMES[v] for v in vocabularies):
            found.append(f"{string.lineno}: {string.value!r} ({how}; {', '.join(vocabularies)})")
    return found


def kind_comparisons(source: str, module: str) -> list[str]:
    """``line: what (compared)`` for each comparison in ``source`` with the whole GPU's
    profile name or a kind's enum member, where ``module`` is not their home."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in [s for c in (node.left, *node.comparators)
                     for s in (c.elts if isinstance(c, ast.Tuple | ast.List | ast.Set) else [c])]:
            name = side.attr if isinstance(side, ast.Attribute) else getattr(side, "id", None)
            if name == "WHOLE_GPU" and module not in WHOLE_GPU_HOMES:
                found.append(f"{node.lineno}: WHOLE_GPU (compared)")
            elif (isinstance(side, ast.Attribute) and isinstance(side.value, ast.Name)
                  and side.value.id == "Kind" and module not in KINDS):
                found.append(f"{node.lineno}: Kind.{side.attr} (compared)")
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
    'if lease.mode == "kube": pass',
    'mig_mode = Enum(["pool", "dynamic"], default_value="pool")',
    'configured_mode = "pool"',
    'Mode = Literal["pool", "dynamic", "kube", "gpu"]',
    'name = "a whole GPU" if profile == "gpu" else profile',
])
def test_the_check_finds_a_name_written_as_a_string(snippet):
    assert stray_names(snippet, "mig_spawner/elsewhere.py"), snippet


@pytest.mark.parametrize("snippet", [
    'name = "a whole GPU" if profile == WHOLE_GPU else profile',
    'whole = offer_key(raw) == catalog.WHOLE_GPU',
    'if lease.kind is Kind.DYNAMIC: pass',
    'if rules.kind in (Kind.POOL, Kind.GPU): pass',
])
def test_the_check_finds_a_branch_on_a_kinds_name(snippet):
    assert kind_comparisons(snippet, "mig_spawner/elsewhere.py"), snippet
    assert kind_comparisons(snippet, "mig_spawner/kinds.py") == [] or "WHOLE" in snippet


@pytest.mark.parametrize("snippet", [
    'labels.get(CONFIG_STATE_LABEL) == "success"',  # not a lifecycle's word
    'iter_users(state=ACTIVE_USERS)',
    '{"budget": 1, "user_budget": 2}',  # policy keys, not listed as one vocabulary
    'if lease.state is LeaseState.RELEASING: pass',
    'devices.add((r.get("driver", ""), r.get("pool", ""), r.get("device", "")))',  # DRA's
    'row = {"gpu": change.gpu_index, "uuid": change.gpu_uuid}',  # a JSON key
    'if catalog.is_whole_gpu(profile): pass',
    'MIG_MODES = ("on", "off", "pending")',  # a GPU's MIG mode, not a warning's state
    'self.metrics.errors.labels(kind="gpu").inc()',  # where an error came from
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


def test_no_code_outside_the_kinds_modules_branches_on_a_kinds_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).as_posix()
        found += [f"{module}:{line}" for line in kind_comparisons(path.read_text(), module)]
    assert found == [], "ask the kind (its KindRules, catalog.is_whole_gpu):\n" + "\n".join(
        found)
