"""How the suite spreads over pytest-xdist workers (``-n 4 --dist loadgroup``, set in
``pyproject.toml``), without any test having to say so.

* A module whose tests share a module-scoped fixture (a real hub started once for the
  module) runs whole on one worker: its tests become one ``xdist_group``. Spread over
  workers, each worker would start a hub of its own. In a module without one, the
  tests of a class sharing a class-scoped fixture (a hub per class) are a group of
  their own, so that a module's classes run side by side. Tests without such a
  fixture go one by one to whichever worker is free.
* Real-hub and browser modules run first, the grouped ones (the longest units) before
  the others, so that the short unit tests fill the gaps at the end instead of one long
  module starting last. Modules keep their own order of tests, and move whole.

Session-scoped fixtures (the PostgreSQL cluster) are per worker: each worker starts its
own, in a directory of its own.
"""

from __future__ import annotations

import pytest

try:  # newer pytest (9.2 here) keeps a node's id in ``_id``, which xdist 3.8 does not rename
    from _pytest.nodeid import coerce_node_id
except ImportError:  # older pytest: xdist renames ``_nodeid`` itself
    coerce_node_id = None

#: Fixture scopes whose value lives longer than one test: such tests stay together,
#: a module's whole (module, package) or a class's.
MODULE_SCOPES = ("module", "package")
SHARED_SCOPES = ("class", *MODULE_SCOPES)
#: Markers of the tests that start real processes (slow): these are started first.
SLOW_MARKERS = ("hub", "browser")


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def shared_scopes(item: pytest.Item) -> set[str]:
    """The scopes of the fixtures ``item`` uses that are kept for more than one test
    (not the session's)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {
        definition.scope
        for name in info.names_closure
        for definition in info.name2fixturedefs.get(name, ())
        if definition.scope in SHARED_SCOPES
    }


def _class_of(item: pytest.Item) -> str:
    """``module::Class`` of a test in a class; the module's id otherwise."""
    cls = getattr(item, "cls", None)
    return f"{_module_of(item)}::{cls.__name__}" if cls is not None else _module_of(item)


def _join_group(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """What ``--dist loadgroup`` does with an ``xdist_group`` mark: the scheduler reads a
    test's group from its id (``<id>@<group>``). xdist 3.8 writes that id where pytest
    9.2 no longer reads it, so that every group would be split; done here."""
    if coerce_node_id is None or not getattr(config.option, "loadgroup", False):
        return
    if not item.nodeid.endswith(f"@{group}"):
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


def _is_slow(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in SLOW_MARKERS)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests that share a module's (or a class's) fixtures; start the slow
    modules first."""
    whole: set[str] = set()  # modules that stay in one piece
    slow: set[str] = set()
    for item in items:
        module = _module_of(item)
        if shared_scopes(item) & set(MODULE_SCOPES):
            whole.add(module)
        if _is_slow(item):
            slow.add(module)
    grouped: set[str] = set()  # modules with a group
    for item in items:
        module = _module_of(item)
        if module in whole:
            unit = module
        elif shared_scopes(item):
            unit = _class_of(item)
        else:
            continue
        grouped.add(module)
        group = unit.removeprefix("tests/").replace(".py", "")
        item.add_marker(pytest.mark.xdist_group(group))
        _join_group(config, item, group)

    def rank(item: pytest.Item) -> int:
        module = _module_of(item)
        if module in slow:
            return 0 if module in grouped else 1
        return 2

    items.sort(key=rank)  # stable: each module keeps its order, and stays in one piece
