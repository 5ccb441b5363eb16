"""The MIG spawner's settings: its traits, and what they select.

A base class of :class:`~mig_spawner.spawner.mixin.MIGSpawnerMixin`, so that
``c.MIGSpawnerMixin.x``, ``c.LocalMIGSpawner.x`` and ``c.KubeMIGSpawner.x`` all
configure it. It also gives the runtime (ledger, GPU adapter, worker thread) and the
group policies these settings select. The ledger and GPU settings that the slice
service and the CLI share are not here but in ``c.MIGSettings``
(:class:`~mig_spawner.config.MIGSettings`), so that nobody can set them twice.
"""

from __future__ import annotations

from traitlets import Bool, Enum
from traitlets.config import Configurable

from mig_spawner.config import MIGPolicyConfig, MIGSettings
from mig_spawner.core.policy import PolicyError, PolicySet, UserPolicy

from .errors import admin_error
from .runtime import RuntimeKey, SpawnerRuntime, runtime_for


class MIGSpawnerSettings(Configurable):
    """How a MIG spawner makes slices; where its ledger is and which GPU it drives come
    from ``c.MIGSettings``.

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

    show_unavailable_offers = Bool(
        False,
        help="""Show offers that no GPU here can serve at all on the spawn form.

        By default a size the user's groups allow but that no GPU (no node) has, and,
        with a fixed layout (pool mode, Kubernetes), one with no instance at all, is left
        off the form: users cannot get it by waiting. ``mig-spawner doctor`` and the
        start-up check tell admins about it. True shows it greyed out with the reason
        (*this host has no such slice (ask a hub admin)*).
        """,
    ).tag(config=True)

    _shared: MIGSettings | None = None

    @property
    def shared(self) -> MIGSettings:
        """The ledger and GPU settings the slice service and the CLI read too
        (``c.MIGSettings``), read once per spawner."""
        if self._shared is None:
            self._shared = MIGSettings(parent=self)
        return self._shared

    @property
    def ledger_url(self) -> str:
        """The ledger this spawner uses (``c.MIGSettings.ledger_url``, else beside the
        hub's SQLite database)."""
        hub = getattr(self.user, "settings", {}).get("app")
        return self.shared.ledger_location(hub.db_url if hub is not None else None)

    @property
    def runtime(self) -> SpawnerRuntime:
        """The ledger, GPU adapter and worker thread shared by this hub's spawners."""
        shared = self.shared
        return runtime_for(RuntimeKey(self.ledger_url, shared.simulate, shared.state_file()))

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
