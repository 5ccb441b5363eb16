"""Allocator benchmark: decision latency and dynamic-mode acceptance.

Run from the repository root (the baseline is the test suite's reference,
``tests.allocator_reference``): ``nice .venv/bin/python -m benchmarks.allocator`` (a few
minutes on 2 cores).

(a) Latency of a decision at 1,000, 10,000 and 50,000 GPUs, pool and dynamic: the
    product's indexed allocator (``SliceIndex``, kept across decisions as the spawner
    keeps it: each decision picks and counts its grant, and an earlier grant is released
    so that the fleet stays half used) against the allocator as it was, one full pass
    over the inventory per decision (``tests/allocator_reference.py``), in the same
    process on the same fleet and requests. Also: building the index, and taking a new
    read of the GPUs in which one GPU changed.
(b) Acceptance of dynamic placement against the driver's own order (what a spawner gets
    when it creates an instance without a placement) and first-fit (lowest GPU, lowest
    start), on one seeded random process of requests and releases:

    * 1 GPU, exact: expected accepted requests by dynamic programming over every
      reachable layout. "Optimum" = the best *online* policy, which knows the request mix
      but not the future, and must accept every request that fits somewhere (as all the
      policies here do). A clairvoyant offline choice is no fair yardstick: it knows which
      instance leaves first, which no spawner does.
    * 8 and 64 GPUs, simulated: the same process, common random numbers, ratios only.
"""

from __future__ import annotations

import gc
import itertools
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from mig_spawner.core.allocator import (
    GpuSlots,
    Occupancy,
    Placement,
    PoolGrant,
    SliceIndex,
)
from mig_spawner.core.allocator.request import resolve
from mig_spawner.core.allocator.tables import table
from mig_spawner.core.catalog import model
from mig_spawner.core.inventory import Gpu, GpuInstance, GpuProcess, Inventory, MigDevice
from mig_spawner.core.refusal import Refused
from tests.allocator_reference import ref_pick_dynamic, ref_pick_pool

# --- (a) latency ----------------------------------------------------------------------

# Half-occupied H200 layouts: (profile, start) of the instances already there.
_HALF = (
    (("3g.71gb", 0),),
    (("2g.35gb", 0), ("1g.18gb", 2), ("1g.18gb", 3)),
    (("1g.35gb", 6), ("2g.35gb", 4)),
    (("1g.18gb", 0), ("1g.18gb", 1), ("1g.18gb+me", 2), ("1g.18gb", 3)),
    (("4g.71gb", 0),),
)
# A pool layout an admin might make: 1g.18gb x3, 2g.35gb at 4 (idle: 1g.35gb at 6 too).
_POOL = (("1g.18gb", 0), ("1g.18gb", 1), ("1g.18gb", 2), ("2g.35gb", 4), ("1g.35gb", 6))


def _gpu(index: int, layout: tuple[tuple[str, int], ...]) -> Gpu:
    m = model("h200")
    uuid = f"GPU-{index:08d}-0000-0000-0000-000000000000"
    gis, devs = [], []
    for n, (name, start) in enumerate(layout):
        p = m.profile(name)
        gi = n + 1  # any unique ID: boards number instances differently
        gis.append(GpuInstance(gi, p.name, p.profile_id, start, p.placement_size))
        devs.append(MigDevice(f"MIG-{index:08d}-{n:04d}", index, uuid, n, f"NVIDIA H200 MIG {name}",
                              p.name, gi, 0, start, p.placement_size, p.memory_mib, 0))
    return Gpu(index, uuid, "NVIDIA H200", "h200", index, m.memory_mib, True, True,
               gpu_instances=tuple(gis), mig_devices=tuple(devs))


def _fleet(n: int, pool: bool) -> tuple[Inventory, set[str]]:
    gpus = tuple(_gpu(i, _POOL if pool else _HALF[i % len(_HALF)]) for i in range(n))
    held = {d.uuid for g in gpus for d in g.mig_devices[:3]} if pool else set()
    return Inventory("bench", "580.65", "13.580", 13000, gpus), held


def _time(decide: Callable[[], object], reps: int) -> tuple[float, float]:
    decide()  # warm the per-model tables and memo, as a running hub has them
    samples = []
    gc.collect()
    gc.disable()  # as timeit does: a collection pause belongs to whoever allocated most
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            decide()
            samples.append((time.perf_counter() - t0) * 1000)
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples), samples[int(0.95 * (len(samples) - 1))]


# Requests cycle through these (H200), so that grants land on different GPUs and states.
_ASKS = ("2g.35gb", "1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb")


def _pool_deciders(inventory: Inventory, held: set[str]
                   ) -> tuple[Callable[[], object], Callable[[], object]]:
    """(indexed, full pass): one pool decision each, its grant counted and an earlier
    grant released, on fleets that start alike."""
    index = SliceIndex(inventory)
    for uuid in held:
        index.hold(uuid, uuid)
    ref_held = set(held)
    asks = itertools.cycle(_ASKS)
    mine: list[str] = []
    theirs: list[str] = []

    def indexed() -> object:
        got = index.pick_pool(next(asks))
        if isinstance(got, PoolGrant):
            index.hold(got.uuid, got.uuid)
            mine.append(got.uuid)
        if len(mine) > 20:
            index.drop(mine.pop(0))
        return got

    def full_pass() -> object:
        got = ref_pick_pool(inventory, ref_held, resolve(next(asks)), "pack")
        if isinstance(got, PoolGrant):
            ref_held.add(got.uuid)
            theirs.append(got.uuid)
        if len(theirs) > 20:
            ref_held.discard(theirs.pop(0))
        return got

    return indexed, full_pass


def _dynamic_deciders(inventory: Inventory
                      ) -> tuple[Callable[[], object], Callable[[], object]]:
    index = SliceIndex(inventory)
    asks = itertools.cycle(_ASKS)
    mine: list[tuple[int, Placement]] = []
    theirs: list[Placement] = []
    ids = itertools.count()

    def indexed() -> object:
        got = index.pick_dynamic(next(asks))
        if isinstance(got, Placement):
            key = next(ids)
            index.hold(key, placement=got)
            mine.append((key, got))
        if len(mine) > 20:
            index.drop(mine.pop(0)[0])
        return got

    def full_pass() -> object:
        got = ref_pick_dynamic(inventory, theirs, resolve(next(asks)), "pack", None)
        if isinstance(got, Placement):
            theirs.append(got)
        if len(theirs) > 20:
            theirs.pop(0)
        return got

    return indexed, full_pass


def latency() -> None:
    print("(a) one decision (pick, count the grant, release an earlier one), H200 fleet at "
          "half occupancy;\n    indexed = SliceIndex kept across decisions, full pass = the "
          "allocator before the index (ms)")
    print(f"{'GPUs':>7} {'mode':8} {'indexed med':>11} {'p95':>7} {'full pass med':>13} "
          f"{'p95':>7} {'ratio':>7} {'build ms':>9} {'new read ms':>11}")
    for n in (1000, 10000, 50000):
        for mode in ("pool", "dynamic"):
            inventory, held = _fleet(n, pool=mode == "pool")
            t0 = time.perf_counter()
            indexed, full_pass = (_pool_deciders(inventory, held) if mode == "pool"
                                  else _dynamic_deciders(inventory))
            indexed()  # the first decision builds the view it reads
            build = (time.perf_counter() - t0) * 1000
            im, ip = _time(indexed, 400)
            fm, fp = _time(full_pass, 100 if n <= 1000 else 20 if n <= 10000 else 5)
            # A new read of the GPUs in which one GPU changed (a process started there).
            index = SliceIndex(inventory)
            index.pick_pool("1g.18gb") if mode == "pool" else index.pick_dynamic("1g.18gb")
            first = inventory.gpus[0]
            busy = replace(first.mig_devices[-1], processes=(GpuProcess(1, 1),))
            changed = replace(inventory, gpus=(replace(first, mig_devices=(
                *first.mig_devices[:-1], busy)), *inventory.gpus[1:]))
            t0 = time.perf_counter()
            index.refresh(changed)
            reread = (time.perf_counter() - t0) * 1000
            print(f"{n:>7} {mode:8} {im:>11.3f} {ip:>7.3f} {fm:>13.3f} {fp:>7.3f} "
                  f"{fm / im:>6.0f}x {build:>9.0f} {reread:>11.0f}")
            del inventory, held, indexed, full_pass, index, changed
            gc.collect()


# --- (b) acceptance -------------------------------------------------------------------

Chooser = Callable[[Occupancy, str], Placement | None]
MIXES = {  # share of requests per profile, in catalog order (1g, 1g+me, 1g2m, 2g, 3g, 4g, 7g)
    "mixed": (30, 5, 15, 20, 15, 5, 10),
    "small": (50, 5, 20, 15, 5, 3, 2),
    "big": (20, 2, 10, 20, 25, 8, 15),
    "2g+3g": (0, 0, 0, 50, 50, 0, 0),
}
RELEASE = 0.35  # chance that a step releases a random held instance (when any is held)
STEPS = 40


def ours(demand: Mapping[str, float] | None) -> Chooser:
    def choose(occ: Occupancy, name: str) -> Placement | None:
        got = occ.pick_dynamic(name, demand=demand)
        return None if isinstance(got, Refused) else got
    return choose


def in_order(driver: bool) -> Chooser:
    """Lowest GPU first; starts in the driver's order, or ascending (first-fit)."""
    def choose(occ: Occupancy, name: str) -> Placement | None:
        for g in occ.gpus:
            t = table(g.model_key or "")
            p = t.by_name[name]
            if t.blocked(p, g.counts):
                continue
            prof = t.model.profile(name)
            starts = t.model.driver_starts(prof) if driver else prof.placement_starts
            for s in starts:
                if not g.used & (((1 << p.size) - 1) << s):
                    return Placement(g.index, g.uuid, name, s, p.size)
        return None
    return choose


def _empty(key: str, n: int) -> Occupancy:
    zero = table(key).zero_counts
    return Occupancy(tuple(GpuSlots(i, f"GPU-{i}", key, "on", 0, zero) for i in range(n)))


def exact_one_gpu(key: str, mix: dict[str, int], choosers: dict[str, Chooser | None]) -> dict:
    """Expected accepted requests in STEPS steps on one GPU, per policy (None = optimum)."""
    t = table(key)
    names = [n for n, w in mix.items() if w]
    total = sum(mix.values())
    # Every reachable layout: a sorted tuple of (profile index, start).
    layouts: dict[tuple, tuple[int, tuple[int, ...], dict[str, dict[int, tuple]], list]] = {}
    todo: list[tuple] = [()]
    while todo:
        lay = todo.pop()
        if lay in layouts:
            continue
        used, counts = 0, [0] * len(t.profiles)
        for pi, s in lay:
            used |= t.profiles[pi].masks[t.profiles[pi].starts.index(s)]
            counts[pi] += 1
        nxt: dict[str, dict[int, tuple]] = {}
        for name in names:
            p = t.by_name[name]
            nxt[name] = {} if t.blocked(p, tuple(counts)) else {
                s: tuple(sorted((*lay, (p.index, s)))) for s, m in zip(p.starts, p.masks,
                                                                       strict=True)
                if not used & m}
            todo.extend(nxt[name].values())
        rel = [lay[:i] + lay[i + 1:] for i in range(len(lay))]
        layouts[lay] = (used, tuple(counts), nxt, rel)
    out = {}
    for label, chooser in choosers.items():
        picks: dict[tuple[int, tuple[int, ...], str], int] = {}
        value = dict.fromkeys(layouts, 0.0)
        for _ in range(STEPS):
            new = {}
            for lay, (used, counts, nxt, rel) in layouts.items():
                req = 0.0
                for name in names:
                    opts = nxt[name]
                    if not opts:
                        best = value[lay]
                    elif chooser is None:
                        best = 1 + max(value[o] for o in opts.values())
                    else:
                        k = (used, counts, name)
                        if k not in picks:
                            occ = Occupancy((GpuSlots(0, "GPU-0", key, "on", used, counts),))
                            picks[k] = chooser(occ, name).start  # type: ignore[union-attr]
                        best = 1 + value[opts[picks[k]]]
                    req += mix[name] / total * best
                stay = sum(value[r] for r in rel) / len(rel) if rel else 0.0
                new[lay] = RELEASE * stay + (1 - RELEASE) * req if rel else req
            value = new
        out[label] = value[()]
    return out


def simulate(key: str, n: int, mix: dict[str, int], chooser: Chooser, seed: int,
             steps: int) -> int:
    """Accepted requests on ``n`` GPUs; same seed = same random numbers for every policy."""
    rng = random.Random(seed)
    names, weights = list(mix), list(mix.values())
    occ, held, accepted = _empty(key, n), [], 0
    for _ in range(steps):
        u, v, name = rng.random(), rng.random(), rng.choices(names, weights)[0]
        if held and u < RELEASE:
            occ = occ.release(held.pop(int(v * len(held))))
            continue
        got = chooser(occ, name)
        if got is not None:
            occ, accepted = occ.place(got), accepted + 1
            held.append(got)
    return accepted


def acceptance() -> None:
    print(f"\n(b1) 1 GPU, exact expected accepted requests in {STEPS} steps "
          f"(release chance {RELEASE}); ratio to the best online policy")
    print(f"{'model':6} {'mix':6} {'optimum':>8} {'ours':>7} {'ours+dem':>8} {'driver':>7} "
          f"{'first':>7}")
    for key in ("h100", "h200"):
        for label, shares in MIXES.items():
            mix = dict(zip(model(key).profile_names, shares, strict=True))
            r = exact_one_gpu(key, mix, {"opt": None, "ours": ours(None), "dem": ours(mix),
                                         "driver": in_order(True), "first": in_order(False)})
            print(f"{key:6} {label:6} {r['opt']:>8.3f} {r['ours'] / r['opt']:>7.4f} "
                  f"{r['dem'] / r['opt']:>8.4f} {r['driver'] / r['opt']:>7.4f} "
                  f"{r['first'] / r['opt']:>7.4f}")
    print("\n(b2) many GPUs, simulated (8 GPUs: 12 seeds x 400 steps, 64 GPUs: 4 seeds x 1500 "
          "steps);\n     accepted requests and ratio ours (no demand given) / baseline")
    print(f"{'model':6} {'GPUs':>4} {'mix':6} {'ours':>6} {'ours+dem':>8} {'driver':>6} "
          f"{'first':>6} {'vs driver':>9} {'vs first':>8}")
    for key in ("h100", "h200"):
        for n, steps, seeds in ((8, 400, 12), (64, 1500, 4)):
            for label, shares in MIXES.items():
                mix = dict(zip(model(key).profile_names, shares, strict=True))
                mix = {k: w for k, w in mix.items() if w}
                res = {name: sum(simulate(key, n, mix, c, s, steps) for s in range(seeds))
                       for name, c in (("ours", ours(None)), ("dem", ours(mix)),
                                       ("driver", in_order(True)), ("first", in_order(False)))}
                print(f"{key:6} {n:>4} {label:6} {res['ours']:>6} {res['dem']:>8} "
                      f"{res['driver']:>6} {res['first']:>6} "
                      f"{res['ours'] / res['driver']:>9.4f} {res['ours'] / res['first']:>8.4f}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    latency()
    acceptance()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
