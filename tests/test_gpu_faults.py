"""GPU faults acted on: a fault the driver reports is held in the ledger (what was seen,
when), claims and grants skip what it holds while other GPUs keep serving, the form says
why, the holders are warned and stopped by their group's ``fault_grace``, and only an
admin's clear lifts it once the driver reads the GPU healthy. docs/health.md.

In-process, on the NVML simulator and a real ledger (SQLite and PostgreSQL); the real
hub with the slice service is ``tests/test_gpu_faults_hub.py``.
"""

from __future__ import annotations

import json
import queue
from datetime import timedelta

import pynvml
import pytest
from alembic import command
from sqlalchemy import inspect

from mig_spawner.cli.main import main
from mig_spawner.core.allocator import SliceIndex
from mig_spawner.core.health import DriverEvent, Fault, FaultKind
from mig_spawner.core.keep import KeepOutcome
from mig_spawner.core.lifecycle import STOP_CODES, ReleaseCode, StopRule
from mig_spawner.core.policy import build_policy
from mig_spawner.core.policy.model import PolicyError
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost, uninstall
from mig_spawner.health import FaultWatch, healthy_now
from mig_spawner.hub.models import HubServer
from mig_spawner.ledger import FaultHold, LeaseRequest, Ledger
from mig_spawner.ledger.engine import create_ledger_engine
from mig_spawner.ledger.migrate import alembic_config, upgrade
from mig_spawner.service.cull_rules import fault_of, fault_stop
from mig_spawner.spawner.decide import faulty_models, make_decide
from mig_spawner.spawner.form import build_choices
from tests.mocking import T0

SPEC = "h200x2:layout=3g.71gb,2g.35gb,1g.18gb*2"
POLICY = build_policy(None, None, {"a": {"allowed": ["1g.18gb", "2g.35gb", "3g.71gb"],
                                          "max_slices_per_user": 9}})
# Long enough never to be reached when the event comes; the tests wait on the event.
EVENT_TIMEOUT = 30


@pytest.fixture
def host(tmp_path, backend_url):
    """A simulated two-GPU host, its adapter, a ledger, and a fault watch whose driver
    events are also handed to a queue the test waits on."""
    gpus = connect(SPEC, tmp_path / "sim.json")
    ledger = Ledger.open(backend_url)
    watch = FaultWatch(lambda: ledger, gpus)
    seen: queue.Queue[DriverEvent] = queue.Queue()

    def on_event(event: DriverEvent) -> None:
        watch.on_event(event)
        seen.put(event)

    gpus.watch_events(on_event, wait_ms=200)
    yield ledger, gpus, pynvml.nvmlLib.host, watch, seen
    ledger.close()
    gpus.close()
    uninstall()


def claim(ledger, gpus, user, offer="1g.18gb"):
    decide = make_decide(POLICY.for_user(["a"]), POLICY.offer(offer), gpus.inventory(),
                         "pool", "pack")
    return ledger.leases.claim(LeaseRequest(user), decide)


def test_a_lost_gpu_is_held_whole_until_cleared_and_other_gpus_keep_serving(host, backend_url):
    ledger, gpus, sim, watch, seen = host
    layout = [(gi.profile, gi.start) for gi in gpus.gpu(1).gpu_instances]
    on_1 = [claim(ledger, gpus, u) for u in ("ana", "bob", "cy", "dan")]
    assert [x.gpu_index for x in on_1] == [0, 0, 1, 1]  # pack: GPU 0's two first
    sim.lose_gpu(1)
    assert seen.get(timeout=EVENT_TIMEOUT).xid == 79
    new = watch.check(ledger.leases.active())
    assert {(f.gpu_index, f.kind, f.whole_gpu) for f in new} == {(1, FaultKind.XID, True),
                                                                 (1, FaultKind.LOST, True)}
    uuid1 = on_1[2].gpu_uuid
    assert set(ledger.holds.held()) == {(gpus.inventory().host, uuid1)}
    # Seen again at the next sweep: no new record.
    assert watch.check(ledger.leases.active()) == []
    # The GPU comes back after a reset with its layout made again: still withheld.
    sim.reset_gpu(1)
    for profile, start in layout:
        gpus.create_instance(1, profile, start)
    for gone in on_1[2:]:  # their servers were stopped: GPU 1 has nothing leased
        ledger.leases.release(gone.id, ReleaseCode.GPU_FAULT)
    with pytest.raises(Refused) as refused:
        claim(ledger, gpus, "eve")  # GPU 0 has no 1g.18gb left; GPU 1's are withheld
    assert refused.value.reason is Reason.GPU_UNHEALTHY
    assert "GPU 1 reported a hardware fault" in refused.value.message
    assert claim(ledger, gpus, "fay", "2g.35gb").gpu_index == 0  # GPU 0 serves on
    # A restart of every process remembers it.
    with Ledger.open(backend_url) as again:
        [lost, xid] = sorted(again.holds.faults(), key=lambda f: f.kind)
        assert (lost.kind, lost.gpu_index, lost.whole_gpu) == (FaultKind.LOST, 1, True)
        assert "fallen off the bus" in xid.detail and xid.seen_at <= xid.last_seen_at
        assert again.holds.clear_faults(gpus.inventory().host, uuid1, "admin") != []
    assert ledger.holds.faults() == [] and ledger.holds.held() == {}
    assert claim(ledger, gpus, "eve").gpu_index == 1


def test_an_application_xid_changes_nothing_and_a_contained_one_withholds_its_slice(host):
    ledger, gpus, sim, watch, seen = host
    inventory = gpus.inventory()
    small = next(d for d in inventory.gpus[1].mig_devices if d.profile == "1g.18gb")
    sim.inject_xid(13, (1, small.gi_id, small.ci_id))
    assert seen.get(timeout=EVENT_TIMEOUT).xid == 13
    assert watch.check([]) == [] and ledger.holds.held() == {}
    # Xid 94 (a contained ECC error), attributed by the driver to one instance: that
    # instance's slices only.
    sim.inject_xid(94, (1, small.gi_id, small.ci_id))
    assert seen.get(timeout=EVENT_TIMEOUT).gi_id == small.gi_id
    [fault] = watch.check([])
    assert not fault.whole_gpu and fault.held_slices == {small.start}
    got = [claim(ledger, gpus, u).mig_uuid for u in ("ana", "bob", "cy")]
    assert small.uuid not in got and len(set(got)) == 3
    with pytest.raises(Refused) as refused:
        claim(ledger, gpus, "dan")
    assert refused.value.reason is Reason.GPU_UNHEALTHY


def test_a_double_bit_ecc_error_withholds_the_whole_gpu(host):
    """nvml.h names an instance for Xid events only: a double-bit ECC event, and the
    volatile counter the polled check reads, concern the whole GPU."""
    _, gpus, sim, watch, seen = host
    sim.inject_ecc_error(1)
    assert seen.get(timeout=EVENT_TIMEOUT).xid is None
    found = watch.check([])
    assert {(f.kind, f.gpu_index, f.whole_gpu) for f in found} == {(FaultKind.ECC, 1, True)}
    assert found[0].held_slices == frozenset(range(8))  # the H200's memory slices
    healthy, still = healthy_now(gpus, found[0].gpu_uuid)
    assert not healthy and still[0].kind is FaultKind.ECC
    sim.reset_gpu(1)  # a reset clears the volatile count
    assert healthy_now(gpus, found[0].gpu_uuid) == (True, [])


def test_the_form_says_why_a_size_is_unavailable(ledger):
    inventory = connect(SPEC).inventory()
    index = SliceIndex(inventory)
    gpu = inventory.gpus[1]
    ledger.holds.record_faults(inventory.host, [FaultHold(
        Fault(FaultKind.ECC, 1, gpu.uuid, "a double-bit ECC error"), None, 8)])
    unhealthy = faulty_models(index, ledger.holds.faults(inventory.host))
    assert unhealthy == {gpu.model_key: "GPU 1 reported a hardware fault"}
    mine = POLICY.for_user(["a"])
    models = [inventory.model(k) for k in index.model_keys]
    free = {inventory.gpus[0].model_key: {"1g.18gb": 0, "2g.35gb": 1}}
    choices = {c.key: c for c in build_choices(mine, models, free, lambda o, n: None,
                                               unhealthy=unhealthy)}
    assert choices["1g.18gb"].unavailable == "GPU 1 reported a hardware fault"
    assert choices["2g.35gb"].available
    # Full as well: the fault is not the whole story, the holders come first.
    busy = {c.key: c for c in build_choices(mine, models, free, lambda o, n: None,
                                            in_use={"1g.18gb": 7}, unhealthy=unhealthy)}
    assert busy["1g.18gb"].unavailable == "all 7 in use; GPU 1 reported a hardware fault"
    # Without it the size reads as missing: nobody is told why.
    plain = {c.key: c for c in build_choices(mine, models, free, lambda o, n: None)}
    assert "hardware fault" not in (plain["1g.18gb"].unavailable or "")


def _server(user="ana"):
    return HubServer(user=user, name="", url=f"/user/{user}/", full_url=None, ready=True,
                     pending=None, started=T0, last_activity=T0)


def test_holders_are_warned_at_once_and_stopped_after_their_groups_fault_grace(host):
    ledger, gpus, sim, watch, seen = host
    leases = [claim(ledger, gpus, u) for u in ("ana", "bob", "cy")]
    sim.lose_gpu(1)
    seen.get(timeout=EVENT_TIMEOUT)
    watch.check(ledger.leases.active())
    faults = ledger.holds.faults()
    on_0, _, on_1 = leases
    assert fault_of(on_0, faults) is None
    fault = fault_of(on_1, faults)
    assert fault is not None and fault.gpu_index == 1
    seen_at = fault.seen_at
    stop, warning = fault_stop(seen_at, _server(), on_1, fault, 600.0)
    assert stop is None and warning.rule is StopRule.GPU_FAULT
    assert warning.deadline == seen_at + timedelta(seconds=600)
    assert "GPU 1" in warning.describe(seen_at) and "off the bus" in warning.describe(seen_at)
    stop, warning = fault_stop(seen_at + timedelta(seconds=600), _server(), on_1, fault, 600.0)
    assert stop.rule is StopRule.GPU_FAULT and warning is None
    assert STOP_CODES[stop.rule] is ReleaseCode.GPU_FAULT
    # At once, by policy; or never: told and left to finish.
    assert fault_stop(seen_at, _server(), on_1, fault, 0.0)[0] is not None
    stop, warning = fault_stop(seen_at + timedelta(days=9), _server(), on_1, fault, None)
    assert stop is None and warning.deadline is None
    assert ledger.warnings.warn(on_1.id, warning.rule, None, warning.describe(seen_at))
    assert ledger.leases.get(on_1.id).warning is StopRule.GPU_FAULT
    # Keep cannot put it off: the GPU itself is faulty.
    kept = ledger.warnings.keep(on_1.id, extend_by=3600, max_extensions=3)
    assert kept.outcome is KeepOutcome.REFUSED and "hardware fault" in kept.message


def test_fault_grace_and_action_are_group_settings_checked_with_the_others():
    default = build_policy(None, None, {"a": {"allowed": []}}).group("a")
    assert (default.fault_grace, default.fault_action) == (600, "stop")
    got = build_policy(None, None, {"a": {"fault_grace": None},
                                    "b": {"fault_grace": "2m", "fault_action": "finish"}})
    assert got.group("a").fault_grace is None
    assert (got.group("b").fault_grace, got.group("b").fault_action) == (120, "finish")
    with pytest.raises(PolicyError) as bad:
        build_policy(None, None, {"a": {"fault_grace": "soon", "fault_action": "stopp"}})
    assert "fault_grace" in str(bad.value) and "fault_action must be one of" in str(bad.value)


def test_migration_0015_adds_the_fault_table_and_goes_back(backend_url):
    engine = create_ledger_engine(backend_url)
    try:
        assert upgrade(engine, "0015") == "0015"
        assert "gpu_faults" in inspect(engine).get_table_names()
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0014")
        assert "gpu_faults" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_doctor_and_health_report_a_fault_and_clear_waits_for_a_healthy_gpu(tmp_path, capsys):
    state, url = tmp_path / "sim.json", f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    cli = ["--simulate", "h200x2:layout=1g.18gb*7", "--sim-state", str(state),
           "--ledger-url", url]
    with Ledger.open(url) as ledger, connect("h200x2:layout=1g.18gb*7", state) as gpus:
        assert main(["doctor", *cli]) == 0
        assert main(["health", *cli]) == 0
        assert "no GPU fault holds any slice" in capsys.readouterr().out
        SimulatedHost.open(state).set_remapped_rows(1, pending=True)
        FaultWatch(lambda: ledger, gpus).check([])
    assert main(["doctor", *cli]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] GPU health" in out and "waits for a GPU reset" in out
    assert "mig-spawner health clear GPU" in out
    assert main(["health", *cli]) == 1
    assert "GPU 1 (" in capsys.readouterr().out
    # status, the admin's first look, says the same under the GPU's picture.
    assert main(["status", *cli]) == 0
    out = capsys.readouterr().out
    assert "withheld: GPU 1 reported a hardware fault" in out.split("GPU 1 ", 1)[1], out
    assert "withheld" not in out.split("GPU 1 ", 1)[0]
    # Not healthy yet: the hold stays.
    assert main(["health", "clear", "1", *cli]) == 1
    assert "not healthy yet" in capsys.readouterr().err
    SimulatedHost.open(state).reset_gpu(1)  # applies the pending remap
    assert main(["health", "clear", "1", *cli]) == 0
    assert main(["health", "--all", "--json", *cli]) == 0
    [cleared] = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert cleared["kind"] == "row_remap" and cleared["cleared_by"]
