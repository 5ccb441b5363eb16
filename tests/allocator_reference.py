"""The allocator as it was before its index: one full pass over the inventory per decision.

The product keeps only the index (:class:`mig_spawner.core.allocator.SliceIndex`); this
is the reference it must agree with (``tests/test_allocator_index.py``) and the baseline
``benchmarks/allocator.py`` measures it against: ``pick_pool``'s loop over every device,
``Occupancy.of`` rebuilt from the inventory per call, the whole-GPU scan, and the kinds'
hold rules, as they were.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from mig_spawner.core.allocator import HeldLease, Placement, PoolGrant
from mig_spawner.core.allocator.dynamic import _shares
from mig_spawner.core.allocator.refusals import GpuView, no_capacity, none_free, plural, precheck
from mig_spawner.core.allocator.request import KNOWN_KEYS, gpu_view, key_of, mig_state
from mig_spawner.core.allocator.tables import table
from mig_spawner.core.catalog import WHOLE_GPU, model
from mig_spawner.core.inventory import Gpu, Inventory
from mig_spawner.core.kinds import Kind
from mig_spawner.core.refusal import Reason, Refused


def ref_pool_free(inventory: Inventory, held: Collection[str]) -> dict[str, int]:
    free: Counter[str] = Counter()
    for g in inventory.gpus:
        if g.mig_enabled:
            for d in g.mig_devices:
                if d.uuid not in held and not d.processes:
                    free[d.profile] += 1
    return dict(free)


def ref_pick_pool(inventory: Inventory, held: Collection[str], wants: Mapping[str, str],
                  strategy: str) -> PoolGrant | Refused:
    spread = strategy == "spread"
    best = None
    for g in inventory.gpus:
        name = wants.get(g.model_key or "")
        if name is None or not (g.mig_current and g.mig_pending):
            continue
        taken = 0
        found = None
        for d in g.mig_devices:
            if d.uuid in held or d.processes:
                taken += d.size
            elif d.profile == name and (found is None or d.start < found.start):
                found = d
        if found is not None:
            rank = (taken if spread else -taken, g.index)
            if best is None or rank < best[0]:
                best = (rank, found)
    if best is not None:
        return PoolGrant(best[1])
    free = ref_pool_free(inventory, held)
    views = [gpu_view(g) for g in inventory.gpus]
    usable, refusal = precheck(views, wants, free)
    if refusal is not None:
        return refusal
    on = {v.index for v in usable}
    devices = [d for g in inventory.gpus if g.index in on
               for d in g.mig_devices if d.profile == wants[key_of(g)]]
    leased = sum(1 for d in devices if d.uuid in held)
    eligible = sum(1 for v in views if v.model_key in wants)
    return none_free(wants, len(usable), eligible, len(devices), leased,
                     len(devices) - leased, free)


def ref_rows(inventory: Inventory, reserved: Iterable[Placement]) -> list[tuple]:
    """Occupancy.of as it was: (index, uuid, (key, mig, used, packed counts)) per GPU."""
    pending: dict[str, list] = defaultdict(list)
    for r in reserved:
        pending[r.gpu_uuid].append(r)
    rows = []
    append = rows.append
    tables: dict = {}
    for g in inventory.gpus:
        key = g.model_key
        t = tables.get(key, tables)
        if t is tables:
            t = tables[key] = table(key) if key in KNOWN_KEYS else None
        mig = mig_state(g)
        if t is None or not g.mig_supported:
            append((g.index, g.uuid, (None, mig, 0, 0)))
            continue
        inc = t.pack_by_id
        used = code = 0
        for gi in g.gpu_instances:
            used |= ((1 << gi.size) - 1) << gi.start
            code += inc.get(gi.profile_id, 0)
        for r in pending.get(g.uuid, ()) if pending else ():
            if any(gi.start == r.start and gi.size == r.size for gi in g.gpu_instances):
                continue
            used |= ((1 << r.size) - 1) << r.start
            slot = t.by_name.get(r.profile)
            if slot is not None:
                code += t.pack_one[slot.index]
        append((g.index, g.uuid, (key, mig, used, code)))
    return rows


def ref_dynamic_free(rows: list[tuple]) -> dict[str, int]:
    free: Counter[str] = Counter()
    for _, _, (key, mig, used, code) in rows:
        if key is not None and mig == "on":
            t = table(key)
            for p in t.profiles:
                free[p.name] += t.room(p, used, t.unpack(code))
    return dict(free)


def ref_pick_dynamic(inventory: Inventory, reserved: Iterable[Placement],
                     wants: Mapping[str, str], strategy: str,
                     demand: Mapping[str, float] | None) -> Placement | Refused:
    rows = ref_rows(inventory, reserved)
    firsts: dict[tuple, tuple] = {}
    for row in rows:
        seen = firsts.get(row[2])
        if seen is None or row[0] < seen[0]:
            firsts[row[2]] = row
    shares = _shares(demand)
    spread = strategy == "spread"
    slots = {key: table(key).by_name[name] for key, name in wants.items()}
    weights = {key: table(key).weights(shares) for key in wants}
    best = None
    for (key, mig, used, code), row in firsts.items():
        if key is None or key not in slots or mig != "on":
            continue
        t = table(key)
        choice = t.choose(slots[key], used, t.unpack(code), weights[key])
        if isinstance(choice, str):
            continue
        loss, start = choice
        busy = used.bit_count()
        rank = (busy, loss, row[0]) if spread else (busy == 0, loss, -busy, row[0])
        if best is None or rank < best[0]:
            best = (rank, row, start)
    if best is not None:
        _, row, start = best
        p = slots[row[2][0]]
        return Placement(row[0], row[1], p.name, start, p.size)
    free = ref_dynamic_free(rows)
    views = [GpuView(i, key, mig) for i, _, (key, mig, _, _) in rows]
    usable, refusal = precheck(views, wants, free)
    if refusal is not None:
        return refusal
    whys: Counter[str] = Counter()
    for _, _, (key, mig, used, code) in rows:
        if key in wants and mig == "on":
            t = table(key)
            whys[str(t.choose(t.by_name[wants[key]], used, t.unpack(code), t.uniform))] += 1
    eligible = sum(1 for v in views if v.model_key in wants)
    return no_capacity(wants, len(usable), eligible, whys, free)


def ref_whole_free(g: Gpu, covered: Collection[str]) -> bool:
    return (g.model_key is not None and not g.mig_current and not g.mig_pending
            and g.uuid not in covered)


def ref_pick_whole(inventory: Inventory, reserved: Iterable[Placement],
                   wants: Mapping[str, str]) -> Placement | Refused:
    covered = {p.gpu_uuid for p in reserved}
    mine = [g for g in inventory.gpus if g.model_key in wants]
    gpu = next((g for g in sorted(mine, key=lambda g: g.index) if ref_whole_free(g, covered)),
               None)
    if gpu is not None:
        return Placement(gpu.index, gpu.uuid, WHOLE_GPU, 0, model(gpu.model_key).memory_slices)
    off = [g for g in mine if not g.mig_current]
    if not off:
        detail = (f"no GPU here has MIG off ({plural(len(mine), 'GPU')} of that model, "
                  "all with MIG on); an admin turns it off with 'nvidia-smi -mig 0'")
    else:
        detail = f"every GPU with MIG off is in use ({plural(len(off), 'GPU')})"
    return Refused(Reason.NONE_FREE, f"no whole GPU free: {detail}")


def ref_held_devices(inventory: Inventory, holds: Mapping) -> frozenset[str]:
    """Pool: the instances on slices a layout change holds are taken."""
    return frozenset(
        d.uuid for g in inventory.gpus if (held := holds.get((inventory.host, g.uuid)))
        for d in g.mig_devices if not held.isdisjoint(range(d.start, d.start + d.size)))


def ref_without_held(inventory: Inventory, holds: Mapping) -> Inventory:
    """Dynamic and whole GPUs: a GPU with any held slice offers nothing."""
    return replace(inventory, gpus=tuple(g for g in inventory.gpus
                                         if not holds.get((inventory.host, g.uuid))))


def ref_reserved(leases: Iterable[HeldLease], host: str) -> list[Placement]:
    return [Placement(x.gpu_index, x.gpu_uuid, x.profile, x.start, x.size) for x in leases
            if x.host == host and x.gpu_uuid and x.gpu_index is not None
            and x.start is not None and x.size is not None]


def ref_pick(kind: Kind, inventory: Inventory, leases: list[HeldLease], holds: Mapping,
             wants: Mapping[str, str], strategy: str, demand: Mapping[str, float] | None
             ) -> object:
    taken = {x.mig_uuid for x in leases if x.mig_uuid}
    reserved = ref_reserved(leases, inventory.host)
    if kind is Kind.POOL:
        grant = ref_pick_pool(inventory, taken | ref_held_devices(inventory, holds), wants,
                              strategy)
        return grant if isinstance(grant, Refused) else grant.placement
    unheld = ref_without_held(inventory, holds)
    if kind is Kind.DYNAMIC:
        return ref_pick_dynamic(unheld, reserved, wants, strategy, demand)
    return ref_pick_whole(unheld, reserved, wants)


def ref_free_now(inventory: Inventory, leases: list[HeldLease], mode: str,
                 holds: Mapping) -> dict[str, dict[str, int]]:
    taken = {x.mig_uuid for x in leases if x.mig_uuid}
    reserved = ref_reserved(leases, inventory.host)
    out = {}
    for key in sorted({g.model_key for g in inventory.gpus if g.model_key}):
        mine = replace(inventory, gpus=tuple(g for g in inventory.gpus if g.model_key == key))
        if mode == "pool":
            free = ref_pool_free(mine, taken | ref_held_devices(mine, holds))
        else:
            free = ref_dynamic_free(ref_rows(ref_without_held(mine, holds), reserved))
        unheld = ref_without_held(mine, holds)
        if any(g.model_key and not g.mig_current for g in unheld.gpus):
            covered = {p.gpu_uuid for p in reserved}
            free[WHOLE_GPU] = sum(ref_whole_free(g, covered) for g in unheld.gpus)
        out[key] = free
    return out
