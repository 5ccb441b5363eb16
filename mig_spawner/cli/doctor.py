"""``mig-spawner doctor``: the readiness checklist, each check with a fix hint.

The checks follow the source article's "what to check before deploying MIG"
table: GPU support, driver version, MIG mode, the profiles users will be
offered, isolation and privileges. Every check is read-only, so doctor is
safe on a production host.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from traitlets import TraitError
from traitlets.config import Config

from ..core.catalog import GpuModel, capability_minors, find_model_for_product
from ..core.health import Fault, health_faults
from ..core.inventory import Inventory
from ..core.kinds import DEFAULT_MIG_MODE, mode_rules
from ..device_cgroup import (
    CAPABILITY_NODES,
    HostSupport,
    IsolationUnavailable,
    isolation_plan,
)
from ..gpu import GpuAdapter
from ..gpu.errors import (
    MIG_CONFIG_DEVICE,
    MIG_CONFIG_PROC,
    GpuError,
    MonitorCapabilityMissing,
)
from ..gpu.nvml import GARBLED_PROCESS_DRIVERS, garbles_process_records
from .catalog import driver_differences

if TYPE_CHECKING:
    from ..ledger import GpuFault

#: The faults the ledger holds on a host (its name), or None where it cannot be read.
HeldFaults = Callable[[str], Sequence["GpuFault"] | None]

# How an admin grants the MIG config capability to the hub's user (no root needed then).
GRANT_CONFIG = (
    f"run the hub as root, or grant its user the MIG config capability: create the node "
    f"with 'nvidia-modprobe -f {MIG_CONFIG_PROC}', then give the hub's group read access "
    f"to {MIG_CONFIG_DEVICE} (chgrp <group> {MIG_CONFIG_DEVICE}; chmod g+r "
    f"{MIG_CONFIG_DEVICE}); pool mode needs none of this"
)

class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    #: Not run: an earlier check failed, so this one could only pass vacuously or repeat
    #: that failure. ``detail`` names the earlier check.
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """The outcome of one readiness check."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def _driver_major(version: str) -> int | None:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return None


def check_driver(inv: Inventory) -> Check:
    major = _driver_major(inv.driver_version)
    too_old = []
    for gpu in inv.gpus:
        model = find_model_for_product(gpu.product)
        if model is not None and major is not None and major < model.min_driver_major:
            too_old.append(
                f"GPU {gpu.index} ({model.display_name}) needs R{model.min_driver_major}+"
            )
    if major is None:
        return Check(
            "driver version", Status.WARN, f"cannot read driver version {inv.driver_version!r}"
        )
    if too_old:
        return Check(
            "driver version",
            Status.FAIL,
            f"driver {inv.driver_version} is too old: " + "; ".join(too_old),
            "install a newer NVIDIA datacenter driver (see docs/gpus.md for each GPU's minimum)",
        )
    return Check("driver version", Status.PASS, f"driver {inv.driver_version} supports every GPU")


def check_mig_support(inv: Inventory) -> Check:
    if not inv.gpus:
        return Check(
            "MIG support",
            Status.FAIL,
            "no NVIDIA GPU found",
            "check that the driver sees the GPUs: nvidia-smi -L",
        )
    unsupported = [
        g for g in inv.gpus if not g.mig_supported or find_model_for_product(g.product) is None
    ]
    if len(unsupported) == len(inv.gpus):
        names = ", ".join(sorted({g.product for g in unsupported}))
        return Check(
            "MIG support",
            Status.FAIL,
            f"no GPU here supports MIG ({names})",
            "MIG needs an A100, A30, H100, H200 or newer data-center GPU",
        )
    if unsupported:
        idx = ", ".join(str(g.index) for g in unsupported)
        return Check(
            "MIG support",
            Status.WARN,
            f"GPU {idx} cannot be partitioned; it is ignored",
            "nothing to do, unless you expected those GPUs to be MIG-capable",
        )
    return Check("MIG support", Status.PASS, f"all {len(inv.gpus)} GPU(s) support MIG")


def check_mig_mode(inv: Inventory) -> Check:
    problems, fixes = [], []
    for g in inv.gpus:
        if not g.mig_supported or find_model_for_product(g.product) is None:
            continue
        if g.mig_current != g.mig_pending:
            problems.append(f"GPU {g.index}: MIG mode change pending")
            fixes.append(f"reset GPU {g.index} when it is idle: nvidia-smi -r -i {g.index}")
        elif not g.mig_current:
            problems.append(f"GPU {g.index}: MIG is disabled")
            fixes.append(f"enable it as root on an idle GPU: nvidia-smi -i {g.index} -mig 1")
    if problems:
        return Check("MIG mode", Status.FAIL, "; ".join(problems), "; ".join(fixes))
    return Check("MIG mode", Status.PASS, "MIG is enabled on every MIG-capable GPU")


def check_offered_profiles(inv: Inventory, offered: Iterable[str], mode: str) -> Check:
    offered = sorted(set(offered))
    if not offered:
        return Check(
            "offered profiles",
            Status.WARN,
            "no profiles are offered to any group",
            "set c.MIGPolicyConfig.group_policies in jupyterhub_config.d (docs/policies.md)",
        )
    names = ", ".join(offered)
    if mode_rules(mode).made_per_lease:
        fleet = [find_model_for_product(g.product) for g in inv.gpus]
        creatable = {p for m in fleet if m is not None for p in m.profile_names}
        missing = ", ".join(p for p in offered if p not in creatable)
        problem = f"no GPU here can create {missing}"
        fix = "offer profiles of the GPUs this host has (mig-spawner status)"
        fine = f"dynamic mode can create every offered profile ({names})"
    else:
        present = {d.profile for d in inv.mig_devices}
        missing = ", ".join(p for p in offered if p not in present)
        problem = f"pool mode offers {missing} but no such MIG device exists on this host"
        fix = ("create them (nvidia-smi mig -cgi <profiles> -C, or NVIDIA mig-parted), "
               "or remove them from the groups' allowed lists")
        fine = f"every offered profile has MIG devices ({names})"
    if missing:
        return Check("offered profiles", Status.FAIL, problem, fix)
    return Check("offered profiles", Status.PASS, fine)


def check_isolation_nodes(inv: Inventory, dev_root: str = "/") -> Check:
    missing = []
    for g in inv.gpus:
        for d in g.mig_devices:
            for minor in capability_minors(g.minor, d.gi_id, d.ci_id):
                path = os.path.join(dev_root, "dev/nvidia-caps", f"nvidia-cap{minor}")
                if not os.path.exists(path):
                    missing.append(path)
    if not inv.mig_devices:
        return Check("isolation device nodes", Status.WARN, "no MIG devices to check")
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        return Check(
            "isolation device nodes",
            Status.WARN,
            f"capability nodes missing: {shown}; servers cannot be confined to their slice",
            "run nvidia-modprobe -f /proc/driver/nvidia/capabilities/gpu<N>/mig/gi<X>/access "
            "(and .../ci<Y>/access) for each instance, or leave isolation off",
        )
    return Check(
        "isolation device nodes", Status.PASS, "every MIG device has its GI and CI capability nodes"
    )


# What an admin can do on a host that cannot confine servers.
CONFINE_FIX = ("run the hub as root; on cgroup v2, under systemd with 'systemd-run' in its "
               "PATH; or accept unconfined servers with LocalMIGSpawner.isolation = False "
               "(docs/admin-install.md, section 5)")


def check_device_isolation(setting: bool | None, simulated: bool, support: HostSupport
                           ) -> Check:
    """Whether the kernel confines each server to its slice's device nodes, and how
    (``setting``: ``LocalMIGSpawner.isolation``; ``support``: what this host offers)."""
    name = "device isolation"
    try:
        plan = isolation_plan(setting, simulated, support)
    except IsolationUnavailable as e:
        return Check(name, Status.FAIL, "LocalMIGSpawner.isolation is True but this host "
                     f"cannot confine servers ({e}): every spawn will fail", CONFINE_FIX)
    if plan.mechanism == CAPABILITY_NODES:
        return Check(name, Status.PASS, "each user's servers can read only their own "
                     "slices' capability nodes (capability-node permissions; no device "
                     f"cgroup: {plan.why}); this protects servers that do not run as root, "
                     "user from user, not server from server")
    if plan.mechanism is not None:
        return Check(name, Status.PASS, f"each server can open only its slice's device "
                     f"nodes ({plan.mechanism}); this protects servers that do not run as "
                     "root: a root process can leave its cgroup")
    if setting is False:
        return Check(name, Status.WARN, "off (LocalMIGSpawner.isolation = False): "
                     "CUDA_VISIBLE_DEVICES only asks CUDA to use a slice; any server can "
                     "open another server's slice",
                     "remove the setting: servers are then confined wherever this host can "
                     "(docs/admin-install.md, section 5)")
    if simulated:
        return Check(name, Status.PASS, f"off: {plan.why}")
    return Check(name, Status.WARN, f"servers are NOT confined to their slice: {plan.why}",
                 CONFINE_FIX)


def confines(setting: bool | None, simulated: bool, support: HostSupport) -> bool:
    """Whether servers are to be confined (then their capability nodes must exist)."""
    try:
        return isolation_plan(setting, simulated, support).mechanism is not None
    except IsolationUnavailable:
        return True  # required: every spawn fails, and the nodes would be needed too


def check_privilege(can_configure: bool, mode: str) -> Check:
    if can_configure:
        return Check(
            "dynamic-mode privilege",
            Status.PASS,
            "this process may create and destroy MIG instances",
        )
    if not mode_rules(mode).made_per_lease:
        return Check(
            "dynamic-mode privilege",
            Status.PASS,
            "this process may not create or destroy MIG instances; pool mode does not need to",
        )
    return Check(
        "dynamic-mode privilege",
        Status.FAIL,
        "dynamic mode needs the MIG config capability "
        f"({MIG_CONFIG_PROC}), which this process lacks: it may not create or destroy "
        "MIG instances",
        GRANT_CONFIG,
    )


def check_driver_tables(inv: Inventory) -> Check:
    """The driver's own profile table against the catalog: the exact differing rows."""
    rows, unknown = [], []
    for g in inv.gpus:
        if g.model_key is None and g.driver_profiles:
            unknown.append(f"GPU {g.index} ({g.product})")
        rows += [f"GPU {g.index}: {d}" for d in driver_differences(g)]
    compared = [g for g in inv.gpus if g.model_key and g.driver_profiles]
    fix = ("the driver's figures are used at run time; to correct the catalog, send the "
           "output of 'mig-spawner catalog --from-driver --json' (docs/gpus.md)")
    if unknown:
        return Check("profile table", Status.WARN,
                     f"{', '.join(unknown)}: a MIG GPU the catalog does not know; "
                     "its profiles are not offered", fix)
    if rows:
        return Check("profile table", Status.WARN,
                     "the driver and the catalog differ: " + "; ".join(rows), fix)
    if not compared:
        return Check("profile table", Status.PASS,
                     "no MIG-enabled GPU to compare with the catalog")
    return Check("profile table", Status.PASS,
                 f"the driver's profile table matches the catalog on {len(compared)} GPU(s)")


def check_process_listing(inv: Inventory) -> Check:
    """Whether the processes on each MIG device can be read (idle culling needs them)."""
    low, high = (".".join(map(str, v)) for v in GARBLED_PROCESS_DRIVERS)
    unknown = [d for d in inv.mig_devices if d.processes_unknown]
    if unknown:
        where = ", ".join(f"GPU {d.gpu_index} GI {d.gi_id}" for d in unknown[:4])
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        return Check(
            "process listing", Status.WARN,
            f"the processes on {where}{more} cannot be read; those slices count as busy "
            "and are not culled for GPU idleness",
            "run the slice service as root or with the MIG config capability; "
            f"on drivers {low}-{high} upgrade the driver",
        )
    if garbles_process_records(inv.driver_version):
        return Check(
            "process listing", Status.WARN,
            f"driver {inv.driver_version} garbles the newest process-list call; "
            "mig-spawner falls back to the older one",
            f"upgrade the driver past {high}",
        )
    return Check("process listing", Status.PASS, "the processes on every MIG device are readable")


def check_gpu_health(now: Iterable[Fault], held: Sequence[GpuFault] | None) -> Check:
    """What the driver reports of every GPU's health now, and the faults the ledger holds
    from new servers (``None``: the ledger was not read). docs/health.md."""
    now = list(now)
    problems = [str(f) for f in now]
    problems += [f"held since {f.seen_at:%Y-%m-%d %H:%M} UTC: GPU {f.gpu_index}: {f.detail}"
                 for f in held or ()]
    if problems:
        fix = ("reset or repair the GPU (a lost one may need a reboot), then run "
               "'mig-spawner health clear GPU' (docs/health.md)" if held else
               "the slice service holds the GPU at its next sweep; reset or repair it, then "
               "'mig-spawner health clear GPU' (docs/health.md)")
        return Check("GPU health", Status.FAIL, "; ".join(problems), fix)
    where = "" if held is None else "; the ledger holds no fault"
    return Check("GPU health", Status.PASS, f"the driver reports no fault on any GPU{where}")


def check_monitor(e: MonitorCapabilityMissing) -> Check:
    """What the hub does without the MIG monitor capability, and how to grant it."""
    return Check(
        "MIG monitor capability", Status.FAIL,
        f"{e}: without the MIG monitor capability this hub cannot list GPU or compute "
        "instances, so it sees no slice: the spawn form offers none, every spawn is "
        "refused because 'The GPU inventory' cannot be read, and the slice service's "
        "sweeps fail the same way",
        e.hint,
    )


OfferedFor = Callable[[list[GpuModel]], tuple[list[str], str]]


def fleet_models(inv: Inventory) -> list[GpuModel]:
    """The catalog models of this host's MIG-capable GPUs, each once."""
    models = {m.key: m for g in inv.gpus if (m := find_model_for_product(g.product))}
    return list(models.values())


def skipped(names: Iterable[str], reason: str) -> list[Check]:
    """``names`` as SKIP checks: they cannot run because of ``reason``."""
    return [Check(name, Status.SKIP, f"not checked: {reason}") for name in names]


#: The checks that read the GPUs, in the order they run.
GPU_CHECKS = ("driver version", "GPU health", "MIG support", "MIG mode", "profile table",
              "process listing", "offered profiles", "isolation device nodes",
              "dynamic-mode privilege")


def run_checks(
    connect: Callable[[], GpuAdapter],
    offered_for: OfferedFor | None = None,
    mode: str | None = None,
    dev_root: str = "/",
    isolation: bool | None = None,
    held_faults: HeldFaults | None = None,
) -> list[Check]:
    """Run every check; ``connect`` opens the GPU adapter (real or simulated).

    ``offered_for`` reads the hub's config for this host's GPU models and returns the
    profiles its groups can be given and the configured mode; ``mode`` overrides that.
    ``isolation``: whether servers are confined (``None``: not known, the nodes are
    checked; :func:`check_device_isolation` says why not). ``held_faults``: the faults
    the ledger holds on this host (None: not read).
    A check that an earlier failure makes meaningless is SKIP, naming that failure.
    """
    try:
        adapter = connect()
        inv = adapter.inventory()
    except MonitorCapabilityMissing as e:
        return [Check("NVML", Status.PASS, "NVML loaded"), check_monitor(e),
                *skipped(GPU_CHECKS, "the MIG instances cannot be listed "
                                     "(see MIG monitor capability)")]
    except GpuError as e:
        return [Check("NVML", Status.FAIL, str(e), e.hint),
                *skipped(GPU_CHECKS, "NVML did not load (see NVML)")]
    try:
        checks = [
            Check("NVML", Status.PASS, f"NVML {inv.nvml_version} loaded, {len(inv.gpus)} GPU(s)"),
            check_driver(inv),
            check_gpu_health((f for gpu in adapter.health() for f in health_faults(gpu)),
                             held_faults(inv.host) if held_faults else None),
            support := check_mig_support(inv),
        ]
        if support.status is Status.FAIL:
            return checks + skipped(GPU_CHECKS[3:], "no GPU here supports MIG (see MIG support)")
        checks.append(mig_mode := check_mig_mode(inv))
        mig_off = mig_mode.status is Status.FAIL and not any(g.mig_enabled for g in inv.gpus)
        off_reason = "MIG is not enabled on any GPU (see MIG mode)"
        if mig_off:
            checks += skipped(("profile table", "process listing"), off_reason)
        else:
            checks += [check_driver_tables(inv), check_process_listing(inv)]
        offered: list[str] = []
        configured_mode: str = DEFAULT_MIG_MODE
        config_broken = False
        if offered_for is not None:
            try:
                offered, configured_mode = offered_for(fleet_models(inv))
            except ValueError as e:  # PolicyError is a ValueError
                config_broken = True
                checks.append(
                    Check(
                        "hub config",
                        Status.FAIL,
                        str(e),
                        "fix jupyterhub_config.d (docs/policies.md)",
                    )
                )
        mode = mode or configured_mode
        if config_broken:
            checks += skipped(["offered profiles"], "the hub's policy is wrong (see hub config)")
        elif mig_off and mode_rules(mode).device_at_claim:
            checks += skipped(["offered profiles"], off_reason)
        else:
            checks.append(check_offered_profiles(inv, offered, mode))
        if isolation is False:
            checks += skipped(["isolation device nodes"],
                              "servers are not confined to their slice (see device isolation)")
        elif mig_off:
            checks += skipped(["isolation device nodes"], off_reason)
        else:
            checks.append(check_isolation_nodes(inv, dev_root))
        checks.append(check_privilege(adapter.can_configure(), mode))
    finally:
        adapter.close()
    return checks




def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"[{c.status.value.upper()}] {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.status in (Status.WARN, Status.FAIL):
            lines.append(f"       {' ' * width}  fix: {c.fix}")
    count = {status: sum(c.status is status for c in checks) for status in Status}
    lines.append("")
    lines.append(f"{count[Status.FAIL]} failed, {count[Status.WARN]} warning(s), "
                 f"{count[Status.PASS]} passed"
                 + (f", {count[Status.SKIP]} skipped" if count[Status.SKIP] else ""))
    return "\n".join(lines)


def render_json(checks: list[Check]) -> str:
    """The checks as JSON (``doctor --json``), for scripts and bug reports."""
    return json.dumps({"checks": [asdict(c) for c in checks],
                       "failed": sum(c.status is Status.FAIL for c in checks),
                       "skipped": sum(c.status is Status.SKIP for c in checks)}, indent=2)


def configured_isolation(config: Config) -> bool | None:
    """The hub's ``LocalMIGSpawner.isolation`` (``None``, the default: where the host can)."""
    values = [section["isolation"] for section in config.values()
              if isinstance(section, Config) and "isolation" in section]
    return None if not values or values[-1] is None else bool(values[-1])


def config_checks(config: Config) -> list[Check]:
    """What the hub's start-up check would refuse (FAIL) or warn about (WARN) in the
    hub's config, beyond the policy itself: misspelt or wrong settings, a slice service
    on another ledger, policies for groups the hub does not have."""
    from ..config import MIGPolicyConfig
    from ..core.policy import PolicyError
    from ..spawner.startup import ledger_problems, policy_warnings, setting_problems

    fix = "fix jupyterhub_config.d (docs/admin-install.md)"
    problems = setting_problems(config) or ledger_problems(config)
    if problems:
        return [Check("hub settings", Status.FAIL, "; ".join(problems), fix)]
    checks = [Check("hub settings", Status.PASS, "the hub's start-up check passes")]
    try:
        warnings = policy_warnings(config, MIGPolicyConfig(config=config).build())
    except PolicyError:
        return checks  # reported by the "hub config" check
    checks += [Check("hub policy", Status.WARN, w, fix) for w in warnings]
    return checks


def check_start_timeouts(config: Config) -> Check:
    """What the hub's spawner makes of JupyterHub's ``start_timeout`` and
    ``http_timeout``: how long a server may take to answer (``core.answer``), whether a
    server that does not is started once more on its slice, and the ``start_timeout``
    JupyterHub then gets (docs/operations.md, "Starting on a loaded host")."""
    from ..config import is_kube
    from ..core.answer import FLOOR, HEADROOM, RECENT, answer_timeout, start_bound
    from ..spawner.local import LocalMIGSpawner
    from ..spawner.mixin import MIGSpawnerMixin

    try:
        spawner = LocalMIGSpawner(config=config)  # JupyterHub's two settings, as configured
    except TraitError:
        return Check("start timeouts", Status.SKIP,
                     "not checked: a setting is wrong (see hub settings)")
    tries = MIGSpawnerMixin.answer_tries if is_kube(config) else spawner.answer_tries
    answer = answer_timeout(spawner.http_timeout, [])
    again = ("a server that exits or does not answer is started once more on its slice, "
             "which it keeps" if tries > 1 else "a pod that does not answer is not started "
             "again (its own restart policy applies)")
    return Check(
        "start timeouts", Status.PASS,
        f"servers may take {answer:.0f} s to answer (http_timeout {spawner.http_timeout} s; "
        f"at least {FLOOR:.0f} s: 15 servers started at once on a busy 2-core host took "
        f"147 s; {HEADROOM:g} x the slowest of the last {RECENT} once measured, "
        "mig_spawner_server_answer_seconds); "
        f"{again}; JupyterHub's start_timeout becomes "
        f"{start_bound(spawner.start_timeout, answer, tries)} s (plus max_wait "
        f"for a spawn that may wait), the server's own start keeping "
        f"{spawner.start_timeout} s",
    )


#: How a cluster hands out MIG devices (:func:`mig_spawner.kube.dra.served_by`), in words.
KUBE_SERVED = {
    "dra": "NVIDIA's DRA driver (ResourceSlices, DeviceClass mig.nvidia.com)",
    "device-plugin": "NVIDIA's device plugin (node allocatable)",
}


def check_kube_resource_api(served: str, configured: str) -> Check:
    """Whether the hub reads the cluster's MIG devices the way the cluster serves them
    (``served``: detected; ``configured``: ``KubeMIGSpawner.mig_resource_api``)."""
    name = "Kubernetes MIG devices"
    if served not in KUBE_SERVED:
        return Check(name, Status.FAIL, "no node advertises MIG devices and no DRA driver "
                     "publishes any", "set up the GPU Operator or NVIDIA's DRA driver "
                     "(docs/kubernetes.md, sections 1 and 7)")
    if served == configured:
        return Check(name, Status.PASS, f"served by {KUBE_SERVED[served]}; the hub reads "
                     f"them so (KubeMIGSpawner.mig_resource_api = {configured!r})")
    return Check(name, Status.FAIL, f"served by {KUBE_SERVED[served]}, but the hub reads "
                 f"them as {configured} and would see no free slices",
                 f'c.KubeMIGSpawner.mig_resource_api = "{served}"')


def kube_checks(found: Any, configured: str, strategy: str = "auto") -> list[Check]:
    """``doctor --kube``'s checks on one read of the cluster (``found``: a
    :class:`mig_spawner.kube.survey.Survey`) against the hub's settings
    (``KubeMIGSpawner.mig_resource_api`` and ``mig_strategy``)."""
    from ..kube.cluster import unhealthy_reason, unhealthy_words

    rbac_fix = ("bind the hub's service account to the Role and ClusterRole in "
                "docs/kubernetes.md ('RBAC')")
    if found.error:
        return [Check("Kubernetes API", Status.FAIL, found.error, found.hint or rbac_fix)]
    checks = [Check("Kubernetes API", Status.PASS,
                    f"{found.version or 'version unknown'}; the hub's namespace is "
                    f"{found.namespace}")]
    checks.append(check_kube_resource_api(found.served, configured))
    slices = found.slices
    if slices.nodes:
        per_node = "; ".join(
            f"{n.name} ({n.model_key}, {n.strategy}): "
            + ", ".join(f"{p} {n.free(p)}/{n.allocatable[p]}" for p in sorted(n.allocatable))
            for n in slices.nodes[:8])
        more = f"; and {len(slices.nodes) - 8} more" if len(slices.nodes) > 8 else ""
        checks.append(Check("GPU nodes", Status.PASS,
                            f"{len(slices.nodes)} offer MIG slices (free/all): "
                            f"{per_node}{more}"))
    else:
        checks.append(Check("GPU nodes", Status.FAIL, "no node offers MIG slices to the hub",
                            "see the nodes left out below, and docs/kubernetes.md section 1"))
    for node in slices.nodes:
        if node.unhealthy:
            checks.append(Check(
                f"node {node.name}", Status.WARN,
                f"the cluster reports slices unhealthy ({unhealthy_words(node)}): "
                + unhealthy_reason(node),
                "the GPU needs a reset or a repair: see the device plugin's or DRA "
                "driver's log for the Xid; docs/kubernetes.md, 'How free slices are "
                "counted'"))
    for skipped in slices.skipped:
        checks.append(Check(f"node {skipped.name}", Status.WARN, f"not offered: {skipped.reason}",
                            "docs/kubernetes.md, 'How free slices are counted'"))
    strategies = sorted({n.strategy for n in slices.nodes})
    if strategies:
        forced = strategy not in ("auto", "")
        mixed_up = forced and configured == "device-plugin" and strategies != [strategy]
        checks.append(Check(
            "MIG strategy", Status.WARN if mixed_up else Status.PASS,
            f"nodes hand out slices as {', '.join(strategies)}"
            + (f"; the hub forces {strategy}" if forced else " (read from each node)"),
            'c.KubeMIGSpawner.mig_strategy = "auto"' if mixed_up else ""))
    if found.device_class is not None:
        checks.append(Check(
            "DeviceClass mig.nvidia.com", Status.PASS if found.device_class else Status.FAIL,
            "present" if found.device_class else "missing: claims of the hub's pods would "
            "never be allocated",
            "install NVIDIA's DRA driver with its GPU resources (docs/kubernetes.md, "
            "section 7)"))
    if found.denied:
        missing = "; ".join(f"{p.words(found.namespace)} (to {p.why})" for p in found.denied)
        checks.append(Check("hub RBAC", Status.FAIL, f"the hub's account may not: {missing}",
                            rbac_fix))
    else:
        rules = f" (its rules there: {'; '.join(found.rules)})" if found.rules else ""
        checks.append(Check("hub RBAC", Status.PASS,
                            f"the hub's account may do all it needs{rules}"))
    return checks
