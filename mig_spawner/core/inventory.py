"""A snapshot of one host's MIG state, as plain immutable data.

The GPU adapter (``mig_spawner.gpu``) builds these from NVML; the allocator,
the spawner and the CLI read them. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .catalog import GpuModel, Profile, model


@dataclass(frozen=True)
class GpuProcess:
    """A process running on a MIG device, or on a whole GPU with MIG off."""

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
    # True when the driver refused or garbled the process list: nobody can tell whether
    # the slice is in use, so it counts as busy (the culler then leaves it alone).
    processes_unknown: bool = False

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.processes)

    @property
    def busy(self) -> bool:
        return bool(self.processes) or self.processes_unknown


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
    # The GI profiles as this GPU's driver reports them (empty with MIG off).
    driver_profiles: tuple[Profile, ...] = ()
    # With MIG off, what runs on the GPU as a whole (with MIG on, each MIG device
    # carries its own): the processes NVML lists, whether that list could not be read
    # (then it counts as busy, as for a MIG device), and the memory in use.
    processes: tuple[GpuProcess, ...] = ()
    processes_unknown: bool = False
    memory_used_mib: int = 0
    # NVML answers GPU_IS_LOST for it (fallen off the bus, or otherwise unreachable):
    # nothing of its state is known. It then reads as a GPU without MIG and without
    # instances whose processes are unknown (busy), so that nothing is offered on it and
    # nothing on it counts as free; index, uuid, product, minor and memory are what
    # this process last read of it ("", -1 and 0 where it never did).
    lost: bool = False

    def pids_on(self, device: str) -> tuple[int, ...]:
        """The PIDs NVML lists on ``device`` of this GPU: one of its MIG devices (by
        UUID), or with MIG off the GPU itself (by its UUID); none for any other name."""
        for d in self.mig_devices:
            if d.uuid == device:
                return d.pids
        if device == self.uuid and not self.mig_current:
            return tuple(p.pid for p in self.processes)
        return ()

    @property
    def mig_enabled(self) -> bool:
        """MIG is on now and no mode change waits for a reset."""
        return self.mig_current and self.mig_pending == self.mig_current

    def catalog_model(self) -> GpuModel | None:
        """This GPU's catalog model with the driver's figures where it reported them."""
        if self.model_key is None:
            return None
        return model(self.model_key).with_driver_figures(self.driver_profiles)


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

    def model(self, key: str) -> GpuModel:
        """Catalog model ``key`` with the figures this host's driver reports for it (the
        catalog's own where no GPU of that model reported any)."""
        for gpu in self.gpus:
            if gpu.model_key == key and gpu.driver_profiles:
                return gpu.catalog_model()  # type: ignore[return-value]
        return model(key)
