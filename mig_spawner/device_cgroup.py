"""The kernel's device control on this host: which mechanism confines a server to its
slice's device nodes, and the per-server cgroup v1 ``devices`` group.

One mechanism per kind of host (docs/admin-install.md, section 5):

* **cgroup v1** with a writable ``devices`` controller (``/sys/fs/cgroup/devices``):
  each server gets its own group ``mig-spawner/<lease id>`` that denies every device
  but the slice's nodes and the pseudo devices. The server's process joins it in the
  forked child *before* ``exec`` (:meth:`SliceCgroups.joiner`), so no instruction of
  the server ever runs outside it, and everything it starts inherits it. Writing the
  PID from the hub after ``Popen`` would leave a window in which the server (or a
  program it starts at once) could open another slice's node: that race is closed.
* **cgroup v2 with systemd**: a transient scope (``systemd-run --scope -p
  DevicePolicy=closed -p DeviceAllow=…``); systemd applies the rules before it starts
  the server (``core/isolation.py`` builds the arguments).
* no device cgroup, but the driver's capability nodes in ``/dev/nvidia-caps``:
  **capability-node permissions**. The slice's GI and CI capability nodes belong to
  the server's user alone (mode 0400) while the server runs, and every other GI/CI
  capability node to root alone (:func:`own_capabilities`); without read access to
  them no process can use another slice. Coarser than a cgroup: per user, not per
  server, and a file descriptor opened before stays open.
* anything else (a hub that is not root, no device cgroup and no capability nodes):
  no mechanism; :func:`host_support` says why, and ``mig-spawner doctor`` shows it.

Only root may move a process between cgroups, and a process running as root may move
itself out again: the group protects servers that do not run as root.

A process in a slice's group is that slice's holder (:func:`pids_in_slice_cgroup`,
used by ``mig_spawner.holder``), even when its environment no longer names the lease.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mig_spawner.ledger import Lease

CGROUP_FS = Path("/sys/fs/cgroup")
#: The cgroup v1 ``devices`` hierarchy.
V1_DEVICES = CGROUP_FS / "devices"
#: Where systemd puts the servers' transient scopes on a cgroup v2 host.
V2_SCOPES = CGROUP_FS / "system.slice"
#: The group under which each server's group is made (one per lease).
PARENT = "mig-spawner"
PROC_DEVICES = Path("/proc/devices")
SYSTEMD_RUNNING = Path("/run/systemd/system")  # as sd_booted() checks
CAPS_DIR = Path("/dev/nvidia-caps")
CGROUP_V1, SYSTEMD = "cgroup v1 devices", "systemd scope (cgroup v2)"
CAPABILITY_NODES = "capability-node permissions"
#: Capability minors below this are the host-wide ``config`` (1) and ``monitor`` (2)
#: capabilities, not a slice's: their permissions are the admin's.
FIRST_SLICE_CAPABILITY = 3
_CAP_NODE = re.compile(r"nvidia-cap(\d+)\Z")
_LEASE_ID = re.compile(r"[A-Za-z0-9_.-]+\Z")


class IsolationUnavailable(Exception):
    """This host cannot confine a server to its slice; the message says why (admins)."""


@dataclass(frozen=True)
class HostSupport:
    """How this host confines servers: ``mechanism`` (:data:`CGROUP_V1` or
    :data:`SYSTEMD`), or ``None`` and ``why`` not."""

    mechanism: str | None
    why: str = ""


def host_support(fs: Path = CGROUP_FS, systemd_running: Path = SYSTEMD_RUNNING,
                 is_root: bool | None = None, caps_dir: Path = CAPS_DIR) -> HostSupport:
    """Which mechanism this host offers (see the module doc); read-only. With
    :data:`CAPABILITY_NODES`, ``why`` says why there is no device cgroup."""
    root = os.geteuid() == 0 if is_root is None else is_root
    if not root:
        return HostSupport(None, "the hub does not run as root, and only root may place "
                           "a server in a device cgroup or give it a capability node")
    cgroup = _cgroup_support(fs, systemd_running)
    if cgroup.mechanism is None and caps_dir.is_dir():
        return HostSupport(CAPABILITY_NODES, cgroup.why)
    return cgroup


def _cgroup_support(fs: Path, systemd_running: Path) -> HostSupport:
    if (fs / "devices" / "devices.allow").exists():
        if not os.access(fs / "devices", os.W_OK):
            return HostSupport(None, f"the cgroup v1 devices controller ({fs / 'devices'}) "
                               "is not writable here (a read-only mount, as in a container?)")
        return HostSupport(CGROUP_V1)
    if (fs / "cgroup.controllers").exists():
        if not systemd_running.exists():
            return HostSupport(None, "this host runs cgroup v2, where device control needs "
                               "systemd (DevicePolicy=), and systemd is not running")
        if shutil.which("systemd-run") is None:
            return HostSupport(None, "this host runs cgroup v2 under systemd, but "
                               "'systemd-run' is not in the hub's PATH")
        return HostSupport(SYSTEMD)
    return HostSupport(None, f"no cgroup devices controller under {fs} (neither a cgroup "
                       "v1 devices hierarchy nor cgroup v2)")


def own_capabilities(caps_dir: Path, mine: Iterable[str], uid: int, gid: int,
                     held: Iterable[str] = ()) -> None:
    """Give the capability nodes ``mine`` to ``uid``/``gid`` alone (0400), and every
    other slice's node but those of slices still ``held`` by other servers to root
    alone: a node as ``nvidia-modprobe`` makes it (0444 by default) is readable by
    everyone, and one a finished server's user still owns (its lease released where
    the nodes were not given back: by a hub that died before it could) by that user."""
    mine = {str(Path(path)) for path in mine}
    keep = mine | {str(Path(path)) for path in held}
    for node in sorted(caps_dir.iterdir()):
        match = _CAP_NODE.match(node.name)
        if match is None or int(match[1]) < FIRST_SLICE_CAPABILITY or str(node) in keep:
            continue
        st = node.stat()
        if st.st_uid or st.st_gid or stat.S_IMODE(st.st_mode) != 0o400:
            os.chown(node, 0, 0)
            os.chmod(node, 0o400)
    for path in mine:
        os.chown(path, uid, gid)
        os.chmod(path, 0o400)


def return_capabilities(paths: Iterable[Path]) -> None:
    """The capability nodes ``paths`` back to root alone, once their server is gone.
    A node that is still root's was never given (no isolation, or a cgroup confined
    the server): it is left as it is, readable as the driver made it."""
    for path in paths:
        try:
            if path.stat().st_uid == 0:
                continue
            os.chown(path, 0, 0)
            os.chmod(path, 0o400)
        except FileNotFoundError:
            continue  # a dynamic instance destroyed with its nodes


def isolation_plan(setting: bool | None, simulated: bool, support: HostSupport
                   ) -> HostSupport:
    """What a hub whose ``LocalMIGSpawner.isolation`` is ``setting`` gets on a host that
    offers ``support`` (:func:`host_support`): the mechanism, or ``None`` and why not.

    ``None`` (the default) confines servers wherever the host can, with the real
    driver; with simulated GPUs only ``True`` does. Raises :class:`IsolationUnavailable`
    when ``setting`` is ``True`` and the host cannot.
    """
    if setting is False:
        return HostSupport(None, "LocalMIGSpawner.isolation is False")
    if setting is None and simulated:
        return HostSupport(None, "the GPUs are simulated (LocalMIGSpawner.isolation = True, "
                           "or mig-spawner demo --isolation, turns it on)")
    if support.mechanism is None and setting:
        raise IsolationUnavailable(support.why)
    return support


def read_proc_devices(proc_devices: Path = PROC_DEVICES) -> str:
    """The kernel's list of device majors (``core.isolation.driver_majors`` reads it)."""
    return proc_devices.read_text()


def node_number(path: str) -> tuple[int, int]:
    """The device number of the character device node at ``path``, as it is on disk:
    for stand-in nodes (the tests', the demo's simulated GPUs'), which no driver
    defines. Raises ``OSError``, or ``ValueError`` for anything but a character device."""
    st = os.stat(path)
    if not stat.S_ISCHR(st.st_mode):
        raise ValueError(f"{path} is not a character device")
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def scope_unit(lease_id: str) -> str:
    """The transient systemd scope a lease's server runs in (cgroup v2)."""
    return f"mig-spawner-{_group_name(lease_id)}.scope"


def _group_name(lease_id: str) -> str:
    if not _LEASE_ID.match(lease_id) or lease_id in (".", ".."):  # one path component
        raise ValueError(f"lease id {lease_id!r} cannot name a cgroup")
    return lease_id


def _pids(procs: Path) -> set[int]:
    try:
        text = procs.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {int(line) for line in text.split()}


@dataclass(frozen=True)
class SliceCgroups:
    """The servers' cgroup v1 ``devices`` groups, one per lease, under
    ``<hierarchy>/<parent>`` (both injectable for tests)."""

    hierarchy: Path = V1_DEVICES
    parent: str = PARENT

    def path(self, lease_id: str) -> Path:
        """The group of ``lease_id``'s server."""
        return self.hierarchy / self.parent / _group_name(lease_id)

    def create(self, lease_id: str, allow: Iterable[str]) -> Path:
        """Make (or reset) the lease's group: deny every device, then allow ``allow``
        (``cgroup_v1_rules``). Raises ``OSError`` when the kernel refuses a rule."""
        group = self.path(lease_id)
        group.mkdir(mode=0o755, parents=True, exist_ok=True)
        (group / "devices.deny").write_text("a")
        for rule in allow:
            # One rule per write: the kernel parses one entry at a time.
            (group / "devices.allow").write_text(rule)
        return group

    def joiner(self, lease_id: str) -> CgroupJoin:
        """What moves a forked child into the lease's group (see :class:`CgroupJoin`)."""
        return CgroupJoin(self.path(lease_id) / "cgroup.procs")

    def pids(self, lease_id: str) -> set[int]:
        """The processes in the lease's group (none when it has no group)."""
        return _pids(self.path(lease_id) / "cgroup.procs")

    def remove(self, lease_id: str) -> bool:
        """Remove the lease's group; ``False`` while a process is still in it."""
        try:
            self.path(lease_id).rmdir()
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno == errno.EBUSY:
                return False
            raise
        return True

    def leftovers(self) -> list[str]:
        """Lease ids with an empty group: left by a release that did not remove it
        (the slice service's, or a hub that died). The caller decides which to remove."""
        try:
            groups = [g for g in (self.hierarchy / self.parent).iterdir() if g.is_dir()]
        except FileNotFoundError:
            return []
        return [g.name for g in groups if not _pids(g / "cgroup.procs")]


class CgroupJoin:
    """A ``preexec_fn`` part that moves the forked child into a group, before ``exec``.

    The group's ``cgroup.procs`` is opened in the hub, so that the child only writes
    one byte: ``0`` means "the writing process". Running Python in a forked child of a
    threaded hub is risky (a lock another thread held stays held); a write on an open
    file descriptor takes none. The descriptor is close-on-exec, so the server never
    has it. :meth:`close` it once ``Popen`` returned.
    """

    def __init__(self, procs: Path) -> None:
        self._fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)

    def __call__(self) -> None:
        os.write(self._fd, b"0")

    def close(self) -> None:
        """Close the group's ``cgroup.procs`` in the hub."""
        os.close(self._fd)


def pids_in_slice_cgroup(lease: Lease, groups: SliceCgroups | None = None,
                         scopes: Path = V2_SCOPES) -> set[int]:
    """The PIDs in ``lease``'s device cgroup on this host: its cgroup v1 group or its
    systemd scope. Each is the slice's holder, whatever its environment says."""
    groups = groups or SliceCgroups()
    try:
        return groups.pids(lease.id) | _pids(scopes / scope_unit(lease.id) / "cgroup.procs")
    except ValueError:
        return set()  # an id no group can be named after has none
