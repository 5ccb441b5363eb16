"""The MIG spawner's settings: its traits, their checks, and what they select.

A base class of :class:`~mig_spawner.spawner.mixin.MIGSpawnerMixin`, so that
``c.MIGSpawnerMixin.x``, ``c.LocalMIGSpawner.x`` and ``c.KubeMIGSpawner.x`` all
configure it. It also gives the runtime (ledger, GPU adapter, worker thread) and the
group policies these settings select.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import make_url
from traitlets import Enum, TraitError, Unicode, validate
from traitlets.config import Configurable

from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.policy import PolicyError, PolicySet, UserPolicy
from mig_spawner.ledger import url_beside_hub_db

from .errors import admin_error
from .runtime import RuntimeKey, SpawnerRuntime, runtime_for


class MIGSpawnerSettings(Configurable):
    """How a MIG spawner makes slices, where its ledger is, and which GPU it drives.

    Only ever a base of ``MIGSpawnerMixin`` (a Spawner, whose ``user`` it reads); not a
    Spawner itself because JupyterHub refuses Spawner subclasses without ``start()``.
    """

    mig_mode = Enum(
        ["pool", "dynamic"],
        default_value="pool",
        help="""How slices are made.

        ``pool``: lease MIG instances that an admin created beforehand (``nvidia-smi mig``
        or mig-parted); needs no privilege. ``dynamic``: create a GPU + compute instance
        at spawn, at the placement that keeps the GPU least fragmented, and destroy it
        when the server stops; the hub needs root or the MIG ``config`` capability.
        """,
    ).tag(config=True)

    strategy = Enum(
        ["pack", "spread"],
        default_value="pack",
        help="""Which GPU a new server goes to when several could serve it.

        ``pack`` fills the GPU that is already most used, so whole GPUs stay free for
        big slices; ``spread`` uses the least used GPU first.
        """,
    ).tag(config=True)

    ledger_url = Unicode(
        "",
        help="""SQLAlchemy URL of the lease ledger, shared with the slice service.

        Empty (default): a SQLite file ``mig_spawner_ledger.sqlite`` beside the hub's
        own SQLite database (or in the hub's working directory when the hub's database
        is not a SQLite file). Use a PostgreSQL URL for a hub with many users.
        """,
    ).tag(config=True)

    simulate = Unicode(
        None,
        allow_none=True,
        help="""Use the NVML simulator instead of the real driver (demos and tests).

        A spec such as ``h200x2:layout=1g.18gb*4,2g.35gb,1g.35gb`` (docs/simulator.md).
        None (default): the real driver through NVML.
        """,
    ).tag(config=True)

    sim_state_file = Unicode(
        None,
        allow_none=True,
        help="""JSON file holding the simulated GPUs' state, so that the hub, the slice
        service and the CLI see one simulated host. Only used with ``simulate``.""",
    ).tag(config=True)

    @validate("ledger_url")
    def _check_ledger_url(self, proposal: dict) -> str:
        url = proposal["value"].strip()
        if url:
            try:
                make_url(url)
            except Exception as e:
                raise TraitError(
                    f"ledger_url {url!r} is not a SQLAlchemy URL ({e}); "
                    "use e.g. 'sqlite:////srv/jupyterhub/mig_ledger.sqlite' or "
                    "'postgresql://user@db/mig'"
                ) from None
        return url

    @validate("simulate")
    def _check_simulate(self, proposal: dict) -> str | None:
        spec = proposal["value"]
        if spec is None or not spec.strip():
            return None
        from mig_spawner.gpu.simulator.spec import SpecError, parse_spec

        try:
            parse_spec(spec)
        except SpecError as e:
            raise TraitError(f"simulate: {e}") from None
        return spec.strip()

    @validate("sim_state_file")
    def _check_sim_state_file(self, proposal: dict) -> str | None:
        path = proposal["value"]
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise TraitError(
                f"sim_state_file {path!r}: its folder does not exist; create it or pick "
                "a file in an existing folder"
            )
        return path or None

    def _default_ledger_location(self) -> str:
        hub = getattr(self.user, "settings", {}).get("app")
        return url_beside_hub_db(hub.db_url if hub is not None else None)

    @property
    def runtime(self) -> SpawnerRuntime:
        """The ledger, GPU adapter and worker thread shared by this hub's spawners."""
        return runtime_for(
            RuntimeKey(
                self.ledger_url or self._default_ledger_location(),
                self.simulate,
                self.sim_state_file if self.simulate else None,
            )
        )

    def policies(self) -> PolicySet:
        """The hub's group policies, checked; an admin's mistake stops the spawn."""
        try:
            return MIGPolicyConfig(parent=self).build()
        except PolicyError as e:
            raise admin_error(
                "The hub's GPU policy configuration is wrong",
                "policy_config",
                str(e),
            ) from None

    def user_policy(self, policies: PolicySet) -> UserPolicy:
        return policies.for_user([g.name for g in self.user.groups])
