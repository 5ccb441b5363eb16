"""What every MIG spawner reads from the shared settings: the runtime and the policies.

A base class of :class:`~mig_spawner.spawner.mixin.MIGSpawnerMixin`: it gives the
runtime (ledger, GPU adapter, worker threads) and the group policies. The traits that
act for one backend only live on that backend's spawner (``local.py``, ``kube.py``).
The ledger and GPU settings that the slice service and the CLI share are not here but
in ``c.MIGSettings`` (:class:`~mig_spawner.config.MIGSettings`), so that nobody can set
them twice.
"""

from __future__ import annotations

import copy
from typing import Any

from traitlets.config import Configurable

from mig_spawner.config import MIGPolicyConfig, MIGSettings
from mig_spawner.core.policy import PolicyError, PolicySet, UserPolicy
from mig_spawner.core.refusal import Reason

from .errors import admin_error
from .runtime import RuntimeKey, SpawnerRuntime, runtime_for


class MIGSpawnerSettings(Configurable):
    """Where a MIG spawner's ledger is and which GPU it drives (``c.MIGSettings``), and
    the group policies (``c.MIGPolicyConfig``).

    Only ever a base of ``MIGSpawnerMixin`` (a Spawner, whose ``user`` it reads); not a
    Spawner itself because JupyterHub refuses Spawner subclasses without ``start()``.
    """

    _shared: MIGSettings | None = None

    @property
    def shared(self) -> MIGSettings:
        """The ledger and GPU settings the slice service and the CLI read too
        (``c.MIGSettings``), read once per spawner."""
        if self._shared is None:
            self._shared = MIGSettings(parent=self)
        return self._shared

    _ledger_url: str | None = None
    _runtime: SpawnerRuntime | None = None

    @property
    def ledger_url(self) -> str:
        """The ledger this spawner uses (``c.MIGSettings.ledger_url``, else beside the
        hub's SQLite database), resolved once per spawner."""
        if self._ledger_url is None:
            hub = getattr(self.user, "settings", {}).get("app")
            self._ledger_url = self.shared.ledger_location(
                hub.db_url if hub is not None else None)
        return self._ledger_url

    @property
    def runtime(self) -> SpawnerRuntime:
        """The ledger, GPU adapter and worker threads shared by this hub's spawners."""
        if self._runtime is None:
            shared = self.shared
            self._runtime = runtime_for(
                RuntimeKey(self.ledger_url, shared.simulate, shared.state_file()))
        return self._runtime

    def policies(self) -> PolicySet:
        """The hub's group policies, checked; an admin's mistake stops the spawn. Built
        again only when ``c.MIGPolicyConfig`` changed (:func:`_built_policies`)."""
        try:
            policies = _built_policies(self)
        except PolicyError as e:
            raise admin_error(
                "The hub's GPU policy configuration is wrong",
                Reason.POLICY_CONFIG,
                str(e),
            ) from None
        # Claims read past leases as far back as the longest budget window.
        if policies.budget_horizon is not None or self._runtime is not None:
            self.runtime.budget_horizon = policies.budget_horizon
        return policies

    def user_policy(self, policies: PolicySet) -> UserPolicy:
        return policies.for_user([g.name for g in self.user.groups])


#: Config section object id -> (the section, a copy of it then, what it built).
_POLICIES: dict[int, tuple[Any, Any, PolicySet]] = {}


def _built_policies(spawner: Configurable) -> PolicySet:
    """``c.MIGPolicyConfig`` built into a :class:`PolicySet`, rebuilt only when the
    section changed: every spawn, form and grant pass asks for the policies, and
    building them (checking every group, class and profile) takes milliseconds."""
    section = spawner.config.get("MIGPolicyConfig")
    cached = _POLICIES.get(id(section))
    if cached is not None and cached[0] is section and cached[1] == _values(section):
        return cached[2]
    policies = MIGPolicyConfig(parent=spawner).build()
    if len(_POLICIES) > 8:  # config objects of tests or reloads: keep the last few
        _POLICIES.clear()
    _POLICIES[id(section)] = (section, copy.deepcopy(_values(section)), policies)
    return policies


def _values(section: Any) -> dict[str, Any]:
    """The section's settings as a plain dict (a Config's own copy is shallow)."""
    return dict(section or {})
