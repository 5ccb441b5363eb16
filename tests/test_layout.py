"""Changing the layout, in-process: the plan (pure), the holds in a real ledger, the
drain through the warning flow, and the apply on the simulator's GPU with faults at
every NVML step. docs/layout.md."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
from ctypes import byref
from datetime import UTC, datetime, timedelta

import pynvml
import pytest

from mig_spawner import holder
from mig_spawner.cli.main import main
from mig_spawner.core.layout import (
    LayoutError,
    PlanState,
    StepKind,
    parse_mig_parted,
    parse_spec,
    plan_layout,
)
from mig_spawner.core.lifecycle import StopRule, WarningState
from mig_spawner.core.policy import build_policy
from mig_spawner.core.policy.model import PolicyError
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.hub.client import HubClient
from mig_spawner.layout import LayoutApplier, begin, drain, holders_of
from mig_spawner.ledger import Grant, LeaseRequest, Ledger, LedgerView, ReleaseCode
from mig_spawner.release import HolderProbes, LocalProcesses, Releaser
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper
from mig_spawner.spawner.decide import make_decide
from tests.mocking import Clock
from tests.support.hub_standin import StandinState, iso, user_model

HOUR = 3600.0
SEVEN = "h200x2:layout=1g.18gb*7"
#: GPU 0: a 4g.71gb over slices 0-3 (a 1g.18gb held there must go), the 1g.18gb at 4-6 stay.
TARGET = "0=4g.71gb,1g.18gb*3"


@pytest.fixture
def world(tmp_path, backend_url):
    state = tmp_path / "sim.json"
    gpus = connect(simulate=SEVEN, state_file=str(state))
    clock = Clock()
    ledger = Ledger.open(backend_url, clock=clock)
    yield ledger, gpus, SimulatedHost.open(state), clock
    ledger.close()
    gpus.close()


def claim_on(ledger: Ledger, gpus, gpu_index: int, start: int, user: str):
    """A pool lease on the 1g.18gb at ``start`` of GPU ``gpu_index``, and a process on it."""
    inventory = gpus.inventory()
    device = next(d for d in inventory.mig_devices
                  if (d.gpu_index, d.start) == (gpu_index, start))
    return ledger.leases.claim(LeaseRequest(user), lambda view: Grant(
        group="analysts", profile=device.profile, compute_slices=1, mode="pool",
        host=inventory.host, gpu_uuid=device.gpu_uuid, gpu_index=gpu_index,
        start=start, size=device.size, mig_uuid=device.uuid, gi_id=device.gi_id,
        ci_id=device.ci_id, expires_at=view.now + timedelta(hours=8))), device


def layout_of(gpus, index: int) -> list[tuple[str, int]]:
    gpu = gpus.gpu(index)
    return sorted((gi.profile, gi.start) for gi in gpu.gpu_instances)


# --- the target and the plan (pure) ----------------------------------------------------


def test_a_target_reads_from_the_advice_file_or_a_spec_and_bad_ones_say_what_to_fix():
    advised = {"version": "v1", "mig-configs": {
        "mig-spawner-advised": [{"devices": [0], "mig-enabled": True,
                                 "mig-devices": {"3g.71gb": 1, "1g.18gb": 4}},
                                {"devices": [1], "mig-enabled": False}],
        "mig-spawner-current": [{"devices": "all", "mig-enabled": True,
                                 "mig-devices": {"1g.18gb": 7}}]}}
    target = parse_mig_parted(advised)
    assert target.for_gpu(0).counts == {"3g.71gb": 1, "1g.18gb": 4}
    assert not target.for_gpu(1).mig_enabled and target.for_gpu(2) is None
    assert parse_mig_parted(advised, "mig-spawner-current").for_gpu(5).counts == {"1g.18gb": 7}
    spec = parse_spec("0=3g.71gb, 1g.18gb*4; 1=off; 2g.35gb*3")
    assert spec.for_gpu(0).counts == {"3g.71gb": 1, "1g.18gb": 4}
    assert not spec.for_gpu(1).mig_enabled and spec.for_gpu(7).counts == {"2g.35gb": 3}
    for bad, words in [("", "empty"), ("x=1g.18gb", "indexes"), ("1g.18gb*-1", "is not .profile.")]:
        with pytest.raises(LayoutError, match=words):
            parse_spec(bad)
    with pytest.raises(LayoutError, match="no config 'nope'"):
        parse_mig_parted(advised, "nope")
    with pytest.raises(LayoutError, match="whole number"):
        parse_mig_parted({"mig-configs": {"a": [{"devices": "all",
                                                 "mig-devices": {"1g.18gb": "x"}}]}})


def test_a_target_that_does_not_fit_is_a_problem_and_changes_nothing(tmp_path):
    inventory = connect(simulate=SEVEN).inventory()
    plan = plan_layout(inventory, parse_spec("0=3g.71gb*3;1=7g.141gb,1g.18gb;4=1g.18gb"))
    problems = {g.index: g.problem for g in plan.problems}
    assert "at most 2 3g.71gb" in problems[0]
    assert "does not fit" in problems[1]
    assert "no GPU 4" in problems[4]
    assert not plan.changing


def test_a_plan_over_held_slices_keeps_every_held_instance_it_can_and_never_runs_ahead():
    """Every holder set on GPU 0, every target: a held instance is destroyed only when no
    layout of the target keeps it, and then only by a step that waits for its holder."""
    inventory = connect(simulate="h200x1:layout=1g.18gb*7").inventory()
    gpu = inventory.gpus[0]
    targets = ["3g.71gb,2g.35gb,1g.18gb*2", "4g.71gb,1g.18gb*3", "2g.35gb*3,1g.18gb",
               "7g.141gb", "1g.18gb*7", "3g.71gb*2"]
    for text, held_starts in itertools.product(
            targets, itertools.chain.from_iterable(
                itertools.combinations(range(7), n) for n in range(4))):
        holders = [_holder(gpu.uuid, s) for s in held_starts]
        g = plan_layout(inventory, parse_spec(text), holders).gpus[0]
        assert g.problem is None, (text, held_starts)
        for step in g.steps:
            if step.kind is StepKind.DESTROY and step.instance.holder is not None:
                assert step.waits_for == (step.instance.holder,)
        kept = {i.start for i in g.keep if i.holder}
        # Nothing better exists: keeping one more held instance would not fit the target.
        assert len(kept) == _most_held_kept(gpu, text, held_starts), (text, held_starts)


def _holder(gpu_uuid: str, start: int):
    from mig_spawner.core.layout import Holder

    return Holder(f"l{start}", f"u{start}", "", "analysts", "1g.18gb", gpu_uuid, start)


def _most_held_kept(gpu, text: str, held_starts) -> int:
    """Brute force: the most held 1g.18gb instances any placement of ``text`` keeps."""
    from mig_spawner.core.catalog import model
    from mig_spawner.core.layout import _place, _wanted

    h200 = model("h200")
    wanted = _wanted(h200, parse_spec(text).entries[0].counts)
    ones = wanted.count("1g.18gb")
    best = 0
    for n in range(min(ones, len(held_starts)), -1, -1):
        for keep in itertools.combinations(held_starts, n):
            rest = list(wanted)
            for _ in keep:
                rest.remove("1g.18gb")
            taken = sum(1 << s for s in keep)
            if _place(h200, rest, taken) is not None:
                return n
    return best


def test_plan_says_who_holds_what_must_go_until_when_and_what_each_group_keeps(
        tmp_path, capsys):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    state = tmp_path / "sim.json"
    gpus = connect(simulate=SEVEN, state_file=str(state))
    with Ledger.open(ledger_url) as ledger:
        _lease, _ = claim_on(ledger, gpus, 0, 2, "ana")
    config = tmp_path / "policy.py"
    config.write_text("c.MIGPolicyConfig.group_policies = {'analysts': {'allowed': "
                      "['1g.18gb', '3g.71gb'], 'drain_notice': '30m'}, 'ml': {'allowed': "
                      "['4g.71gb']}}\n")
    args = ["layout", "plan", "--sim-state", str(state), "--ledger-url", ledger_url,
            "-f", str(config), TARGET]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "destroys: 1g.18gb at 2 (GI 9): held by ana (group analysts, 1g.18gb) until" in text
    assert "destroy 1g.18gb at 2 (GI 9) once ana ended" in text
    assert "create 4g.71gb at 0 once ana ended" in text
    assert "group ml can still get: nothing" in text  # its 4g goes where ana's slice is
    assert "group analysts can still get: 10x 1g.18gb" in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    held = [d for d in data["gpus"][0]["destroy"] if "held_by" in d]
    until = datetime.fromisoformat(held[0]["held_by"]["until"])
    assert held[0]["held_by"]["user"] == "ana"
    # The notice (30 min from now) comes before the session's 8 h limit.
    assert timedelta(minutes=29) < until - datetime.now(UTC) <= timedelta(minutes=30)
    assert layout_of(gpus, 0) == [("1g.18gb", s) for s in range(7)]  # read-only
    gpus.close()


def test_drain_notice_is_validated_with_the_policy():
    policy = build_policy(None, None, {"a": {"allowed": ["1g.18gb"], "drain_notice": "2h"}})
    assert policy.group("a").drain_notice == 2 * HOUR
    assert policy.group("nobody").drain_notice == HOUR
    # None (or "never"): the group's servers are never stopped, the change waits for them.
    assert build_policy(None, None, {"a": {"allowed": ["1g.18gb"], "drain_notice": None}}
                        ).group("a").drain_notice is None
    with pytest.raises(PolicyError, match="drain_notice"):
        build_policy(None, None, {"a": {"allowed": ["1g.18gb"], "drain_notice": "soon"}})


# --- the drain and the apply, on the simulator and a real ledger --------------------------


async def test_a_drain_stops_its_server_through_the_hub_never_from_outside(world, serve_hub):
    """At the end of a drain notice the slice service stops the server as it stops any:
    the code ``drain`` recorded first, then the hub asked (whose spawner's stop releases
    the lease). The server's process is the hub's to stop: nothing signals it from
    outside, and the lease waits for the hub's stop."""
    ledger, gpus, _, clock = world
    lease, device = claim_on(ledger, gpus, 0, 2, "ana")
    server = subprocess.Popen(["sleep", "600"], env={
        "CUDA_VISIBLE_DEVICES": device.uuid, "MIG_SPAWNER_LEASE_ID": lease.id})
    try:
        ledger.leases.activate(lease.id, holder_host=holder.this_host(), holder_pid=server.pid,
                        holder_start=holder.start_time(server.pid))
        inventory = gpus.inventory()
        plan = plan_layout(inventory, parse_spec(TARGET), holders_of(ledger.leases.active()))
        begin(ledger, inventory.host, plan, parse_spec(TARGET))
        hub = StandinState()
        hub.users["ana"] = user_model("ana", clock.now - timedelta(hours=1), clock.now)
        policy = build_policy(None, None, {"analysts": {"allowed": ["1g.18gb"]}})
        sweeper = Sweeper(
            HubClient(f"{serve_hub(hub)}/hub/api", "t", retries=0), policy, ServiceMetrics(),
            ledger=ledger, probe_servers=False, clock=clock,
            layout=LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock))
        await sweeper.sweep()
        assert ledger.leases.get(lease.id).warning is StopRule.DRAIN and hub.stopped == []

        clock.now += timedelta(hours=1, seconds=1)  # the drain notice has ended
        hub.users["ana"]["last_activity"] = iso(clock.now)
        report = await sweeper.sweep()
        assert [x.id for x in report.drained] == [lease.id] and hub.stopped == ["ana/"]
        stopping = ledger.leases.get(lease.id)
        assert stopping.held and stopping.release_code is ReleaseCode.DRAIN
        assert stopping.warning_state is WarningState.CARRIED_OUT
        assert server.poll() is None  # the hub's to stop, not signalled from outside
    finally:
        server.kill()
        server.wait()


def test_processes_without_a_lease_on_an_instance_that_must_go_make_the_change_wait(world):
    """What needs the busy instance's room waits with it, rather than failing the change."""
    ledger, gpus, sim, clock = world
    busy = next(d for d in gpus.inventory().mig_devices if (d.gpu_index, d.start) == (0, 2))
    sim.set_processes(busy.uuid, [(4242, 100)])  # no lease: someone's stray process
    inventory = gpus.inventory()
    begin(ledger, inventory.host, plan_layout(inventory, parse_spec(TARGET), []),
          parse_spec(TARGET))
    applier = LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock)
    [gpu0] = applier.step().gpus
    [change] = ledger.holds.changes()
    assert gpu0.state is PlanState.DRAINING and "process" in change.detail, change.detail
    assert layout_of(gpus, 0) == [("1g.18gb", s) for s in (2, 4, 5, 6)]
    sim.set_processes(busy.uuid, [])
    assert applier.step().gpus[0].state is PlanState.DONE
    assert ("4g.71gb", 0) in layout_of(gpus, 0)


def test_a_held_slice_is_drained_warned_once_and_its_step_applied_after_it_ends(world):
    ledger, gpus, sim, clock = world
    lease, device = claim_on(ledger, gpus, 0, 2, "ana")
    sim.set_processes(device.uuid, [(4242, 100)])
    inventory = gpus.inventory()
    plan = plan_layout(inventory, parse_spec(TARGET), holders_of(ledger.leases.active()))
    [change] = begin(ledger, inventory.host, plan, parse_spec(TARGET))
    applier = LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock)

    first = applier.step()
    [gpu0] = first.gpus
    assert gpu0.state is PlanState.DRAINING and gpu0.warned == [lease.id]
    # Everything that waits for nobody is done; ana's instance and what needs its room wait.
    assert layout_of(gpus, 0) == [("1g.18gb", s) for s in (2, 4, 5, 6)]
    warned = ledger.leases.get(lease.id)
    assert warned.warning == "drain" and warned.warning_deadline == clock.now + timedelta(
        hours=1)
    # Keep cannot pass it.
    kept = ledger.warnings.keep(lease.id, extend_by=HOUR, max_extensions=3)
    assert kept.outcome == "refused" and "re-cutting" in kept.message
    # The 4g.71gb's room is held from grants; the 1g.18gb that stay are granted as usual.
    assert ledger.holds.held()[(inventory.host, change.gpu_uuid)] == frozenset(range(4))

    clock.now += timedelta(minutes=30)
    assert applier.step().due == []  # still within the notice; warned once only
    assert [e.kind for e in ledger.warnings.events(lease.id)] == ["warned", "refused"]

    clock.now += timedelta(minutes=31)
    due = applier.step().due
    assert [x.id for x in due] == [lease.id]
    # The service asks the hub to stop it; while the hub is slow to finish, the stop is
    # not due again (it would be asked, and counted, twice).
    ledger.warnings.carry_out(lease.id)
    assert applier.step().due == []
    sim.set_processes(device.uuid, [])  # the server's process is gone
    releaser = Releaser(lambda: ledger, lambda: gpus,
                        HolderProbes(local=LocalProcesses(asyncio.to_thread, lambda: gpus)),
                        run=asyncio.to_thread, grace=0.1)
    asyncio.run(releaser.release(due[0], ReleaseCode.DRAIN, "drain notice ended"))
    assert ledger.leases.get(lease.id).release_code is ReleaseCode.DRAIN
    last = applier.step()
    assert last.gpus[0].state is PlanState.DONE
    assert layout_of(gpus, 0) == [("1g.18gb", 4), ("1g.18gb", 5), ("1g.18gb", 6),
                                  ("4g.71gb", 0)]
    assert ledger.holds.held() == {} and ledger.holds.changes() == []
    assert layout_of(gpus, 1) == [("1g.18gb", s) for s in range(7)]


def test_no_picker_grants_a_placement_that_will_change_and_the_form_says_why(world):
    ledger, gpus, _, _ = world
    inventory = gpus.inventory()
    # GPU 0 changes all but its first two slices; GPU 1 is drained whole.
    begin(ledger, inventory.host, plan_layout(inventory, parse_spec(TARGET)),
          parse_spec(TARGET))
    drain(ledger, inventory.host, inventory.gpus[1])
    policy = build_policy(None, None, {"a": {"allowed": ["1g.18gb", "2g.35gb"],
                                              "max_slices_per_user": 9}})
    mine = policy.for_user(["a"])
    got = []
    for n in range(3):
        decide = make_decide(mine, policy.offer("1g.18gb"), inventory, "pool", "pack")
        try:
            got.append(ledger.leases.claim(LeaseRequest("u", f"s{n}"), decide))
        except Refused as refusal:
            assert refusal.reason is Reason.GPU_RECUT
            assert "being re-cut" in refusal.message
            break
    assert sorted((x.gpu_index, x.start) for x in got) == [(0, 4), (0, 5), (0, 6)]
    # Dynamic mode: a drained GPU gets no new instance.
    empty = connect(simulate="h200x1").inventory()
    decide = make_decide(mine, policy.offer("1g.18gb"), empty, "dynamic", "pack")
    whole = {(empty.host, empty.gpus[0].uuid): frozenset(range(64))}
    with pytest.raises(Refused) as refused:
        decide(LedgerView(LeaseRequest("v"), (), datetime.now(UTC), holds=whole))
    assert refused.value.reason is Reason.GPU_RECUT
    assert decide(LedgerView(LeaseRequest("v"), (), datetime.now(UTC))).start is not None
    # Where the holds are not why, the refusal says what is.
    decide = make_decide(mine, policy.offer("2g.35gb"), inventory, "pool", "pack")
    with pytest.raises(Refused) as refused:
        ledger.leases.claim(LeaseRequest("w"), decide)
    assert refused.value.reason is Reason.NONE_FREE
    # Once the changes end, their slices are granted again.
    for change in ledger.holds.changes():
        ledger.holds.move_change(change.id, PlanState.FAILED, detail="test")
    decide = make_decide(mine, policy.offer("1g.18gb"), inventory, "pool", "pack")
    assert ledger.leases.claim(LeaseRequest("u", "again"), decide).start == 0


@pytest.mark.parametrize(("function", "code", "ends"), [
    ("nvmlGpuInstanceDestroy", "IN_USE", PlanState.APPLYING),
    ("nvmlComputeInstanceDestroy", "NO_PERMISSION", PlanState.FAILED),
    ("nvmlDeviceCreateGpuInstanceWithPlacement", "INSUFFICIENT_RESOURCES", PlanState.FAILED),
    ("nvmlGpuInstanceCreateComputeInstance", "UNKNOWN", PlanState.FAILED),
    ("nvmlDeviceGetGpuInstanceById", "NO_PERMISSION", PlanState.FAILED),
])
def test_an_nvml_error_at_any_step_stops_that_gpu_with_the_reason_and_the_rest_goes_on(
        world, function, code, ends):
    ledger, gpus, sim, clock = world
    target = parse_spec("3g.71gb,2g.35gb,1g.18gb*2")  # both GPUs
    inventory = gpus.inventory()
    begin(ledger, inventory.host, plan_layout(inventory, target), target)
    sim.inject_error(function, code)
    applier = LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock)
    first = {g.gpu_index: g for g in applier.step().gpus}
    [hit] = [g for g in first.values() if g.state is not PlanState.DONE]
    assert hit.state is ends and hit.why
    other = first[1 - hit.gpu_index]
    assert other.state is PlanState.DONE
    if ends is PlanState.FAILED:
        [failed] = [c for c in ledger.holds.changes(open_only=False)
                    if c.state is PlanState.FAILED]
        assert failed.detail and failed.gpu_index == hit.gpu_index
        assert ledger.holds.held() == {}  # a failed change holds nothing
    else:  # in use: the next pass goes on where it stopped
        assert applier.step().gpus[0].state is PlanState.DONE
    # Whatever failed, no instance is left that the target does not have or that has no
    # MIG device, and none was made twice.
    for g in gpus.inventory().gpus:
        assert len(g.gpu_instances) == len(g.mig_devices)
        assert len({gi.start for gi in g.gpu_instances}) == len(g.gpu_instances)


def test_a_change_that_fails_midway_puts_back_what_it_destroyed(world, caplog):
    """A create that fails after free instances went: the change ends failed, having
    made again what it destroyed where it could, and says what it could not."""
    ledger, gpus, sim, clock = world
    target = parse_spec("0=3g.71gb,2g.35gb,1g.18gb*2")
    inventory = gpus.inventory()
    begin(ledger, inventory.host, plan_layout(inventory, target), target)
    sim.inject_error("nvmlGpuInstanceCreateComputeInstance", "UNKNOWN")
    applier = LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock)
    [gpu0] = applier.step().gpus
    assert gpu0.state is PlanState.FAILED
    assert any(d.startswith("destroy") for d in gpu0.done)  # it had destroyed some
    assert layout_of(gpus, 0) == [("1g.18gb", s) for s in range(7)]
    [failed] = ledger.holds.changes(open_only=False)
    assert failed.detail.startswith("put back") and "could not" not in failed.detail
    assert ledger.holds.held() == {}
    # Where the way back fails too, what is missing is said and logged; the hold ends.
    begin(ledger, inventory.host, plan_layout(gpus.inventory(), target), target)
    sim.inject_error("nvmlGpuInstanceCreateComputeInstance", "UNKNOWN", count=2)
    with caplog.at_level("WARNING", logger="mig_spawner.layout"):
        assert applier.step().gpus[0].state is PlanState.FAILED
    failed = ledger.holds.changes(open_only=False)[-1]
    assert "could not put back 1x 1g.18gb" in failed.detail, failed.detail
    assert "could not put back 1x 1g.18gb" in caplog.text
    assert len(gpus.gpu(0).gpu_instances) == 6 and ledger.holds.held() == {}


def test_a_profile_the_driver_does_not_offer_is_refused_before_anything_is_destroyed(
        tmp_path, capsys):
    """An A30 on R515 lists no 2g.12gb+me (from R525, NVIDIA's guide): the plan says so
    and `apply` changes nothing, where it used to destroy a 2g.12gb and then fail."""
    state = tmp_path / "sim.json"
    connect(simulate="a30x1:layout=2g.12gb*2:driver=515.86.01", state_file=str(state)).close()
    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    common = ["--sim-state", str(state), "--ledger-url", url]
    assert main(["layout", "plan", *common, "0=2g.12gb+me,2g.12gb"]) == 1
    assert "driver does not offer 2g.12gb+me" in capsys.readouterr().out
    assert main(["layout", "apply", *common, "0=2g.12gb+me,2g.12gb"]) == 1
    assert "driver does not offer 2g.12gb+me" in capsys.readouterr().err
    with connect(state_file=str(state)) as gpus:
        assert layout_of(gpus, 0) == [("2g.12gb", 0), ("2g.12gb", 2)]
    with Ledger.open(url) as ledger:
        assert ledger.holds.changes(open_only=False) == []


def test_a_compute_instance_lost_to_a_crash_is_cleaned_up_on_the_next_pass(world):
    """kill -9 between creating a GPU instance and its compute instance leaves a GPU
    instance no lease can use: the next pass destroys it and makes it again."""
    ledger, gpus, _, clock = world
    target = parse_spec("0=7g.141gb")
    inventory = gpus.inventory()
    begin(ledger, inventory.host, plan_layout(inventory, target), target)
    for gi in inventory.gpus[0].gpu_instances:
        gpus.destroy_instance(0, gi.gi_id)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(
        handle, pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle, info.id, byref(pynvml.c_nvmlGpuInstancePlacement_t(0, 8)))
    assert len(gpus.gpu(0).gpu_instances) == 1 and not gpus.gpu(0).mig_devices
    done = LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock).step()
    assert done.gpus[0].state is PlanState.DONE
    assert [d.profile for d in gpus.gpu(0).mig_devices] == ["7g.141gb"]


def test_a_mig_mode_change_waits_for_an_idle_gpu_and_ampere_needs_allow_reset(tmp_path):
    state = tmp_path / "sim.json"
    gpus = connect(simulate="h200x1:layout=1g.18gb*2+a100-80gbx1:layout=1g.10gb",
                   state_file=str(state))
    with Ledger.open(f"sqlite:///{tmp_path / 'l.sqlite'}") as ledger:
        target = parse_spec("off")
        inventory = gpus.inventory()
        plan = plan_layout(inventory, target)
        assert [g.needs_reset for g in plan.gpus] == [False, True]
        assert plan.gpus[0].changing_slices == frozenset(range(8))
        begin(ledger, inventory.host, plan, target)
        done = {g.gpu_index: g for g in LayoutApplier(ledger, gpus, lambda g: HOUR).step().gpus}
        assert done[0].state is PlanState.DONE and not gpus.gpu(0).mig_current
        assert done[1].state is PlanState.FAILED and "--allow-reset" in done[1].why
        assert gpus.gpu(1).mig_current  # untouched
        begin(ledger, inventory.host, plan_layout(gpus.inventory(), target), target)
        again = LayoutApplier(ledger, gpus, lambda g: HOUR, allow_reset=True).step()
        assert again.gpus[0].state is PlanState.DONE and not gpus.gpu(1).mig_current
    gpus.close()


def test_dynamic_mode_refuses_a_target_layout_and_drains_a_gpu_instead(tmp_path, capsys):
    config = tmp_path / "dyn.py"
    config.write_text("c.LocalMIGSpawner.mig_mode = 'dynamic'\n")
    state = tmp_path / "sim.json"
    connect(simulate="h200x1", state_file=str(state)).close()
    url = f"sqlite:///{tmp_path / 'l.sqlite'}"
    common = ["--sim-state", str(state), "--ledger-url", url, "-f", str(config)]
    assert main(["layout", "plan", *common, "1g.18gb*7"]) == 2
    assert "dynamic mode" in capsys.readouterr().err
    assert main(["layout", "apply", *common, "1g.18gb*7"]) == 2
    assert main(["layout", "drain", *common, "0"]) == 0
    assert main(["layout", "status", "--ledger-url", url]) == 0
    assert "drain draining" in capsys.readouterr().out
    assert main(["status", "--sim-state", str(state), "--ledger-url", url]) == 0
    assert "GPU 0: drained for maintenance (draining)" in capsys.readouterr().out
    with Ledger.open(url) as ledger:
        assert ledger.holds.held()[(holder.this_host(), connect(state_file=str(state))
                               .inventory().gpus[0].uuid)] == frozenset(range(64))
    assert main(["layout", "end", "--ledger-url", url, "0"]) == 0
    with Ledger.open(url) as ledger:
        assert ledger.holds.held() == {}


def test_the_map_shows_a_gpu_being_re_cut_and_which_slices_are_held(world):
    from mig_spawner.observe.slice_state import slice_map
    from mig_spawner.observe.slicemap import slicemap_json

    ledger, gpus, _, clock = world
    claim_on(ledger, gpus, 0, 2, "ana")
    inventory = gpus.inventory()
    plan = plan_layout(inventory, parse_spec(TARGET), holders_of(ledger.leases.active()))
    begin(ledger, inventory.host, plan, parse_spec(TARGET))
    LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock).step()
    data = slicemap_json(slice_map(gpus.inventory(), ledger.leases.active(), clock.now,
                                   changes=ledger.holds.changes()))
    gpu0, gpu1 = data["gpus"]
    assert gpu0["change"] == "being re-cut (draining): waits for ana"
    assert gpu0["held_slices"] == [0, 1, 2, 3]
    assert gpu1["change"] is None and gpu1["held_slices"] == []


def test_the_form_says_a_size_is_not_free_for_a_while_because_its_gpu_is_re_cut():
    from mig_spawner.core.catalog import model
    from mig_spawner.spawner.form import build_choices

    policy = build_policy(None, None, {"a": {"allowed": ["1g.18gb", "4g.71gb"]}})
    h200 = model("h200")
    # No 4g.71gb free, none held by a server, one held by a layout change.
    [small, big] = build_choices(policy.for_user(["a"]), [h200],
                                 {"h200": {"1g.18gb": 3, "4g.71gb": 0}}, lambda o, c: None,
                                 recut={"4g.71gb": 1})
    assert small.available
    assert big.unavailable == "not free for a while: an admin is re-cutting its GPU"
    [_, gone] = build_choices(policy.for_user(["a"]), [h200],
                              {"h200": {"1g.18gb": 3, "4g.71gb": 0}}, lambda o, c: None)
    assert gone.unavailable.startswith("no such slice")


def test_ending_a_change_withdraws_the_drain_warning_of_a_server_that_stays(world):
    ledger, gpus, _, clock = world
    lease, _ = claim_on(ledger, gpus, 1, 3, "bo")
    inventory = gpus.inventory()
    drain(ledger, inventory.host, inventory.gpus[1])
    LayoutApplier(ledger, gpus, lambda group: HOUR, clock=clock).step()
    assert ledger.leases.get(lease.id).warning == "drain"
    assert main(["layout", "end", "--ledger-url", ledger.url, "1"]) == 0
    assert ledger.leases.get(lease.id).warning is None and ledger.holds.held() == {}
