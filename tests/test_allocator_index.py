"""The indexed allocator makes exactly the choices of a full pass over the inventory.

``SliceIndex`` keeps what decisions need and is told only what changed (leases claimed
and released, a layout change's holds, a new read of the GPUs). The reference is the
allocator as it was before the index (``tests/allocator_reference.py``): one pass over
every GPU and device per decision. One index is kept across random sequences of
claims (pool, dynamic, whole GPU), releases, holds, busy devices, created instances and
MIG mode changes on random fleets, as the spawner keeps it, and every choice, refusal
and free count must be the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mig_spawner.core.allocator import SliceIndex
from mig_spawner.core.allocator.request import resolve
from mig_spawner.core.catalog import WHOLE_GPU, model
from mig_spawner.core.inventory import Gpu, Inventory
from mig_spawner.core.kinds import HOST_KINDS, Kind
from mig_spawner.core.refusal import Refused
from mig_spawner.spawner.decide import free_now
from tests.allocator_reference import ref_free_now, ref_pick
from tests.mocking import make_gpu, make_inventory

HOST = "node1"  # make_inventory's host

# --- random fleets and sequences ---------------------------------------------------------

MODEL_KEYS = ("h200", "h100", "a30", "a30", "a100-40gb")
MIG_STATES = ((True, True),) * 5 + ((False, False),) * 2 + ((False, True), (True, False))


@dataclass(frozen=True)
class Lease:
    """What the index reads of a ledger lease."""

    id: str
    host: str | None
    mig_uuid: str | None
    gpu_uuid: str | None
    gpu_index: int | None
    profile: str
    start: int | None
    size: int | None


@dataclass
class GpuPlan:
    index: int
    key: str
    mig: tuple[bool, bool]
    layout: list[tuple[str, int]]  # instances an admin made, and the dynamic ones created
    busy: set[int]

    def gpu(self) -> Gpu:
        return make_gpu(self.index, self.key, self.layout, mig=self.mig, busy_starts=self.busy)


def fits(plan: GpuPlan, name: str, start: int) -> bool:
    m = model(plan.key)
    p = m.profile(name)
    slices = set(range(start, start + p.placement_size))
    taken = [(n, s) for n, s in plan.layout]
    if any(slices & set(range(s, s + m.profile(n).placement_size)) for n, s in taken):
        return False
    if sum(1 for n, _ in taken if n == p.name) >= p.max_instances:
        return False
    return not (p.media_extensions and any(m.profile(n).media_extensions for n, _ in taken))


def random_layout(draw: st.DrawFn, plan: GpuPlan) -> list[tuple[str, int]]:
    m = model(plan.key)
    for _ in range(draw(st.integers(0, 10))):
        prof = draw(st.sampled_from(m.profiles))
        start = draw(st.sampled_from(prof.placement_starts))
        if fits(plan, prof.name, start):
            plan.layout.append((prof.name, start))
    return plan.layout


@st.composite
def fleets(draw: st.DrawFn) -> list[GpuPlan]:
    n = draw(st.integers(1, 6))
    # Indexes unique (NVML's) but not in the inventory's order.
    indexes = draw(st.lists(st.integers(0, 15), min_size=n, max_size=n, unique=True))
    # Few models, and mostly one layout per model as an admin's mig-parted config makes
    # it, so that several GPUs compete for one request.
    keys = draw(st.lists(st.sampled_from(MODEL_KEYS), min_size=1, max_size=2))
    templates = {key: random_layout(draw, GpuPlan(0, key, (True, True), [], set()))
                 for key in keys}
    plans = []
    for index in indexes:
        key = draw(st.sampled_from(keys))
        plan = GpuPlan(index, key, draw(st.sampled_from(MIG_STATES)), [], set())
        if draw(st.booleans()):
            plan.layout = list(templates[key])
        else:
            random_layout(draw, plan)
        plan.busy = draw(st.sets(st.sampled_from([s for _, s in plan.layout] or [0]),
                                 max_size=2))
        plans.append(plan)
    return plans


claim = st.tuples(st.just("claim"), st.sampled_from(list(HOST_KINDS)), st.integers(0, 999),
                  st.sampled_from(["pack", "spread"]), st.booleans(), st.booleans())
step = st.one_of(
    claim, claim, claim, claim,
    st.tuples(st.just("release"), st.integers(0, 999)),
    st.tuples(st.just("hold"), st.integers(0, 999), st.frozensets(st.integers(0, 7),
                                                                  max_size=3)),
    st.tuples(st.just("busy"), st.integers(0, 999), st.integers(0, 999)),
    st.tuples(st.just("mig"), st.integers(0, 999), st.sampled_from(MIG_STATES)),
    st.tuples(st.just("foreign"), st.integers(0, 999)),
)

DEMAND = {"1g.18gb": 30, "4g.71gb": 30, "1g.10gb": 20, "4g.40gb": 30, "2g.12gb": 5}


def wants_of(plans: list[GpuPlan], pick: int, kind: Kind) -> dict[str, str]:
    if kind is Kind.GPU:
        keys = sorted({p.key for p in plans})
        return {keys[pick % len(keys)]: WHOLE_GPU}
    made = sorted({name for plan in plans for name, _ in plan.layout})
    if made and pick % 3:  # mostly a profile that exists somewhere, as pool mode asks
        return resolve(made[pick % len(made)])
    if pick % 2:  # a slice class: one profile per model
        return {plan.key: model(plan.key).profiles[pick % len(model(plan.key).profiles)].name
                for plan in plans}
    names = sorted({p.name for plan in plans for p in model(plan.key).profiles})
    return resolve(names[pick % len(names)])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans=fleets(), steps=st.lists(step, min_size=10, max_size=40))
def test_index_chooses_as_a_full_pass_does(plans: list[GpuPlan], steps: list) -> None:
    inventory = make_inventory(*(p.gpu() for p in plans))
    index = SliceIndex(inventory)  # one index, told every change, as the spawner keeps it
    leases: list[Lease] = []
    holds: dict[tuple[str, str], frozenset[int]] = {}
    created: dict[str, tuple[GpuPlan, tuple[str, int]]] = {}  # lease id -> its instance
    ids = iter(range(10**6))

    def reread() -> None:
        nonlocal inventory
        inventory = make_inventory(*(p.gpu() for p in plans))
        index.refresh(inventory)

    for op in steps:
        if op[0] == "claim":
            _, kind, pick, strategy, with_demand, create = op
            wants = wants_of(plans, pick, kind)
            demand = DEMAND if with_demand else None
            host_kind = HOST_KINDS[kind]
            # As the claim does: the holds first, then without them to tell why.
            for view_holds in (holds, {}):
                index.match(leases, view_holds)
                got = host_kind.pick(index, wants, strategy, demand)  # type: ignore[arg-type]
                got = got if isinstance(got, Refused) else got.placement
                expected = ref_pick(kind, inventory, leases, view_holds, wants, strategy,
                                    demand)
                assert got == expected, (kind, wants, strategy, got, expected)
            index.match(leases, holds)
            got = host_kind.pick(index, wants, strategy, demand)  # type: ignore[arg-type]
            if isinstance(got, Refused):
                continue
            p, device = got.placement, got.device
            lease = Lease(f"L{next(ids)}", HOST, device.uuid if device else None,
                          p.gpu_uuid, p.gpu_index, p.profile, p.start, p.size)
            leases.append(lease)
            if kind is Kind.DYNAMIC and create:
                # Others decide while the instance is being made, then a read shows it.
                check_free(index, inventory, leases, holds)
                plan = next(x for x in plans if x.index == p.gpu_index)
                plan.layout.append((p.profile, p.start))
                created[lease.id] = (plan, (p.profile, p.start))
                reread()
                made = next(d for d in inventory.gpus[plans.index(plan)].mig_devices
                            if d.start == p.start)
                leases[-1] = replace(lease, mig_uuid=made.uuid)
        elif op[0] == "release" and leases:
            gone = leases.pop(op[1] % len(leases))
            if gone.id in created:  # a dynamic instance is destroyed at its release
                plan, instance = created.pop(gone.id)
                plan.layout.remove(instance)
                reread()
        elif op[0] == "hold":
            uuid = inventory.gpus[op[1] % len(plans)].uuid
            if op[2]:
                holds[HOST, uuid] = op[2]
            else:
                holds.pop((HOST, uuid), None)
        elif op[0] == "busy":
            plan = plans[op[1] % len(plans)]
            if plan.layout:
                start = plan.layout[op[2] % len(plan.layout)][1]
                plan.busy ^= {start}
                reread()
        elif op[0] == "mig":
            plans[op[1] % len(plans)].mig = op[2]
            reread()
        elif op[0] == "foreign":  # another host's lease: its MIG UUID counts, not its slices
            gpu = inventory.gpus[op[1] % len(plans)]
            device = gpu.mig_devices[0].uuid if gpu.mig_devices else None
            leases.append(Lease(f"L{next(ids)}", "node2", device, gpu.uuid, gpu.index,
                                "1g.18gb", 0, 1))
        check_free(index, inventory, leases, holds)


def check_free(index: SliceIndex, inventory: Inventory, leases: list[Lease],
               holds: Mapping) -> None:
    for mode in ("pool", "dynamic"):
        assert free_now(index, leases, mode, holds) == ref_free_now(inventory, leases, mode,
                                                                    holds), mode


def test_a_new_gpu_builds_the_index_again_and_keeps_what_is_held() -> None:
    one = make_inventory(make_gpu(0, "h200", [("3g.71gb", 0), ("3g.71gb", 4)]))
    index = SliceIndex(one)
    index.hold("a", "MIG-0-0-3g.71gb")
    assert index.pick_pool("3g.71gb").uuid == "MIG-0-4-3g.71gb"
    two = make_inventory(*one.gpus, make_gpu(1, "h200", [("3g.71gb", 0)]))
    index.refresh(two)
    assert index.model_keys == ("h200",)
    assert index.pick_pool("3g.71gb").uuid == "MIG-0-4-3g.71gb"  # the busier GPU first
    index.hold("b", "MIG-0-4-3g.71gb")
    assert index.pick_pool("3g.71gb").uuid == "MIG-1-0-3g.71gb"
    index.drop("a")
    assert index.pick_pool("3g.71gb").uuid == "MIG-0-0-3g.71gb"
