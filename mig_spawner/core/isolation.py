"""Device-cgroup rules that confine a notebook server to its one MIG slice.

``CUDA_VISIBLE_DEVICES=MIG-<uuid>`` only *asks* CUDA to use one slice; a user
can change it. The kernel enforces isolation through the device cgroup: a
process confined with ``DevicePolicy=closed`` reaches only the device nodes
listed in ``DeviceAllow=``. For one MIG device that is the NVIDIA control
nodes, the parent GPU's node, and read access to the capability nodes of its
GPU instance (GI) and compute instance (CI) (docs/mig-facts.md, "Isolation on a
bare-metal host").

Pure functions, no I/O. The rules name device nodes; the kernel matches device
*numbers*. On a real host the numbers come from the driver's majors in
``/proc/devices`` (:func:`driver_majors`, :func:`driver_numbers`); tests and the
demo map the nodes onto stand-ins instead. The spawner turns the rules into a cgroup
v1 ``devices`` list (:func:`cgroup_v1_rules`, applied by ``mig_spawner.device_cgroup``)
or ``systemd-run`` arguments (:func:`systemd_run_args`); an admin can paste
:func:`systemd_properties` into ``SystemdSpawner.unit_extra_properties``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mig_spawner.core.catalog import capability_minors

# Capability minors come in a block of 135 per GPU: for each of 15 GI IDs, one
# GI-access minor and 8 CI-access minors (catalog.capability_minors has the formula).
MAX_GI_ID = 14
MAX_CI_ID = 7

# The names under which the driver's modules register their character devices in
# /proc/devices: the GPUs and nvidiactl, unified memory, and the MIG capabilities.
# Some driver builds register the GPUs' major as plain "nvidia".
FRONTEND, UVM, CAPS = "nvidia-frontend", "nvidia-uvm", "nvidia-caps"
FRONTEND_ALIASES = (FRONTEND, "nvidia")
CONTROL_MINOR = 255  # /dev/nvidiactl is minor 255 of the GPUs' major
# Nodes every CUDA process opens, whatever slice it uses: (name under /dev, driver, minor).
CONTROL_NODES = (("nvidiactl", FRONTEND, CONTROL_MINOR), ("nvidia-uvm", UVM, 0),
                 ("nvidia-uvm-tools", UVM, 1))

#: What systemd's ``DevicePolicy=closed`` admits besides ``DeviceAllow=``, as cgroup v1
#: rules: /dev/null, zero, full, random, urandom, tty, ptmx and the pseudo-terminals
#: (Jupyter's terminals need the last three). A server needs them whatever its slice.
PSEUDO_DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",
                  "c 5:0 rwm", "c 5:2 rwm", "c 136:* rw")


class IsolationError(ValueError):
    """A GPU minor, GI or CI number that cannot name a real capability node."""


@dataclass(frozen=True)
class DeviceRule:
    """One device node a server may open: its path, the access it gets (``rw`` or ``r``),
    and its device number as the driver defines it (the major ``driver`` registers in
    /proc/devices, and ``minor``)."""

    path: str
    access: str
    driver: str
    minor: int

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


def gpu_rules(gpu_minor: int, dev: str = "/dev") -> tuple[DeviceRule, ...]:
    """Every device node a process needs to use one whole GPU (MIG off): the control
    nodes and the GPU's own. ``dev`` as in :func:`device_rules`."""
    dev = dev.rstrip("/") or "/"
    return (
        *(DeviceRule(f"{dev}/{name}", "rw", driver, minor)
          for name, driver, minor in CONTROL_NODES),
        DeviceRule(f"{dev}/nvidia{gpu_minor}", "rw", FRONTEND, gpu_minor),
    )


def device_rules(gpu_minor: int, gi_id: int, ci_id: int, dev: str = "/dev"
                 ) -> tuple[DeviceRule, ...]:
    """Every device node a process needs to use exactly one MIG device, and nothing more.

    ``dev`` is where the nodes are: ``/dev`` on a real host, stand-ins elsewhere.
    """
    gi_minor, ci_minor = cap_minors(gpu_minor, gi_id, ci_id)
    dev = dev.rstrip("/") or "/"
    return (
        *gpu_rules(gpu_minor, dev),
        DeviceRule(f"{dev}/nvidia-caps/nvidia-cap{gi_minor}", "r", CAPS, gi_minor),
        DeviceRule(f"{dev}/nvidia-caps/nvidia-cap{ci_minor}", "r", CAPS, ci_minor),
    )


def driver_majors(proc_devices: str) -> dict[str, int]:
    """The character-device majors in the text of ``/proc/devices``, by name."""
    majors: dict[str, int] = {}
    section = ""
    for line in proc_devices.splitlines():
        if line.endswith(":"):
            section = line
            continue
        number, _, name = line.strip().partition(" ")
        if section.startswith("Character") and number.isdigit() and name:
            majors.setdefault(name.strip(), int(number))
    return majors


DeviceNumber = Callable[[DeviceRule], tuple[int, int]]


def driver_numbers(majors: dict[str, int]) -> DeviceNumber:
    """The device number of each rule's node on a host whose driver registered
    ``majors`` (:func:`driver_majors`); :class:`IsolationError` names a missing module."""

    def number(rule: DeviceRule) -> tuple[int, int]:
        names = FRONTEND_ALIASES if rule.driver == FRONTEND else (rule.driver,)
        for name in names:
            if name in majors:
                return majors[name], rule.minor
        raise IsolationError(f"the NVIDIA driver registers no {rule.driver!r} device in "
                             f"/proc/devices, needed for {rule.path} (is its module loaded?)")

    return number


def cgroup_v1_rules(rules: Iterable[DeviceRule], number: DeviceNumber,
                    baseline: Iterable[str] = PSEUDO_DEVICES) -> list[str]:
    """The lines to write to a cgroup v1 ``devices.allow``, after ``a`` was denied:
    ``baseline`` (:data:`PSEUDO_DEVICES`), then each rule's node (``"c 195:0 rw"``)."""
    allowed = list(baseline)
    for rule in rules:
        major, minor = number(rule)
        allowed.append(f"c {major}:{minor} {rule.access}")
    return allowed


def systemd_properties(rules: tuple[DeviceRule, ...]) -> dict[str, str | list[str]]:
    """Unit properties, in the shape ``SystemdSpawner.unit_extra_properties`` takes."""
    return {"DevicePolicy": "closed", "DeviceAllow": [rule.systemd for rule in rules]}


def systemd_run_args(rules: tuple[DeviceRule, ...], unit: str | None = None,
                     user: str | None = None) -> list[str]:
    """``systemd-run`` options that put a command in a transient scope with these rules.

    ``--scope`` keeps the command in the foreground with its own PID, so the
    spawner can still poll and signal it as it would a plain child process; systemd
    applies the rules before it starts the command. ``unit`` names the scope
    (``device_cgroup.scope_unit``); ``user``: systemd-run, started as root (only root may make a
    system scope), becomes that user before it starts the command.
    """
    args = ["systemd-run", "--scope", "--quiet", "--collect", "-p", "DevicePolicy=closed"]
    for rule in rules:
        args += ["-p", f"DeviceAllow={rule.systemd}"]
    if unit:
        args += [f"--unit={unit}", "--slice=system.slice"]
    if user:
        args.append(f"--uid={user}")
    return [*args, "--"]


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
