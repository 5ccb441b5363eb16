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

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol

from .allocator import Placement, PlacementStrategy, SliceIndex
from .allocator.refusals import plural
from .allocator.whole import offered_whole as offered_whole
from .catalog import WHOLE_GPU, model
from .inventory import MigDevice
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


#: What an admin configures as a spawner's ``mig_mode``.
MigMode = Literal["pool", "dynamic"]
#: The spawner's ``mig_mode`` (what an admin configures) -> the kind its slices are.
MIG_MODE_KINDS: Mapping[str, Kind] = {"pool": Kind.POOL, "dynamic": Kind.DYNAMIC}
#: The ``mig_mode`` of a spawner that sets none: slices an admin made (no privilege).
DEFAULT_MIG_MODE: MigMode = "pool"


def mode_rules(mig_mode: str) -> KindRules:
    """The rules of the kind of slice a spawner with ``mig_mode`` makes."""
    return RULES[MIG_MODE_KINDS[mig_mode]]


@dataclass(frozen=True)
class Picked:
    """Where a claim goes on this host: the placement, and the MIG device it names
    when that exists already (pool)."""

    placement: Placement
    device: MigDevice | None = None


class HostKind(Protocol):
    """A kind placed on this host's GPUs: what is free, and what a claim gets.

    Both read a :class:`~mig_spawner.core.allocator.SliceIndex` that the caller has told
    what is held (``SliceIndex.match``: the ledger's held leases and a layout change's
    holds). What a hold takes away is each kind's own rule, which its part of the index
    applies: a pool loses only the instances on held slices; a dynamic GPU or a whole
    GPU with any held slice offers nothing (docs/layout.md).
    """

    rules: KindRules

    def free(self, index: SliceIndex) -> Mapping[str | None, Mapping[str, int]]:
        """Per GPU model key, how many of each profile a user could get now (the form)."""
        ...

    def pick(self, index: SliceIndex, wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        """The placement for one claim of ``wants`` (model key -> profile), or why not."""
        ...


class PoolKind:
    """Free existing MIG devices; ``pack``/``spread`` as docs/allocator.md says."""

    rules = RULES[Kind.POOL]

    def free(self, index: SliceIndex) -> Mapping[str | None, Mapping[str, int]]:
        return index.free_pool()

    def pick(self, index: SliceIndex, wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        grant = index.pick_pool(wants, strategy)
        return grant if isinstance(grant, Refused) else Picked(grant.placement, grant.device)


class DynamicKind:
    """A new instance at the placement that keeps the most requests placeable."""

    rules = RULES[Kind.DYNAMIC]

    def free(self, index: SliceIndex) -> Mapping[str | None, Mapping[str, int]]:
        return index.free_dynamic()

    def pick(self, index: SliceIndex, wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        placed = index.pick_dynamic(wants, strategy, demand)
        return placed if isinstance(placed, Refused) else Picked(placed)


class WholeGpuKind:
    """A whole GPU with MIG off: its placement is all of its memory slices, so that a
    lease of it and a lease of any slice of it can never both be stored."""

    rules = RULES[Kind.GPU]

    def free(self, index: SliceIndex) -> Mapping[str | None, Mapping[str, int]]:
        # A model none of whose GPUs has MIG off is never offered whole: not even a 0.
        return {key: {WHOLE_GPU: n} for key, n in index.free_whole().items() if n is not None}

    def pick(self, index: SliceIndex, wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None) -> Picked | Refused:
        # Lowest index first: whole GPUs are alike, and the order is stable for users.
        gpu = index.whole_gpu(wants)
        if gpu is not None:
            size = model(gpu.model_key or "").memory_slices
            return Picked(Placement(gpu.index, gpu.uuid, WHOLE_GPU, 0, size))
        mine, off = index.whole_gpus(wants)
        if not off:
            detail = (f"no GPU here has MIG off ({plural(mine, 'GPU')} of that model, "
                      "all with MIG on); an admin turns it off with 'nvidia-smi -mig 0'")
        else:
            detail = f"every GPU with MIG off is in use ({plural(off, 'GPU')})"
        return Refused(Reason.NONE_FREE, f"no whole GPU free: {detail}")


#: The kinds placed on this host, by name.
HOST_KINDS: Mapping[Kind, HostKind] = {
    Kind.POOL: PoolKind(), Kind.DYNAMIC: DynamicKind(), Kind.GPU: WholeGpuKind(),
}


def offer_kind(whole: bool, mode: str) -> HostKind:
    """The kind of slice a claim gets on a host whose spawner makes ``mode`` slices (a
    ``mig_mode`` or a kind's name): a whole GPU for an offer of one (``whole``), else the
    spawner's kind."""
    return HOST_KINDS[Kind.GPU] if whole else host_kind(mode)


def offered_kinds(mode: str) -> tuple[HostKind, ...]:
    """The kinds a host whose spawner makes ``mode`` slices offers on its form: its own,
    and whole GPUs beside them (a host may have GPUs with MIG on and off)."""
    return tuple(dict.fromkeys((host_kind(mode), HOST_KINDS[Kind.GPU])))


def host_kind(name: str) -> HostKind:
    """The host kind stored as ``name`` (``ValueError`` for any other)."""
    try:
        return HOST_KINDS[Kind(name)]
    except (ValueError, KeyError):
        raise ValueError(
            f"a slice kind on this host is one of {', '.join(HOST_KINDS)}, not {name!r}"
        ) from None
