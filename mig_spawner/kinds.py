"""What a lease holds, with its I/O: one :class:`SliceKind` per kind of slice.

A lease's kind (``lease.mode``: ``pool``, ``dynamic``, ``kube``, ``gpu``) is looked up
here (:func:`kind_of`) and answers, for every caller alike:

* the server's environment (:meth:`SliceKind.environment`): which device CUDA sees;
* the device nodes a confined server may open (:meth:`SliceKind.device_rules`);
* the release steps: what must happen before the ledger may call the slice free
  (:meth:`SliceKind.before_release`: a dynamic instance is destroyed) and what is
  undone after (:meth:`SliceKind.after_release`: the server's device cgroup and its
  capability nodes), run by :class:`mig_spawner.release.Releaser` on every release
  path, the spawner's and the slice service's;
* its traits (:class:`~mig_spawner.core.kinds.KindRules`), among them which holder
  probe applies (``on_host``: this host's processes, else the lease's pod).

What is free and which placement a claim gets are pure and live in
:mod:`mig_spawner.core.kinds`. Nothing outside these two modules branches on a kind's
name. docs/architecture.md, "Kinds".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mig_spawner.core.catalog import capability_minors
from mig_spawner.core.inventory import Gpu
from mig_spawner.core.isolation import DeviceRule, device_rules, gpu_rules
from mig_spawner.core.kinds import RULES, Kind, KindRules, rules_of
from mig_spawner.device_cgroup import CAPS_DIR, SliceCgroups, return_capabilities
from mig_spawner.gpu.errors import GpuError, InstanceInUse, InstanceNotFound
from mig_spawner.ledger import Lease

__all__ = ["NO_GPU_ACCESS", "Confinement", "Kind", "SliceGpus", "SliceKind",
           "kind_of", "lease_environment", "on_device_words"]

log = logging.getLogger(__name__)

#: ``held_by`` of a dynamic lease whose instance cannot be reached to destroy it.
NO_GPU_ACCESS = "its dynamic instance must be destroyed, but there is no GPU access here"


def on_device_words(pids: Iterable[int]) -> str:
    """``held_by`` for processes the GPU itself lists on the slice."""
    return f"processes still run on its GPU instance (PIDs {', '.join(map(str, pids))})"


class SliceGpus(Protocol):
    """What the release path needs of the GPU adapter (:class:`mig_spawner.gpu.GpuAdapter`)."""

    def gpu(self, index: int) -> Gpu: ...

    def destroy_instance(self, gpu_index: int, gi_id: int) -> None: ...


@dataclass(frozen=True)
class Confinement:
    """Where this host confines servers, so a release can undo it: the cgroup v1
    groups (``cgroups``) and the capability nodes (``caps_dir``). The defaults are the
    host's own; the spawner passes its configured ones."""

    cgroups: SliceCgroups = field(default_factory=SliceCgroups)
    caps_dir: Path = CAPS_DIR

    def undo(self, lease: Lease, gpu_minor: int | None) -> None:
        """Remove ``lease``'s device cgroup (kept, with a warning, while a process is
        still in it) and give its slice's capability nodes (its GPU's minor is
        ``gpu_minor``; ``None``: it has none) back to root alone. A node that is still
        root's was never given (no isolation, or a cgroup confined the server): it is
        left as it is. ``OSError`` when the kernel refuses."""
        if not self.cgroups.remove(lease.id):
            log.warning("Lease %s: its device cgroup is still in use", lease.id)
        if gpu_minor is None or lease.gi_id is None or lease.ci_id is None:
            return
        return_capabilities(self.caps_dir / f"nvidia-cap{minor}"
                            for minor in capability_minors(gpu_minor, lease.gi_id, lease.ci_id))


class SliceKind:
    """One kind of slice (the base: a MIG device on this host, named by the lease)."""

    rules: KindRules

    def device_name(self, lease: Lease) -> str | None:
        """The device ``CUDA_VISIBLE_DEVICES`` names for this slice (``None``: not known
        here); a process whose variable names it holds the slice (mig_spawner.holder)."""
        return lease.mig_uuid

    def environment(self, lease: Lease) -> dict[str, str]:
        """The variables that point the server (CUDA, containers, the user) at its slice."""
        return {**_visible(_mig_name(lease.mig_uuid or "")), **lease_environment(lease),
                **_where(lease),
                "MIG_SPAWNER_GI_ID": str(lease.gi_id),
                "MIG_SPAWNER_CI_ID": str(lease.ci_id)}

    def device_rules(self, lease: Lease, gpu_minor: int, dev: str) -> tuple[DeviceRule, ...]:
        """The device nodes a server confined to ``lease``'s slice may open (its GPU's
        node is ``/dev/nvidia<gpu_minor>`` under ``dev``). ``IsolationError``/``ValueError``
        when the lease does not name one."""
        if lease.gi_id is None or lease.ci_id is None:
            raise ValueError(f"lease {lease.id} names no GPU/compute instance")
        return device_rules(gpu_minor, lease.gi_id, lease.ci_id, dev)

    def before_release(self, lease: Lease, gpus: Callable[[], SliceGpus | None]
                       ) -> str | None:
        """What must be done before the ledger may call the slice free; ``None`` when
        done, else what holds it (for ``held_by``). ``gpus`` reaches the GPU adapter
        (``None``: no GPU access here). Blocking; raises ``GpuError`` for a GPU that
        refused (the release is retried)."""
        return None

    def after_release(self, lease: Lease, gpus: Callable[[], SliceGpus | None],
                      confinement: Confinement | None) -> None:
        """Undo what confined the server to its slice, once nothing holds it. Blocking;
        logs what it cannot undo."""
        if confinement is None or not self.rules.on_host:
            return
        try:
            adapter = gpus() if lease.gi_id is not None else None
            minor = (adapter.gpu(lease.gpu_index).minor
                     if adapter is not None and lease.gpu_index is not None else None)
        except GpuError:
            minor = None  # no capability nodes to name: only the cgroup goes
        try:
            confinement.undo(lease, minor)
        except OSError as e:
            log.error("Lease %s: its server's confinement could not be undone: %s",
                      lease.id, e)


class PoolSlice(SliceKind):
    """A MIG instance an admin made; the lease names it from its claim."""

    rules = RULES[Kind.POOL]


class DynamicSlice(SliceKind):
    """A MIG instance made for the lease; destroyed before the lease is released, so
    the ledger never shows a slice free that still exists on the GPU."""

    rules = RULES[Kind.DYNAMIC]

    def before_release(self, lease: Lease, gpus: Callable[[], SliceGpus | None]
                       ) -> str | None:
        if lease.gi_id is None or lease.gpu_index is None:
            return None  # never made
        adapter = gpus()
        if adapter is None:
            return NO_GPU_ACCESS
        try:
            adapter.destroy_instance(lease.gpu_index, lease.gi_id)
        except InstanceNotFound:
            pass  # destroyed already (by the other party, or out of band)
        except InstanceInUse as e:
            return on_device_words(e.pids)  # never forced
        return None


class KubeResource(SliceKind):
    """A cluster's MIG resource: the device plugin gives the pod its device, so the
    environment names only the lease, and the pod is what holds it."""

    rules = RULES[Kind.KUBE]

    def device_name(self, lease: Lease) -> str | None:
        return None  # the device plugin chose it, inside the pod

    def environment(self, lease: Lease) -> dict[str, str]:
        return lease_environment(lease)


class WholeGpu(SliceKind):
    """A whole GPU with MIG off (every memory slice of it in the ledger)."""

    rules = RULES[Kind.GPU]

    def device_name(self, lease: Lease) -> str | None:
        return lease.gpu_uuid

    def environment(self, lease: Lease) -> dict[str, str]:
        return {**_visible(lease.gpu_uuid or ""), **lease_environment(lease), **_where(lease)}

    def device_rules(self, lease: Lease, gpu_minor: int, dev: str) -> tuple[DeviceRule, ...]:
        return gpu_rules(gpu_minor, dev)


_KINDS: dict[Kind, SliceKind] = {
    k.rules.kind: k for k in (PoolSlice(), DynamicSlice(), KubeResource(), WholeGpu())
}


def kind_of(lease: Lease) -> SliceKind:
    """The kind of slice ``lease`` holds."""
    return _KINDS[rules_of(lease.mode).kind]


def lease_environment(lease: Lease) -> dict[str, str]:
    """What every kind tells the server about its lease: the profile and the lease id."""
    return {"MIG_SPAWNER_PROFILE": lease.profile, "MIG_SPAWNER_LEASE_ID": lease.id}


def _visible(device: str) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": device, "NVIDIA_VISIBLE_DEVICES": device}


def _mig_name(uuid: str) -> str:
    return uuid if uuid.startswith("MIG-") else f"MIG-{uuid}"


def _where(lease: Lease) -> dict[str, str]:
    return {"MIG_SPAWNER_GPU_INDEX": str(lease.gpu_index),
            "MIG_SPAWNER_GPU_UUID": lease.gpu_uuid or ""}

