"""A snapshot of one host's MIG state, as plain immutable data.

The GPU adapter (``mig_spawner.gpu``) builds these from NVML; the allocator,
the spawner and the CLI read them. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuProcess:
    """A process running on a MIG device."""

    pid: int
    used_memory_mib: int


@dataclass(frozen=True)
class MigDevice:
    """A GPU instance + compute instance pair: what ``CUDA_VISIBLE_DEVICES=MIG-<uuid>`` selects."""

    uuid: str
    gpu_index: int
    gpu_uuid: str
    index: int
    name: str
    profile: str
    gi_id: int
    ci_id: int
    start: int
    size: int
    memory_total_mib: int
    memory_used_mib: int
    processes: tuple[GpuProcess, ...] = ()
    #: True when the driver refused or garbled the process list: the device may be
    #: in use, so it counts as busy (never idle).
    processes_unknown: bool = False

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.processes)

    @property
    def busy(self) -> bool:
        return self.processes_unknown or bool(self.processes)


@dataclass(frozen=True)
class ComputeInstance:
    ci_id: int
    profile_index: int
    slice_count: int


@dataclass(frozen=True)
class GpuInstance:
    """A GPU instance: a profile laid on ``size`` memory slices from ``start``."""

    gi_id: int
    profile: str
    profile_id: int
    start: int
    size: int
    compute_instances: tuple[ComputeInstance, ...] = ()

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True)
class Gpu:
    """One physical GPU and its MIG layout."""

    index: int
    uuid: str
    product: str
    model_key: str | None
    minor: int
    memory_total_mib: int
    mig_current: bool
    mig_pending: bool
    mig_supported: bool = True
    gpu_instances: tuple[GpuInstance, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()

    @property
    def mig_enabled(self) -> bool:
        """MIG is on now and no mode change waits for a reset."""
        return self.mig_current and self.mig_pending == self.mig_current


@dataclass(frozen=True)
class Inventory:
    """Every GPU of one host at one moment."""

    host: str
    driver_version: str
    nvml_version: str
    cuda_driver_version: int
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)

    @property
    def mig_devices(self) -> tuple[MigDevice, ...]:
        return tuple(d for g in self.gpus for d in g.mig_devices)

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def device_by_uuid(self, uuid: str) -> MigDevice | None:
        return next((d for d in self.mig_devices if d.uuid == uuid), None)
