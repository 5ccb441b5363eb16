"""Allocator properties on random fleets and random request/release sequences.

Every decision is checked against NVIDIA's rules and, when refused, against a brute
force search over every GPU and start: a refusal only when truly nothing fits.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mig_spawner.core.allocator import Placement, PoolGrant, pick_dynamic, pick_pool
from mig_spawner.core.catalog import model
from mig_spawner.core.inventory import Gpu, GpuInstance, Inventory
from mig_spawner.core.refusal import Refused
from tests.mocking import make_gpu, make_inventory

# A30 twice: its two +me profiles are where the one-media-instance rule bites.
MODEL_KEYS = ("h200", "h100", "a30", "a30", "a100-40gb")
MIG_STATES = ((True, True), (True, True), (True, True), (False, False), (False, True))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fleets(draw: st.DrawFn) -> list[tuple[str, tuple[bool, bool]]]:
    n = draw(st.integers(1, 3))
    return [(draw(st.sampled_from(MODEL_KEYS)), draw(st.sampled_from(MIG_STATES)))
            for _ in range(n)]


# One step: ("req", which profile, strategy, create the instance now?) or ("rel", which held).
steps = st.lists(
    st.one_of(
        st.tuples(st.just("req"), st.integers(0, 99), st.sampled_from(["pack", "spread"]),
                  st.booleans()),
        st.tuples(st.just("rel"), st.integers(0, 99), st.just(""), st.just(False)),
    ),
    min_size=1, max_size=25,
)


def with_instances(gpu: Gpu, placed: list[Placement]) -> Gpu:
    m = model(gpu.model_key or "")
    mine = [p for p in placed if p.gpu_uuid == gpu.uuid]
    gis = tuple(  # IDs unique but arbitrary: boards number instances differently
        GpuInstance(n + 1, p.profile, m.profile(p.profile).profile_id, p.start, p.size)
        for n, p in enumerate(mine)
    )
    return replace(gpu, gpu_instances=gis)


def taken_on(gpu: Gpu, held: list[Placement]) -> list[tuple[str, int, int]]:
    return [(p.profile, p.start, p.size) for p in held if p.gpu_uuid == gpu.uuid]


def fits(gpu: Gpu, name: str, start: int, held: list[Placement]) -> bool:
    """NVIDIA's rules, written out plainly (independent of the allocator's bitmasks)."""
    if not gpu.mig_enabled or gpu.model_key is None:
        return False
    m = model(gpu.model_key)
    if not m.has_profile(name):
        return False
    prof = m.profile(name)
    taken = taken_on(gpu, held)
    if start not in prof.placement_starts:
        return False
    slices = set(range(start, start + prof.placement_size))
    if any(slices & set(range(s, s + z)) for _, s, z in taken):
        return False
    if sum(1 for n, _, _ in taken if n == prof.name) >= prof.max_instances:
        return False
    return not (prof.media_extensions and any(m.profile(n).media_extensions for n, _, _ in taken))


def check_rules(inv: Inventory, held: list[Placement]) -> None:
    for gpu in inv.gpus:
        mine: list[Placement] = []
        for p in (p for p in held if p.gpu_uuid == gpu.uuid):
            assert fits(gpu, p.profile, p.start, mine), (p, mine)
            mine.append(p)


@SETTINGS
@given(fleet=fleets(), plan=steps)
def test_dynamic_sequences_follow_the_rules(fleet: list, plan: list) -> None:
    base = [make_gpu(i, key, mig=mig) for i, (key, mig) in enumerate(fleet)]
    names = sorted({p.name for key, _ in fleet for p in model(key).profiles})
    held: list[Placement] = []  # granted, in order
    created: list[Placement] = []  # the subset whose instance exists
    for kind, pick, strategy, create in plan:
        if kind == "rel":
            if held:
                gone = held.pop(pick % len(held))
                if gone in created:
                    created.remove(gone)
            continue
        inv = make_inventory(*(with_instances(g, created) for g in base))
        reserved = [p for p in held if p not in created]
        name = names[pick % len(names)]
        got = pick_dynamic(inv, reserved, name, strategy)
        # Deterministic, and blind to the order of the ledger's claims and of the GPUs.
        assert pick_dynamic(inv, list(reversed(reserved)), name, strategy) == got
        backwards = replace(inv, gpus=tuple(reversed(inv.gpus)))
        assert pick_dynamic(backwards, reserved, name, strategy) == got
        if isinstance(got, Refused):
            assert not any(fits(g, name, s, held) for g in inv.gpus for s in range(8)), got
            assert name in got.message
        else:
            gpu = inv.gpus[got.gpu_index]
            assert gpu.uuid == got.gpu_uuid and got.profile == name
            assert got.size == model(gpu.model_key or "").profile(name).placement_size
            assert fits(gpu, name, got.start, held)
            held.append(got)
            if create:
                created.append(got)
        check_rules(inv, held)


@st.composite
def pool_fleets(draw: st.DrawFn) -> tuple[Inventory, set[str], str]:
    """GPUs pre-partitioned by random valid layouts, some devices leased or busy."""
    gpus = []
    for i, (key, mig) in enumerate(draw(fleets())):
        m = model(key)
        layout: list[Placement] = []
        for _ in range(draw(st.integers(0, 7))):
            prof = draw(st.sampled_from(m.profiles))
            start = draw(st.sampled_from(prof.placement_starts))
            gpu = make_gpu(i, key)
            if fits(gpu, prof.name, start, layout):
                layout.append(Placement(i, gpu.uuid, prof.name, start, prof.placement_size))
        busy = draw(st.sets(st.integers(0, 7), max_size=2))
        gpus.append(make_gpu(i, key, [(p.profile, p.start) for p in layout], mig=mig,
                             busy_starts=busy))
    inv = make_inventory(*gpus)
    uuids = sorted(d.uuid for d in inv.mig_devices)
    held = draw(st.sets(st.sampled_from(uuids), max_size=len(uuids))) if uuids else set()
    names = sorted({p.name for g in gpus for p in model(g.model_key or "").profiles})
    return inv, held, draw(st.sampled_from(names))


@SETTINGS
@given(case=pool_fleets(), strategy=st.sampled_from(["pack", "spread"]))
def test_pool_grants_only_free_devices_and_refuses_only_when_none(
    case: tuple[Inventory, set[str], str], strategy: str
) -> None:
    inv, held, name = case
    free = [d for g in inv.gpus if g.mig_enabled for d in g.mig_devices
            if d.profile == name and d.uuid not in held and not d.processes]
    got = pick_pool(inv, held, name, strategy)  # type: ignore[arg-type]
    backwards = replace(inv, gpus=tuple(reversed(inv.gpus)))
    assert pick_pool(backwards, set(held), name, strategy) == got  # type: ignore[arg-type]
    if not free:
        assert isinstance(got, Refused) and name in got.message
        return
    assert isinstance(got, PoolGrant) and got.device in free

    def taken(gpu_index: int) -> int:
        return sum(d.size for d in inv.gpus[gpu_index].mig_devices
                   if d.uuid in held or d.processes)

    loads = {taken(d.gpu_index) for d in free}
    assert taken(got.device.gpu_index) == (max(loads) if strategy == "pack" else min(loads))
