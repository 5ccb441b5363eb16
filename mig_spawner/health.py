"""Faults found on this host's GPUs, recorded in the ledger: what the slice service runs
at each sweep, and what ``mig-spawner health clear`` re-reads before it lifts a hold.

The GPU adapter reads (``GpuAdapter.health``, ``GpuAdapter.watch_events``), the core
judges (:func:`mig_spawner.core.health.health_faults`, :func:`~mig_spawner.core.health.
event_fault`) and places (:func:`~mig_spawner.core.health.fault_slices`), the ledger
holds (:meth:`Holds.record_faults <mig_spawner.ledger.holds.Holds.record_faults>`). A
fault is held until an admin clears it, whatever the driver says later: a GPU back after
a reset is re-checked before any slice of it is offered again. docs/health.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from mig_spawner.core.health import (
    APPLICATION_XIDS,
    DriverEvent,
    Fault,
    FaultKind,
    GpuHealth,
    event_fault,
    fault_slices,
    health_faults,
)
from mig_spawner.core.inventory import Inventory
from mig_spawner.core.lifecycle import LeaseState
from mig_spawner.kinds import kind_of
from mig_spawner.ledger import FaultHold, GpuFault, Lease, Ledger

log = logging.getLogger(__name__)


class HealthGpus(Protocol):
    """What reading faults needs of the GPU adapter (:class:`mig_spawner.gpu.GpuAdapter`)."""

    def inventory(self) -> Inventory: ...

    def health(self, expected: Mapping[str, Collection[str]] | None = None
               ) -> tuple[GpuHealth, ...]: ...


def expected_devices(leases: Iterable[Lease], host: str) -> dict[str, set[str]]:
    """GPU UUID -> the MIG devices active leases on ``host`` run on: a device of these the
    driver no longer lists is a fault. Not a lease being made or given back, nor one
    whose instance is made per lease (destroyed just before its release: gone, not
    faulty)."""
    expected: dict[str, set[str]] = {}
    for lease in leases:
        if (lease.state is LeaseState.ACTIVE and lease.host == host and lease.gpu_uuid
                and lease.mig_uuid and not kind_of(lease).rules.made_per_lease):
            expected.setdefault(lease.gpu_uuid, set()).add(lease.mig_uuid)
    return expected


def faults_now(gpus: HealthGpus, leases: Sequence[Lease]) -> tuple[Inventory, list[Fault]]:
    """This host's GPUs and the faults their health shows now (the polled checks)."""
    inventory = gpus.inventory()
    health = gpus.health(expected_devices(leases, inventory.host))
    return inventory, [fault for gpu in health for fault in health_faults(gpu)]


def placed(faults: Iterable[Fault], inventory: Inventory, leases: Sequence[Lease],
           sizes: Mapping[str, int] | None = None,
           named: Iterable[tuple[int, str]] = ()) -> list[FaultHold]:
    """Each fault with what it withholds: one MIG device where the driver says which,
    else the whole GPU (:func:`~mig_spawner.core.health.fault_slices`), recorded as its
    memory slices (``sizes``: GPU UUID -> memory slices, as last read; a lost GPU cannot
    tell its model). A GPU the driver no longer lists (index -1) takes its index from the
    leases on it; a lost GPU this process never read takes its UUID from the leases on
    this host or ``named`` (index, UUID: the faults held), else it is left out (logged:
    the inventory shows it lost, so nothing on it is offered)."""
    by_uuid = {gpu.uuid: gpu for gpu in inventory.gpus}
    sizes = {**(sizes or {}), **gpu_sizes(inventory)}
    here = [(x.gpu_index, x.gpu_uuid) for x in leases
            if x.host == inventory.host and x.gpu_uuid and x.gpu_index is not None]
    uuids, indexes = dict([*named, *here]), {uuid: index for index, uuid in here}
    holds = []
    for fault in faults:
        index = fault.gpu_index if fault.gpu_index >= 0 else indexes.get(fault.gpu_uuid, -1)
        uuid = fault.gpu_uuid or uuids.get(index, "")
        if not uuid:
            log.error("%s; its UUID is not known here, so it is not held in the ledger", fault)
            continue
        fault = replace(fault, gpu_index=index, gpu_uuid=uuid)
        holds.append(FaultHold(fault, fault_slices(fault, by_uuid.get(fault.gpu_uuid), leases),
                               sizes.get(fault.gpu_uuid, 0)))
    return holds


def gpu_sizes(inventory: Inventory) -> dict[str, int]:
    """GPU UUID -> its memory slices, for each GPU whose model this read knows."""
    return {gpu.uuid: inventory.model(gpu.model_key).memory_slices
            for gpu in inventory.gpus if gpu.model_key}


class FaultWatch:
    """Finds faults on this host's GPUs and holds them in the ledger.

    The driver's events (a critical Xid, a double-bit ECC error) arrive on the GPU
    adapter's event thread and wait here, judged, until :meth:`check`, which a sweep
    calls with the polled checks. Blocking: run :meth:`check` on a worker thread.
    """

    def __init__(self, ledger: Callable[[], Ledger], gpus: HealthGpus,
                 ignored_xids: Collection[int] = APPLICATION_XIDS) -> None:
        self._ledger = ledger
        self._gpus = gpus
        self._ignored = frozenset(ignored_xids)
        self._lock = threading.Lock()
        self._events: list[Fault] = []
        self._sizes: dict[str, int] = {}  # GPU UUID -> memory slices, as last read

    def on_event(self, event: DriverEvent) -> None:
        """Called by the event thread: keep a fault for the next :meth:`check` (an Xid
        an application causes is dropped here)."""
        fault = event_fault(event, self._ignored)
        if fault is None:
            log.info("GPU %d: Xid %s is one applications cause; the GPU stays healthy",
                     event.gpu_index, event.xid)
            return
        log.error("%s", fault)
        with self._lock:
            self._events.append(fault)

    def check(self, leases: Sequence[Lease]) -> list[GpuFault]:
        """Read the GPUs' health, add the events since the last check, and hold what is
        faulty (``leases``: the held leases, to expect their devices and place a device
        that is gone). Returns the faults recorded new. An event is kept for the next
        check when the ledger cannot be written."""
        with self._lock:
            events, self._events = self._events, []
        try:
            inventory, polled = faults_now(self._gpus, leases)
            polled = self._still_expected(polled)
            unnamed = any(not f.gpu_uuid for f in [*events, *polled])
            named = [(f.gpu_index, f.gpu_uuid) for f in
                     self._ledger().holds.faults(inventory.host)] if unnamed else []
            found = placed([*events, *polled], inventory, leases, self._sizes, named)
            self._sizes.update(gpu_sizes(inventory))
            new = self._ledger().holds.record_faults(inventory.host, found)
        except BaseException:
            with self._lock:
                self._events[:0] = events
            raise
        for fault in new:
            log.error("holding %s from new servers: %s", fault.where, fault.detail)
        return new

    def _still_expected(self, faults: list[Fault]) -> list[Fault]:
        """Drop a missing MIG device whose lease ended meanwhile (its instance may be
        destroyed since: a layout change)."""
        missing = {f.device_uuid for f in faults if f.kind is FaultKind.MISSING_INSTANCE}
        if not missing:
            return faults
        active = {x.mig_uuid for x in self._ledger().leases.active()
                  if x.state is LeaseState.ACTIVE}
        return [f for f in faults if f.kind is not FaultKind.MISSING_INSTANCE
                or f.device_uuid in active]


def healthy_now(gpus: HealthGpus, gpu_uuid: str) -> tuple[bool, list[Fault]]:
    """Whether the driver lists the GPU and reads it healthy now (what ``health clear``
    asks before it lifts a hold), and the faults it still shows."""
    inventory, faults = faults_now(gpus, [])
    listed = any(gpu.uuid == gpu_uuid and not gpu.lost for gpu in inventory.gpus)
    mine = [f for f in faults if f.gpu_uuid == gpu_uuid]
    return listed and not mine, mine
