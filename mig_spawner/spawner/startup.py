"""Check the GPU policy when the hub starts, so a mistake never waits for the first spawn.

JupyterHub creates spawners only when someone starts a server; a misspelt key in
``jupyterhub_config.d/20-groups.py`` would otherwise surface as a failed spawn hours
later. ``jupyterhub_config.py`` calls :func:`check_hub_config` after loading the
snippets, and the hub refuses to start with a message naming each group and key.
"""

from __future__ import annotations

import sys

from traitlets.config import Config

from mig_spawner.config import MIGPolicyConfig, spawner_setting
from mig_spawner.core.catalog import GpuModel, model
from mig_spawner.core.policy import PolicyError, PolicySet
from mig_spawner.gpu import connect
from mig_spawner.gpu.errors import GpuError
from mig_spawner.kube.resources import KubeConfigError, check_kube_profiles


def local_fleet(config: Config) -> list[GpuModel] | None:
    """The GPU models this host has, as the local spawner would see them.

    ``None`` when the GPUs cannot be read now (no driver on the hub's machine, e.g. a
    Kubernetes hub): the policy is then checked without knowing the fleet.
    """
    try:
        adapter = connect(
            simulate=spawner_setting(config, "simulate"),
            state_file=spawner_setting(config, "sim_state_file"),
        )
        try:
            inventory = adapter.inventory()
        finally:
            adapter.close()
    except GpuError as e:
        print(f"mig-spawner: GPUs not readable at start ({e}); checking the policy "
              "without them", file=sys.stderr)
        return None
    keys = {g.model_key for g in inventory.gpus if g.model_key}
    return [model(k) for k in sorted(keys)] or None


def _is_kube(config: Config) -> bool:
    spawner = str(config.get("JupyterHub", {}).get("spawner_class", ""))
    return spawner == "mig-kube" or "Kube" in spawner


def check_hub_config(config: Config) -> PolicySet:
    """Build the group policy from ``config``; exit the hub with the problems if wrong.

    On a local GPU host the profiles are also checked against the GPUs present; on
    Kubernetes the hub has no GPU, and the cluster's models are not known at start.
    """
    kube = _is_kube(config)
    fleet = None if kube else local_fleet(config)
    try:
        policies = MIGPolicyConfig(config=config).build(fleet)
        if kube:
            check_kube_profiles(policies.profile_names())
        return policies
    except (PolicyError, KubeConfigError) as e:
        raise SystemExit(
            "mig-spawner: the GPU policy in jupyterhub_config.d is wrong, so the hub will "
            f"not start.\n{e}\nFix the file and start the hub again (docs/policies.md)."
        ) from None
