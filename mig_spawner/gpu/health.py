"""A GPU's health from NVML: the event set (critical Xids, double-bit ECC errors) and the
checks a sweep polls (ECC counters, row remapping, page retirement, lost GPUs, MIG
devices that are gone).

Both only read; what is a fault is decided in :mod:`mig_spawner.core.health`. Use them
through :meth:`GpuAdapter.health <mig_spawner.gpu.GpuAdapter.health>` and
:meth:`GpuAdapter.watch_events <mig_spawner.gpu.GpuAdapter.watch_events>`. docs/health.md
says what is read and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any

import pynvml

from mig_spawner.core.health import DriverEvent, EventKind, GpuHealth

from .errors import GpuError

log = logging.getLogger(__name__)

#: The events read, as NVIDIA's device plugin registers them (it adds single-bit ECC,
#: which it then ignores).
WATCHED_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
#: How long one wait for an event lasts, in ms: the longest :meth:`DriverEvents.close`
#: takes (NVML cannot interrupt a wait), and how often an idle watcher wakes.
WAIT_MS = 1000
# nvml.h: an event's GPU/compute instance ID when it is not attributable to one.
_NOT_ATTRIBUTED = 0xFFFFFFFF
_NO_DEVICE_HERE = (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument)

NvmlScope = Callable[[str], AbstractContextManager[None]]


def read_health(known_uuids: Mapping[int, str],
                expected: Mapping[str, Collection[str]]) -> tuple[GpuHealth, ...]:
    """Every GPU's health now (read-only; call it with NVML in use).

    ``known_uuids``: GPU index -> the UUID last read of it (a lost GPU cannot tell its
    own). ``expected``: GPU UUID -> the MIG device UUIDs the caller expects on it; those
    the driver no longer lists are reported ``missing``, on a GPU the driver no longer
    lists at all with index -1. Each call the driver does not support leaves its value
    None (not known); GPU_IS_LOST from any call makes the GPU ``lost``.
    """
    found = []
    unknown_lost = False
    for index in range(pynvml.nvmlDeviceGetCount()):
        try:
            health = _read_gpu(index, expected)
        except pynvml.NVMLError_GpuIsLost:
            uuid = known_uuids.get(index, "")
            unknown_lost = unknown_lost or not uuid
            health = GpuHealth(index, uuid, lost=True)
        found.append(health)
    listed = {h.gpu_uuid for h in found}
    # A GPU whose UUID this process never read may be the lost one: its devices are
    # not reported missing then (the loss covers them).
    if not unknown_lost:
        found += [GpuHealth(-1, uuid, missing=tuple(sorted(devices)))
                  for uuid, devices in expected.items() if uuid not in listed and devices]
    return tuple(found)


def _read_gpu(index: int, expected: Mapping[str, Collection[str]]) -> GpuHealth:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    ecc = _known(pynvml.nvmlDeviceGetTotalEccErrors, handle,
                 pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
    rows = _known(pynvml.nvmlDeviceGetRemappedRows, handle)
    pages = _known(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    wanted = expected.get(uuid, ())
    missing = tuple(sorted(set(wanted) - set(_mig_uuids(handle)))) if wanted else ()
    return GpuHealth(
        index, uuid, ecc_uncorrected=ecc,
        rows_pending=None if rows is None else bool(rows[2]),
        rows_failed=None if rows is None else bool(rows[3]),
        pages_pending=None if pages is None else pages == pynvml.NVML_FEATURE_ENABLED,
        missing=missing,
    )


def _known(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None where the driver does not tell (NOT_SUPPORTED: ECC off, a
    GPU without row remapping; or any error but GPU_IS_LOST, which is a finding)."""
    try:
        return call(*args)
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError_NotSupported:
        return None
    except pynvml.NVMLError as exc:
        log.warning("%s: %s; its health value is not known", call.__name__, exc)
        return None


def _mig_uuids(handle: Any) -> list[str]:
    """The UUIDs of the MIG devices the driver lists on a GPU (none with MIG off)."""
    uuids = []
    try:
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError_NotSupported:
        return []
    for slot in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except _NO_DEVICE_HERE:
            continue
        uuids.append(pynvml.nvmlDeviceGetUUID(mig))
    return uuids


class DriverEvents:
    """One NVML event set for every GPU of the host, and one thread that waits on it.

    Registers each GPU for critical Xid and double-bit ECC events (those of the two it
    supports: ECC events need ECC on), on the GPU itself: with MIG on, the driver
    delivers an event of a MIG device there with its GPU and compute instance IDs, as
    NVIDIA's device plugin reads them, so the registration outlives layout changes.
    Calls ``on_event`` from the waiting thread for each event (it should hand the event
    on, not block). A GPU that cannot be registered (lost, or too old for events) is
    left out of :attr:`watched` and logged; the polled checks still read it.

    The cost does not grow with the fleet: one set, one thread, one wait at a time, and
    NVML wakes the thread when an event comes (else every ``wait_ms``).
    """

    def __init__(self, on_event: Callable[[DriverEvent], None], nvml: NvmlScope,
                 wait_ms: int = WAIT_MS) -> None:
        """``nvml``: the adapter's scope for NVML calls (its library, typed errors)."""
        self._on_event = on_event
        self._nvml = nvml
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._by_handle: dict[int, tuple[int, str]] = {}  # handle address -> index, UUID
        with self._nvml("creating an NVML event set"):
            self._set = pynvml.nvmlEventSetCreate()
            try:
                self._register_all()
            except BaseException:
                pynvml.nvmlEventSetFree(self._set)
                raise
        #: GPU index -> UUID of each GPU whose events are read.
        self.watched: dict[int, str] = dict(self._by_handle.values())
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._thread.start()

    def _register_all(self) -> None:
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                mask = WATCHED_EVENTS & pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                if mask:
                    pynvml.nvmlDeviceRegisterEvents(handle, mask, self._set)
            except pynvml.NVMLError as exc:  # lost, too old for events, ...
                log.warning("GPU %d: its driver events cannot be read (%s); its health is "
                            "polled only", index, exc)
                continue
            if mask:
                self._by_handle[_address(handle)] = (index, uuid)
            else:
                log.warning("GPU %d reports neither Xid nor ECC events; its health is "
                            "polled only", index)

    def close(self) -> None:
        """Stop the thread (within one wait) and free the event set (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        # NVML: operations on a set are not thread-safe; the waiter has ended.
        with contextlib.suppress(Exception), self._nvml("freeing the NVML event set"):
            pynvml.nvmlEventSetFree(self._set)

    def __enter__(self) -> DriverEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._wait()
            except GpuError as exc:
                # The polled checks find what failed; do not spin on a broken set.
                log.warning("%s (%s)", exc, exc.hint)
                self._stop.wait(self._wait_ms / 1000)
                continue
            if event is None:
                continue
            try:
                self._on_event(event)
            except Exception:
                log.exception("handling the NVML event %s failed", event)

    def _wait(self) -> DriverEvent | None:
        """The next event, or None when the wait timed out or brought none of ours."""
        with self._nvml("waiting for NVML events"):
            try:
                data = pynvml.nvmlEventSetWait_v2(self._set, self._wait_ms)
            except pynvml.NVMLError_Timeout:
                return None
        return self._event(data)

    def _event(self, data: Any) -> DriverEvent | None:
        gpu = self._by_handle.get(_address(data.device))
        if gpu is None:
            log.warning("an NVML event on a GPU that is not watched: %s", data)
            return None
        if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            kind, xid = EventKind.XID, int(data.eventData)
        elif data.eventType & pynvml.nvmlEventTypeDoubleBitEccError:
            kind, xid = EventKind.DOUBLE_BIT_ECC, None
        else:
            return None
        gi, ci = (None if v == _NOT_ATTRIBUTED else int(v)
                  for v in (data.gpuInstanceId, data.computeInstanceId))
        return DriverEvent(kind, *gpu, xid=xid, gi_id=gi, ci_id=ci)


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0
