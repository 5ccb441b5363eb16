"""Play a request history through the allocator on a given MIG layout, and count refusals.

A :class:`Fleet` is one :class:`GpuLayout` per GPU (model and instances per profile).
:func:`layout_inventory` lays it out as NVIDIA's placement rules allow, using the
allocator's own placement choice, and returns the :class:`Inventory` a host with that
layout would report; :func:`replay_pool` then grants each request with
:meth:`~mig_spawner.core.allocator.SliceIndex.pick_pool` exactly as the spawner does, and
:func:`replay_dynamic` with :meth:`~mig_spawner.core.allocator.SliceIndex.pick_dynamic`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from mig_spawner.core.allocator import Occupancy, Placement, PoolGrant, SliceIndex
from mig_spawner.core.catalog import CatalogError, model
from mig_spawner.core.inventory import Gpu, GpuInstance, Inventory, MigDevice
from mig_spawner.report.demand import Request

REPLAY_HOST = "replay"


class LayoutError(ValueError):
    """A layout that cannot be laid on its GPU (too many slices, caps, two ``+me``)."""


@dataclass(frozen=True)
class GpuLayout:
    """One GPU (its index on the host), its model and its instances per profile."""

    gpu_index: int
    model_key: str
    devices: Mapping[str, int] = field(default_factory=dict, hash=False)

    def key(self) -> tuple[str, tuple[tuple[str, int], ...]]:
        """What the GPU carries, hashable (model + sorted non-zero counts), index left out."""
        return self.model_key, tuple(sorted((p, n) for p, n in self.devices.items() if n))

    def with_devices(self, devices: Mapping[str, int]) -> GpuLayout:
        """The same GPU carrying ``devices`` instead."""
        return GpuLayout(self.gpu_index, self.model_key, dict(devices))

    def describe(self) -> str:
        """``3g.71gb + 2g.35gb + 2x 1g.18gb``, biggest first."""
        gpu = model(self.model_key)
        items = sorted(((n, p) for p, n in self.devices.items() if n),
                       key=lambda item: (-gpu.profile(item[1]).placement_size, item[1]))
        return " + ".join(p if n == 1 else f"{n}x {p}" for n, p in items) or "(empty)"


Fleet = tuple[GpuLayout, ...]


@dataclass(frozen=True)
class ReplayResult:
    """How a layout fared: requests served and refused, refusals per profile, and which
    requests (indexes into the replayed sequence) were refused."""

    served: int
    refused: int
    refused_by_profile: Mapping[str, int]
    refused_requests: tuple[int, ...] = ()

    @property
    def requests(self) -> int:
        return self.served + self.refused


def fleet_of(inventory: Inventory) -> Fleet:
    """The layout a host has now: instances per profile on each GPU in MIG mode that the
    catalog knows. GPUs with MIG off are left out: they serve as whole GPUs on purpose."""
    return tuple(
        GpuLayout(g.index, g.model_key, dict(Counter(gi.profile for gi in g.gpu_instances)))
        for g in inventory.gpus
        if g.model_key is not None and g.mig_enabled
    )


def _empty_gpu(index: int, model_key: str) -> Gpu:
    gpu = model(model_key)
    return Gpu(index=index, uuid=f"GPU-{REPLAY_HOST}-{index}", product=gpu.product_names[0],
               model_key=gpu.key, minor=index, memory_total_mib=gpu.memory_mib,
               mig_current=True, mig_pending=True)


def _placements(index: int, layout: GpuLayout) -> list[Placement]:
    """Valid placements for ``layout`` on one GPU, biggest profiles first."""
    gpu = model(layout.model_key)
    occupancy = Occupancy.of(Inventory(REPLAY_HOST, "", "", 0, (_empty_gpu(index, gpu.key),)))
    wanted = sorted(
        ((gpu.profile(p), n) for p, n in layout.devices.items() if n),
        key=lambda item: (-item[0].placement_size, item[0].name),
    )
    placed = []
    for profile, count in wanted:
        for _ in range(count):
            choice = occupancy.pick_dynamic(profile.name)
            if not isinstance(choice, Placement):
                raise LayoutError(
                    f"GPU {index} ({gpu.display_name}) cannot hold {layout.describe()}: "
                    f"{choice.message}")
            occupancy = occupancy.place(choice)
            placed.append(choice)
    return placed


def layout_inventory(fleet: Fleet) -> Inventory:
    """The inventory of a host whose GPUs carry ``fleet`` (GPU ``i`` gets ``fleet[i]``;
    the GPUs' real indexes do not matter to a replay)."""
    gpus = []
    for index, layout in enumerate(fleet):
        gpu = model(layout.model_key)
        instances, devices = [], []
        for slot, p in enumerate(sorted(_placements(index, layout), key=lambda p: p.start)):
            profile = gpu.profile(p.profile)
            gi_id = slot + 1  # unique per GPU; real boards number instances their own way
            instances.append(GpuInstance(gi_id, profile.name, profile.profile_id, p.start,
                                         p.size))
            devices.append(MigDevice(
                uuid=f"MIG-{REPLAY_HOST}-{index}-{gi_id}", gpu_index=index, gpu_uuid=p.gpu_uuid,
                index=slot, name=f"{gpu.product_names[0]} MIG {profile.name}",
                profile=profile.name, gi_id=gi_id, ci_id=0, start=p.start, size=p.size,
                memory_total_mib=profile.memory_mib, memory_used_mib=0,
            ))
        gpus.append(replace(_empty_gpu(index, gpu.key), gpu_instances=tuple(instances),
                            mig_devices=tuple(devices)))
    return Inventory(REPLAY_HOST, "", "", 0, tuple(gpus))


def _events(requests: Sequence[Request]) -> list[tuple[object, int, int]]:
    """(time, 0 = leave / 1 = arrive, request index): leaving at t frees before arriving at t."""
    events = []
    for n, q in enumerate(requests):
        events.append((q.arrive, 1, n))
        events.append((q.leave, 0, n))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    return events


def replay_pool(inventory: Inventory, requests: Sequence[Request]) -> ReplayResult:
    """Grant ``requests`` in time order from the pool ``inventory``, as the spawner would
    (one allocator index, told each grant and release)."""
    index = SliceIndex(inventory)
    granted: set[int] = set()
    refused: Counter[str] = Counter()
    refused_requests: list[int] = []
    for _, arriving, n in _events(requests):
        if not arriving:
            if n in granted:
                granted.discard(n)
                index.drop(n)
            continue
        try:
            grant = index.pick_pool(requests[n].profile)
        except CatalogError:
            grant = None  # a profile no GPU model has: nothing could serve it
        if isinstance(grant, PoolGrant):
            index.hold(n, grant.uuid)
            granted.add(n)
        else:
            refused[requests[n].profile] += 1
            refused_requests.append(n)
    total = sum(refused.values())
    return ReplayResult(len(requests) - total, total, dict(refused), tuple(refused_requests))


def replay_dynamic(model_keys: Iterable[str], requests: Sequence[Request]) -> ReplayResult:
    """Grant ``requests`` in dynamic mode (an instance created per request) on empty GPUs."""
    empty = tuple(_empty_gpu(i, key) for i, key in enumerate(model_keys))
    index = SliceIndex(Inventory(REPLAY_HOST, "", "", 0, empty))
    granted: set[int] = set()
    refused: Counter[str] = Counter()
    refused_requests: list[int] = []
    for _, arriving, n in _events(requests):
        if not arriving:
            if n in granted:
                granted.discard(n)
                index.drop(n)
            continue
        try:
            choice = index.pick_dynamic(requests[n].profile)
        except CatalogError:
            choice = None
        if isinstance(choice, Placement):
            index.hold(n, placement=choice)
            granted.add(n)
        else:
            refused[requests[n].profile] += 1
            refused_requests.append(n)
    total = sum(refused.values())
    return ReplayResult(len(requests) - total, total, dict(refused), tuple(refused_requests))
