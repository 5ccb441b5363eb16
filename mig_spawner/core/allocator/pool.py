"""Pool mode: hand out a free MIG device that an admin made beforehand."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from mig_spawner.core.inventory import Inventory, MigDevice
from mig_spawner.core.refusal import Refused

from .refusals import none_free, precheck
from .request import Placement, PlacementStrategy, Wanted, gpu_view, key_of, prepare


@dataclass(frozen=True)
class PoolGrant:
    """Pool mode: the existing MIG device given to the server."""

    device: MigDevice

    @property
    def uuid(self) -> str:
        return self.device.uuid

    @property
    def placement(self) -> Placement:
        d = self.device
        return Placement(d.gpu_index, d.gpu_uuid, d.profile, d.start, d.size)


def pool_free(inventory: Inventory, held: Collection[str]) -> dict[str, int]:
    """Free devices per profile: MIG on, not held by a lease, running no process."""
    free: Counter[str] = Counter()
    for g in inventory.gpus:
        if g.mig_enabled:
            for d in g.mig_devices:
                if d.uuid not in held and not d.processes:
                    free[d.profile] += 1
    return dict(free)


def pick_pool(
    inventory: Inventory,
    held_mig_uuids: Collection[str],
    wanted: Wanted,
    strategy: PlacementStrategy = "pack",
) -> PoolGrant | Refused:
    """A free existing MIG device of ``wanted``, or why there is none.

    Free = not held by a lease and running no process (a process no lease accounts
    for means someone uses the slice outside mig-spawner). ``pack`` picks the GPU with
    the most memory slices in use, ``spread`` the fewest; ties go to the lowest GPU
    index, then the lowest start.
    """
    wants = prepare(wanted, strategy)
    held = held_mig_uuids if isinstance(held_mig_uuids, (set, frozenset)) else set(held_mig_uuids)
    spread = strategy == "spread"
    best: tuple[tuple[int, int], MigDevice] | None = None
    for g in inventory.gpus:
        name = wants.get(g.model_key or "")
        # MIG on and no mode change waiting (Gpu.mig_enabled, inlined: hot loop).
        if name is None or not (g.mig_current and g.mig_pending):
            continue
        taken = 0
        found: MigDevice | None = None
        for d in g.mig_devices:
            if d.uuid in held or d.processes:
                taken += d.size
            elif d.profile == name and (found is None or d.start < found.start):
                found = d
        if found is not None:
            # The GPU index last: among equals the lowest wins, whatever the inventory order.
            rank = (taken if spread else -taken, g.index)
            if best is None or rank < best[0]:
                best = (rank, found)
    if best is not None:
        return PoolGrant(best[1])
    return _refuse_pool(inventory, held, wants)


def _refuse_pool(inventory: Inventory, held: Collection[str], wants: Mapping[str, str]) -> Refused:
    free = pool_free(inventory, held)
    views = [gpu_view(g) for g in inventory.gpus]
    usable, refusal = precheck(views, wants, free)
    if refusal is not None:
        return refusal
    on = {v.index for v in usable}
    devices = [
        d for g in inventory.gpus if g.index in on
        for d in g.mig_devices if d.profile == wants[key_of(g)]
    ]
    leased = sum(1 for d in devices if d.uuid in held)
    eligible = sum(1 for v in views if v.model_key in wants)
    return none_free(wants, len(usable), eligible, len(devices), leased,
                     len(devices) - leased, free)
