"""A MIG spawner built without a hub, the one way the in-process tests build one:
:func:`make_spawner` gives any spawner class (local or Kubernetes) the JupyterHub
objects it reads (:mod:`tests.mocking`'s ``User``, ``Hub``, ``OrmSpawner``);
:func:`mig_config` and :func:`kube_config` the settings most tests share. The module
shorthands (``local_spawner``, ``kube_spawner``) are these with the usual defaults.

    s = local_spawner(tmp_path, ledger_url, mode="dynamic")
    s = kube_spawner(kube, ledger_url, profile="large")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from kubespawner import KubeSpawner
from traitlets.config import Config

from mig_spawner.config import load_config_files
from mig_spawner.ledger import Lease, Ledger
from mig_spawner.spawner import LocalMIGSpawner
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.mocking import Hub, OrmSpawner, User

REPO = Path(__file__).resolve().parents[2]
#: The shipped group policies (analysts, ...), the groups most spawner tests use.
SHIPPED_GROUPS = REPO / "jupyterhub_config.d" / "20-groups.py"

S = TypeVar("S", bound=LocalMIGSpawner | KubeMIGSpawner)


def mig_config(ledger_url: str, *, sim: str | None = None, sim_state: Path | None = None,
               policies: Path | dict | None = SHIPPED_GROUPS) -> Config:
    """Settings of a MIG spawner: its ledger, the simulated GPUs ``sim`` (state in
    ``sim_state``) and the group policies (a config file, or ``group_policies``)."""
    c = Config(load_config_files(policies)) if isinstance(policies, Path) else Config()
    if isinstance(policies, dict):
        c.MIGPolicyConfig.group_policies = policies
    c.MIGSettings.ledger_url = ledger_url
    if sim is not None:
        c.MIGSettings.simulate = sim
    if sim_state is not None:
        c.MIGSettings.sim_state_file = str(sim_state)
    return c


def make_spawner(config: Config, user: str = "ana", groups: Sequence[str] = ("analysts",),
                 *, cls: type[S] = LocalMIGSpawner, server: str = "",
                 profile: str | None = None) -> S:
    """A spawner of ``cls`` for ``user`` (a member of ``groups``) and its server
    ``server``, as JupyterHub makes one; with ``profile``, its spawn asks for it."""
    extra: dict[str, Any] = {"_mock": True} if issubclass(cls, KubeSpawner) else {}
    spawner = cls(config=config, user=User(user, list(groups)), hub=Hub(),
                  orm_spawner=OrmSpawner(server), **extra)
    if profile is not None:
        spawner.user_options = {"profile": profile}
    if extra:
        spawner.api_token = "token"
    return spawner


def local_spawner(tmp_path: Path, ledger_url: str, mode: str = "pool", user: str = "ana",
                  groups: Sequence[str] = ("analysts",), sim: str = "h200x1",
                  cls: type[LocalMIGSpawner] = LocalMIGSpawner, **config: Any
                  ) -> LocalMIGSpawner:
    """A local spawner on the shipped groups and simulated GPUs ``sim`` (state in
    ``tmp_path/sim-gpus.json``), in ``mode``; ``config`` sets more of its own traits."""
    c = mig_config(ledger_url, sim=sim, sim_state=tmp_path / "sim-gpus.json")
    c.LocalMIGSpawner.mig_mode = mode
    for key, value in config.items():
        setattr(c.LocalMIGSpawner, key, value)
    return make_spawner(c, user, groups, cls=cls)


# --- Kubernetes ------------------------------------------------------------------------


def kube_config(ledger_url: str, allowed: Sequence[str] = ("small", "large"),
                **spawner: Any) -> Config:
    """A KubeMIGSpawner's settings: a small and a large slice class, the analysts
    group, its ledger, namespace ``jupyterhub``, short timeouts; ``spawner`` sets more."""
    c = mig_config(ledger_url, policies={
        "analysts": {"allowed": list(allowed), "max_slices_per_user": 1},
    })
    c.MIGPolicyConfig.slice_classes = {
        "small": {"display_name": "Small", "profiles": {"a100-80gb": "1g.10gb",
                                                        "h100": "1g.10gb",
                                                        "h200": "1g.18gb"}},
        "large": {"display_name": "Large", "profiles": {"a100-80gb": "3g.40gb"}},
    }
    c.KubeMIGSpawner.namespace = "jupyterhub"
    c.KubeMIGSpawner.events_enabled = False
    c.KubeMIGSpawner.start_timeout = 30
    c.KubeMIGSpawner.k8s_api_request_retry_timeout = 5
    for key, value in spawner.items():
        setattr(c.KubeMIGSpawner, key, value)
    return c


def kube_spawner(kube, ledger_url: str, name: str = "ana",
                 groups: Sequence[str] = ("analysts",), profile: str = "small",
                 server: str = "", allowed: Sequence[str] = ("small", "large"),
                 **spawner: Any) -> KubeMIGSpawner:
    """A KubeMIGSpawner on this test's share of the real cluster ``kube`` (the ``kube``
    fixture: its namespace, its nodes, the hub's account through the tap), its spawn
    asking for ``profile``; ``spawner`` sets more (and may override those)."""
    settings = {**kube.spawner_config(), **spawner}
    return make_spawner(kube_config(ledger_url, allowed, **settings),
                        name, groups, cls=KubeMIGSpawner, server=server, profile=profile)


async def created(kube, name: str) -> dict:
    """The pod ``name`` of the test's namespace, as the API server has it."""
    found = await kube.pod(name)
    assert found is not None, f"no pod {name}"
    return found


def held(ledger_url: str) -> list[Lease]:
    """The leases held now in the ledger at ``ledger_url``."""
    with Ledger.open(ledger_url) as ledger:
        return ledger.leases.active()
