"""What a lease holds: a kind of slice, and the pure rules each kind follows.

Four kinds (their stored names are ``leases.mode``'s values, unchanged since the first
ledger, so SQL written against a ledger keeps working):

* ``pool``: a MIG instance an admin made beforehand; the lease names it from its claim;
* ``dynamic``: a MIG instance made for the lease after its claim, destroyed at release;
* ``kube``: a cluster's MIG resource; the device plugin picks the device, the lease
  names a pod;
* ``gpu``: a whole GPU with MIG off (``catalog.WHOLE_GPU``), every memory slice of it.

This module holds what can be decided without I/O: each kind's traits
(:class:`KindRules`) and, for the kinds placed on this host's GPUs, what is free
(:meth:`HostKind.free`) and which placement a claim gets (:meth:`HostKind.pick`).
The I/O steps (environment, release, holder probe) are in :mod:`mig_spawner.kinds`.
Nothing outside these two modules branches on a kind's name (docs/architecture.md,
"Kinds").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from .allocator import Occupancy, Placement, PlacementStrategy, pick_dynamic, pick_pool
from .allocator.pool import pool_free
from .allocator.refusals import plural
from .catalog import WHOLE_GPU, model
from .inventory import Gpu, Inventory, MigDevice
from .refusal import Reason, Refused


class Kind(StrEnum):
    """A kind's name, as ``leases.mode`` stores it."""

    POOL = "pool"
    DYNAMIC = "dynamic"
    KUBE = "kube"
    GPU = "gpu"


@dataclass(frozen=True)
class KindRules:
    """What a kind of slice is, in traits the rest of the code asks about."""

    kind: Kind
    #: The lease names a host, a GPU and its memory slices: the ledger's uniqueness
    #: guarantee (``lease_slots``) covers it.
    placed: bool
    #: The lease names an existing MIG device from its claim on.
    device_at_claim: bool
    #: The slice is made for the lease after its claim and destroyed before its release.
    made_per_lease: bool
    #: What holds it is a process of this host (else: a pod, which only the cluster's
    #: API can check).
    on_host: bool
    #: The sizes offered are fixed beforehand: waiting cannot make an absent one appear.
    fixed_layout: bool
    #: A smaller waiter that fits may be served before a larger one that does not
    #: (bounded by the starvation guard).
    passes_over: bool


RULES: Mapping[Kind, KindRules] = {
    Kind.POOL: KindRules(Kind.POOL, placed=True, device_at_claim=True, made_per_lease=False,
                         on_host=True, fixed_layout=True, passes_over=False),
    Kind.DYNAMIC: KindRules(Kind.DYNAMIC, placed=True, device_at_claim=False,
                            made_per_lease=True, on_host=True, fixed_layout=False,
                            passes_over=True),
    Kind.KUBE: KindRules(Kind.KUBE, placed=False, device_at_claim=False, made_per_lease=False,
                         on_host=False, fixed_layout=True, passes_over=False),
    Kind.GPU: KindRules(Kind.GPU, placed=True, device_at_claim=False, made_per_lease=False,
                        on_host=True, fixed_layout=True, passes_over=False),
}


def rules_of(name: str) -> KindRules:
    """The rules of the kind stored as ``name``; ``ValueError`` naming the kinds."""
    try:
        return RULES[Kind(name)]
    except ValueError:
        raise ValueError(f"a lease's kind is one of {', '.join(Kind)}, not {name!r}") from None


#: The spawner's ``mig_mode`` (what an admin configures) -> the kind its slices are.
MIG_MODE_KINDS: Mapping[str, Kind] = {"pool": Kind.POOL, "dynamic": Kind.DYNAMIC}


def mode_rules(mig_mode: str) -> KindRules:
    """The rules of the kind of slice a spawner with ``mig_mode`` makes."""
    return RULES[MIG_MODE_KINDS[mig_mode]]


#: Memory slices a layout change holds from new grants, per (host, GPU UUID)
#: (docs/layout.md; ``LedgerView.holds``).
Holds = Mapping[tuple[str, str], frozenset[int]]


def _devices_on_held_slices(inventory: Inventory, holds: Holds) -> frozenset[str]:
    """MIG devices on slices a layout change holds."""
    return frozenset(
        d.uuid for g in inventory.gpus if (held := holds.get((inventory.host, g.uuid)))
        for d in g.mig_devices if not held.isdisjoint(range(d.start, d.start + d.size)))


def without_held_gpus(inventory: Inventory, holds: Holds) -> Inventory:
    """``inventory`` less the GPUs a layout change holds any slice of."""
    if not holds:
        return inventory
    return replace(inventory, gpus=tuple(g for g in inventory.gpus
                                         if not holds.get((inventory.host, g.uuid))))


@dataclass(frozen=True)
class Picked:
    """Where a claim goes on this host: the placement, and the MIG device it names
    when that exists already (pool)."""

    placement: Placement
    device: MigDevice | None = None


class HostKind(Protocol):
    """A kind placed on this host's GPUs: what is free, and what a claim gets.

    ``taken``: MIG device UUIDs held leases name; ``reserved``: the placements held
    leases cover (both from the ledger, read in the claim's transaction).
    """

    rules: KindRules

    def unheld(self, inventory: Inventory, taken: Collection[str],
               holds: Holds) -> tuple[Inventory, Collection[str]]:
        """``inventory`` and ``taken`` as :meth:`free` and :meth:`pick` must see them
        while a layout change holds ``holds``: nothing held is offered."""
        ...

    def free(self, inventory: Inventory, taken: Collection[str],
             reserved: Iterable[Placement]) -> dict[str, int]:
        """How many of each profile a user could get now (for the form)."""
        ...

    def pick(self, inventory: Inventory, taken: Collection[str], reserved: Iterable[Placement],
             wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        """The placement for one claim of ``wants`` (model key -> profile), or why not."""
        ...


class PoolKind:
    """Free existing MIG devices; ``pack``/``spread`` as docs/allocator.md says."""

    rules = RULES[Kind.POOL]

    def unheld(self, inventory: Inventory, taken: Collection[str],
               holds: Holds) -> tuple[Inventory, Collection[str]]:
        # Only the instances on held slices stop being offered: the rest of their GPU
        # stays as it is through the change.
        return inventory, frozenset(taken) | _devices_on_held_slices(inventory, holds)

    def free(self, inventory: Inventory, taken: Collection[str],
             reserved: Iterable[Placement]) -> dict[str, int]:
        return pool_free(inventory, set(taken))

    def pick(self, inventory: Inventory, taken: Collection[str], reserved: Iterable[Placement],
             wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        grant = pick_pool(inventory, taken, wants, strategy)
        return grant if isinstance(grant, Refused) else Picked(grant.placement, grant.device)


class DynamicKind:
    """A new instance at the placement that keeps the most requests placeable."""

    rules = RULES[Kind.DYNAMIC]

    def unheld(self, inventory: Inventory, taken: Collection[str],
               holds: Holds) -> tuple[Inventory, Collection[str]]:
        # A GPU being drained or re-cut gets nothing new on it.
        return without_held_gpus(inventory, holds), taken

    def free(self, inventory: Inventory, taken: Collection[str],
             reserved: Iterable[Placement]) -> dict[str, int]:
        return Occupancy.of(inventory, reserved).free_counts()

    def pick(self, inventory: Inventory, taken: Collection[str], reserved: Iterable[Placement],
             wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        placed = pick_dynamic(inventory, list(reserved), wants, strategy, demand)
        return placed if isinstance(placed, Refused) else Picked(placed)


def offered_whole(gpu: Gpu) -> bool:
    """A GPU offered whole: a catalog model with MIG off, and no change to that waiting
    for a reset."""
    return gpu.model_key is not None and not gpu.mig_current and not gpu.mig_pending


def whole_gpu_free(gpu: Gpu, reserved_gpus: Collection[str]) -> bool:
    """A GPU that can be leased whole now: :func:`offered_whole`, and no held lease
    covers any memory slice of it."""
    return offered_whole(gpu) and gpu.uuid not in reserved_gpus


class WholeGpuKind:
    """A whole GPU with MIG off: its placement is all of its memory slices, so that a
    lease of it and a lease of any slice of it can never both be stored."""

    rules = RULES[Kind.GPU]

    def unheld(self, inventory: Inventory, taken: Collection[str],
               holds: Holds) -> tuple[Inventory, Collection[str]]:
        # A GPU being drained or re-cut gets nothing new on it.
        return without_held_gpus(inventory, holds), taken

    def free(self, inventory: Inventory, taken: Collection[str],
             reserved: Iterable[Placement]) -> dict[str, int]:
        covered = {p.gpu_uuid for p in reserved}
        if not any(g.model_key and not g.mig_current for g in inventory.gpus):
            return {}  # no GPU here is ever offered whole
        return {WHOLE_GPU: sum(whole_gpu_free(g, covered) for g in inventory.gpus)}

    def pick(self, inventory: Inventory, taken: Collection[str], reserved: Iterable[Placement],
             wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        covered = {p.gpu_uuid for p in reserved}
        mine = [g for g in inventory.gpus if g.model_key in wants]
        # Lowest index first: whole GPUs are alike, and the order is stable for users.
        gpu = next((g for g in sorted(mine, key=lambda g: g.index)
                    if whole_gpu_free(g, covered)), None)
        if gpu is not None:
            size = model(gpu.model_key or "").memory_slices
            return Picked(Placement(gpu.index, gpu.uuid, WHOLE_GPU, 0, size))
        off = [g for g in mine if not g.mig_current]
        if not off:
            detail = (f"no GPU here has MIG off ({plural(len(mine), 'GPU')} of that model, "
                      "all with MIG on); an admin turns it off with 'nvidia-smi -mig 0'")
        else:
            detail = f"every GPU with MIG off is in use ({plural(len(off), 'GPU')})"
        return Refused(Reason.NONE_FREE, f"no whole GPU free: {detail}")


#: The kinds placed on this host, by name.
HOST_KINDS: Mapping[Kind, HostKind] = {
    Kind.POOL: PoolKind(), Kind.DYNAMIC: DynamicKind(), Kind.GPU: WholeGpuKind(),
}


def host_kind(name: str) -> HostKind:
    """The host kind stored as ``name`` (``ValueError`` for any other)."""
    try:
        return HOST_KINDS[Kind(name)]
    except (ValueError, KeyError):
        raise ValueError(
            f"a slice kind on this host is one of {', '.join(HOST_KINDS)}, not {name!r}"
        ) from None
