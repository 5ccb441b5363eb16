"""Which MIG slice a new server gets: pure, deterministic decisions over an Inventory.

Two modes (see docs/allocator.md):

* **pool**: an admin made the MIG devices beforehand; :func:`pick_pool` hands out a
  free one of the wanted profile. ``pack`` fills the GPU that is already most used
  (whole GPUs stay free for big slices), ``spread`` the least used one.
* **dynamic**: a new GPU instance is created per server; :func:`pick_dynamic` chooses
  the GPU and the placement ``{start, size}`` that keeps the most future requests
  placeable, within NVIDIA's rules (valid starts, no overlap, per-profile limits, one
  ``+me`` instance per GPU, MIG on and not waiting for a reset).

When nothing can be given, the pickers *return* (not raise: simulations make thousands
of decisions) a :class:`~mig_spawner.core.refusal.Refused` that says why and what is
free instead.

A caller that decides more than once keeps a :class:`SliceIndex` (:mod:`.index`): built
once from an inventory, told what is held and what a newer read changed, it answers
each decision without a pass over the fleet. :func:`pick_pool` and :func:`pick_dynamic`
are one-off decisions on an index built for them.

This package's face is what callers import; the code lives in :mod:`.index` (the
index), :mod:`.pool` (pool picking), :mod:`.dynamic` (dynamic picking,
:class:`Occupancy`), :mod:`.whole` (whole GPUs), :mod:`.request` (what was asked for,
:class:`Placement`), :mod:`.refusals` (the refusals' words) and :mod:`.tables`
(per-model placement tables and the value function).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from mig_spawner.core.inventory import Inventory
from mig_spawner.core.refusal import Refused

from .dynamic import GpuSlots, Occupancy
from .index import HeldLease, Holds, SliceIndex
from .pool import PoolGrant
from .request import Placement, PlacementStrategy, Wanted

__all__ = [
    "GpuSlots",
    "HeldLease",
    "Holds",
    "Occupancy",
    "Placement",
    "PlacementStrategy",
    "PoolGrant",
    "SliceIndex",
    "Wanted",
    "pick_dynamic",
    "pick_pool",
]


def _index(inventory: Inventory, held_mig_uuids: Iterable[str] = (),
           reserved: Iterable[Placement] = ()) -> SliceIndex:
    """A one-off index of ``inventory`` holding these devices and placements."""
    index = SliceIndex(inventory)
    for uuid in set(held_mig_uuids):
        index.hold(("device", uuid), mig_uuid=uuid)
    for n, placement in enumerate(reserved):
        index.hold(("placement", n), placement=placement)
    return index


def pick_pool(
    inventory: Inventory,
    held_mig_uuids: Collection[str],
    wanted: Wanted,
    strategy: PlacementStrategy = "pack",
) -> PoolGrant | Refused:
    """A free existing MIG device of ``wanted``, or why there is none (one decision;
    a caller deciding again keeps a :class:`SliceIndex`).

    Free = not held by a lease and running no process (a process no lease accounts
    for means someone uses the slice outside mig-spawner). ``pack`` picks the GPU with
    the most memory slices in use, ``spread`` the fewest; ties go to the lowest GPU
    index, then the lowest start.
    """
    return _index(inventory, held_mig_uuids).pick_pool(wanted, strategy)


def pick_dynamic(
    inventory: Inventory,
    reserved: Iterable[Placement],
    wanted: Wanted,
    strategy: PlacementStrategy = "pack",
    demand: Mapping[str, float] | None = None,
) -> Placement | Refused:
    """GPU and placement for a NEW instance of ``wanted``, or why there is none (one
    decision; a caller deciding again keeps a :class:`SliceIndex`).

    ``reserved`` are the ledger's dynamic claims (those whose instance exists are
    recognised and counted once). ``pack`` (default) takes the placement that loses
    the least future capacity, preferring GPUs already in use; ``spread`` takes the
    least used GPU first, then the best placement on it. Ties go to the lowest GPU
    index, then the lowest start. ``demand`` (profile name -> how often it is asked
    for, e.g. recent request counts) tells which future requests matter most; without
    it every profile counts the same.
    """
    return _index(inventory, reserved=reserved).pick_dynamic(wanted, strategy, demand)
