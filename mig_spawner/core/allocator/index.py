"""What the allocator's decisions need, kept up to date as leases come and go.

A :class:`SliceIndex` is built once from an :class:`~mig_spawner.core.inventory.Inventory`
and told what is held: leases (:meth:`~SliceIndex.hold`, :meth:`~SliceIndex.drop`, or
:meth:`~SliceIndex.match` with the ledger's held leases, which applies only what changed
since the last call) and a layout change's holds. It keeps, for each way of handing out
slices, what a decision reads:

* pool: per model and profile, the GPUs with a free device, bucketed by the memory
  slices in use (:class:`~.pool.PoolView`);
* dynamic: per distinct GPU state, its GPUs, lowest index first
  (:class:`~.dynamic.DynamicView`);
* whole GPUs: per model, the free ones, lowest index first (:class:`~.whole.WholeView`).

A change touches the GPUs it names only, and a decision reads a few buckets or the
distinct GPU states (bounded by the GPU models' layouts, not by the fleet), so neither
grows with the number of GPUs. Each view is built on first use. :meth:`~SliceIndex.refresh`
takes a new read of the same host and recounts only the GPUs whose layout, MIG mode or
busy devices changed; a GPU added or gone builds the views again. The choices are
exactly those of a full pass over the inventory (``tests/test_allocator_index.py``).

Not thread-safe by itself: callers that share one index hold :attr:`SliceIndex.lock`
around a :meth:`~SliceIndex.match` and the decision that reads it.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Protocol

from mig_spawner.core.inventory import Gpu, Inventory, MigDevice
from mig_spawner.core.refusal import Refused

from .dynamic import DynamicView
from .pool import PoolGrant, PoolView
from .refusals import GpuView
from .request import Placement, PlacementStrategy, Wanted, gpu_view, prepare
from .whole import WholeView

#: Memory slices a layout change holds from new grants, per (host, GPU UUID)
#: (docs/layout.md).
Holds = Mapping[tuple[str, str], frozenset[int]]


class HeldLease(Protocol):
    """What the index reads of a held lease (the ledger's ``Lease`` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def host(self) -> str | None: ...
    @property
    def mig_uuid(self) -> str | None: ...
    @property
    def gpu_uuid(self) -> str | None: ...
    @property
    def gpu_index(self) -> int | None: ...
    @property
    def profile(self) -> str: ...
    @property
    def start(self) -> int | None: ...
    @property
    def size(self) -> int | None: ...


def _signature(gpu: Gpu) -> tuple[object, ...]:
    """Everything of one GPU that a decision reads: a GPU whose signature is unchanged
    in a new read needs no recount."""
    return (gpu.index, gpu.model_key, gpu.mig_current, gpu.mig_pending, gpu.mig_supported,
            tuple((gi.profile_id, gi.start, gi.size) for gi in gpu.gpu_instances),
            tuple((d.uuid, d.profile, d.start, d.size, d.gi_id, d.ci_id, not d.processes)
                  for d in gpu.mig_devices))


class SliceIndex:
    """One host's GPUs and what is held on them, indexed for the allocator's decisions."""

    def __init__(self, inventory: Inventory) -> None:
        #: Held by callers that share this index across threads (see the module's doc).
        self.lock = threading.RLock()
        # What is held, by the caller's key: (MIG device UUID, placement) per lease.
        self._entries: dict[Hashable, tuple[str | None, Placement | None]] = {}
        self._deviceless: set[Hashable] = set()  # held keys with no MIG device (yet)
        self._devices_held: Counter[str] = Counter()
        self._reserved: defaultdict[str, list[Placement]] = defaultdict(list)
        self._holds: dict[tuple[str, str], frozenset[int]] = {}
        self._load(inventory)

    def _load(self, inventory: Inventory) -> None:
        self.inventory = inventory
        gpus = inventory.gpus
        self._position = {g.uuid: n for n, g in enumerate(gpus)}
        self._device_gpu = {d.uuid: n for n, g in enumerate(gpus) for d in g.mig_devices}
        self._signatures = [_signature(g) for g in gpus]
        #: The catalog model keys of this host's GPUs, sorted.
        self.model_keys = tuple(sorted({g.model_key for g in gpus if g.model_key}))
        self._pool: PoolView | None = None
        self._dynamic: DynamicView | None = None
        self._whole: WholeView | None = None

    # -- what the host has -------------------------------------------------------------

    def refresh(self, inventory: Inventory) -> None:
        """Take a new read of this host: only the GPUs that changed are counted again
        (all of them when a GPU was added, removed or moved)."""
        if inventory is self.inventory:
            return
        old, new = self.inventory.gpus, inventory.gpus
        if inventory.host != self.inventory.host or [g.uuid for g in old] != [
                g.uuid for g in new]:
            self._load(inventory)
            return
        changed = [n for n, g in enumerate(new) if _signature(g) != self._signatures[n]]
        self.inventory = inventory  # unchanged GPUs: the newer objects, equal for decisions
        for n in changed:
            self._recount([n], lambda n=n: self._replace(n, old[n], new[n]))
        if changed:
            self.model_keys = tuple(sorted({g.model_key for g in new if g.model_key}))

    def _replace(self, n: int, old: Gpu, new: Gpu) -> None:
        for d in old.mig_devices:
            self._device_gpu.pop(d.uuid, None)
        for d in new.mig_devices:
            self._device_gpu[d.uuid] = n
        self._signatures[n] = _signature(new)

    def gpu(self, uuid: str) -> Gpu | None:
        """This host's GPU with ``uuid``, if it has one."""
        n = self._position.get(uuid)
        return None if n is None else self.inventory.gpus[n]

    # -- what is held --------------------------------------------------------------------

    def hold(self, key: Hashable, mig_uuid: str | None = None,
             placement: Placement | None = None) -> None:
        """Count ``key`` (a lease) as holding the MIG device ``mig_uuid`` (pool: taken)
        and ``placement`` (dynamic: reserved; a whole GPU: covered). Holding a key again
        replaces what it held."""
        if key in self._entries:
            self.drop(key)
        self._entries[key] = (mig_uuid, placement)
        if mig_uuid is None:
            self._deviceless.add(key)
        self._recount(self._touched(mig_uuid, placement), lambda: self._count(
            mig_uuid, placement, +1))

    def drop(self, key: Hashable) -> None:
        """Stop counting what ``key`` held (nothing when it held nothing)."""
        entry = self._entries.pop(key, None)
        self._deviceless.discard(key)
        if entry is not None:
            self._recount(self._touched(*entry), lambda: self._count(*entry, -1))

    def match(self, leases: Iterable[HeldLease], holds: Holds | None = None) -> None:
        """Make the held leases exactly ``leases`` (a placement counts where the lease is
        on this host) and the layout holds ``holds``, applying only what changed since
        the last call: leases that came or went, and a lease that has gained its MIG
        device since (a dynamic instance made after its claim; nothing else of a held
        lease changes)."""
        wanted = {lease.id: lease for lease in leases}
        entries = self._entries
        for key in entries.keys() - wanted.keys():
            self.drop(key)
        for key in wanted.keys() - entries.keys():
            lease = wanted[key]
            self.hold(key, lease.mig_uuid, self._placement(lease))
        for key in [k for k in self._deviceless if k in wanted and wanted[k].mig_uuid]:
            lease = wanted[key]
            self.hold(key, lease.mig_uuid, self._placement(lease))
        self.set_holds(holds or {})

    def _placement(self, lease: HeldLease) -> Placement | None:
        if (lease.host != self.inventory.host or not lease.gpu_uuid
                or lease.gpu_index is None or lease.start is None or lease.size is None):
            return None
        return Placement(lease.gpu_index, lease.gpu_uuid, lease.profile, lease.start,
                         lease.size)

    def set_holds(self, holds: Holds) -> None:
        """A layout change's holds (for this host's GPUs; other hosts' are ignored)."""
        host = self.inventory.host
        mine = {k: v for k, v in holds.items() if k[0] == host and v}
        if mine == self._holds:
            return
        touched = {self._position[uuid] for (_, uuid) in mine.keys() ^ self._holds.keys()
                   if uuid in self._position}
        touched |= {self._position[k[1]] for k in mine.keys() & self._holds.keys()
                    if mine[k] != self._holds[k] and k[1] in self._position}

        def change() -> None:
            self._holds = mine
        self._recount(sorted(touched), change)

    def _touched(self, mig_uuid: str | None, placement: Placement | None) -> list[int]:
        found = set()
        if mig_uuid is not None and (n := self._device_gpu.get(mig_uuid)) is not None:
            found.add(n)
        if placement is not None and (n := self._position.get(placement.gpu_uuid)) is not None:
            found.add(n)
        return sorted(found)

    def _count(self, mig_uuid: str | None, placement: Placement | None, sign: int) -> None:
        if mig_uuid is not None:
            self._devices_held[mig_uuid] += sign
            if not self._devices_held[mig_uuid]:
                del self._devices_held[mig_uuid]
        if placement is not None:
            on = self._reserved[placement.gpu_uuid]
            if sign > 0:
                on.append(placement)
            else:
                on.remove(placement)
                if not on:
                    del self._reserved[placement.gpu_uuid]

    def _recount(self, touched: Iterable[int], change: Callable[[], None]) -> None:
        """Take the ``touched`` GPUs out of the built views, ``change``, put them back."""
        touched = list(touched)
        for view in self._built():
            for n in touched:
                view.remove(n)
        change()
        for n in touched:
            self._add(n, self._pool, self._dynamic, self._whole)

    def _built(self) -> list[PoolView | DynamicView | WholeView]:
        return [v for v in (self._pool, self._dynamic, self._whole) if v is not None]

    def _add(self, n: int, pool: PoolView | None, dynamic: DynamicView | None,
             whole: WholeView | None) -> None:
        gpu = self.inventory.gpus[n]
        held = self._holds.get((self.inventory.host, gpu.uuid))
        if pool is not None:
            pool.add(n, gpu, self._pool_taken)
        if dynamic is not None:
            dynamic.add(n, gpu, self._reserved.get(gpu.uuid, ()), bool(held))
        if whole is not None:
            whole.add(n, gpu, gpu.uuid in self._reserved, bool(held))

    def _pool_taken(self, device: MigDevice) -> bool:
        """A lease holds the device, or a layout change holds a slice of it."""
        if device.uuid in self._devices_held:
            return True
        held = self._holds.get((self.inventory.host, device.gpu_uuid))
        return bool(held) and not held.isdisjoint(range(device.start,
                                                        device.start + device.size))

    # -- the views, built on first use -------------------------------------------------------

    def _pool_view(self) -> PoolView:
        if self._pool is None:
            self._pool = PoolView(len(self.inventory.gpus))
            for n in range(len(self.inventory.gpus)):
                self._add(n, self._pool, None, None)
        return self._pool

    def _dynamic_view(self) -> DynamicView:
        if self._dynamic is None:
            self._dynamic = DynamicView(len(self.inventory.gpus))
            for n in range(len(self.inventory.gpus)):
                self._add(n, None, self._dynamic, None)
        return self._dynamic

    def _whole_view(self) -> WholeView:
        if self._whole is None:
            self._whole = WholeView(len(self.inventory.gpus))
            for n in range(len(self.inventory.gpus)):
                self._add(n, None, None, self._whole)
        return self._whole

    def _views(self) -> list[GpuView]:
        return [gpu_view(g) for g in self.inventory.gpus]

    # -- decisions ---------------------------------------------------------------------------

    def pick_pool(self, wanted: Wanted, strategy: PlacementStrategy = "pack"
                  ) -> PoolGrant | Refused:
        """A free existing MIG device of ``wanted``, or why there is none
        (docs/allocator.md, "Pool mode"). A device a lease or a layout change holds is
        taken; one that runs a process no lease accounts for is too."""
        wants = prepare(wanted, strategy)
        view = self._pool_view()
        grant = view.pick(wants, strategy == "spread", self._pool_taken, self.inventory.gpus)
        return grant if grant is not None else view.refuse(wants, self._views)

    def pick_dynamic(self, wanted: Wanted, strategy: PlacementStrategy = "pack",
                     demand: Mapping[str, float] | None = None) -> Placement | Refused:
        """GPU and placement for a NEW instance of ``wanted``, or why there is none
        (docs/allocator.md, "Dynamic mode"). A GPU a layout change holds gets nothing."""
        wants = prepare(wanted, strategy)
        return self._dynamic_view().pick(wants, strategy, demand, self.inventory.gpus)

    def whole_gpu(self, wants: Mapping[str, str]) -> Gpu | None:
        """The free whole GPU of a wanted model with the lowest index (none held by a lease
        or a layout change), or ``None``."""
        n = self._whole_view().first(wants)
        return None if n is None else self.inventory.gpus[n]

    def whole_gpus(self, wants: Mapping[str, str]) -> tuple[int, int]:
        """GPUs of the wanted models not held by a layout change, and how many of them
        have MIG off (for a refusal's words)."""
        return self._whole_view().counts(wants)

    # -- what is free, per GPU model (for the spawn form) --------------------------------

    def free_pool(self) -> dict[str | None, dict[str, int]]:
        """Free devices per model key (``None``: unknown to the catalog), per profile."""
        return self._pool_view().free()

    def free_dynamic(self) -> dict[str | None, dict[str, int]]:
        """Per model key, per profile: how many more could be created, each alone."""
        return self._dynamic_view().free()

    def free_whole(self) -> dict[str, int | None]:
        """Free whole GPUs per model key (``None``: no GPU of it has MIG off)."""
        return self._whole_view().free()
