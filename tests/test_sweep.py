"""Decision tables for the slice service's sweep: which kernels and servers are culled, and why."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from mig_spawner.core.inventory import Gpu, GpuProcess, Inventory, MigDevice
from mig_spawner.core.lifecycle import StopRule
from mig_spawner.core.policy import GroupPolicy
from mig_spawner.hub.models import HubServer, Kernel, ServerStatus
from mig_spawner.ledger.records import Lease
from mig_spawner.service.cull_rules import (
    UNREACHABLE,
    Probe,
    SliceActivity,
    decide,
    decide_server,
    find_orphans,
    gpu_facts_to_record,
    needs_probe,
    recheck_kernels,
    unleased_busy_devices,
    warnings_due,
)
from tests.mocking import warned_of

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
MIN = 60.0


def ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


def server(active_ago: float | None = 5, started_ago: float = 60, **kw) -> HubServer:
    fields = dict(
        user="ana", name="", url="/user/ana/", full_url=None, ready=True, pending=None,
        started=ago(started_ago),
        last_activity=None if active_ago is None else ago(active_ago),
    )
    fields.update(kw)
    return HubServer(**fields)


def kernel(state: str = "idle", active_ago: float = 5, connections: int = 0, kid="k1") -> Kernel:
    return Kernel(kid, "python3", state, ago(active_ago), connections)


LIMITS = GroupPolicy(
    "analysts", server_idle_timeout=30 * MIN, kernel_idle_timeout=10 * MIN,
    max_session_age=8 * 60 * MIN,
)
BUSY_OK = GroupPolicy(
    "batch", server_idle_timeout=30 * MIN, kernel_idle_timeout=10 * MIN, cull_busy_kernels=True
)
NO_LIMITS = GroupPolicy("research")


# (case, server, limits, probe, expected [(rule, kernel_id)])
SERVER_TABLE = [
    ("recently active server stays", server(active_ago=5), LIMITS, None, []),
    ("idle past server limit is stopped on hub data alone",
     server(active_ago=31), LIMITS, None, [(StopRule.SERVER_IDLE, None)]),
    ("exactly at the limit is stopped", server(active_ago=30), LIMITS, None,
     [(StopRule.SERVER_IDLE, None)]),
    ("no limits: never culled", server(active_ago=10_000, started_ago=10_000),
     NO_LIMITS, None, []),
    ("over max age: stopped although active", server(active_ago=0, started_ago=481),
     LIMITS, None, [(StopRule.MAX_SESSION_AGE, None)]),
    ("over max age: stopped although unreachable", server(active_ago=0, started_ago=481),
     LIMITS, UNREACHABLE, [(StopRule.MAX_SESSION_AGE, None)]),
    ("over max age with a busy kernel: still stopped", server(started_ago=481), LIMITS,
     Probe(kernels=(kernel("busy", active_ago=400),)), [(StopRule.MAX_SESSION_AGE, None)]),
    ("hub says idle but server unreachable: never culled for that",
     server(active_ago=600), LIMITS, UNREACHABLE, []),
    ("hub says idle but a kernel is busy: stays",
     server(active_ago=45), LIMITS, Probe(kernels=(kernel("busy", active_ago=45),)), []),
    ("busy kernel with cull_busy_kernels: server idle",
     server(active_ago=45), BUSY_OK, Probe(kernels=(kernel("busy", active_ago=45),)),
     [(StopRule.SERVER_IDLE, None)]),
    ("hub activity stale but server's own status recent: stays",
     server(active_ago=45), LIMITS,
     Probe(status=ServerStatus(ago(60), ago(2), 0, 0)), []),
    ("hub activity stale, kernel active recently: stays, kernel not idle enough",
     server(active_ago=45), LIMITS, Probe(kernels=(kernel("idle", active_ago=3),)), []),
    ("no activity recorded: idle since start",
     server(active_ago=None, started_ago=31), LIMITS, None, [(StopRule.SERVER_IDLE, None)]),
    ("pending server is left alone",
     server(active_ago=600, started_ago=600, pending="stop"), LIMITS, None, []),
    ("not ready server is left alone",
     server(active_ago=600, started_ago=600, ready=False), LIMITS, None, []),
]


KEEP_CONNECTED = replace(LIMITS, cull_connected_kernels=False)

KERNEL_TABLE = [
    ("idle kernel past limit is shut down", [kernel("idle", 11)], LIMITS,
     [(StopRule.KERNEL_IDLE, "k1")]),
    ("idle kernel under limit stays", [kernel("idle", 9)], LIMITS, []),
    ("busy kernel never, by default", [kernel("busy", 60)], LIMITS, []),
    ("busy kernel with cull_busy_kernels", [kernel("busy", 11)], BUSY_OK,
     [(StopRule.KERNEL_IDLE, "k1")]),
    ("kernel nobody talked to (still 'starting') past limit",
     [kernel("starting", 11)], LIMITS, [(StopRule.KERNEL_IDLE, "k1")]),
    ("just started kernel stays", [kernel("starting", 1)], LIMITS, []),
    # An open tab does not keep an idle kernel, which holds the slice's memory (with a
    # lease its user is warned first: test_a_connected_kernel_is_warned_then_shut_down).
    ("connected idle kernel past limit is shut down too", [kernel("idle", 11, connections=1)],
     LIMITS, [(StopRule.KERNEL_IDLE, "k1")]),
    ("connected idle kernel stays where the group keeps connected kernels",
     [kernel("idle", 11, connections=1)], KEEP_CONNECTED, []),
    ("no kernel limit: none shut down", [kernel("idle", 600)], NO_LIMITS, []),
    ("only the idle one of two",
     [kernel("idle", 11, kid="old"), kernel("busy", 11, kid="work")], LIMITS,
     [(StopRule.KERNEL_IDLE, "old")]),
]


def outcome(decisions):
    return [(d.rule, d.kernel_id) for d in decisions]


def cull(now, srv, group, limits, probe, lease=None):
    """What the sweep culls on one server: ``decide_server``'s verdict, then ``decide``."""
    stop = decide_server(now, srv, group, limits, probe, lease)
    return decide(now, srv, group, limits, probe, stop, lease)


@pytest.mark.parametrize(("case", "srv", "limits", "probe", "expected"), SERVER_TABLE,
                         ids=[row[0] for row in SERVER_TABLE])
def test_server_decisions(case, srv, limits, probe, expected):
    assert outcome(cull(NOW, srv, limits.name, limits, probe)) == expected


@pytest.mark.parametrize(("case", "kernels", "limits", "expected"), KERNEL_TABLE,
                         ids=[row[0] for row in KERNEL_TABLE])
def test_kernel_decisions(case, kernels, limits, expected):
    # The server itself is active, so only kernel rules can fire.
    probe = Probe(kernels=tuple(kernels))
    decisions = cull(NOW, server(active_ago=1), limits.name, limits, probe)
    assert outcome(decisions) == expected


def test_a_connected_kernel_is_warned_then_shut_down():
    """The kernel limit is 10 min and ``warn_before`` 10 min: a connected kernel's user
    (the notebook is open) is warned half the kernel limit ahead, at the latest; the
    kernel goes at the warned time, not before; a Keep counts as using it."""
    limits = replace(LIMITS, warn_before=10 * MIN)
    srv = server(active_ago=1)
    open_idle = Probe(kernels=(kernel("idle", 6, connections=1),))
    held = leased(60, None)
    # Idle 6 of 10 min: its stop is 4 min away, within the 5-minute lead: warned.
    [warning] = warnings_due(NOW, srv, limits, open_idle, held)
    assert (warning.rule, warning.deadline) == (StopRule.KERNEL_IDLE, NOW + timedelta(minutes=5))
    assert cull(NOW, srv, limits.name, limits, open_idle, held) == []
    # Past its limit but warned only 2 minutes ago: it stays until the warned time...
    late = Probe(kernels=(kernel("idle", 11, connections=1),))
    warned = warned_of(held, StopRule.KERNEL_IDLE, NOW + timedelta(minutes=3), ago(2))
    assert cull(NOW, srv, limits.name, limits, late, warned) == []
    # ...and goes then.
    due = warned_of(held, StopRule.KERNEL_IDLE, ago(0.5), ago(2))
    assert outcome(cull(NOW, srv, limits.name, limits, late, due)) == [(StopRule.KERNEL_IDLE, "k1")]
    # Keep my server a minute ago: the kernel counts as used then.
    kept = replace(held, kept_at=ago(1))
    assert cull(NOW, srv, limits.name, limits, late, kept) == []
    assert warnings_due(NOW, srv, limits, late, kept) == []
    # An unconnected kernel is nobody's open notebook: shut down at its limit, unwarned.
    alone = Probe(kernels=(kernel("idle", 11),))
    assert warnings_due(NOW, srv, limits, alone, held) == []
    assert outcome(cull(NOW, srv, limits.name, limits, alone, held)) == [
        (StopRule.KERNEL_IDLE, "k1")]
    # A group that keeps connected kernels: neither warned nor shut down.
    keeps = replace(limits, cull_connected_kernels=False)
    assert warnings_due(NOW, srv, keeps, open_idle, held) == []
    assert cull(NOW, srv, keeps.name, keeps, late, held) == []


@pytest.mark.parametrize(("case", "kernels", "limits", "expected"), KERNEL_TABLE,
                         ids=[row[0] for row in KERNEL_TABLE])
def test_a_server_shuts_down_what_was_decided_while_nothing_changed(
        case, kernels, limits, expected):
    """Given the kernels as the service saw them, mig-spawner's single-user extension
    shuts down exactly the kernels decided on: the same decisions as a DELETE each."""
    probe = Probe(kernels=tuple(kernels))
    decided = cull(NOW, server(active_ago=1), limits.name, limits, probe)
    running = {k.id: k for k in kernels}
    asked = [(d.kernel_id, running[d.kernel_id].last_activity) for d in decided]
    plan = recheck_kernels(running, asked, limits.cull_busy_kernels,
                           limits.cull_connected_kernels)
    assert list(plan.shut_down) == [d.kernel_id for d in decided]
    assert plan.kept == plan.unknown == ()


RECHECK_TABLE = [
    # (case, the kernel now, cull_busy, cull_connected, outcome)
    ("as seen", kernel("idle", 11), False, False, "shut_down"),
    ("a cell ran since the look", kernel("idle", 1), False, False, "kept"),
    ("busy now, with no message since", kernel("busy", 11), False, False, "kept"),
    ("busy now, busy kernels may go", kernel("busy", 11), True, False, "shut_down"),
    ("a tab connected since", kernel("idle", 11, connections=1), False, False, "kept"),
    ("a tab connected, connected kernels may go", kernel("idle", 11, connections=1),
     False, True, "shut_down"),
]


@pytest.mark.parametrize(("case", "now", "cull_busy", "cull_connected", "expected"),
                         RECHECK_TABLE, ids=[row[0] for row in RECHECK_TABLE])
def test_a_kernel_in_use_since_the_look_is_kept(case, now, cull_busy, cull_connected,
                                                expected):
    plan = recheck_kernels({"k1": now}, [("k1", ago(11))], cull_busy, cull_connected)
    assert getattr(plan, expected) == ("k1",)


def test_a_kernel_gone_or_never_there_is_reported_not_shut_down():
    plan = recheck_kernels({"k1": kernel("idle", 11)},
                           [("gone", ago(11)), ("k1", ago(11)), ("../forged", None)],
                           False, False)
    assert plan.shut_down == ("k1",) and plan.unknown == ("gone", "../forged")


def test_decision_carries_who_what_and_measured_idle_time():
    [d] = cull(NOW, server(active_ago=45, name="big"), "analysts", LIMITS, None)
    assert (d.user, d.server, d.group, d.rule) == ("ana", "big", "analysts", StopRule.SERVER_IDLE)
    assert d.idle_seconds == 45 * MIN
    assert d.limit_seconds == 30 * MIN
    assert d.stops_server
    assert d.describe() == (
        "server ana/big (group analysts): server_idle, idle 00:45:00 >= limit 00:30:00"
    )


def test_kernel_decision_does_not_stop_the_server():
    [d] = cull(NOW, server(), "analysts", LIMITS, Probe(kernels=(kernel("idle", 12),)))
    assert not d.stops_server
    assert d.describe().startswith("kernel k1 of ana (group analysts): kernel_idle, idle 00:12")


def test_server_stop_takes_precedence_over_kernel_shutdowns():
    probe = Probe(kernels=(kernel("idle", 50),))
    assert outcome(cull(NOW, server(active_ago=50), "a", LIMITS, probe)) == [
        (StopRule.SERVER_IDLE, None)
    ]


@pytest.mark.parametrize(
    ("srv", "limits", "expected"),
    [
        (server(active_ago=5), LIMITS, True),  # kernel limit set: look at kernels
        (server(active_ago=5), GroupPolicy("s", server_idle_timeout=30 * MIN), False),
        (server(active_ago=31), GroupPolicy("s", server_idle_timeout=30 * MIN), True),
        (server(started_ago=481), LIMITS, False),  # max age: stopped without looking
        (server(active_ago=600), NO_LIMITS, False),
        (server(pending="spawn"), LIMITS, False),
    ],
)
def test_needs_probe_only_when_a_look_inside_can_change_the_outcome(srv, limits, expected):
    by_hub_data = decide_server(NOW, srv, limits.name, limits, None)
    assert needs_probe(NOW, srv, limits, None, by_hub_data) is expected


def lease(lid: str, user: str, server_name: str = "", claimed_ago: float = 60,
          state: str = "active", mig_uuid: str | None = None) -> Lease:
    return Lease(
        id=lid, user=user, server_name=server_name, group="analysts", profile="1g.18gb",
        compute_slices=1, mode="pool", state=state, claimed_at=ago(claimed_ago),
        mig_uuid=mig_uuid,
    )


def test_orphan_released_only_after_missing_for_the_grace_period():
    leases = [lease("L1", "ana"), lease("L2", "bob"), lease("L3", "cy", "gpu")]
    running = {("bob", "")}
    orphans, missing = find_orphans(NOW, leases, running, {}, grace=5 * MIN)
    assert orphans == []  # first sweep that misses them starts the clock
    assert set(missing) == {"L1", "L3"}

    later = NOW + timedelta(minutes=5)
    orphans, missing = find_orphans(later, leases, running, missing, grace=5 * MIN)
    assert [o.id for o in orphans] == ["L1", "L3"]


def test_orphan_clock_resets_when_the_server_shows_up_again():
    leases = [lease("L1", "ana")]
    _, missing = find_orphans(NOW, leases, set(), {}, grace=5 * MIN)
    _, missing = find_orphans(NOW + timedelta(minutes=3), leases, {("ana", "")}, missing, 300)
    assert missing == {}
    orphans, _ = find_orphans(NOW + timedelta(minutes=6), leases, set(), missing, 300)
    assert orphans == []


def test_a_releasing_lease_whose_server_is_gone_is_retried_at_once_not_after_the_grace():
    # A stop whose give-back failed: retried at every sweep while the hub does not run it.
    leases = [lease("L1", "ana", state="releasing", claimed_ago=1), lease("L2", "bob",
              state="releasing")]
    orphans, _ = find_orphans(NOW, leases, {("bob", "")}, {}, grace=5 * MIN)
    assert [o.id for o in orphans] == ["L1"]


def test_fresh_claim_is_not_an_orphan_while_its_spawn_may_be_in_flight():
    young = lease("L1", "ana", claimed_ago=1)
    orphans, missing = find_orphans(NOW, [young], set(), {"L1": ago(10)}, grace=5 * MIN)
    assert orphans == []
    assert "L1" in missing


def test_released_leases_are_never_orphans():
    gone = lease("L1", "ana", state="released")
    orphans, missing = find_orphans(NOW, [gone], set(), {"L1": ago(60)}, grace=0)
    assert (orphans, missing) == ([], {})


def mig(uuid: str, pids: tuple[int, ...]) -> MigDevice:
    return MigDevice(
        uuid=uuid, gpu_index=0, gpu_uuid="GPU-0", index=0, name="1g.18gb", profile="1g.18gb",
        gi_id=7, ci_id=0, start=0, size=1, memory_total_mib=16000, memory_used_mib=100,
        processes=tuple(GpuProcess(p, 100) for p in pids),
    )


def test_busy_device_without_a_lease_is_reported():
    gpu = Gpu(
        index=0, uuid="GPU-0", product="NVIDIA H200", model_key="h200", minor=0,
        memory_total_mib=143000, mig_current=True, mig_pending=True, mig_supported=True,
        gpu_instances=(),
        mig_devices=(mig("MIG-a", (11,)), mig("MIG-b", (12,)), mig("MIG-c", ())),
    )
    inventory = Inventory(host="h", driver_version="580", nvml_version="13",
                          cuda_driver_version=13000, gpus=(gpu,))
    # MIG-a is held; MIG-b's lease ended; MIG-c runs nothing.
    assert [d.uuid for d in unleased_busy_devices(inventory, ["MIG-a"])] == ["MIG-b"]


def whole(uuid: str, pids: tuple[int, ...], mig: bool = False, pending: bool | None = None,
          supported: bool = True, unknown: bool = False) -> Gpu:
    return Gpu(index=1, uuid=uuid, product="NVIDIA H200", model_key="h200", minor=1,
               memory_total_mib=143000, mig_current=mig,
               mig_pending=mig if pending is None else pending, mig_supported=supported,
               processes=tuple(GpuProcess(p, 100) for p in pids), processes_unknown=unknown)


def test_a_busy_whole_gpu_without_a_lease_is_reported_as_a_slice_would_be():
    gpus = (whole("GPU-held", (11,)), whole("GPU-stray", (12, 13)), whole("GPU-idle", ()),
            whole("GPU-unlisted", (), unknown=True),
            # Its processes are the ones a mode change waits for (reported elsewhere).
            whole("GPU-resetting", (14,), mig=False, pending=True),
            # Not a GPU mig-spawner could lease (a display GPU).
            whole("GPU-other", (15,), supported=False))
    inventory = Inventory(host="h", driver_version="580", nvml_version="13",
                          cuda_driver_version=13000, gpus=gpus)
    found = unleased_busy_devices(inventory, ["GPU-held"])
    assert [(d.uuid, d.what, d.pids) for d in found] == [
        ("GPU-stray", "whole GPU", (12, 13)), ("GPU-unlisted", "whole GPU", ())]


def leased(claimed_ago: float, expires_in: float | None) -> Lease:
    return Lease(id="L1", user="ana", server_name="", group="analysts", profile="1g.18gb",
                 compute_slices=1, mode="pool", state="active", claimed_at=ago(claimed_ago),
                 expires_at=None if expires_in is None else NOW + timedelta(minutes=expires_in))


@pytest.mark.parametrize(
    ("case", "started_ago", "lease", "expected"),
    [
        # The hub's "started" (reset, or not, by a hub restart) does not matter once a
        # lease records the deadline: the lease is the one truth.
        ("lease expired although the hub says it started a minute ago", 1,
         leased(8 * 60 + 1, -1), [(StopRule.MAX_SESSION_AGE, None)]),
        ("lease not expired although the hub says it started 9 h ago", 9 * 60,
         leased(9 * 60, 30), []),
        ("lease without a deadline (group had none at claim)", 9 * 60, leased(9 * 60, None),
         []),
        ("no lease: the hub's start plus the limit", 8 * 60 + 1, None,
         [(StopRule.MAX_SESSION_AGE, None)]),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_session_age_is_the_leases_expires_at(case, started_ago, lease, expected):
    srv = server(active_ago=1, started_ago=started_ago)
    assert outcome(cull(NOW, srv, "analysts", LIMITS, Probe(), lease=lease)) == expected


def test_session_age_decision_measures_from_the_claim():
    [d] = cull(NOW, server(active_ago=1), "analysts", LIMITS, Probe(),
                 lease=leased(8 * 60 + 5, -5))
    assert d.rule is StopRule.MAX_SESSION_AGE
    assert (d.age_seconds, d.limit_seconds) == ((8 * 60 + 5) * MIN, 8 * 60 * MIN)


@pytest.mark.parametrize(
    ("case", "activity", "working"),
    [
        ("a process with SM activity", SliceActivity(1, 9000, sm_active=0.6), True),
        ("a process holding a context, SMs idle", SliceActivity(1, 9000, sm_active=0.01),
         False),
        ("a process on a GPU without GPM", SliceActivity(1, 9000, sm_active=None), True),
        ("memory held with no process and no SM activity", SliceActivity(0, 60000, 0.0),
         False),
        ("processes cannot be read: busy, never idle", SliceActivity(0, 0, None, True), True),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_what_counts_as_gpu_work(case, activity, working):
    assert activity.working is working


def gpu_lease(gpu_active_ago: float | None) -> Lease:
    # Warned of the idle stop, whose time has come: only activity can keep it now.
    return warned_of(replace(leased(60, None), gpu_active_at=None if gpu_active_ago is None
                             else ago(gpu_active_ago)), StopRule.SERVER_IDLE, ago(1))


@pytest.mark.parametrize(
    ("case", "lease", "limits", "expected"),
    [
        ("GPU work within the idle limit keeps an idle server", gpu_lease(5), LIMITS, []),
        ("GPU work longer ago than the limit does not", gpu_lease(31), LIMITS,
         [(StopRule.SERVER_IDLE, None)]),
        ("never any GPU work", gpu_lease(None), LIMITS, [(StopRule.SERVER_IDLE, None)]),
        ("the group says GPU work does not count", gpu_lease(5),
         replace(LIMITS, gpu_activity_counts=False), [(StopRule.SERVER_IDLE, None)]),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_gpu_work_is_activity(case, lease, limits, expected):
    srv = server(active_ago=45)
    assert outcome(cull(NOW, srv, "analysts", limits, Probe(), lease=lease)) == expected


def test_gpu_facts_record_work_and_a_new_peak_only():
    lease = replace(leased(60, None), peak_memory_mib=20000)
    assert gpu_facts_to_record(NOW, lease, SliceActivity(1, 30000, 0.5)) == {
        "gpu_active_at": NOW, "peak_memory_mib": 30000}
    assert gpu_facts_to_record(NOW, lease, SliceActivity(0, 10000, 0.0)) == {}


@pytest.mark.parametrize(
    ("case", "srv", "lease", "expected"),
    [
        ("idle 21 of 30 min, warn 10 min before: warned, stop due in 9 min",
         server(active_ago=21), None, (StopRule.SERVER_IDLE, NOW + timedelta(minutes=9))),
        ("idle 19 of 30 min: too early", server(active_ago=19), None, None),
        ("kept a minute ago: not idle", server(active_ago=25),
         replace(leased(60, None), kept_at=ago(1)), None),
        ("session ends in 5 min, server active", server(active_ago=1), leased(60, 5),
         (StopRule.MAX_SESSION_AGE, NOW + timedelta(minutes=5))),
        ("both due: each warned, the sooner first", server(active_ago=25), leased(60, 2),
         (StopRule.MAX_SESSION_AGE, NOW + timedelta(minutes=2))),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_warning_before_a_stop(case, srv, lease, expected):
    limits = replace(LIMITS, warn_before=10 * MIN)
    due = [(w.rule, w.deadline) for w in warnings_due(NOW, srv, limits, Probe(), lease)]
    assert due[:1] == ([] if expected is None else [expected])
    assert warnings_due(NOW, srv, replace(limits, warn_before=None), Probe(), lease) == []
