"""A stand-in for ``libnvidia-ml.so`` that pynvml calls exactly as it calls the real one.

pynvml looks every C symbol up on its module global ``nvmlLib`` and calls it with ctypes
arguments: numbers, ``byref()`` outputs, string buffers, arrays. This object answers those
calls from a :class:`SimulatedHost`, so pynvml's own wrappers, marshalling and
``NVMLError`` mapping run unchanged. Handles are opaque pointers whose address encodes
what they point at (kind, GPU, GI, CI); pynvml never dereferences them.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml
from pynvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_SUCCESS,
)

from ..nvml import garbles_process_records
from . import rules
from .activity import GpmFunctions
from .host import SimulatedHost
from .rules import SimError
from .state import (
    HostState,
    SimComputeInstance,
    SimEvent,
    SimGpu,
    SimGpuInstance,
    mig_device_uuid,
)

_DEVICE, _MIG, _GI, _CI, _EVENT_SET = 1, 2, 3, 4, 5
_MIB = 1024 * 1024
_PTR = ctypes.sizeof(ctypes.c_void_p)
# Calls that work before nvmlInit (or are init itself).
# nvmlErrorString texts that pynvml's own table lacks (as libnvidia-ml words them).
_ERROR_TEXT = {
    pynvml.NVML_ERROR_IN_USE: "In use by another client",
    pynvml.NVML_ERROR_NO_DATA: "No data",
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    pynvml.NVML_ERROR_INVALID_STATE: "Invalid state",
}
_NO_INIT = frozenset({"nvmlInit", "nvmlInitWithFlags", "nvmlInit_v2", "nvmlErrorString"})
# An older libnvidia-ml lacks the newer process-list symbols (spec option procs=).
_PROCS = "nvmlDeviceGetComputeRunningProcesses"
# A process record's GPU/compute instance ID on a GPU with MIG off, as NVML sets it.
_NO_INSTANCE = 0xFFFFFFFF
_MISSING_BY_API = {"v2": (f"{_PROCS}_v3",), "v1": (f"{_PROCS}_v3", f"{_PROCS}_v2")}
# The event types a GPU supports (nvmlDeviceGetSupportedEventTypes); nvml.h: "ECC
# events are available only on ECC enabled devices".
_BASE_EVENTS = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypePState
                | pynvml.nvmlEventTypeClock)
_ECC_EVENTS = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError


def _addr(kind: int, gpu: int, gi: int = 0, ci: int = 0) -> int:
    return (kind << 40) | ((gpu + 1) << 24) | ((gi + 1) << 12) | (ci + 1)


def _decode(handle: Any) -> tuple[int, int, int, int]:
    try:
        value = ctypes.c_void_p.from_buffer(handle).value or 0
    except TypeError:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT) from None
    kind = value >> 40
    return kind, ((value >> 24) & 0xFFFF) - 1, ((value >> 12) & 0xFFF) - 1, (value & 0xFFF) - 1


def _out(ref: Any) -> Any:
    """The object behind a ``byref()`` or ``pointer()`` output argument."""
    if ref is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT)
    obj = getattr(ref, "_obj", None)
    return obj if obj is not None else ref.contents


def _set_handle(target: Any, kind: int, gpu: int, gi: int = 0, ci: int = 0, slot: int = 0
                ) -> None:
    ctypes.c_void_p.from_buffer(target, slot * _PTR).value = _addr(kind, gpu, gi, ci)


def _handle(ptr_type: Any, kind: int, gpu: int, gi: int = 0, ci: int = 0) -> Any:
    return ctypes.cast(ctypes.c_void_p(_addr(kind, gpu, gi, ci)), ptr_type)


def _num(arg: Any) -> int:
    return int(getattr(arg, "value", arg))


def _put_text(buf: Any, length: Any, text: str) -> None:
    data = text.encode()
    if len(data) + 1 > _num(length):
        raise SimError(NVML_ERROR_INSUFFICIENT_SIZE)
    buf.value = data


@dataclass
class _EventSet:
    """One ``nvmlEventSet_t`` of this process: the GPUs registered (index -> event
    types, and the last event posted before registering: NVML records none of those)
    and the last event it looked at."""

    cursor: int
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)

    def next(self, events: list[SimEvent]) -> SimEvent | None:
        for event in events:
            if event.seq <= self.cursor:
                continue
            self.cursor = event.seq
            types, since = self.registered.get(event.gpu, (0, 0))
            if types & event.event_type and event.seq > since:
                return event
        return None


class _Function:
    """One simulated C symbol: checks init, replays injected faults, maps SimError."""

    __slots__ = ("argtypes", "impl", "lib", "name", "restype")

    def __init__(self, name: str, impl: Callable[..., Any], lib: SimulatedNvmlLibrary) -> None:
        self.name, self.impl, self.lib = name, impl, lib
        self.restype: Any = None  # pynvml sets this on some symbols, as on a CDLL function
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        host = self.lib.host
        host.calls[self.name] += 1
        if self.name not in _NO_INIT and self.lib.init_count == 0:
            return NVML_ERROR_UNINITIALIZED
        host.refresh()  # once per call: see what other processes changed
        if self.name != "nvmlErrorString":
            fault = host.take_injected_error(self.name)
            if fault is not None:
                return fault
        try:
            result = self.impl(*args)
        except SimError as exc:
            return exc.code
        return NVML_SUCCESS if result is None else result


class SimulatedNvmlLibrary(GpmFunctions):
    """The object installed as ``pynvml.nvmlLib``; attribute names are NVML symbols."""

    def __init__(self, host: SimulatedHost) -> None:
        self.host = host
        self.init_count = 0
        self._event_sets: dict[int, _EventSet] = {}
        self._event_set_ids = itertools.count(1)

    def reset_gpu(self, index: int) -> None:
        """What ``nvidia-smi -r`` does to a real GPU (not an NVML call; see
        :meth:`mig_spawner.gpu.GpuAdapter.reset_gpu`)."""
        self.host.reset_gpu(index)

    def __getattr__(self, name: str) -> _Function:
        impl = getattr(type(self), f"_{name}", None) if name.startswith("nvml") else None
        if impl is None or name in _MISSING_BY_API.get(self.host.state.process_api, ()):
            raise AttributeError(name)  # pynvml turns this into NVMLError_FunctionNotFound
        fn = _Function(name, impl.__get__(self), self)
        self.__dict__[name] = fn  # looked up once per name
        return fn

    # --- resolving handles against the current state -------------------------------

    def _gpu(self, state: HostState, handle: Any, kinds: tuple[int, ...] = (_DEVICE,)
             ) -> tuple[int, SimGpu, SimGpuInstance | None, SimComputeInstance | None]:
        kind, g, gi_id, ci_id = _decode(handle)
        if kind not in kinds or not 0 <= g < len(state.gpus):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = state.gpus[g]
        if gpu.lost:
            raise SimError(NVML_ERROR_GPU_IS_LOST)  # nvml.h: on any call naming it
        if kind == _DEVICE:
            return kind, gpu, None, None
        gi = gpu.gis.get(gi_id) if gpu.mig_current else None
        if gi is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        if kind == _GI:
            return kind, gpu, gi, None
        ci = gi.cis.get(ci_id)
        if ci is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        return kind, gpu, gi, ci

    def _gi(self, state: HostState, handle: Any) -> tuple[SimGpu, SimGpuInstance]:
        _, gpu, gi, _ = self._gpu(state, handle, (_GI,))
        return gpu, gi  # type: ignore[return-value]

    def _ci(self, state: HostState, handle: Any
            ) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
        _, gpu, gi, ci = self._gpu(state, handle, (_CI,))
        return gpu, gi, ci  # type: ignore[return-value]

    def _require_root(self) -> None:
        """Switching MIG mode, and (with MIG on) the parent GPU's memory and process list:
        nvml.h gives aggregate figures "only if the caller has appropriate privileges"."""
        if not self.host.state.caller_root:
            raise SimError(NVML_ERROR_NO_PERMISSION)

    def _require_config(self) -> None:
        """Creating and destroying instances: root or the MIG config capability."""
        if not self.host.state.caller_config:
            raise SimError(NVML_ERROR_NO_PERMISSION)

    def _require_monitor(self) -> None:
        """Listing GPU and compute instances: root or the MIG monitor capability (which
        NVIDIA makes world-readable; spec monitor=root restricts it)."""
        if not self.host.state.caller_monitor:
            raise SimError(NVML_ERROR_NO_PERMISSION)

    def _offered(self, gpu: SimGpu, profile: Any) -> bool:
        return rules.offered_by_driver(profile, gpu.model_key or "",
                                       self.host.state.driver_version)

    def _reported(self, gpu: SimGpu, profile: Any) -> Any:
        return rules.as_driver_reports(profile, gpu.model_key or "",
                                       self.host.state.driver_version)

    # --- library and system -------------------------------------------------------

    def _nvmlInitWithFlags(self, flags: Any) -> None:
        self.init_count += 1

    def _nvmlShutdown(self) -> int | None:
        if self.init_count == 0:
            return NVML_ERROR_UNINITIALIZED
        self.init_count -= 1
        return None

    def _nvmlErrorString(self, code: Any) -> bytes:
        code = _num(code)
        text = pynvml.NVMLError._errcode_to_string.get(code) or _ERROR_TEXT.get(code)
        return (text or "Unknown Error").encode()

    def _nvmlSystemGetDriverVersion(self, buf: Any, length: Any) -> None:
        _put_text(buf, length, self.host.state.driver_version)

    def _nvmlSystemGetNVMLVersion(self, buf: Any, length: Any) -> None:
        _put_text(buf, length, self.host.state.nvml_version)

    def _nvmlSystemGetCudaDriverVersion(self, ref: Any) -> None:
        _out(ref).value = self.host.state.cuda_version

    _nvmlSystemGetCudaDriverVersion_v2 = _nvmlSystemGetCudaDriverVersion

    # --- devices --------------------------------------------------------------------

    def _nvmlDeviceGetCount_v2(self, ref: Any) -> None:
        _out(ref).value = len(self.host.state.gpus)

    def _nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> None:
        i = _num(index)
        if not 0 <= i < len(self.host.state.gpus):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        if self.host.state.gpus[i].lost:
            raise SimError(NVML_ERROR_GPU_IS_LOST)
        _set_handle(_out(ref), _DEVICE, i)

    def _nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> None:
        wanted = getattr(uuid, "value", uuid)
        wanted = wanted.decode() if isinstance(wanted, bytes) else str(wanted)
        for gpu in self.host.state.gpus:
            found = (_DEVICE, 0, 0) if gpu.uuid == wanted else next(
                ((_MIG, gi.gi_id, ci.ci_id) for gi, ci in rules.mig_devices(gpu)
                 if mig_device_uuid(gpu.uuid, gi.gi_id, ci.ci_id) == wanted), None)
            if found is not None:
                if gpu.lost:
                    raise SimError(NVML_ERROR_GPU_IS_LOST)
                kind, gi_id, ci_id = found
                return _set_handle(_out(ref), kind, gpu.index, gi_id, ci_id)
        raise SimError(NVML_ERROR_NOT_FOUND)

    def _nvmlDeviceGetName(self, handle: Any, buf: Any, length: Any) -> None:
        _, gpu, gi, _ = self._gpu(self.host.state, handle, (_DEVICE, _MIG))
        name = gpu.product
        if gi is not None:
            name = f"{name} MIG {rules.mig_model(gpu).profile_by_id(gi.profile_id).name}"
        _put_text(buf, length, name)

    def _nvmlDeviceGetUUID(self, handle: Any, buf: Any, length: Any) -> None:
        _, gpu, gi, ci = self._gpu(self.host.state, handle, (_DEVICE, _MIG))
        uuid = gpu.uuid if gi is None else mig_device_uuid(gpu.uuid, gi.gi_id, ci.ci_id)
        _put_text(buf, length, uuid)

    def _nvmlDeviceGetMinorNumber(self, handle: Any, ref: Any) -> None:
        _out(ref).value = self._gpu(self.host.state, handle)[1].index

    _nvmlDeviceGetIndex = _nvmlDeviceGetMinorNumber

    def _nvmlDeviceGetMemoryInfo(self, handle: Any, ref: Any) -> None:
        _, gpu, gi, ci = self._gpu(self.host.state, handle, (_DEVICE, _MIG))
        if ci is None and gpu.mig_current:
            self._require_root()  # a MIG device's own memory is anyone's to read
        if ci is None:
            total = gpu.memory_mib
            used = (sum(_used_mib(c) for _, c in rules.mig_devices(gpu)) if gpu.mig_current
                    else _used_mib(gpu))
        else:
            total = self._reported(gpu, rules.mig_model(gpu).profile_by_id(gi.profile_id)
                                   ).memory_mib
            used = _used_mib(ci)
        info = _out(ref)
        info.total, info.used, info.free = total * _MIB, used * _MIB, (total - used) * _MIB

    _nvmlDeviceGetMemoryInfo_v2 = _nvmlDeviceGetMemoryInfo

    def _nvmlDeviceGetUtilizationRates(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        if gpu.mig_current:
            raise SimError(NVML_ERROR_NOT_SUPPORTED)  # per-instance activity needs GPM/DCGM
        util = _out(ref)
        util.gpu = util.memory = 0

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count_ref: Any,
                                                 infos: Any) -> int | None:
        # The drivers the adapter knows to garble _v3 records do so here too.
        garble = garbles_process_records(self.host.state.driver_version)
        return self._processes(handle, count_ref, infos, garble=garble)

    def _nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any, count_ref: Any,
                                                 infos: Any) -> int | None:
        return self._processes(handle, count_ref, infos)

    # v1 records are (pid, usedGpuMemory) only; the same writer fills what a record has.
    _nvmlDeviceGetComputeRunningProcesses = _nvmlDeviceGetComputeRunningProcesses_v2

    def _processes(self, handle: Any, count_ref: Any, infos: Any, garble: bool = False
                   ) -> int | None:
        _, gpu, gi, ci = self._gpu(self.host.state, handle, (_DEVICE, _MIG))
        if ci is None and gpu.mig_current:
            self._require_root()  # per-instance lists come from the MIG device handles
        if ci is None and not gpu.mig_current:
            # A whole GPU: the records name no instance (NVML sets both IDs to this).
            procs = [(pid, mib, _NO_INSTANCE, _NO_INSTANCE) for pid, mib in gpu.processes]
        else:
            pairs = rules.mig_devices(gpu) if ci is None else [(gi, ci)]
            procs = [(pid, mib, g.gi_id, c.ci_id) for g, c in pairs for pid, mib in c.processes]
        count = _out(count_ref)
        capacity = count.value
        count.value = len(procs)
        if not procs:
            return None
        if infos is None or capacity < len(procs):
            return NVML_ERROR_INSUFFICIENT_SIZE  # the two-call size protocol
        for n, (slot, (pid, mib, gi_id, ci_id)) in enumerate(zip(infos, procs, strict=False)):
            if garble and n:
                # The driver wrote records of another size: later ones are misaligned.
                pid, mib, gi_id, ci_id = (mib * _MIB) & 0xFFFFFFFF, pid, 0xFFFFFFFF, 0
            slot.pid, slot.usedGpuMemory = pid, mib * _MIB
            if hasattr(slot, "gpuInstanceId"):
                slot.gpuInstanceId, slot.computeInstanceId = gi_id, ci_id
        return None

    # --- health: ECC, row remapping, page retirement ----------------------------------

    def _nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: Any, counter: Any,
                                     ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        if not gpu.ecc_enabled:
            raise SimError(NVML_ERROR_NOT_SUPPORTED)
        kind, which = _num(error_type), _num(counter)
        if which not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC) or kind not in (
                pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        # Corrected errors are not simulated: they need no action.
        uncorrected = kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        _out(ref).value = gpu.ecc_uncorrected[which] if uncorrected else 0

    def _nvmlDeviceGetRemappedRows(self, handle: Any, correctable: Any, uncorrectable: Any,
                                   pending: Any, failure: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        if not rules.remaps_rows(gpu):
            raise SimError(NVML_ERROR_NOT_SUPPORTED)
        for ref, value in zip((correctable, uncorrectable, pending, failure),
                              gpu.remapped_rows, strict=True):
            _out(ref).value = value

    def _nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        if rules.remaps_rows(gpu):
            raise SimError(NVML_ERROR_NOT_SUPPORTED)  # nvidia-smi shows N/A on an A100
        _out(ref).value = int(gpu.pages_pending)

    # --- events -------------------------------------------------------------------------

    def _nvmlDeviceGetSupportedEventTypes(self, handle: Any, ref: Any) -> None:
        _out(ref).value = _supported_events(self._gpu(self.host.state, handle)[1])

    def _nvmlEventSetCreate(self, ref: Any) -> None:
        set_id = next(self._event_set_ids)
        self._event_sets[set_id] = _EventSet(cursor=self.host.state.event_seq)
        _set_handle(_out(ref), _EVENT_SET, set_id)

    def _event_set(self, handle: Any) -> _EventSet:
        kind, set_id, _, _ = _decode(handle)
        event_set = self._event_sets.get(set_id) if kind == _EVENT_SET else None
        if event_set is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    def _nvmlDeviceRegisterEvents(self, handle: Any, types: Any, event_set: Any) -> None:
        # On the GPU itself, as NVIDIA's device plugin registers (MIG device handles are
        # not taken: their events come on the GPU with instance IDs).
        gpu = self._gpu(self.host.state, handle)[1]
        wanted, registered = _num(types), self._event_set(event_set).registered
        if wanted & ~_supported_events(gpu):
            # nvml.h: then none of the requested types is registered.
            raise SimError(NVML_ERROR_NOT_SUPPORTED)
        before = registered.get(gpu.index, (0, 0))[0]
        registered[gpu.index] = (before | wanted, self.host.state.event_seq)

    def _nvmlEventSetWait_v2(self, event_set: Any, ref: Any, timeout_ms: Any) -> int | None:
        """Deliver the next event registered for, or wait for one up to the timeout."""
        waiting = self._event_set(event_set)
        deadline = time.monotonic() + _num(timeout_ms) / 1000
        while True:
            seen = self.host.changes
            event = waiting.next(self.host.refresh().events)
            if event is not None:
                data = _out(ref)
                data.device = _handle(pynvml.c_nvmlDevice_t, _DEVICE, event.gpu)
                data.eventType, data.eventData = event.event_type, event.data
                data.gpuInstanceId, data.computeInstanceId = event.gi_id, event.ci_id
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return NVML_ERROR_TIMEOUT
            self.host.wait_for_change(seen, left)

    def _nvmlEventSetFree(self, event_set: Any) -> None:
        self._event_set(event_set)
        del self._event_sets[_decode(event_set)[1]]

    # --- MIG mode and MIG device handles -------------------------------------------

    def _nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        rules.mig_model(gpu)
        _out(current).value, _out(pending).value = gpu.mig_current, gpu.mig_pending

    def _nvmlDeviceSetMigMode(self, handle: Any, mode: Any, status: Any) -> None:
        self._require_root()
        with self.host.mutate() as state:
            _out(status).value = rules.set_mig_mode(self._gpu(state, handle)[1], _num(mode))

    def _nvmlDeviceIsMigDeviceHandle(self, handle: Any, ref: Any) -> None:
        kind = self._gpu(self.host.state, handle, (_DEVICE, _MIG))[0]
        _out(ref).value = int(kind == _MIG)

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        # nvml.h: 0 when MIG is off (the count is "of MIG devices that can exist now").
        _out(ref).value = rules.mig_model(gpu).compute_slices if gpu.mig_current else 0

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        i = _num(index)
        if not 0 <= i < rules.mig_model(gpu).compute_slices:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        devices = rules.mig_devices(gpu)
        if i >= len(devices):
            raise SimError(NVML_ERROR_NOT_FOUND)
        gi, ci = devices[i]
        _set_handle(_out(ref), _MIG, gpu.index, gi.gi_id, ci.ci_id)

    def _nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any, ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle, (_MIG,))[1]
        _set_handle(_out(ref), _DEVICE, gpu.index)

    def _nvmlDeviceGetGpuInstanceId(self, handle: Any, ref: Any) -> None:
        _, _, gi, _ = self._gpu(self.host.state, handle, (_DEVICE, _MIG))
        if gi is None:
            raise SimError(NVML_ERROR_NOT_SUPPORTED)
        _out(ref).value = gi.gi_id

    def _nvmlDeviceGetComputeInstanceId(self, handle: Any, ref: Any) -> None:
        _, _, _, ci = self._gpu(self.host.state, handle, (_DEVICE, _MIG))
        if ci is None:
            raise SimError(NVML_ERROR_NOT_SUPPORTED)
        _out(ref).value = ci.ci_id

    # --- GPU instance profiles and placements ----------------------------------------

    def _nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: Any, ref: Any
                                             ) -> int | None:
        gpu = self._gpu(self.host.state, handle)[1]
        p = self._reported(gpu, rules.profile_by_enum(gpu, _num(profile)))
        if not gpu.mig_current or not self._offered(gpu, p):
            raise SimError(NVML_ERROR_NOT_SUPPORTED)  # nvml.h: profiles need MIG on
        info = _out(ref)
        if hasattr(info, "version"):
            if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            info.name = f"MIG {p.name}".encode()
        info.id, info.isP2pSupported, info.sliceCount = p.profile_id, 0, p.compute_slices
        info.instanceCount, info.multiprocessorCount = p.max_instances, p.sm_count
        info.copyEngineCount, info.memorySizeMB = p.copy_engines, p.memory_mib
        info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount = p.media
        return None

    _nvmlDeviceGetGpuInstanceProfileInfoV = _nvmlDeviceGetGpuInstanceProfileInfo

    def _nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profile_id: Any,
                                                   ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        _out(ref).value = rules.remaining_capacity(gpu, _num(profile_id))

    def _nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, handle: Any, profile_id: Any,
                                                       placements: Any, count_ref: Any
                                                       ) -> int | None:
        gpu = self._gpu(self.host.state, handle)[1]
        # nvml.h: placements are answered whatever the MIG mode.
        p = rules.profile_by_id(gpu, _num(profile_id), mig_off_ok=True)
        count = _out(count_ref)
        count.value = len(p.placement_starts)
        if placements is None:
            return None  # size query
        if len(placements) < len(p.placement_starts):
            return NVML_ERROR_INSUFFICIENT_SIZE
        for slot, start in zip(placements, p.placement_starts, strict=False):
            slot.start, slot.size = start, p.placement_size
        return None

    # --- GPU instances -------------------------------------------------------------

    def _nvmlDeviceCreateGpuInstance(self, handle: Any, profile_id: Any, ref: Any) -> None:
        self._create_gi(handle, profile_id, None, ref)

    def _nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: Any,
                                                  placement: Any, ref: Any) -> None:
        self._create_gi(handle, profile_id, _out(placement), ref)

    def _create_gi(self, handle: Any, profile_id: Any, placement: Any, ref: Any) -> None:
        self._require_config()
        with self.host.mutate() as state:
            gpu = self._gpu(state, handle)[1]
            start, size = (None, None) if placement is None else (placement.start, placement.size)
            if not self._offered(gpu, rules.profile_by_id(gpu, _num(profile_id))):
                raise SimError(NVML_ERROR_INVALID_ARGUMENT)  # an ID this driver does not list
            gi = rules.create_gpu_instance(gpu, _num(profile_id), start, size)
            _set_handle(_out(ref), _GI, gpu.index, gi.gi_id)

    def _nvmlGpuInstanceDestroy(self, handle: Any) -> None:
        self._require_config()
        with self.host.mutate() as state:
            gpu, gi = self._gi(state, handle)
            rules.destroy_gpu_instance(gpu, gi.gi_id)

    def _nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: Any, instances: Any,
                                   count_ref: Any) -> int | None:
        gpu = self._gpu(self.host.state, handle)[1]
        self._require_monitor()
        pid = rules.profile_by_id(gpu, _num(profile_id)).profile_id
        if instances is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        found = [g for g in sorted(gpu.gis) if gpu.gis[g].profile_id == pid]
        count = _out(count_ref)
        count.value = len(found)
        if len(instances) < len(found):
            return NVML_ERROR_INSUFFICIENT_SIZE
        for slot, gi_id in enumerate(found):
            _set_handle(instances, _GI, gpu.index, gi_id, slot=slot)
        return None

    def _nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: Any, ref: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]
        rules.require_mig_on(gpu)
        self._require_monitor()
        if _num(gi_id) not in gpu.gis:
            raise SimError(NVML_ERROR_NOT_FOUND)
        _set_handle(_out(ref), _GI, gpu.index, _num(gi_id))

    def _nvmlGpuInstanceGetInfo(self, handle: Any, ref: Any) -> None:
        gpu, gi = self._gi(self.host.state, handle)
        info = _out(ref)
        info.device = _handle(pynvml.c_nvmlDevice_t, _DEVICE, gpu.index)
        info.id, info.profileId = gi.gi_id, gi.profile_id
        info.placement.start, info.placement.size = gi.start, gi.size

    # --- compute instances -----------------------------------------------------------

    def _nvmlGpuInstanceGetComputeInstanceProfileInfo(self, handle: Any, profile: Any,
                                                      engine: Any, ref: Any) -> int | None:
        gpu, gi = self._gi(self.host.state, handle)
        if _num(engine) != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        slices = rules.ci_profile_slices(gpu, gi, _num(profile))
        gi_profile = rules.mig_model(gpu).profile_by_id(gi.profile_id)
        info = _out(ref)
        if hasattr(info, "version"):
            if info.version != pynvml.nvmlComputeInstanceProfileInfo_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            prefix = "" if slices == gi_profile.compute_slices else f"{slices}c."
            info.name = f"MIG {prefix}{gi_profile.name}".encode()
        info.id, info.sliceCount = _num(profile), slices
        info.instanceCount = gi_profile.compute_slices // slices
        info.multiprocessorCount = gi_profile.sm_count * slices // gi_profile.compute_slices
        # A CI shares its GI's engines (the full-size CI is the only one simulated).
        info.sharedCopyEngineCount = gi_profile.copy_engines
        (info.sharedDecoderCount, info.sharedEncoderCount, info.sharedJpegCount,
         info.sharedOfaCount) = gi_profile.media
        return None

    _nvmlGpuInstanceGetComputeInstanceProfileInfoV = _nvmlGpuInstanceGetComputeInstanceProfileInfo

    def _nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, handle: Any, profile: Any,
                                                            ref: Any) -> None:
        gpu, gi = self._gi(self.host.state, handle)
        rules.ci_profile_slices(gpu, gi, _num(profile))
        full = rules.mig_model(gpu).profile_by_id(gi.profile_id).ci_profile_index
        _out(ref).value = int(_num(profile) == full and not gi.cis)

    def _nvmlGpuInstanceCreateComputeInstance(self, handle: Any, profile: Any, ref: Any
                                              ) -> None:
        self._require_config()
        with self.host.mutate() as state:
            gpu, gi = self._gi(state, handle)
            ci = rules.create_compute_instance(gpu, gi, _num(profile))
            _set_handle(_out(ref), _CI, gpu.index, gi.gi_id, ci.ci_id)

    def _nvmlGpuInstanceGetComputeInstances(self, handle: Any, profile: Any, instances: Any,
                                            count_ref: Any) -> int | None:
        gpu, gi = self._gi(self.host.state, handle)
        self._require_monitor()
        rules.ci_profile_slices(gpu, gi, _num(profile))
        if instances is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        found = [c for c in sorted(gi.cis) if gi.cis[c].profile_index == _num(profile)]
        count = _out(count_ref)
        count.value = len(found)
        if len(instances) < len(found):
            return NVML_ERROR_INSUFFICIENT_SIZE
        for slot, ci_id in enumerate(found):
            _set_handle(instances, _CI, gpu.index, gi.gi_id, ci_id, slot=slot)
        return None

    def _nvmlGpuInstanceGetComputeInstanceById(self, handle: Any, ci_id: Any, ref: Any
                                               ) -> None:
        gpu, gi = self._gi(self.host.state, handle)
        self._require_monitor()
        if _num(ci_id) not in gi.cis:
            raise SimError(NVML_ERROR_NOT_FOUND)
        _set_handle(_out(ref), _CI, gpu.index, gi.gi_id, _num(ci_id))

    def _nvmlComputeInstanceGetInfo_v2(self, handle: Any, ref: Any) -> None:
        gpu, gi, ci = self._ci(self.host.state, handle)
        info = _out(ref)
        info.device = _handle(pynvml.c_nvmlDevice_t, _DEVICE, gpu.index)
        info.gpuInstance = _handle(pynvml.c_nvmlGpuInstance_t, _GI, gpu.index, gi.gi_id)
        info.id, info.profileId = ci.ci_id, ci.profile_index
        info.placement.start, info.placement.size = 0, ci.slice_count

    def _nvmlComputeInstanceDestroy(self, handle: Any) -> None:
        self._require_config()
        with self.host.mutate() as state:
            _, gi, ci = self._ci(state, handle)
            rules.destroy_compute_instance(gi, ci.ci_id)


def _supported_events(gpu: SimGpu) -> int:
    return _BASE_EVENTS | (_ECC_EVENTS if gpu.ecc_enabled else 0)


def _used_mib(ci: SimComputeInstance | SimGpu) -> int:
    if ci.memory_used_mib is not None:
        return ci.memory_used_mib
    return sum(mib for _, mib in ci.processes)
