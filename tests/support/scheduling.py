"""How the suite spreads over pytest-xdist workers (``-n 4 --dist loadgroup``, set in
``pyproject.toml``), without any test having to say so.

* A module whose tests share a module-scoped fixture (a real hub started once for the
  module) runs whole on one worker: spread over workers, each worker would start a hub
  of its own. In a module without one, the tests of a class sharing a class-scoped
  fixture (a hub per class) go together, so that a module's classes run side by side.
  Tests without such a fixture go one by one to whichever worker is free.
* Real-hub and browser modules run first, the grouped ones (the longest units) before
  the others, so that the short unit tests fill the gaps at the end instead of one long
  module starting last. Modules keep their own order of tests, and move whole.

The groups are known where the tests are collected, in the workers; the controller,
which hands out the work, sees only the tests' ids. So each worker writes the groups it
found (the same in all) to a file the controller named (:data:`GROUPS_ENV`), and the
controller's scheduler (:class:`SharedFixtureScheduling`, given to xdist through its
``pytest_xdist_make_scheduler`` hook) reads them: xdist's own scheduler for ``loadgroup``
with the group read from that file instead of from the test's id. Nothing of pytest's
or xdist's internals is changed.

Session-scoped fixtures (the PostgreSQL cluster) are per worker: each worker starts its
own, in a directory of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling

#: Names the file that carries the groups from the workers to the controller.
GROUPS_ENV = "MIG_TEST_XDIST_GROUPS"
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


def _is_slow(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in SLOW_MARKERS)


def groups_of(items: list[pytest.Item]) -> dict[str, str]:
    """The group of each test that shares a module's (or a class's) fixtures, by id."""
    whole = {_module_of(item) for item in items if shared_scopes(item) & set(MODULE_SCOPES)}
    groups = {}
    for item in items:
        module = _module_of(item)
        if module in whole:
            groups[item.nodeid] = module
        elif shared_scopes(item):
            groups[item.nodeid] = _class_of(item)
    return groups


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the slow modules first, grouped ones before the others; in an xdist
    worker, tell the controller the groups."""
    groups = groups_of(items)
    grouped = {_module_of(item) for item in items if item.nodeid in groups}
    slow = {_module_of(item) for item in items if _is_slow(item)}

    def rank(item: pytest.Item) -> int:
        module = _module_of(item)
        if module in slow:
            return 0 if module in grouped else 1
        return 2

    items.sort(key=rank)  # stable: each module keeps its order, and stays in one piece
    path = os.environ.get(GROUPS_ENV)
    if path and hasattr(config, "workerinput"):
        # Every worker collects the same tests: whichever writes last writes the same.
        written = Path(f"{path}.{os.getpid()}")
        written.write_text(json.dumps(groups))
        written.replace(path)


def pytest_configure(config: pytest.Config) -> None:
    """In the controller of an xdist run: name the file the workers write the groups to
    (they inherit the environment when they start, after this)."""
    if hasattr(config, "workerinput") or not _distributing(config):
        return
    folder = tempfile.mkdtemp(prefix="mig-test-groups-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ[GROUPS_ENV] = str(Path(folder) / "groups.json")


def _distributing(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and (
        config.getvalue("dist") == "loadgroup")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` with the groups of :func:`groups_of`."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return SharedFixtureScheduling(config, log)


class SharedFixtureScheduling(LoadGroupScheduling):
    """xdist's ``loadgroup`` scheduler, which sends each group's tests to one worker,
    taking the groups that the workers wrote (a test's ``xdist_group`` mark still counts
    where xdist can add it to the test's id)."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            # Read once every worker has collected: xdist schedules only then.
            path = os.environ.get(GROUPS_ENV)
            self._groups = json.loads(Path(path).read_text()) if path else {}
        group = self._groups.get(nodeid)
        return group if group is not None else super()._split_scope(nodeid)
