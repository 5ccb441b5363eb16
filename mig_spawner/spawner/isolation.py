"""Device-cgroup rules that confine a notebook server to its one MIG slice.

``CUDA_VISIBLE_DEVICES=MIG-<uuid>`` only *asks* CUDA to use one slice; a user
can change it. The kernel enforces isolation through the device cgroup: a
process confined with ``DevicePolicy=closed`` reaches only the device nodes
listed in ``DeviceAllow=``. For one MIG device that is the NVIDIA control
nodes, the parent GPU's node, and read access to the capability nodes of its
GPU instance (GI) and compute instance (CI) (docs/mig-facts.md, "Isolation on a
bare-metal host").

Pure functions, no I/O: the spawner turns the result into ``systemd-run``
arguments, an admin can paste it into ``SystemdSpawner.unit_extra_properties``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mig_spawner.core.catalog import capability_minors

# Capability minors come in a block of 135 per GPU: for each of 15 GI IDs, one
# GI-access minor and 8 CI-access minors (catalog.capability_minors has the formula).
MAX_GI_ID = 14
MAX_CI_ID = 7

CAPS_DIR = "/dev/nvidia-caps"
# Nodes every CUDA process opens, whatever slice it uses.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class IsolationError(ValueError):
    """A GPU minor, GI or CI number that cannot name a real capability node."""


@dataclass(frozen=True)
class DeviceRule:
    """One ``DeviceAllow=`` entry: a device node and the access it gets (``rw`` or ``r``)."""

    path: str
    access: str

    @property
    def systemd(self) -> str:
        """The value systemd expects after ``DeviceAllow=``: ``"/dev/nvidia0 rw"``."""
        return f"{self.path} {self.access}"


def _check(name: str, value: int, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise IsolationError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f"..{high}"
        raise IsolationError(f"{name} must be in {low}{upper}, got {value}")


def cap_minors(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """Minors of ``/dev/nvidia-caps/nvidia-cap<N>`` for a GI and its CI, range-checked.

    >>> cap_minors(0, 1, 0)
    (12, 13)
    """
    _check("gpu_minor", gpu_minor, 0)
    _check("gi_id", gi_id, 0, MAX_GI_ID)
    _check("ci_id", ci_id, 0, MAX_CI_ID)
    return capability_minors(gpu_minor, gi_id, ci_id)


def device_rules(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[DeviceRule, ...]:
    """Every device node a process needs to use exactly one MIG device, and nothing more."""
    gi_minor, ci_minor = cap_minors(gpu_minor, gi_id, ci_id)
    return (
        *(DeviceRule(path, "rw") for path in CONTROL_NODES),
        DeviceRule(f"/dev/nvidia{gpu_minor}", "rw"),
        DeviceRule(f"{CAPS_DIR}/nvidia-cap{gi_minor}", "r"),
        DeviceRule(f"{CAPS_DIR}/nvidia-cap{ci_minor}", "r"),
    )


def systemd_properties(rules: tuple[DeviceRule, ...]) -> dict[str, str | list[str]]:
    """Unit properties, in the shape ``SystemdSpawner.unit_extra_properties`` takes."""
    return {"DevicePolicy": "closed", "DeviceAllow": [rule.systemd for rule in rules]}


def systemd_run_args(rules: tuple[DeviceRule, ...]) -> list[str]:
    """``systemd-run`` options that put a command in a transient scope with these rules.

    ``--scope`` keeps the command in the foreground with its own PID, so the
    spawner can still poll and signal it as it would a plain child process.
    """
    args = ["systemd-run", "--scope", "--quiet", "--collect", "-p", "DevicePolicy=closed"]
    for rule in rules:
        args += ["-p", f"DeviceAllow={rule.systemd}"]
    return args


def capability_paths(gpu_index: int, gi_id: int, ci_id: int) -> tuple[str, str]:
    """``/proc`` files that ``nvidia-modprobe -f`` reads to create the two capability nodes.

    The driver publishes them per GPU *index* (``gpu<N>``), while the nodes'
    minors use the GPU's device minor; on most hosts both are equal.
    """
    _check("gpu_index", gpu_index, 0)
    _check("gi_id", gi_id, 0, MAX_GI_ID)
    _check("ci_id", ci_id, 0, MAX_CI_ID)
    base = f"/proc/driver/nvidia/capabilities/gpu{gpu_index}/mig/gi{gi_id}"
    return f"{base}/access", f"{base}/ci{ci_id}/access"
