"""The GPU adapter: MIG inventory and instance management through pynvml.

Reading (``inventory``) never changes anything on the GPU. Creating and destroying
instances happens only when asked. The same code runs on a real driver and on the
simulator (which sits below pynvml), so nothing here knows which one it talks to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from ctypes import Structure, byref, c_uint, c_ulonglong
from dataclasses import dataclass
from typing import Any

import pynvml

from mig_spawner.core import catalog
from mig_spawner.core.health import DriverEvent, GpuHealth
from mig_spawner.core.inventory import (
    ComputeInstance,
    Gpu,
    GpuInstance,
    GpuProcess,
    Inventory,
    MigDevice,
)

from . import errors
from .health import WAIT_MS, DriverEvents, read_health

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
# "No MIG device at this index" (docs/mig-facts.md): holes in the index range are normal.
_NO_DEVICE_HERE = (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument)
_NO_PROFILE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument)
# A library or driver without a process-list call: try the older one.
_NO_SUCH_CALL = (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLLibraryMismatchError)
# A process record's GPU/compute instance ID on a GPU with MIG off (NVML sets both to
# this when MIG is disabled: there is no instance to name).
_NO_INSTANCE = 0xFFFFFFFF
# Drivers 535.43-535.86 garble the _v3 process records after the first (nvitop#79/#89).
GARBLED_PROCESS_DRIVERS = ((535, 43), (535, 86))


class _ProcessInfoV1(Structure):
    """``nvmlProcessInfo_v1_t``: what the unversioned call of old drivers fills."""

    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]


def garbles_process_records(driver_version: str) -> bool:
    """Whether this driver is one whose _v3 process records are known to come out garbled."""
    try:
        major, minor = (int(x) for x in driver_version.split(".")[:2])
    except ValueError:
        return False
    low, high = GARBLED_PROCESS_DRIVERS
    return low <= (major, minor) <= high


def probe_mig_config_access() -> bool:
    """Whether this process may create/destroy MIG instances on a real host (read-only check).

    Root may; otherwise read access to the MIG ``config`` capability is needed: the device
    node when the driver exposes capabilities in /dev, else the /proc file.
    """
    if os.geteuid() == 0:
        return True
    if os.path.isdir(os.path.dirname(errors.MIG_CONFIG_DEVICE)):
        return os.access(errors.MIG_CONFIG_DEVICE, os.R_OK)
    return os.access(errors.MIG_CONFIG_PROC, os.R_OK)


class GpuAdapter:
    """MIG on one host, through NVML. Use :func:`mig_spawner.gpu.connect` to get one."""

    def __init__(self, *, library: Any = None,
                 privilege_probe: Callable[[], bool] = probe_mig_config_access) -> None:
        """``library``: an object to install as ``pynvml.nvmlLib`` (the simulator), or None
        for the real libnvidia-ml. ``privilege_probe`` answers :meth:`can_configure`."""
        self._library = library
        self._privilege_probe = privilege_probe
        self._profiles: dict[str, tuple[catalog.Profile, ...]] = {}  # by GPU UUID; per driver
        self._ci_profiles: dict[tuple[str, int], int] = {}  # (GPU UUID, GI profile) -> CI ID
        self._seen: dict[int, Gpu] = {}  # by index: the last good read (a lost GPU's name)
        self._lost: set[int] = set()  # GPU indexes the last inventory found lost
        self._watchers: list[DriverEvents] = []
        self._open = False
        with self._nvml("initialising NVML"):
            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        self._open = True
        if garbles_process_records(driver):
            low, high = (".".join(map(str, v)) for v in GARBLED_PROCESS_DRIVERS)
            log.warning("NVIDIA driver %s (%s-%s) garbles process lists; mig-spawner falls "
                        "back to the older call, but upgrading the driver is advised",
                        driver, low, high)

    # --- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the event watchers and release NVML (idempotent)."""
        for watcher in self._watchers:
            watcher.close()
        if self._open:
            self._open = False
            with self._nvml("shutting NVML down"):
                pynvml.nvmlShutdown()

    def __enter__(self) -> GpuAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading ----------------------------------------------------------------------

    def inventory(self) -> Inventory:
        """A snapshot of every GPU, its MIG mode, instances and MIG devices (read-only).

        A GPU the driver reports lost (GPU_IS_LOST) is in it with ``lost`` set and
        nothing usable (see :class:`~mig_spawner.core.inventory.Gpu`); the others are
        read as ever."""
        with self._nvml("reading the GPU inventory"):
            count = pynvml.nvmlDeviceGetCount()
            gpus = tuple(self._gpu_or_lost(i) for i in range(count))
            return Inventory(
                host=socket.gethostname(),
                driver_version=pynvml.nvmlSystemGetDriverVersion(),
                nvml_version=pynvml.nvmlSystemGetNVMLVersion(),
                cuda_driver_version=pynvml.nvmlSystemGetCudaDriverVersion(),
                gpus=gpus,
            )

    def gpu(self, index: int) -> Gpu:
        """A snapshot of one GPU (cheaper than a full inventory); :class:`GpuLost
        <mig_spawner.gpu.errors.GpuLost>` for a GPU the driver reports lost (what runs
        on it cannot be read, which a caller must not take for "nothing")."""
        with self._nvml(f"reading GPU {index}"):
            return self._gpu(index)

    def health(self, expected: Mapping[str, Collection[str]] | None = None
               ) -> tuple[GpuHealth, ...]:
        """Every GPU's health now, for one sweep (read-only): volatile uncorrectable ECC
        errors, remapped rows pending or failed, retired pages pending, lost; and, of
        ``expected`` (GPU UUID -> the MIG device UUIDs the caller expects there), the
        devices the driver no longer lists. A value the driver does not report is None.
        Judge it with :func:`mig_spawner.core.health.health_faults`."""
        with self._nvml("reading the GPUs' health"):
            known = {index: gpu.uuid for index, gpu in self._seen.items()}
            return read_health(known, expected or {})

    def watch_events(self, on_event: Callable[[DriverEvent], None],
                     wait_ms: int = WAIT_MS) -> DriverEvents:
        """Start reading the driver's critical Xid and double-bit ECC events of every GPU
        (one event set, one thread): ``on_event`` is called from that thread with each.
        Judge them with :func:`mig_spawner.core.health.event_fault`. Close the watcher,
        or the adapter, to stop (within ``wait_ms``)."""
        watcher = DriverEvents(on_event, self._nvml, wait_ms)
        self._watchers.append(watcher)
        return watcher

    def can_configure(self) -> bool:
        """Whether creating/destroying instances is allowed to this process (read-only)."""
        return self._privilege_probe()

    # --- changing -------------------------------------------------------------------------

    def create_instance(self, gpu_index: int, profile_name: str, start: int) -> MigDevice:
        """Create a GPU instance of ``profile_name`` at memory slice ``start`` and its
        full-size compute instance; return the new MIG device."""
        doing = f"creating a {profile_name} instance at start {start} on GPU {gpu_index}"
        with self._nvml(doing):
            handle, uuid = self._mig_gpu(gpu_index)
            profile = self._profile_named(handle, uuid, profile_name, gpu_index)
            if start not in profile.placement_starts:
                raise errors.InvalidPlacement(
                    f"{profile.name} cannot start at memory slice {start} on GPU {gpu_index}",
                    f"use one of the starts {list(profile.placement_starts)}",
                )
            placement = pynvml.c_nvmlGpuInstancePlacement_t(start, profile.placement_size)
            try:
                gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    handle, profile.profile_id, byref(placement))
            except pynvml.NVMLError_InsufficientResources:
                raise errors.InsufficientResources(
                    f"no room for {profile.name} at memory slices {start}-"
                    f"{start + profile.placement_size - 1} on GPU {gpu_index}",
                    code=pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
                ) from None
            ci = None
            try:
                ci_profile = self._full_ci_profile(gi, uuid, profile)
                ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
                # IDs are read back, never computed: boards number instances differently.
                gi_id = pynvml.nvmlGpuInstanceGetInfo(gi).id
                ci_id = pynvml.nvmlComputeInstanceGetInfo(ci).id
                device = next((d for d in self._gpu(gpu_index).mig_devices
                               if (d.gi_id, d.ci_id) == (gi_id, ci_id)), None)
                if device is None:
                    raise errors.NvmlCallFailed(
                        f"{doing}: the new instance (GI {gi_id}, CI {ci_id}) has no MIG "
                        "device", "check 'nvidia-smi -L'; the driver may need a newer version")
            except BaseException:
                # Nothing leaks: an instance nobody can find or use would hold its slices.
                with contextlib.suppress(pynvml.NVMLError):
                    if ci is not None:
                        pynvml.nvmlComputeInstanceDestroy(ci)
                    pynvml.nvmlGpuInstanceDestroy(gi)
                raise
            return device

    def destroy_instance(self, gpu_index: int, gi_id: int) -> None:
        """Destroy GPU instance ``gi_id`` and its compute instances.

        Raises :class:`~errors.InstanceInUse` (with ``pids``) when processes still run on it.
        """
        doing = f"destroying GPU instance {gi_id} on GPU {gpu_index}"
        with self._nvml(doing):
            handle, _ = self._mig_gpu(gpu_index)
            try:
                gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            except _NO_DEVICE_HERE:
                raise errors.InstanceNotFound(
                    f"GPU {gpu_index} has no GPU instance {gi_id}",
                    code=pynvml.NVML_ERROR_NOT_FOUND) from None
            devices = [d for d in self._mig_devices(handle, gpu_index) if d.gi_id == gi_id]
            self._refuse_if_busy(devices, doing)
            try:
                for device in devices:
                    ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, device.ci_id)
                    pynvml.nvmlComputeInstanceDestroy(ci)
                pynvml.nvmlGpuInstanceDestroy(gi)
            except pynvml.NVMLError_InUse:
                # A process started between our check and the destroy.
                fresh = [d for d in self._mig_devices(handle, gpu_index) if d.gi_id == gi_id]
                self._refuse_if_busy(fresh, doing)
                raise

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> bool:
        """Ask for MIG on or off on GPU ``gpu_index`` (it must carry no instance); True
        when the new mode waits for a GPU reset (Ampere), False when it is live."""
        doing = f"turning MIG {'on' if enabled else 'off'} on GPU {gpu_index}"
        with self._nvml(doing):
            handle = self._handle(gpu_index)
            mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
            status = pynvml.nvmlDeviceSetMigMode(handle, mode)
            return status != pynvml.NVML_SUCCESS

    def reset_gpu(self, gpu_index: int) -> None:
        """Reset GPU ``gpu_index`` so that a pending MIG mode takes effect (every instance
        on it is gone). NVML has no call for it: ``nvidia-smi -r``, as root; the simulator
        models the same."""
        reset = getattr(self._library, "reset_gpu", None)
        if reset is not None:
            reset(gpu_index)
            return
        import subprocess

        done = subprocess.run(["nvidia-smi", "-i", str(gpu_index), "-r"], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise errors.NvmlCallFailed(
                f"resetting GPU {gpu_index} failed: {done.stdout.strip() or done.stderr.strip()}",
                "stop every process on the GPU and run it as root")

    # --- internals --------------------------------------------------------------------

    @contextlib.contextmanager
    def _nvml(self, doing: str) -> Iterator[None]:
        """Use our library, and turn pynvml errors into typed GpuErrors."""
        if self._library is not None and pynvml.nvmlLib is not self._library:
            # Another simulated host was installed since (e.g. a second test adapter).
            with pynvml.libLoadLock:
                pynvml.nvmlLib = self._library
                pynvml._nvmlGetFunctionPointer_cache.clear()
        try:
            yield
        except pynvml.NVMLError as exc:
            raise errors.from_nvml(exc, doing) from exc

    def _handle(self, index: int) -> Any:
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        except _NO_DEVICE_HERE:
            count = pynvml.nvmlDeviceGetCount()
            raise errors.NoSuchGpu(
                f"there is no GPU {index}; this host has {count} GPU(s) (0-{count - 1})"
            ) from None

    def _mig_gpu(self, index: int) -> tuple[Any, str]:
        """Handle and UUID of GPU ``index``, checking MIG is on and not waiting for a reset."""
        handle = self._handle(index)
        product = pynvml.nvmlDeviceGetName(handle)
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError_NotSupported:
            raise errors.MigNotSupported(f"GPU {index} ({product}) does not support MIG",
                                         code=pynvml.NVML_ERROR_NOT_SUPPORTED) from None
        if current != pending:
            raise errors.MigPending(
                f"GPU {index} ({product}) has MIG {'on' if current else 'off'} now and "
                f"{'on' if pending else 'off'} pending a GPU reset",
                f"stop the processes on GPU {index} and run 'nvidia-smi -i {index} -r' as "
                "root, or reboot",
            )
        if not current:
            raise errors.MigDisabled(
                f"MIG mode is disabled on GPU {index} ({product})",
                f"enable it as root: nvidia-smi -i {index} -mig 1",
            )
        return handle, pynvml.nvmlDeviceGetUUID(handle)

    def _gpu_or_lost(self, index: int) -> Gpu:
        """GPU ``index``, or what is known of it when the driver reports it lost."""
        try:
            gpu = self._gpu(index)
        except pynvml.NVMLError_GpuIsLost:
            if index not in self._lost:
                self._lost.add(index)
                log.error("GPU %d is lost (fallen off the bus or unreachable): its slices "
                          "are not offered; the other GPUs serve on", index)
            seen = self._seen.get(index)
            return Gpu(index=index, uuid=seen.uuid if seen else "",
                       product=seen.product if seen else "", model_key=None,
                       minor=seen.minor if seen else -1,
                       memory_total_mib=seen.memory_total_mib if seen else 0,
                       mig_current=False, mig_pending=False, mig_supported=False,
                       processes_unknown=True, lost=True)
        if index in self._lost:
            self._lost.discard(index)
            log.warning("GPU %d answers again (%s)", index, gpu.uuid)
        return gpu

    def _gpu(self, index: int) -> Gpu:
        handle = self._handle(index)
        product = pynvml.nvmlDeviceGetName(handle)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        model = catalog.find_model_for_product(product)
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
            supported = True
        except pynvml.NVMLError_NotSupported:
            current, pending, supported = 0, 0, False
        gis: tuple[GpuInstance, ...] = ()
        devices: tuple[MigDevice, ...] = ()
        driver_profiles: tuple[catalog.Profile, ...] = ()
        if current:
            driver_profiles = self._gpu_profiles(handle, uuid)
            gi_handles: dict[int, Any] = {}
            try:
                gis = self._gpu_instances(handle, uuid, gi_handles)
            except pynvml.NVMLError_NoPermission:
                # Reading needs the monitor capability, not config: say which one.
                raise errors.MonitorCapabilityMissing(
                    f"listing the GPU instances of GPU {index} is not permitted",
                    code=pynvml.NVML_ERROR_NO_PERMISSION,
                ) from None
            devices = self._mig_devices(handle, index, gis, uuid)
            cis: dict[int, list[ComputeInstance]] = {}
            for d in devices:
                ci_info = pynvml.nvmlComputeInstanceGetInfo(
                    pynvml.nvmlGpuInstanceGetComputeInstanceById(gi_handles[d.gi_id], d.ci_id))
                cis.setdefault(d.gi_id, []).append(
                    ComputeInstance(d.ci_id, ci_info.profileId, ci_info.placement.size))
            gis = tuple(GpuInstance(g.gi_id, g.profile, g.profile_id, g.start, g.size,
                                    tuple(cis.get(g.gi_id, ()))) for g in gis)
        processes: tuple[GpuProcess, ...] = ()
        unknown, used = False, 0
        if not current:
            # A whole GPU: what runs on it is read as a MIG device's is (the quirks alike).
            processes, unknown = self._processes(handle, _NO_INSTANCE, _NO_INSTANCE,
                                                 f"GPU {index}")
            used = self._memory_used_mib(handle, index)
        gpu = self._seen[index] = Gpu(
            index=index,
            uuid=uuid,
            product=product,
            model_key=model.key if model else None,
            minor=pynvml.nvmlDeviceGetMinorNumber(handle),
            memory_total_mib=self._parent_memory_mib(handle, index, model, devices),
            mig_current=bool(current),
            mig_pending=bool(pending),
            mig_supported=supported,
            gpu_instances=gis,
            mig_devices=devices,
            driver_profiles=driver_profiles,
            processes=processes,
            processes_unknown=unknown,
            memory_used_mib=used,
        )
        return gpu

    @staticmethod
    def _memory_used_mib(handle: Any, index: int) -> int:
        """The memory in use on a GPU with MIG off (0, with a warning, when the driver
        will not tell: the process list still says whether it is in use)."""
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle).used // _MIB
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as exc:
            log.warning("cannot read the memory in use on GPU %d: %s", index, exc)
            return 0

    @staticmethod
    def _parent_memory_mib(handle: Any, index: int, model: catalog.GpuModel | None,
                           devices: tuple[MigDevice, ...]) -> int:
        """The GPU's memory; with MIG on, real drivers tell it to privileged callers only,
        so an unprivileged hub takes the catalog's figure (else its MIG devices' sum)."""
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle).total // _MIB
        except pynvml.NVMLError_NoPermission:
            log.debug("GPU %d: parent memory is privileged; using the catalog's figure", index)
            if model is not None:
                return model.memory_mib
            return sum(d.memory_total_mib for d in devices)

    def _gpu_instances(self, handle: Any, uuid: str, gi_handles: dict[int, Any]
                       ) -> tuple[GpuInstance, ...]:
        """Every GI of the GPU, by asking for the GIs of each profile it supports."""
        found = []
        for profile in self._gpu_profiles(handle, uuid):
            array = (pynvml.c_nvmlGpuInstance_t * profile.max_instances)()
            count = c_uint(0)
            pynvml.nvmlDeviceGetGpuInstances(handle, profile.profile_id, array, byref(count))
            for slot in range(count.value):
                info = pynvml.nvmlGpuInstanceGetInfo(array[slot])
                gi_handles[info.id] = array[slot]
                found.append(GpuInstance(info.id, profile.name, profile.profile_id,
                                         info.placement.start, info.placement.size))
        return tuple(sorted(found, key=lambda g: g.gi_id))

    def _mig_devices(self, handle: Any, index: int, gis: tuple[GpuInstance, ...] = (),
                     uuid: str = "") -> tuple[MigDevice, ...]:
        """Walk the MIG device handles; holes in the index range are skipped."""
        by_gi = {g.gi_id: g for g in gis}
        devices = []
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except _NO_DEVICE_HERE:
                continue
            name = pynvml.nvmlDeviceGetName(mig)
            gi_id = pynvml.nvmlDeviceGetGpuInstanceId(mig)
            memory = pynvml.nvmlDeviceGetMemoryInfo(mig)
            gi = by_gi.get(gi_id)
            ci_id = pynvml.nvmlDeviceGetComputeInstanceId(mig)
            processes, unknown = self._processes(mig, gi_id, ci_id)
            devices.append(MigDevice(
                uuid=pynvml.nvmlDeviceGetUUID(mig),
                gpu_index=index,
                gpu_uuid=uuid,
                index=slot,
                name=name,
                profile=gi.profile if gi else catalog.normalize_profile_name(
                    name.rpartition(" MIG ")[2]),
                gi_id=gi_id,
                ci_id=ci_id,
                start=gi.start if gi else -1,
                size=gi.size if gi else 0,
                memory_total_mib=memory.total // _MIB,
                memory_used_mib=memory.used // _MIB,
                processes=processes,
                processes_unknown=unknown,
            ))
        return tuple(devices)

    @staticmethod
    def _processes(mig: Any, gi_id: int, ci_id: int, what: str = ""
                   ) -> tuple[tuple[GpuProcess, ...], bool]:
        """The processes on one MIG device (or, with ``gi_id``/``ci_id`` both
        ``_NO_INSTANCE``, on a whole GPU with MIG off: ``what`` names it in the log), and
        whether they could not be read.

        Newest call first (_v3, _v2, then the unversioned v1 layout): an older library
        lacks the newer ones, and some drivers garble _v3's records, so an answer whose
        records do not belong to this device is retried with the older layout. A list
        nobody could read is *unknown* (the slice then counts as busy), never "empty".
        """
        what = what or f"MIG device GI {gi_id} CI {ci_id}"
        for read in (pynvml.nvmlDeviceGetComputeRunningProcesses_v3,
                     pynvml.nvmlDeviceGetComputeRunningProcesses_v2, _processes_v1):
            try:
                procs = read(mig)
            except _NO_SUCH_CALL:
                continue
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError as exc:
                log.warning("cannot list the processes of %s: %s", what, exc)
                return (), True
            if _consistent(procs, gi_id, ci_id):
                return tuple(GpuProcess(p.pid, (p.usedGpuMemory or 0) // _MIB)
                             for p in procs), False
            log.warning("the driver's %s answer for %s is garbled; trying an older call",
                        getattr(read, "__name__", "process"), what)
        return (), True

    def _gpu_profiles(self, handle: Any, uuid: str) -> tuple[catalog.Profile, ...]:
        """The GI profiles this GPU supports, with the driver's own figures (memory, SMs,
        copy and media engines, instances, placements). Cached once read: fixed per
        driver."""
        cached = self._profiles.get(uuid)
        if cached is not None:
            return cached
        profiles = []
        for enum_index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info, name = self._profile_info(handle, enum_index)
            except _NO_PROFILE:
                continue
            count = c_uint(0)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None, byref(count))
            slots = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, slots, byref(count))
            placements = slots[: count.value]
            profiles.append(catalog.Profile(
                name=name,
                enum_index=enum_index,
                profile_id=info.id,
                compute_slices=info.sliceCount,
                memory_slices=placements[0].size if placements else 0,
                memory_mib=info.memorySizeMB,
                sm_count=info.multiprocessorCount,
                copy_engines=info.copyEngineCount,
                decoders=info.decoderCount,
                encoders=info.encoderCount,
                jpeg=info.jpegCount,
                ofa=info.ofaCount,
                max_instances=info.instanceCount,
                placement_starts=tuple(p.start for p in placements),
                ci_profile_index=-1,  # asked of the GPU instance when creating
                variant=_variant(name),
                source="driver",
            ))
        profiles.sort(key=lambda p: catalog.profile_sort_key(p.name))
        if profiles:  # with MIG off the driver lists none; ask again once it is on
            self._profiles[uuid] = tuple(profiles)
        return tuple(profiles)

    def driver_profiles(self, gpu_index: int) -> tuple[catalog.Profile, ...]:
        """The profile table the driver reports for one GPU (read-only; empty with MIG off
        or on a GPU without MIG)."""
        with self._nvml(f"reading the MIG profiles of GPU {gpu_index}"):
            handle = self._handle(gpu_index)
            try:
                return self._gpu_profiles(handle, pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError_NotSupported:
                return ()

    @staticmethod
    def _profile_info(handle: Any, enum_index: int) -> tuple[Any, str]:
        """Profile info and name; drivers before the versioned call get the name from the
        catalog (or from the slice count and memory, for a GPU the catalog lacks)."""
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum_index)
            return info, catalog.normalize_profile_name(info.name)
        except pynvml.NVMLError_FunctionNotFound:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum_index, version=1)
        model = catalog.find_model_for_product(pynvml.nvmlDeviceGetName(handle))
        if model is not None:
            with contextlib.suppress(catalog.CatalogError):
                return info, model.profile_by_id(info.id).name
        return info, f"{info.sliceCount}g.{round(info.memorySizeMB / 1024)}gb"

    def _profile_named(self, handle: Any, uuid: str, name: str, index: int
                       ) -> catalog.Profile:
        profiles = self._gpu_profiles(handle, uuid)
        wanted = catalog.normalize_profile_name(name)
        for profile in profiles:
            if profile.name == wanted:
                return profile
        raise errors.UnknownProfile(
            f"{name!r} is not a MIG profile of GPU {index}",
            f"use one of: {', '.join(p.name for p in profiles)}",
        )

    def _full_ci_profile(self, gi: Any, uuid: str, profile: catalog.Profile) -> int:
        """The ID of the compute-instance profile that spans the whole GI, as the driver
        offers it for this GI (cached per GI profile): every compute-instance profile is
        asked of the GI itself, as NVIDIA's mig-parted and DCGM do, and
        :func:`full_compute_profile` picks (docs/mig-facts.md, "Compute instances")."""
        key = (uuid, profile.profile_id)
        if key not in self._ci_profiles:
            offered = []
            for enum_index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi, enum_index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                except _NO_PROFILE:
                    continue  # the driver does not offer this one in this GI
                offered.append(ComputeProfile(enum_index, info.id, info.sliceCount,
                                              info.multiprocessorCount))
            chosen = full_compute_profile(offered, profile.compute_slices)
            if chosen is None:
                raise errors.NvmlCallFailed(
                    f"the driver offers no full-size compute instance for {profile.name} "
                    f"(it offers {', '.join(str(c) for c in offered) or 'none'})")
            self._ci_profiles[key] = chosen.profile_id
        return self._ci_profiles[key]

    @staticmethod
    def _refuse_if_busy(devices: list[MigDevice], doing: str) -> None:
        pids = tuple(pid for d in devices for pid in d.pids)
        if pids:
            raise errors.InstanceInUse(
                f"{doing}: processes still run on it ({', '.join(map(str, pids))})", pids)


@dataclass(frozen=True)
class ComputeProfile:
    """One compute-instance profile a GPU instance offers, as the driver answers it."""

    enum_index: int
    profile_id: int
    slices: int
    sm_count: int

    def __str__(self) -> str:
        return f"profile {self.enum_index}: {self.slices} slice(s), {self.sm_count} SMs"


def full_compute_profile(offered: Iterable[ComputeProfile], gi_slices: int
                         ) -> ComputeProfile | None:
    """The compute-instance profile spanning a GPU instance of ``gi_slices`` compute
    slices, of those its driver ``offered``: the GI's slice count, then the most SMs (the
    whole GI's), then the lowest enum (the default `nvidia-smi mig -lcip` marks). Not the
    first with a matching slice count: on Hopper the double-memory 1g's is
    ``1_SLICE_REV1`` (enum 7), which `nvidia-smi mig -cgi 15 -C` creates."""
    spanning = [p for p in offered if p.slices == gi_slices]
    return min(spanning, key=lambda p: (-p.sm_count, p.enum_index), default=None)


def _variant(name: str) -> str:
    try:
        return catalog.parse_profile_name(name)[2]
    except catalog.CatalogError:
        return ""


def _consistent(procs: list[Any], gi_id: int, ci_id: int) -> bool:
    """Records that belong to this MIG device (or whole GPU): real PIDs, each once, and
    (where the layout carries them) this device's GI and CI IDs (``_NO_INSTANCE`` on a
    whole GPU)."""
    pids = [p.pid for p in procs]
    if any(pid <= 0 for pid in pids) or len(set(pids)) != len(pids):
        return False
    return all((getattr(p, "gpuInstanceId", gi_id), getattr(p, "computeInstanceId", ci_id))
               == (gi_id, ci_id) for p in procs)


def _processes_v1(mig: Any) -> list[Any]:
    """The unversioned process list (the v1 record layout), through pynvml's own
    symbol lookup and error mapping; pynvml itself no longer wraps this layout."""
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    count = c_uint(0)
    ret = fn(mig, byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    count.value = count.value * 2 + 5  # room for processes started since
    records = (_ProcessInfoV1 * count.value)()
    pynvml._nvmlCheckReturn(fn(mig, byref(count), records))
    return list(records[: count.value])
