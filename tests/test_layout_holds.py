"""A layout change touches only what its hold covers (issue 37): a whole GPU held by a
lease is capacity like any slice (its MIG mode never changes under it), every pass plans
again and holds what it changes under the claim lock before it destroys anything, and
one stepper at a time steps a change. In-process, on a real ledger (SQLite and
PostgreSQL) and the simulator; docs/layout.md."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mig_spawner.cli.main import main
from mig_spawner.core.layout import (
    Holder,
    PlanState,
    StepKind,
    instances_of,
    parse_spec,
    plan_gpu,
    plan_layout,
)
from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Refused
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.layout import LayoutApplier, begin, holders_of, stepper_gone, this_stepper
from mig_spawner.ledger import LeaseRequest, Ledger
from mig_spawner.spawner.decide import make_decide
from tests.mocking import Clock

HOUR = 3600.0
POLICY = build_policy({"gpu": {"display_name": "Whole GPU"}}, None,
                      {"a": {"allowed": ["1g.18gb", "gpu"], "max_slices_per_user": 99}})


@pytest.fixture
def host_of(tmp_path, backend_url):
    """``host_of(spec)``: a ledger, the simulated GPUs of ``spec``, a handle on them and
    the ledger's clock; all closed after the test."""
    opened = []

    def open_(spec: str):
        state = tmp_path / "sim.json"
        gpus = connect(simulate=spec, state_file=str(state))
        clock = Clock()
        ledger = Ledger.open(backend_url, clock=clock)
        opened.append((ledger, gpus))
        return ledger, gpus, SimulatedHost.open(state), clock

    yield open_
    for ledger, gpus in opened:
        ledger.close()
        gpus.close()


def start_change(ledger: Ledger, gpus, clock, text: str) -> LayoutApplier:
    """Open the change to ``text`` as `layout apply` does; the applier that steps it."""
    target = parse_spec(text)
    inventory = gpus.inventory()
    plan = plan_layout(inventory, target, holders_of(ledger.leases.active()))
    begin(ledger, inventory.host, plan, target)
    return LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock)


def claim(ledger: Ledger, gpus, user: str, offer: str = "1g.18gb"):
    """A spawn's claim, as the hub makes it: the GPUs read afresh, the holds respected."""
    mine = POLICY.for_user(["a"])
    decide = make_decide(mine, mine.offer(offer), gpus.inventory(), "pool", "pack")
    return ledger.leases.claim(LeaseRequest(user), decide)


def claim_at(ledger: Ledger, gpus, start: int, user: str):
    """A spawn that gets the 1g.18gb at ``start`` of GPU 0: the free ones before it are
    taken first by others, then given back."""
    others = []
    for n in range(7):
        lease = claim(ledger, gpus, f"{user}-{n}")
        if lease.start == start:
            for other in others:
                ledger.leases.release(other.id, "stopped")
            return lease
        others.append(lease)
    raise AssertionError(f"the 1g.18gb at {start} is not free")


def layout_of(gpus, index: int = 0) -> list[tuple[str, int]]:
    return sorted((gi.profile, gi.start) for gi in gpus.gpu(index).gpu_instances)


def leases_on_destroyed_devices(ledger: Ledger, gpus) -> list[str]:
    devices = {d.uuid for d in gpus.inventory().mig_devices}
    return [x.server for x in ledger.leases.active() if x.mig_uuid and x.mig_uuid not in devices]


# --- a whole GPU held by a lease --------------------------------------------------------


def test_a_gpu_held_whole_is_named_by_the_plan_drained_and_its_mig_mode_waits(
        tmp_path, backend_url, capsys, host_of):
    ledger, gpus, _, clock = host_of("h200x1:mig=off")
    whole = claim(ledger, gpus, "ana", "gpu")
    assert whole.profile == "gpu"
    args = ["layout", "plan", "--sim-state", str(tmp_path / "sim.json"), "--ledger-url",
            backend_url, "0=1g.18gb*7"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "destroys: the whole GPU (MIG off): held by ana (group a, gpu) until" in text
    assert "turn MIG on once ana ended" in text
    applier = start_change(ledger, gpus, clock, "0=1g.18gb*7")
    [gpu0] = applier.step().gpus
    # Warned through the drain notice, never switched under its server.
    assert gpu0.state is PlanState.DRAINING and gpu0.warned == [whole.id]
    assert not gpus.gpu(0).mig_current and layout_of(gpus) == []
    assert ledger.leases.get(whole.id).warning == "drain"
    clock.now += timedelta(hours=1, minutes=1)
    assert [x.id for x in applier.step().due] == [whole.id]
    assert not gpus.gpu(0).mig_current  # due, but not gone: still nothing changes
    ledger.leases.release(whole.id, "drain")
    assert applier.step().gpus[0].state is PlanState.DONE
    assert layout_of(gpus) == [("1g.18gb", s) for s in range(7)]


def test_processes_on_a_gpu_held_by_nobody_keep_its_mig_mode_too(host_of):
    ledger, gpus, sim, clock = host_of("h200x1:mig=off")
    sim.set_processes(gpus.gpu(0).uuid, [(4242, 100)])
    applier = start_change(ledger, gpus, clock, "0=7g.141gb")
    [gpu0] = applier.step().gpus
    assert gpu0.state is PlanState.DRAINING
    assert "processes on the whole GPU" in ledger.holds.changes()[0].detail
    assert not gpus.gpu(0).mig_current
    sim.set_processes(gpus.gpu(0).uuid, [])
    assert applier.step().gpus[0].state is PlanState.DONE
    assert layout_of(gpus) == [("7g.141gb", 0)]


def test_mig_goes_off_only_once_every_held_instance_is_gone(host_of):
    ledger, gpus, _, clock = host_of("h200x1:layout=1g.18gb*7")
    held = claim_at(ledger, gpus, 3, "bo")
    applier = start_change(ledger, gpus, clock, "0=off")
    assert applier.step().gpus[0].warned == [held.id]
    assert gpus.gpu(0).mig_current and layout_of(gpus) == [("1g.18gb", 3)]
    ledger.leases.release(held.id, "drain")
    assert applier.step().gpus[0].state is PlanState.DONE
    assert not gpus.gpu(0).mig_current


# --- each pass holds what it changes before it destroys ---------------------------------


def test_a_claim_between_the_plan_and_a_destroy_never_gets_an_instance_that_goes(host_of):
    """Issue 37's case: 1g.18gb x7 to 1g.18gb x5 + 2g.35gb with servers at 0, 2 and 4. The
    first pass holds slices 4-5 (the 2g waits for the server at 4); once the server at 2
    has left, the next pass puts the 2g at 2, over slice 3, which the first hold never
    covered. A spawn that claims just before each destroy must not get what goes."""
    ledger, gpus, _, clock = host_of("h200x1:layout=1g.18gb*7")
    servers = {s: claim_at(ledger, gpus, s, f"u{s}") for s in (0, 2, 4)}
    applier = start_change(ledger, gpus, clock, "0=1g.18gb*5,2g.35gb")
    applier.step()
    ledger.leases.release(servers[2].id, "stopped")
    destroy, got = gpus.destroy_instance, []

    def claim_first(gpu_index: int, gi_id: int) -> None:
        for n in range(3):
            try:
                got.append(claim(ledger, gpus, f"late{len(got)}-{n}"))
            except Refused:
                break
        destroy(gpu_index, gi_id)

    gpus.destroy_instance = claim_first
    applier.step()
    gpus.destroy_instance = destroy
    assert got, "no claim came between the plan and a destroy"
    assert leases_on_destroyed_devices(ledger, gpus) == []


TARGETS = ("1g.18gb*5,2g.35gb", "3g.71gb,2g.35gb,1g.18gb*2", "4g.71gb,1g.18gb*3",
           "2g.35gb*3,1g.18gb", "1g.18gb*3,3g.71gb")


def test_every_plan_changes_only_its_changing_slices_and_runs_ahead_of_no_holder():
    """Exhaustive over the planner's small world (every target above, every set of
    servers on seven 1g.18gb, then every set of them leaving after the first pass): the
    hold a pass writes before it acts (the plan's changing slices) covers every step of
    that plan, and a step that waits for nobody never destroys a held instance."""
    inventory = connect(simulate="h200x1:layout=1g.18gb*7").inventory()
    gpu = inventory.gpus[0]
    checked = 0
    for text, held in itertools.product(TARGETS, itertools.chain.from_iterable(
            itertools.combinations(range(7), n) for n in range(5))):
        entry = parse_spec(text).entries[0]
        holders = {(gpu.uuid, s): Holder(f"l{s}", f"u{s}", "", "a", "1g.18gb", gpu.uuid, s)
                   for s in held}
        first = plan_gpu(gpu, entry, instances_of(gpu, holders))
        # What the first pass leaves: every step that waits for nobody done.
        for left in itertools.chain.from_iterable(
                itertools.combinations(held, n) for n in range(len(held) + 1)):
            after = _apply_free_steps(gpu, first)
            still = {k: h for k, h in holders.items() if k[1] not in left}
            plan = plan_gpu(after, entry, instances_of(after, still))
            assert plan.problem is None, (text, held, left)
            for s in plan.steps:
                on = s.instance.slices if s.instance is not None else s.new.slices
                assert set(on) <= plan.changing_slices, (text, held, left, s.describe())
                if s.kind is StepKind.DESTROY and not s.waits_for:
                    assert s.instance.free, (text, held, left, s.describe())
            checked += 1
    assert checked > 4000


def _apply_free_steps(gpu, plan):
    """``gpu`` as it is once every step of ``plan`` that waits for nobody is done."""
    from dataclasses import replace

    from mig_spawner.core.inventory import GpuInstance, MigDevice

    gone = {s.instance.gi_id for s in plan.steps if s.kind is StepKind.DESTROY and not
            s.waits_for and s.instance.free}
    gis = [gi for gi in gpu.gpu_instances if gi.gi_id not in gone]
    devices = [d for d in gpu.mig_devices if d.gi_id not in gone]
    blocked = {x for s in plan.steps if s.waits_for for x in
               (s.instance.slices if s.instance is not None else ())}
    for n, s in enumerate(plan.steps):
        if s.kind is StepKind.CREATE and not s.waits_for and not blocked & set(s.new.slices):
            gi_id = 100 + n
            gis.append(GpuInstance(gi_id, s.new.profile, 0, s.new.start, s.new.size))
            devices.append(MigDevice(f"MIG-new-{n}", gpu.index, gpu.uuid, 100 + n, "",
                                     s.new.profile, gi_id, 0, s.new.start, s.new.size, 0, 0))
    return replace(gpu, gpu_instances=tuple(gis), mig_devices=tuple(devices))


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    """A migrated, empty SQLite ledger file that each example copies."""
    path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite"
    Ledger.open(f"sqlite:///{path}").close()
    return path


EVENTS = st.lists(st.sampled_from(["pass", "leave", "claim", "pass"]), min_size=2, max_size=8)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(TARGETS),
       servers=st.sets(st.integers(0, 6), max_size=4),
       events=EVENTS,
       claim_before_destroy=st.booleans())
def test_no_step_of_any_pass_destroys_what_the_hold_does_not_cover(
        migrated, target, servers, events, claim_before_destroy):
    """Property: whatever servers hold, leave and claim between and within the passes,
    each destroy is of an instance inside the change's hold at that moment that no lease
    holds, and no lease is ever left on a destroyed MIG device."""
    workdir = Path(tempfile.mkdtemp(prefix="layout-prop-"))
    try:
        shutil.copy(migrated, workdir / "ledger.sqlite")
        ledger = Ledger.open(f"sqlite:///{workdir / 'ledger.sqlite'}")
        gpus = connect(simulate="h200x1:layout=1g.18gb*7", state_file=str(workdir / "s.json"))
        try:
            _run_events(ledger, gpus, target, servers, events, claim_before_destroy)
        finally:
            ledger.close()
            gpus.close()
    finally:
        shutil.rmtree(workdir)


def _run_events(ledger, gpus, target, servers, events, claim_before_destroy):
    held = [claim_at(ledger, gpus, s, f"u{s}") for s in sorted(servers)]
    spec = parse_spec(f"0={target}")
    inventory = gpus.inventory()
    host, uuid = inventory.host, inventory.gpus[0].uuid
    begin(ledger, host, plan_layout(inventory, spec, holders_of(ledger.leases.active())), spec)
    destroy, late = gpus.destroy_instance, itertools.count()

    def checked_destroy(gpu_index: int, gi_id: int) -> None:
        if claim_before_destroy:
            with contextlib.suppress(Refused):
                held.append(claim(ledger, gpus, f"late{next(late)}"))
        gi = next(g for g in gpus.gpu(gpu_index).gpu_instances if g.gi_id == gi_id)
        slices = set(range(gi.start, gi.start + gi.size))
        held_now = ledger.holds.held()
        assert slices <= held_now.get((host, uuid), frozenset()), (gi, held_now)
        assert not any(slices & set(x.memory_slices) for x in ledger.leases.active())
        destroy(gpu_index, gi_id)

    gpus.destroy_instance = checked_destroy
    applier = LayoutApplier(ledger, gpus, lambda group: HOUR)
    for event in events:
        if event == "pass":
            applier.step()
        elif event == "leave" and held:
            ledger.leases.release(held.pop(0).id, "stopped")
        elif event == "claim":
            with contextlib.suppress(Refused):
                held.append(claim(ledger, gpus, f"c{len(held)}-{next(late)}"))
        assert leases_on_destroyed_devices(ledger, gpus) == []
    for lease in ledger.leases.active():
        ledger.leases.release(lease.id, "stopped")
    applier.step()
    assert ledger.holds.changes() == []
    assert Counter(p for p, _ in layout_of(gpus)) == Counter(
        parse_spec(target).entries[0].counts)


# --- one stepper at a time ------------------------------------------------------------


def test_two_steppers_never_step_one_change_at_once(tmp_path, backend_url):
    """The slice service's sweep and `layout apply --wait` step the same changes: while
    one is in the middle of a GPU's change, the other leaves that GPU alone."""
    state = str(tmp_path / "sim.json")
    first_gpus = connect(simulate="h200x2:layout=1g.18gb*7", state_file=state)
    second_gpus = connect(state_file=state)
    first, second = Ledger.open(backend_url), Ledger.open(backend_url)
    try:
        target = parse_spec("3g.71gb,2g.35gb,1g.18gb*2")
        inventory = first_gpus.inventory()
        begin(first, inventory.host, plan_layout(inventory, target), target)
        a = LayoutApplier(first, first_gpus, lambda group: HOUR)
        b = LayoutApplier(second, second_gpus, lambda group: HOUR)
        inside, go_on = threading.Event(), threading.Event()
        destroy = first_gpus.destroy_instance

        def slow_destroy(gpu_index: int, gi_id: int) -> None:
            inside.set()
            assert go_on.wait(60)
            destroy(gpu_index, gi_id)

        first_gpus.destroy_instance = slow_destroy
        done: list = []
        stepping = threading.Thread(target=lambda: done.append(a.step()))
        stepping.start()
        assert inside.wait(60)
        before = [layout_of(second_gpus, i) for i in (0, 1)]
        meanwhile = b.step()
        # A is inside GPU 0's change: B left it alone; GPU 1 it could take, or find taken.
        assert meanwhile.gpus[0].why == "another process is applying it"
        assert [layout_of(second_gpus, 0)] == before[:1]
        go_on.set()
        stepping.join(60)
        first_gpus.destroy_instance = destroy
        for _ in range(4):
            a.step()
            b.step()
        ended = first.holds.changes(open_only=False)
        assert [c.state for c in ended] == [PlanState.DONE, PlanState.DONE], [
            (c.state, c.detail) for c in ended]
        for i in (0, 1):
            assert layout_of(first_gpus, i) == [("1g.18gb", 0), ("1g.18gb", 1),
                                                ("2g.35gb", 2), ("3g.71gb", 4)]
    finally:
        first.close()
        second.close()
        first_gpus.close()
        second_gpus.close()


HOLD_AND_HANG = """
import sys, time
from mig_spawner.layout import this_stepper
from mig_spawner.ledger import Ledger
ledger = Ledger.open(sys.argv[1])
assert ledger.holds.take_change(int(sys.argv[2]), this_stepper(), lambda c: False) is not None
print("taken", flush=True)
time.sleep(600)
"""


def test_a_stepper_killed_mid_change_never_wedges_it(backend_url, host_of):
    ledger, gpus, _, clock = host_of("h200x1:layout=1g.18gb*7")
    applier = start_change(ledger, gpus, clock, "0=7g.141gb")
    [change] = ledger.holds.changes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    hung = subprocess.Popen([sys.executable, "-c", HOLD_AND_HANG, backend_url,
                             str(change.id)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert hung.stdout.readline().strip() == "taken"
        # While it lives, nobody else steps the change.
        assert applier.step().gpus[0].why == "another process is applying it"
        assert len(layout_of(gpus)) == 7
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait()
    # Killed outright, it never let go: the next stepper finds it gone and goes on.
    assert applier.step().gpus[0].state is PlanState.DONE
    assert layout_of(gpus) == [("7g.141gb", 0)]


def test_a_stepper_this_host_cannot_look_up_is_gone_only_after_a_long_silence():
    from dataclasses import replace

    from mig_spawner.ledger.holds import LayoutChange

    now = datetime(2026, 12, 1, 9, tzinfo=UTC)
    change = LayoutChange(1, "h", "GPU-x", 0, {}, PlanState.APPLYING, frozenset(), False,
                          now, now, stepper=this_stepper(), stepper_seen=now)
    assert not stepper_gone(change, now + timedelta(days=1))  # this very process: alive
    elsewhere = replace(change, stepper="other-host pid 1 start 1 ns 1 abc")
    assert not stepper_gone(elsewhere, now + timedelta(minutes=9))
    assert stepper_gone(elsewhere, now + timedelta(minutes=11))
