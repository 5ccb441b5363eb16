"""The processes that hold a lease's slice, found, checked and stopped through /proc.

A lease may be released only when its holder is provably gone (docs/ledger.md,
"The holder"). The device is the truth: a process on this host holds the slice when

* its environment's ``CUDA_VISIBLE_DEVICES`` names the slice's MIG device (any of its
  comma-separated entries, ``MIG-<uuid>`` or the bare uuid), whatever else it sets;
* or NVML lists it among the processes of that device, the MIG device or the whole GPU
  (``on_device``, read by the caller from the GPU adapter);
* or its environment names the lease (``MIG_SPAWNER_LEASE_ID``, which the spawner sets
  and kernels inherit: the only name a dynamic lease has before its instance exists);
* or it is in the slice's device cgroup (``members``: the hook kernel-enforced isolation
  fills in);
* or it is the server process the spawner recorded in the lease (host, PID and start
  time, so that a reused PID is not mistaken for it).

The scan covers the window between the spawn and the record: a hub killed right after
starting a server leaves a process that only its environment names. What it cannot see
without isolation: a process that points CUDA at the slice only after it started (its
``/proc/<pid>/environ`` is what it was started with) and has not opened the GPU yet, so
NVML does not list it either.

A PID that only NVML lists is never signalled: NVML's PIDs may be of another PID
namespace (a hub in a container), where the number names another process. Such a slice
stays held, its PIDs reported, until NVML lists nothing.

Only this host can be checked. A lease recorded on another host, or a process that
cannot be signalled, is :data:`UNKNOWN`: such a lease is reported, never released.

On Kubernetes the holder is the lease's pod: its name (``pod``) and UID
(``holder_pod_uid``), checked and deleted through the Kubernetes API
(:func:`check_pod`, :func:`stop_pod`). A pod of that name with another UID was
recreated since and is not the holder; a lease whose UID was not recorded yet (the hub
died while the pod started) takes the pod of that name for its holder.
Processes whose environment cannot be read (another user's, when not root) are not
seen; the hub and the slice service run as root or as the servers' own user.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mig_spawner.kinds import kind_of
from mig_spawner.kube.availability import ClusterReadError
from mig_spawner.kube.cluster import TERMINATED_PHASES
from mig_spawner.kube.pods import delete_pod, pod_uid, read_pod
from mig_spawner.ledger import Lease

PROC = Path("/proc")
#: Seconds between SIGTERM and SIGKILL (as LocalProcessSpawner's ``term_timeout``).
STOP_GRACE = 5.0
#: After SIGKILL, how long to wait for the kernel to reap the processes.
KILL_WAIT = 5.0
#: After a deleted pod's grace period, how long to wait for the API to show it gone.
POD_GONE_WAIT = 30.0
GONE, RUNNING, UNKNOWN = "gone", "running", "unknown"
LEASE_VARIABLE = "MIG_SPAWNER_LEASE_ID"


@dataclass(frozen=True)
class Process:
    """One process, told apart from a later one with the same PID by its start time."""

    pid: int
    start: int


@dataclass(frozen=True)
class HolderCheck:
    """What holds a lease now: :data:`GONE`, :data:`RUNNING` (``processes``, or on
    Kubernetes the ``pod``) or :data:`UNKNOWN` (``why`` says what could not be checked).
    ``on_device``: PIDs NVML lists on the slice's MIG device that no process here was
    found for (never signalled; see the module doc)."""

    state: str
    processes: tuple[Process, ...] = ()
    why: str = ""
    pod: str = ""
    on_device: tuple[int, ...] = ()

    @property
    def pids(self) -> list[int]:
        """The holder's PIDs, for logs."""
        return [p.pid for p in self.processes]


def this_host() -> str:
    """The name the holder record uses for this host."""
    return socket.gethostname()


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22);
    ``None`` when there is no such process or it has exited (a zombie)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")".
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def current(pid: int) -> Process | None:
    """The running process ``pid`` as a holder record (``None`` if it is not running)."""
    start = start_time(pid)
    return None if start is None else Process(pid, start)


def alive(process: Process) -> bool:
    """True while that very process (same PID *and* start time) runs."""
    return start_time(process.pid) == process.start


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None  # exited meanwhile, or another user's process
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _bare(uuid: str) -> str:
    uuid = uuid.strip()
    return uuid[4:] if uuid.startswith("MIG-") else uuid


def names_slice(env: Mapping[str, str], lease: Lease) -> bool:
    """Whether an environment names ``lease``: its MIG device in any entry of
    ``CUDA_VISIBLE_DEVICES``, or the lease id in ``MIG_SPAWNER_LEASE_ID``. Either is
    enough; neither variable can hide the other."""
    if env.get(LEASE_VARIABLE) == lease.id:
        return True
    named = kind_of(lease).device_name(lease)
    if not named:
        return False
    device = _bare(named)
    return any(_bare(entry) == device
               for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(","))


def processes_of(lease: Lease) -> list[Process]:
    """Processes on this host whose environment names ``lease`` (:func:`names_slice`)."""
    found = []
    me = os.getpid()
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        env = _environ(int(entry.name))
        if env is not None and names_slice(env, lease):
            process = current(int(entry.name))
            if process is not None:
                found.append(process)
    return found


def check(lease: Lease, host: str | None = None, *, on_device: Iterable[int] = (),
          members: Iterable[int] = ()) -> HolderCheck:
    """Whether anything still holds ``lease``'s slice (this host only; see the module
    doc for the rule). ``on_device``: the PIDs NVML lists on its device;
    ``members``: the PIDs in its device cgroup. A Kubernetes lease is :data:`UNKNOWN`
    here: only :func:`check_pod`, with the API, can tell."""
    if not kind_of(lease).rules.on_host:
        return HolderCheck(UNKNOWN, why=f"its server is pod {lease.pod}, which only the "
                           "Kubernetes API can check")
    host = host or this_host()
    recorded_host = lease.holder_host or lease.host
    if recorded_host not in (None, host):
        return HolderCheck(UNKNOWN, why=f"its server runs on host {recorded_host}, not here")
    processes = set(processes_of(lease))
    processes.update(p for p in map(current, members) if p is not None)
    if lease.holder_pid is not None and lease.holder_start is not None:
        recorded = Process(lease.holder_pid, lease.holder_start)
        if alive(recorded):
            processes.add(recorded)
    found = {p.pid for p in processes}
    unaccounted = tuple(sorted(set(on_device) - found))
    if processes:
        return HolderCheck(RUNNING, tuple(sorted(processes, key=lambda p: p.pid)),
                           on_device=unaccounted)
    if unaccounted:
        return HolderCheck(UNKNOWN, why=f"NVML lists PIDs {list(unaccounted)} on its "
                           "device, which no process here was found for", on_device=unaccounted)
    return HolderCheck(GONE)


def stop(held: HolderCheck, grace: float = STOP_GRACE) -> HolderCheck:
    """Stop a running holder: SIGTERM, then SIGKILL after ``grace`` seconds; wait until
    every process is gone. Blocking: call it off the event loop."""
    if held.state != RUNNING:
        return held
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT)):
        left = [p for p in held.processes if alive(p)]
        for process in left:
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                continue
            except PermissionError:
                return HolderCheck(UNKNOWN, tuple(left), f"no permission to stop PID {process.pid}")
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if alive(p)]
        if not left:
            return HolderCheck(GONE)
    return HolderCheck(UNKNOWN, tuple(left), f"PIDs {[p.pid for p in left]} survived SIGKILL")


# --- Kubernetes: the lease's pod -----------------------------------------------------


def pod_holder(pod: Mapping[str, Any] | None, lease: Lease) -> HolderCheck:
    """What the pod found under the lease's pod name says: :data:`GONE` when there is
    none, when it has another UID than the lease recorded (recreated since: not ours),
    or when it has terminated; else :data:`RUNNING`."""
    if pod is None:
        return HolderCheck(GONE)
    if lease.holder_pod_uid and pod_uid(dict(pod)) != lease.holder_pod_uid:
        return HolderCheck(GONE, why=f"pod {lease.pod} was recreated (another UID)")
    if (pod.get("status") or {}).get("phase") in TERMINATED_PHASES:
        return HolderCheck(GONE)
    return HolderCheck(RUNNING, pod=lease.pod or "")


async def check_pod(api: Any, lease: Lease) -> HolderCheck:
    """The Kubernetes lease's pod, read through ``api`` (a ``CoreV1Api``):
    :func:`pod_holder`, or :data:`UNKNOWN` when the API cannot be read."""
    if not lease.pod:
        return HolderCheck(UNKNOWN, why="the lease names no pod")
    try:
        return pod_holder(await read_pod(api, lease.pod), lease)
    except ClusterReadError as e:
        return HolderCheck(UNKNOWN, why=str(e))


async def stop_pod(api: Any, lease: Lease, held: HolderCheck, grace: float = STOP_GRACE
                   ) -> HolderCheck:
    """Delete a running holder pod (``grace`` seconds from SIGTERM to SIGKILL, only while
    it has the recorded UID) and wait until it is gone: :data:`GONE` then, else
    :data:`UNKNOWN` (the API failed, or the pod outlived the wait)."""
    if held.state != RUNNING:
        return held
    try:
        left = await delete_pod(api, held.pod, lease.holder_pod_uid, grace,
                                grace + POD_GONE_WAIT)
    except ClusterReadError as e:
        return HolderCheck(UNKNOWN, pod=held.pod, why=str(e))
    after = pod_holder(left, lease)
    if after.state == RUNNING:
        return HolderCheck(UNKNOWN, pod=held.pod, why=f"pod {held.pod} is still there "
                           f"{grace + POD_GONE_WAIT:.0f}s after it was deleted")
    return after
