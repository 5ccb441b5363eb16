"""A GPU's health: what the driver reported, and which of it is a fault.

The GPU adapter (``mig_spawner.gpu.health``) reads two things from NVML and hands them
here as plain values: a :class:`DriverEvent` (a critical Xid or a double-bit ECC error,
as NVML's event set delivers it) and a :class:`GpuHealth` (one GPU's counters and
states, read each sweep). :func:`event_fault` and :func:`health_faults` decide what is a
:class:`Fault` and whether it concerns the whole GPU or one MIG device. Pure: no I/O.

Sources (docs/health.md): NVIDIA's k8s-device-plugin (``internal/rm/health.go``) for the
Xids that applications cause and for mapping an event to a MIG device by its GPU and
compute instance IDs; ``nvml.h`` for the event data; NVIDIA's Xid catalog for the words.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from mig_spawner.core.inventory import Gpu

#: Xids that an application causes; the GPU stays healthy. The device plugin's list
#: (graphics engine exception, GPU memory page fault, GPU stopped processing,
#: preemptive cleanup, video processor exception, context switch timeout).
APPLICATION_XIDS: tuple[int, ...] = (13, 31, 43, 45, 68, 109)

#: nvml.h: ``eventData`` of an Xid event the driver could not name.
UNKNOWN_XID = 999

# NVIDIA's Xid catalog, in words an analyst can read (the Xids worth naming here).
_XID_WORDS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after earlier errors",
    48: "double-bit ECC error",
    61: "internal micro-controller warning",
    62: "internal micro-controller halt",
    63: "memory page retirement or row remapping recorded",
    64: "memory page retirement or row remapping failed",
    68: "video processor exception",
    74: "NVLink error",
    79: "the GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    UNKNOWN_XID: "an error the driver could not name",
}


class FaultKind(StrEnum):
    """What kind of fault the driver reported. The values are stable: later records,
    metrics labels and the CLI use them."""

    XID = "xid"  # a critical Xid event (not one an application causes)
    ECC = "ecc"  # uncorrectable ECC errors: a double-bit event or the volatile counter
    ROW_REMAP = "row_remap"  # a memory row waits for a reset to be remapped, or failed to
    RETIRED_PAGES = "retired_pages"  # memory pages wait for a reset to be retired
    LOST = "lost"  # NVML answers GPU_IS_LOST: the GPU fell off the bus or is inaccessible
    MISSING_INSTANCE = "missing_instance"  # an expected MIG device is no longer listed


class EventKind(StrEnum):
    """The NVML event types that are read (``nvmlEventType*``)."""

    XID = "xid"  # nvmlEventTypeXidCriticalError
    DOUBLE_BIT_ECC = "double_bit_ecc"  # nvmlEventTypeDoubleBitEccError


@dataclass(frozen=True)
class DriverEvent:
    """One event from NVML's event set (``nvmlEventData_t``), on one GPU.

    ``xid``: the Xid of an Xid event (``eventData``). ``gi_id``/``ci_id``: the GPU and
    compute instance the driver attributed the event to, both or neither (nvml.h sets
    them for Xid events on a GPU with MIG on, where attributable; else 0xFFFFFFFF, read
    as None).
    """

    kind: EventKind
    gpu_index: int
    gpu_uuid: str
    xid: int | None = None
    gi_id: int | None = None
    ci_id: int | None = None


@dataclass(frozen=True)
class GpuHealth:
    """What one sweep read of one GPU's health. None: the driver does not tell (the
    call answered NOT_SUPPORTED, e.g. ECC off, or a GPU without row remapping); that is
    "not known", never a fault.

    ``lost``: NVML answered GPU_IS_LOST (nothing else is then known). ``gpu_index`` is
    -1 for a GPU the caller expected that the driver no longer lists at all.
    ``missing``: the MIG device UUIDs the caller expected on this GPU that the driver no
    longer lists.
    """

    gpu_index: int
    gpu_uuid: str
    lost: bool = False
    ecc_uncorrected: int | None = None  # volatile: since the last reset or driver load
    rows_pending: bool | None = None
    rows_failed: bool | None = None
    pages_pending: bool | None = None
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fault:
    """A hardware fault on a whole GPU, or on one MIG device of it.

    The scope is one MIG device when ``gi_id``/``ci_id`` (as the driver attributed an
    Xid) or ``device_uuid`` (an expected MIG device that is gone) name it; else the
    whole GPU. ``detail`` says what was seen in words an analyst and an admin can both
    read (no path, host or URL); ``str()`` adds where.
    """

    kind: FaultKind
    gpu_index: int
    gpu_uuid: str
    detail: str
    gi_id: int | None = None
    ci_id: int | None = None
    device_uuid: str | None = None
    xid: int | None = None

    @property
    def whole_gpu(self) -> bool:
        """The fault concerns every slice of the GPU, not one MIG device."""
        return self.gi_id is None and self.device_uuid is None

    @property
    def where(self) -> str:
        """``GPU 1``, or the MIG device on it (``GPU 1, GPU instance 7``)."""
        gpu = f"GPU {self.gpu_index}" if self.gpu_index >= 0 else f"GPU {self.gpu_uuid}"
        if self.gi_id is not None:
            return f"{gpu}, GPU instance {self.gi_id} (compute instance {self.ci_id})"
        if self.device_uuid is not None:
            return f"{gpu}, MIG device {self.device_uuid}"
        return gpu

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


def xid_words(xid: int) -> str:
    """``Xid 79 (the GPU has fallen off the bus)``; the bare number for an Xid not named
    here (NVIDIA's Xid catalog has them all)."""
    words = _XID_WORDS.get(xid)
    return f"Xid {xid} ({words})" if words else f"Xid {xid}"


def check_xids(values: Iterable[object]) -> tuple[int, ...]:
    """``values`` as a sorted tuple of distinct Xids; ``ValueError`` naming the first
    that is not a whole number from 1 up."""
    xids = set()
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{value!r} is not an Xid (a whole number from 1 up, "
                             "e.g. 13 or 79)")
        xids.add(value)
    return tuple(sorted(xids))


def event_fault(event: DriverEvent, ignored_xids: Collection[int] = APPLICATION_XIDS
                ) -> Fault | None:
    """The fault an NVML event reports, or None for an Xid in ``ignored_xids`` (those an
    application causes: the GPU stays healthy).

    Scope, as the device plugin maps events: an Xid the driver attributed to a GPU and
    compute instance concerns that MIG device only; any other event the whole GPU. A
    double-bit ECC event never carries instance IDs (nvml.h sets them for Xid events
    only), so it concerns the whole GPU.
    """
    if event.kind is EventKind.DOUBLE_BIT_ECC:
        return Fault(FaultKind.ECC, event.gpu_index, event.gpu_uuid,
                     "a double-bit (uncorrectable) ECC memory error")
    xid = event.xid if event.xid is not None else UNKNOWN_XID
    if xid in ignored_xids:
        return None
    attributed = event.gi_id is not None and event.ci_id is not None
    return Fault(FaultKind.XID, event.gpu_index, event.gpu_uuid, xid_words(xid),
                 gi_id=event.gi_id if attributed else None,
                 ci_id=event.ci_id if attributed else None, xid=xid)


def health_faults(health: GpuHealth) -> tuple[Fault, ...]:
    """The faults one GPU's health read shows: none when all is well or not known.

    Counters and row/page states are per GPU (NVML reads them on the GPU, not on a MIG
    device), and a pending remap or retirement needs a reset of the whole GPU, so these
    concern the whole GPU. An expected MIG device that is gone concerns that device.
    """
    gpu = (health.gpu_index, health.gpu_uuid)
    if health.lost:
        return (Fault(FaultKind.LOST, *gpu, "the GPU has fallen off the bus or cannot be "
                      "reached (the driver reports it lost)"),)
    faults = []
    if health.ecc_uncorrected:
        faults.append(Fault(FaultKind.ECC, *gpu, f"{health.ecc_uncorrected} uncorrectable "
                            "ECC memory error(s) since the GPU was last reset"))
    if health.rows_failed:
        faults.append(Fault(FaultKind.ROW_REMAP, *gpu, "a memory row could not be "
                            "remapped: the GPU needs service"))
    elif health.rows_pending:
        faults.append(Fault(FaultKind.ROW_REMAP, *gpu, "a faulty memory row waits for a "
                            "GPU reset to be remapped"))
    if health.pages_pending:
        faults.append(Fault(FaultKind.RETIRED_PAGES, *gpu, "faulty memory pages wait for a "
                            "GPU reset to be retired"))
    faults += [Fault(FaultKind.MISSING_INSTANCE, *gpu, "the driver no longer lists this "
                     "MIG device", device_uuid=uuid) for uuid in health.missing]
    return tuple(faults)


#: What the spawn form and the slice map say of a size or slice withheld for a fault, after
#: the GPU's name: "Unavailable: GPU 1 reported a hardware fault" on the form.
FAULT_WORDS = "reported a hardware fault"


def withheld_words(gpu_index: int) -> str:
    """Why slices of GPU ``gpu_index`` are withheld, in words an analyst reads (the form
    puts "Unavailable: " before it): ``GPU 1 reported a hardware fault``."""
    return f"GPU {gpu_index} {FAULT_WORDS}"


class PlacedLease(Protocol):
    """What :func:`fault_slices` reads of a held lease (the ledger's ``Lease`` is one)."""

    @property
    def gpu_uuid(self) -> str | None: ...
    @property
    def mig_uuid(self) -> str | None: ...
    @property
    def memory_slices(self) -> range: ...


def fault_slices(fault: Fault, gpu: Gpu | None, leases: Iterable[PlacedLease] = ()
                 ) -> frozenset[int] | None:
    """The memory slices a fault withholds from new grants, or None: the whole GPU.

    A fault on one MIG device withholds that device's slices: found by the GPU instance
    the driver attributed an Xid to, or by the device's UUID in the GPU's read or, for a
    device the driver no longer lists, in the lease that holds it. A device that cannot
    be placed (the GPU's read does not show it, no lease names it), and every fault of the
    whole GPU, withhold the whole GPU: the safe side.
    """
    if fault.whole_gpu:
        return None
    devices = gpu.mig_devices if gpu is not None else ()
    for device in devices:
        if (fault.gi_id is not None and device.gi_id == fault.gi_id) or (
                fault.device_uuid is not None and device.uuid == fault.device_uuid):
            return frozenset(range(device.start, device.start + device.size))
    if fault.device_uuid is not None:
        for lease in leases:
            if lease.gpu_uuid == fault.gpu_uuid and lease.mig_uuid == fault.device_uuid:
                return frozenset(lease.memory_slices)
    return None
