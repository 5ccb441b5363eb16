"""docs/architecture.md cites the code by name: every module, class, function, method,
setting, column and stored value it writes in backticks exists in the package, and where
it writes a chain (``core.kinds.offer_kind``, ``SliceKind.before_release``) each link is
defined where the one before it says; every file it names exists. A rename that leaves
the doc behind fails here. (The layer map it draws is checked by tests/test_layers.py.)
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mig_spawner"
DOC = ROOT / "docs" / "architecture.md"

#: A name as the doc cites it: dotted identifiers, perhaps called (``release(lease)``).
CITED_NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?$")
#: A file as the doc cites it: a path ending in a module, a page or a folder.
CITED_FILE = re.compile(r"^[\w./-]+(?:\.py|\.md|\.html|/)$")
#: Names the doc cites that are not the package's: PostgreSQL's, SQLAlchemy's, Python's.
FOREIGN = {"LISTEN", "do_commit", "None"}


@dataclass
class Names:
    """What the package defines, read from its source."""

    #: Module -> the names defined or imported at its top level (and its submodules).
    modules: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: Class name -> its members (methods, class attributes, ``self.x`` assignments).
    classes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: The ledger's tables -> their columns.
    tables: dict[str, set[str]] = field(default_factory=dict)
    #: Module -> the classes it defines.
    classes_in: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    #: Every name defined anywhere, and every string written (columns, settings, values).
    known: set[str] = field(default_factory=set)

    def in_module(self, module: str, name: str) -> bool:
        """Whether ``module`` (or, for a package, one of its modules) defines ``name``, at
        its top or in a class of it (``ledger.waits``: the ``Ledger``'s store)."""
        return name in self.modules[module] or any(
            name in self.classes[c] for m, cs in self.classes_in.items()
            if m == module or m.startswith(f"{module}.") for c in cs)

    def module(self, dotted: str) -> str | None:
        """The one module whose dotted name ends in ``dotted`` (``waiting``,
        ``core.kinds``, ``mig_spawner.release``), else ``None``."""
        found = [m for m in self.modules if m == dotted or m.endswith(f".{dotted}")]
        return found[0] if len(found) == 1 else None


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for element in node.elts for n in _targets(element)]
    return []


def read_package() -> Names:
    names = Names()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)
        names.known.update(parts)
        if len(parts) > 1:
            names.modules[".".join(parts[:-1])].add(parts[-1])
        tree = ast.parse(path.read_text())
        top = names.modules[module]
        # A metric's name is often its module's prefix and its own: f"{PREFIX}_name".
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Table"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                names.tables[node.args[0].value] = {
                    c.args[0].value for c in node.args
                    if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "Column"
                    and isinstance(c.args[0], ast.Constant)}
            if isinstance(node, ast.JoinedStr):
                pieces = [v.value if isinstance(v, ast.Constant) else
                          constants.get(getattr(v.value, "id", ""))
                          if isinstance(v, ast.FormattedValue) else None for v in node.values]
                if all(isinstance(piece, str) for piece in pieces):
                    names.known.add("".join(pieces))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                top.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    top.update(_targets(target))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                top.update((a.asname or a.name).split(".")[0] for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names.classes_in[module].add(node.name)
                members = names.classes[node.name]
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        members.add(item.name)
                    elif isinstance(item, ast.Assign | ast.AnnAssign):
                        for target in (item.targets if isinstance(item, ast.Assign)
                                       else [item.target]):
                            members.update(_targets(target))
                            if (isinstance(target, ast.Attribute)
                                    and isinstance(target.value, ast.Name)
                                    and target.value.id == "self"):
                                members.add(target.attr)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.known.add(node.name)
                if not isinstance(node, ast.ClassDef):
                    names.known.update(a.arg for a in node.args.args + node.args.kwonlyargs)
            elif isinstance(node, ast.Name):
                names.known.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.known.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.known.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.known.add(node.value)
    return names


def unknown(cited: str, names: Names) -> str | None:
    """Why ``cited`` (a backticked name of the doc) is not the package's, or ``None``."""
    match = CITED_NAME.match(cited)
    if match is None or CITED_FILE.match(cited) or cited in FOREIGN:
        return None
    # A counter's name as Prometheus shows it ends in _total; the code names it without.
    name = match.group(1)
    parts = (name.removesuffix("_total") if name.startswith("mig_spawner_") else name).split(".")
    if len(parts) == 2 and parts[1] in names.tables.get(parts[0], ()):
        return None  # a column of the ledger: leases.mode
    missing = [p for p in parts if p not in names.known and p not in names.classes]
    if missing:
        return f"{cited}: {', '.join(missing)} is named nowhere in the package"
    # Follow the chain while it is a module or a class: each link defined in the last.
    where: tuple[str, str] | None = None  # ("module", name) or ("class", name)
    for i, part in enumerate(parts):
        if where is not None:
            kind, name = where
            if not (names.in_module(name, part) if kind == "module"
                    else part in names.classes[name]):
                return f"{cited}: {part} is not defined in {kind} {name}"
        module = names.module(".".join(parts[: i + 1]))
        if module is not None:
            where = ("module", module)
        elif part in names.classes and part[:1].isupper():
            where = ("class", part)
        else:
            where = None
    return None


def cited() -> list[str]:
    """The doc's backticked spans, outside its fenced drawings."""
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.DOTALL)
    return sorted(set(re.findall(r"`([^`\n]+)`", text)))


def test_the_check_finds_a_name_that_is_gone_and_a_link_in_the_wrong_place():
    names = read_package()
    assert unknown("Releaser.release(lease, code, detail)", names) is None
    assert unknown("core.kinds.offer_kind", names) is None
    assert unknown("mig_spawner.core.waitlist.next_grants", names) is None
    assert unknown("leases.release_code", names) is None  # a column
    assert "named nowhere" in unknown("Releaser.give_back_now", names)
    assert "not defined in class Releaser" in unknown("Releaser.offer_kind", names)
    assert "not defined in module mig_spawner.core.kinds" in unknown(
        "core.kinds.free_counts", names)


@pytest.fixture(scope="module")
def names() -> Names:
    return read_package()


def test_every_name_the_architecture_doc_cites_is_the_packages(names):
    wrong = [why for span in cited() if (why := unknown(span, names)) is not None]
    assert wrong == [], "docs/architecture.md:\n" + "\n".join(wrong)


def test_every_file_the_architecture_doc_cites_exists():
    missing = [span for span in cited() if CITED_FILE.match(span)
               and not any((base / span).exists()
                           for base in (ROOT, PACKAGE, ROOT / "docs", PACKAGE / "spawner"))]
    assert missing == [], "docs/architecture.md names files that are not there: " + ", ".join(
        missing)
