"""Check the hub's config when the hub starts, so a mistake never waits for the first spawn.

JupyterHub creates spawners only when someone starts a server; a misspelt key in
``jupyterhub_config.d/20-groups.py`` or ``mig_mode = "dynamc"`` would otherwise surface
as a failed spawn hours later. ``jupyterhub_config.py`` (and ``mig-spawner demo``) call
:func:`check_hub_config` after loading the snippets, and the hub refuses to start with
a message naming each setting, or each group and key, that is wrong. Mistakes that may
be on purpose (a policy for a group not created yet, a group that may use nothing) are
warnings on the hub's stderr instead.
"""

from __future__ import annotations

import copy
import difflib
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points

from sqlalchemy.engine import make_url
from traitlets import TraitError, import_item
from traitlets.config import Config, Configurable

from mig_spawner.config import (
    MIGPolicyConfig,
    MIGSettings,
    RightsizeConfig,
    configured_mode,
    is_kube,
    misplaced_settings,
    misspelt_sections,
    section_problems,
    setting_value,
)
from mig_spawner.core.catalog import GpuModel, model
from mig_spawner.core.inventory import Inventory
from mig_spawner.core.kinds import mode_rules, offered_whole
from mig_spawner.core.policy import (
    PolicyError,
    PolicySet,
    contradiction_warnings,
    memory_wording_warnings,
    unserved_offers,
    unserved_whole_gpus,
)
from mig_spawner.gpu import connect
from mig_spawner.gpu.errors import GpuError
from mig_spawner.hub.groups import hub_db_url, hub_groups
from mig_spawner.kube.resources import KubeConfigError, check_kube_profiles

from .local import LocalMIGSpawner, SimpleLocalMIGSpawner
from .mixin import MIGSpawnerMixin
from .settings import MIGSpawnerSettings

#: How the slice service is started in ``c.JupyterHub.services`` (its console script,
#: or ``python -m mig_spawner.service``).
_SERVICE_COMMANDS = ("mig-spawner-service", "mig_spawner.service")
#: True while check_hub_config runs (see there).
_checking = False
#: Every class whose settings mig-spawner reads, by name: a config section that nearly
#: names one of them is a misspelling (the Kubernetes spawner and the slice service are
#: named, not imported, so that checking a local hub needs neither).
CLASS_NAMES = (
    "MIGPolicyConfig", "MIGSettings", "RightsizeConfig", "MIGSpawnerSettings",
    "MIGSpawnerMixin", "LocalMIGSpawner", "SimpleLocalMIGSpawner", "KubeMIGSpawner",
    "SliceServiceApp",
)


def local_inventory(config: Config) -> Inventory | None:
    """This host's GPUs, as the local spawner would see them.

    ``None`` when the GPUs cannot be read now (no driver on the hub's machine, e.g. a
    Kubernetes hub): the policy is then checked without knowing the fleet.
    """
    shared = MIGSettings(config=config)
    try:
        adapter = connect(simulate=shared.simulate, state_file=shared.state_file())
        try:
            inventory = adapter.inventory()
        finally:
            adapter.close()
    except GpuError as e:
        print(f"mig-spawner: GPUs not readable at start ({e}); checking the policy "
              "without them", file=sys.stderr)
        return None
    return inventory


def fleet_of(inventory: Inventory | None) -> list[GpuModel] | None:
    """The catalog models of ``inventory``'s GPUs (None: unknown, or no MIG GPU)."""
    keys = {g.model_key for g in inventory.gpus if g.model_key} if inventory else ()
    return [model(k) for k in sorted(keys)] or None


def _checked_classes(config: Config) -> dict[str, type[Configurable]]:
    """The config sections whose every name and value mig-spawner can check."""
    classes: list[type[Configurable]] = [
        MIGPolicyConfig, MIGSettings, RightsizeConfig, MIGSpawnerSettings, MIGSpawnerMixin,
        LocalMIGSpawner, SimpleLocalMIGSpawner,
    ]
    if "KubeMIGSpawner" in config or is_kube(config):
        from .kube import KubeMIGSpawner  # needs kubespawner: only where it is used

        classes.append(KubeMIGSpawner)
    if "SliceServiceApp" in config:
        # The slice service reads the same snippets: its settings are checked here, before
        # the hub starts it, as the service checks them itself.
        from mig_spawner.service.app import SliceServiceApp

        classes.append(SliceServiceApp)
    return {cls.__name__: cls for cls in classes}


def setting_problems(config: Config) -> list[str]:
    """Settings of mig-spawner's classes that are misspelt (the setting or the class),
    hold a value their class refuses, sit where they are no longer read, or, each right
    alone, refuse each other or this host (a class's ``config_problems()``: right-sizing,
    the hub's spawner's isolation); one line each."""
    problems = (misplaced_settings(config) + misspelt_sections(config, CLASS_NAMES)
                + section_problems(config, _checked_classes(config).values()))
    if problems:
        return problems  # the classes below cannot be made with such values
    together: list[Configurable] = [RightsizeConfig(config=config)]
    spawner = hub_spawner_class(config)
    if spawner is not None and issubclass(spawner, LocalMIGSpawner):
        try:
            together.append(spawner(config=config))
        except TraitError as e:  # a setting of JupyterHub's own (c.Spawner.cmd = 5)
            return [f"c.JupyterHub.spawner_class: {spawner.__name__} cannot be made from "
                    f"this config: {e}"]
    return [line for configured in together for line in configured.config_problems()]


def hub_spawner_class(config: Config) -> type | None:
    """The class ``c.JupyterHub.spawner_class`` names (an entry point such as
    ``mig-simple``, a dotted name, or the class), or None: unset, or not found
    (JupyterHub refuses that itself)."""
    value = config.JupyterHub.get("spawner_class")
    if isinstance(value, str):
        named = {e.name.lower(): e for e in entry_points(group="jupyterhub.spawners")}
        try:
            value = (named[value.lower()].load() if value.lower() in named
                     else import_item(value))
        except (ImportError, AttributeError, ValueError):
            return None
    return value if isinstance(value, type) else None


def _service_argvs(config: Config) -> Iterator[tuple[str, list[str]]]:
    """(name, arguments) of each slice service the hub would start."""
    for service in setting_value(config.JupyterHub, "services", []) or ():
        command = [str(arg) for arg in (service.get("command") or ())]
        for i, arg in enumerate(command):
            if arg in _SERVICE_COMMANDS or arg.endswith("/mig-spawner-service"):
                yield str(service.get("name", "?")), command[i + 1:]
                break


def _same_url(a: str, b: str) -> bool:
    return make_url(a).render_as_string(hide_password=False) == make_url(b).render_as_string(
        hide_password=False)


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def ledger_problems(config: Config) -> list[str]:
    """The hub's ledger cannot be used from here (every spawn would fail), or slice
    services in ``c.JupyterHub.services`` would use another ledger than the hub's
    spawner: they would see none of its leases."""
    shared = MIGSettings(config=config)
    problems = shared.unreachable_ledger(hub_db_url(config))
    if problems:
        return problems
    hub_ledger = shared.ledger_location(hub_db_url(config))
    for name, argv in _service_argvs(config):
        # The service's own option and config loading, so that the check sees exactly
        # what the service will (its --config-dir, --ledger-url, ...).
        from mig_spawner.service.app import SliceServiceApp

        app = SliceServiceApp()
        try:
            app.initialize(argv)
            service_ledger = app.ledger_url
        except (SystemExit, TraitError, ValueError) as e:
            problems.append(f"the slice service {name!r} would not start: {e}")
            continue
        if not _same_url(service_ledger, hub_ledger):
            problems.append(
                f"the slice service {name!r} would use the ledger {_shown(service_ledger)} "
                f"but the hub uses {_shown(hub_ledger)}; set the ledger once, as "
                "c.MIGSettings.ledger_url, and give the service the same config directory "
                "(--config-dir) without its own --ledger-url"
            )
    return problems


def policy_warnings(
    config: Config, policies: PolicySet, inventory: Inventory | None = None
) -> list[str]:
    """What may be on purpose but usually is a mistake: policies for groups the hub
    does not have, groups that may use no slice at all, settings that another keeps
    from acting, and wording that states another memory size than the slice has.
    Given this host's ``inventory``, in pool mode also offers that no MIG device here
    can serve (``mig-spawner doctor`` checks those itself, as "offered profiles")."""
    fleet = fleet_of(inventory)
    model_keys = None if fleet is None else [m.key for m in fleet]
    warnings = memory_wording_warnings(policies, model_keys) + contradiction_warnings(policies)
    known = hub_groups(config)
    if known is not None:
        for group in sorted(set(policies.groups) - known):
            match = difflib.get_close_matches(group, sorted(known), n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            warnings.append(
                f"c.MIGPolicyConfig.group_policies has a policy for the group {group!r}, "
                f"which this hub does not have{hint}; it applies to nobody until the group "
                "is created (on /hub/admin, or in c.JupyterHub.load_groups)"
            )
    for group in sorted(g.name for g in policies.groups.values() if not g.allowed):
        warnings.append(
            f"the group {group!r} has allowed = []: its members get no GPU slice unless "
            "another of their groups allows one (docs/policies.md)"
        )
    mode = _mode(config)
    if (inventory is not None and model_keys is not None and mode is not None
            and mode_rules(mode).device_at_claim):
        by_index = {g.index: g.model_key for g in inventory.gpus}
        devices = [(by_index[d.gpu_index], d.profile) for d in inventory.mig_devices]
        warnings += unserved_offers(policies, model_keys, devices)
    if inventory is not None:
        warnings += unserved_whole_gpus(policies, sum(map(offered_whole, inventory.gpus)))
    return warnings


def _mode(config: Config) -> str | None:
    try:
        return configured_mode(config)
    except ValueError:
        return None  # two modes: no offer is known to need a device


def check_hub_config(config: Config) -> PolicySet:
    """Check ``config`` and return its group policy; exit the hub with the problems.

    Refused: misspelt names and wrong values of mig-spawner's settings, settings that
    refuse each other or this host (isolation), shared settings in their old places, a
    ledger that cannot be reached, a slice service on another ledger, and a wrong group
    policy; one line each, naming the setting. On
    a local GPU host the profiles are also checked against the GPUs present; on
    Kubernetes the hub has no GPU, and the cluster's models are not known at start.
    Warned about on stderr: see :func:`policy_warnings`.

    ``config`` itself is left as it was: the checks read a copy. Reading a setting that
    snippets extended (``c.JupyterHub.load_roles.append(...)``) fixes its value in
    traitlets, so an entry appended after this call (a later file, Zero to
    JupyterHub's ``extraConfig``) would otherwise be lost.
    """
    global _checking
    if _checking:
        # A slice service whose --config-dir is the file that called us: loading it
        # for ledger_problems runs this again. The outer call checks everything.
        return PolicySet(offers={}, groups={})
    config = copy.deepcopy(config)
    _checking = True
    try:
        problems = setting_problems(config) or ledger_problems(config)
    finally:
        _checking = False
    if problems:
        raise SystemExit(
            "mig-spawner: the configuration in jupyterhub_config.d is wrong, so the hub "
            "will not start.\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nFix the file and start the hub again (docs/admin-install.md)."
        )
    kube = is_kube(config)
    inventory = None if kube else local_inventory(config)
    try:
        policies = MIGPolicyConfig(config=config).build(fleet_of(inventory))
        if kube:
            check_kube_profiles(policies.profile_names())
    except (PolicyError, KubeConfigError) as e:
        raise SystemExit(
            "mig-spawner: the GPU policy in jupyterhub_config.d is wrong, so the hub will "
            f"not start.\n{e}\nFix the file and start the hub again (docs/policies.md)."
        ) from None
    for warning in policy_warnings(config, policies, inventory):
        print(f"mig-spawner: warning: {warning}", file=sys.stderr)
    return policies
