"""Every setting a MIG spawner offers acts for that spawner.

A trait defined by one of mig-spawner's classes must be read (``self.<name>``) in the
code of a mig-spawner class that this spawner is made of: a setting that does nothing
for a backend (e.g. ``mig_mode`` on Kubernetes) belongs to the backend it acts for.
"""

from __future__ import annotations

import inspect
import re

import pytest
from traitlets import Unicode

from mig_spawner.spawner.local import LocalMIGSpawner, SimpleLocalMIGSpawner


def _kube_spawner() -> type:
    pytest.importorskip("kubespawner")
    from mig_spawner.spawner.kube import KubeMIGSpawner

    return KubeMIGSpawner


def _ours(cls: type) -> list[type]:
    """``cls`` and the mig-spawner classes it is made of (not JupyterHub's)."""
    return [k for k in cls.mro() if k is cls or k.__module__.startswith("mig_spawner.")]


def own_settings(cls: type) -> set[str]:
    """The config traits that mig-spawner's classes define for ``cls``."""
    traits = cls.class_traits(config=True)
    return {name for k in _ours(cls) for name in vars(k) if name in traits}


def unused_settings(cls: type) -> set[str]:
    source = "\n".join(inspect.getsource(k) for k in _ours(cls))
    return {name for name in own_settings(cls)
            if not re.search(rf"\bself\.{name}\b", source)}


@pytest.mark.parametrize("get", [lambda: LocalMIGSpawner, lambda: SimpleLocalMIGSpawner,
                                 _kube_spawner], ids=["local", "simple", "kube"])
def test_every_setting_of_a_spawner_acts_there(get):
    cls = get()
    assert own_settings(cls), "no settings found: the test reads the wrong classes"
    assert unused_settings(cls) == set()


def test_local_only_settings_are_not_on_the_kubernetes_spawner():
    kube = _kube_spawner()
    for name in ("mig_mode", "strategy", "isolation", "nvidia_modprobe", "nice"):
        assert name in LocalMIGSpawner.class_traits(config=True)
        assert name not in kube.class_traits(config=True), name


def test_the_check_finds_a_setting_that_does_nothing():
    class Idle(LocalMIGSpawner):
        never_read = Unicode("", help="A setting nothing reads.").tag(config=True)

    assert unused_settings(Idle) == {"never_read"}
