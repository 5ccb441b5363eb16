"""Imports point down: the package's import graph, read from its source, has no circle,
and no module imports from a layer above its own (docs/architecture.md, "Layers").

Every import counts, wherever it is written: at the top, inside a function (imported
late to keep a command fast) or under ``TYPE_CHECKING`` (a type is a dependency too).
``from P import m`` counts as an import of ``P.m`` where that is a module, else of
``P``. A module may import its own layer and those below it; the core imports nothing
but the core and the standard library.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mig_spawner"

#: The layers, lowest first, and the top-level parts of the package in each. The same
#: map is drawn in docs/architecture.md ("Layers"), which this test reads back.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("core",)),
    ("adapters", ("gpu", "ledger", "hub", "kube", "device_cgroup", "config")),
    ("composed", ("kinds", "holder", "release", "layout", "health", "observe", "report")),
    ("products", ("spawner", "service", "cli", "singleuser")),
)
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}
LAYER_NAME = {part: name for name, parts in LAYERS for part in parts}


def module_names(root: Path) -> dict[str, Path]:
    """``mig_spawner.x.y`` -> its file, for every module of the package under ``root``."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(module: str, source: str, is_package: bool, modules: Iterable[str]
               ) -> set[str]:
    """The package's modules that ``module`` (whose text is ``source``) imports."""
    known = set(modules)
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {name for name in found if name in known and name != module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_names(root)
    return {name: imports_of(name, path.read_text(), path.name == "__init__.py", modules)
            for name, path in modules.items()}


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected set of two or more
    modules, sorted (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def part_of(module: str) -> str:
    """The top-level part of the package ``module`` belongs to (``""``: the package's
    own ``__init__``, which imports nothing and may be imported by all)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """``a -> b (layer -> higher layer)`` for each import that points up the layer map."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            mine, theirs = part_of(module), part_of(target)
            if theirs and RANK[theirs] > RANK.get(mine, -1):
                found.append(f"{module} -> {target} ({LAYER_NAME.get(mine, 'the package')} "
                             f"-> {LAYER_NAME[theirs]})")
    return found


def outside_the_stdlib(root: Path = ROOT) -> list[str]:
    """``module: name`` for each import in the core of neither the core nor the
    standard library."""
    found = []
    for name, path in module_names(root).items():
        if part_of(name) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = [node.module or ""]
            else:
                continue
            found += [f"{name}: {top}" for top in tops
                      if top.split(".")[0] not in sys.stdlib_module_names
                      and not (top == f"{PACKAGE}.core" or top.startswith(f"{PACKAGE}.core."))]
    return found


# --- the checks work -------------------------------------------------------------------


def test_a_circle_is_found_however_long_and_a_chain_is_not():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_an_import_is_read_wherever_it_is_written_and_resolved_to_its_module():
    modules = ["mig_spawner.spawner", "mig_spawner.spawner.mixin", "mig_spawner.spawner.form",
               "mig_spawner.ledger", "mig_spawner.cli.main", "mig_spawner.cli.report"]
    source = ("from typing import TYPE_CHECKING\n"
              "from . import form\n"
              "if TYPE_CHECKING:\n    from ..ledger import Lease\n"
              "def later():\n    import mig_spawner.cli.main\n"
              "    from mig_spawner.cli import report\n")
    assert imports_of("mig_spawner.spawner.mixin", source, False, modules) == {
        "mig_spawner.spawner.form", "mig_spawner.ledger", "mig_spawner.cli.main",
        "mig_spawner.cli.report"}


@pytest.mark.parametrize(("graph", "found"), [
    ({"mig_spawner.kinds": {"mig_spawner.spawner.isolation"}},
     ["mig_spawner.kinds -> mig_spawner.spawner.isolation (composed -> products)"]),
    ({"mig_spawner.core.kinds": {"mig_spawner.ledger.records"}},
     ["mig_spawner.core.kinds -> mig_spawner.ledger.records (core -> adapters)"]),
    ({"mig_spawner.spawner.mixin": {"mig_spawner.service.app", "mig_spawner.kinds",
                                    "mig_spawner.core.kinds", "mig_spawner"}}, []),
])
def test_an_import_up_the_layer_map_is_found(graph, found):
    assert upward(graph) == found


# --- the package ---------------------------------------------------------------------


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(name) for name in module_names(ROOT)} - {""}
    assert parts - set(RANK) == set(), "add it to LAYERS and to docs/architecture.md"


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_no_import_points_up_the_layer_map():
    assert upward(import_graph()) == []


def test_the_core_imports_only_the_core_and_the_standard_library():
    assert outside_the_stdlib() == []


def test_the_package_root_imports_nothing_of_the_package():
    assert import_graph()[PACKAGE] == set()


def test_the_architecture_doc_draws_the_layers_this_test_enforces():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \*\*(\w+)\*\* \| ([^|]+) \|", section, re.MULTILINE)
    drawn = tuple((name, tuple(re.findall(r"`(\w+)(?:/|\.py)`", parts))) for name, parts in rows)
    assert drawn == LAYERS
