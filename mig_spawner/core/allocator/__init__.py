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

This package's face is what callers import; the code lives in :mod:`.pool` (pool
picking), :mod:`.dynamic` (dynamic picking, :class:`Occupancy`), :mod:`.request` (what
was asked for, :class:`Placement`), :mod:`.refusals` (the refusals' words) and
:mod:`.tables` (per-model placement tables and the value function).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Literal

from mig_spawner.core.inventory import Inventory

from .dynamic import GpuSlots, Occupancy, pick_dynamic
from .pool import PoolGrant, pick_pool, pool_free
from .request import Placement, PlacementStrategy, Wanted

__all__ = [
    "GpuSlots",
    "Occupancy",
    "Placement",
    "PlacementStrategy",
    "PoolGrant",
    "Wanted",
    "free_counts",
    "pick_dynamic",
    "pick_pool",
]


def free_counts(
    inventory: Inventory,
    mode: Literal["pool", "dynamic"],
    *,
    held_mig_uuids: Collection[str] = (),
    reserved: Iterable[Placement] = (),
) -> dict[str, int]:
    """How many of each profile a user could get right now (for the spawn form).

    pool: free existing devices (``held_mig_uuids`` are taken). dynamic: how many more
    of that profile could still be created, each profile counted alone (``reserved``
    are the ledger's claims). The spawner asks its slice kind
    (:mod:`mig_spawner.core.kinds`), which calls the same two counts.
    """
    count = _FREE_COUNTS.get(mode)
    if count is None:
        raise ValueError(f"mode must be 'pool' or 'dynamic', not {mode!r}")
    return count(inventory, held_mig_uuids, reserved)


_FREE_COUNTS: dict[str, Callable[[Inventory, Collection[str], Iterable[Placement]],
                                 dict[str, int]]] = {
    "pool": lambda inventory, held, _: pool_free(inventory, set(held)),
    "dynamic": lambda inventory, _, reserved: Occupancy.of(inventory, reserved).free_counts(),
}
