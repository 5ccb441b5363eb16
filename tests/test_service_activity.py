"""The slice service writes each server's latest activity on its lease, so that the slice
map's idle time and the usage report's idle share are real, not "idle since start".

The rule as a table (pure), then sweeps against the stand-in hub and a real SQLite ledger.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.lifecycle import StopRule, WarningState
from mig_spawner.core.policy import GroupPolicy
from mig_spawner.hub.client import HubClient
from mig_spawner.hub.models import HubServer, Kernel, ServerStatus
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.service.cull_rules import HUB_DATA_ONLY, Probe, activity_to_record
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper
from tests.support.hub_standin import StandinState

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


def server(active_ago: float | None) -> HubServer:
    return HubServer(user="ana", name="", url="/user/ana/", full_url=None, ready=True,
                     pending=None, started=ago(120),
                     last_activity=None if active_ago is None else ago(active_ago))


def kernel(state: str, active_ago: float) -> Kernel:
    return Kernel("k1", "python3", state, ago(active_ago), 0)


# (case, server, probe, recorded on the lease, expected write)
TABLE = [
    ("hub activity newer than the lease's: written", server(5), HUB_DATA_ONLY, ago(30),
     ago(5)),
    ("moved on by less than the resolution: nothing written", server(5), HUB_DATA_ONLY,
     ago(5.5), None),
    ("older than the lease's: nothing written (touch only moves forward)", server(50),
     HUB_DATA_ONLY, ago(30), None),
    ("nothing recorded yet: written", server(5), HUB_DATA_ONLY, None, ago(5)),
    ("not looked at this sweep: nothing written (the hub's time is an open tab's)",
     server(5), None, ago(30), None),
    ("a kernel's activity is later than the hub's", server(40),
     Probe(kernels=(kernel("idle", 3),)), ago(30), ago(3)),
    ("the server's own status is later than the hub's", server(40),
     Probe(status=ServerStatus(started=ago(120), last_activity=ago(2), connections=0,
                               kernels=0)), ago(30), ago(2)),
    ("a busy kernel is activity now, however long its output is silent", server(90),
     Probe(kernels=(kernel("busy", 90),)), ago(30), NOW),
    ("never active: its start counts", server(None), HUB_DATA_ONLY, None, ago(120)),
]


@pytest.mark.parametrize(("case", "srv", "probe", "recorded", "expected"), TABLE,
                         ids=[row[0] for row in TABLE])
def test_what_activity_is_written_on_the_lease(case, srv, probe, recorded, expected):
    limits = GroupPolicy("analysts")
    assert activity_to_record(NOW, srv, limits, probe, recorded, resolution=60) == expected


POLICY = MIGPolicyConfig(group_policies={
    "analysts": {"allowed": ["1g.18gb"], "server_idle_timeout": "1h"},
}).build()


def claim(ledger: Ledger, user: str, start: int) -> str:
    def decide(view):
        return Grant(group="analysts", profile="1g.18gb", compute_slices=1, mode="pool",
                        host="h", gpu_uuid="GPU-0", gpu_index=0, start=start, size=1,
                        mig_uuid=f"MIG-{start}")
    return ledger.leases.activate(ledger.leases.claim(LeaseRequest(user), decide).id).id


@pytest.fixture
async def world(tmp_path, serve_hub):
    """The stand-in hub (user00001 active a minute ago, user00000 idle for 2 h), a
    ledger whose leases were claimed 90 minutes ago, and the stand-in's state."""
    now = datetime.now(UTC)
    state = StandinState.build(3, idle_every=3, now=now)
    base = serve_hub(state)
    claimed = now - timedelta(minutes=90)
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.sqlite", clock=lambda: claimed) as ledger:
        leases = {user: claim(ledger, user, i) for i, user in enumerate(state.users)}
        yield base, ledger, leases, now, state


def sweeper(base: str, ledger: Ledger, **kw) -> Sweeper:
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
    return Sweeper(client, POLICY, ServiceMetrics(), ledger=ledger, probe_servers=False, **kw)


async def test_a_sweep_writes_the_hubs_activity_on_each_lease(world):
    base, ledger, leases, now, _ = world
    before = ledger.leases.get(leases["user00001"]).last_activity_at
    assert before < now - timedelta(minutes=89)  # as claimed: "idle" for 90 minutes

    await sweeper(base, ledger).sweep()
    active = ledger.leases.get(leases["user00001"]).last_activity_at
    assert now - timedelta(minutes=2) < active < now  # the hub said: a minute ago
    # Idle for 2 h by the hub, which is before the claim: the lease keeps its time.
    assert ledger.leases.get(leases["user00000"]).last_activity_at == before


async def test_a_dry_run_writes_nothing(world):
    base, ledger, leases, *_ = world
    before = ledger.leases.get(leases["user00001"]).last_activity_at
    await sweeper(base, ledger, dry_run=True).sweep()
    assert ledger.leases.get(leases["user00001"]).last_activity_at == before


@pytest.mark.parametrize("dry_run", [True, False])
async def test_warnings_are_recorded_or_in_dry_run_only_listed(world, dry_run):
    base, ledger, leases, *_ = world
    # Warn 59.5 min ahead of a 1 h limit: user00001, active a minute ago, is due one;
    # user00000, idle for 2 h, is warned too (never stopped unannounced; a dry run,
    # which records no warning, says it would be stopped).
    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "server_idle_timeout": "1h", "warn_before": "59m30s"}}).build()
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
    sweeper = Sweeper(client, policy, ServiceMetrics(), ledger=ledger, probe_servers=False,
                      dry_run=dry_run)
    report = await sweeper.sweep()
    warned = {who: w.rule.value for who, w in report.warnings}
    assert warned.get("user00001") == "server_idle"
    assert ("user00000" in warned) is not dry_run
    stopped = {d.user for d in report.decisions}
    assert stopped == ({"user00000"} if dry_run else set())
    events = ledger.warnings.events(leases["user00001"])
    assert [e.kind for e in events] == ([] if dry_run else ["warned"])
    if not dry_run:  # once per coming stop, not every sweep
        await sweeper.sweep()
        assert len(ledger.warnings.events(leases["user00001"])) == 1


async def test_a_warning_stands_while_its_server_cannot_be_read(world):
    """Not knowing is not activity: a sweep that cannot read a warned server (a moment of
    load, a proxy hiccup) neither withdraws the warning nor gives it again after, which
    put the stop off by ``warn_before`` and showed the user a second warning."""
    base, ledger, leases, _, state = world
    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "server_idle_timeout": "1h", "warn_before": "59m30s"}}).build()
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
    sweeper = Sweeper(client, policy, ServiceMetrics(), ledger=ledger, probe_servers=True)
    lease = leases["user00001"]
    await sweeper.sweep()
    warned = ledger.leases.get(lease)
    assert warned.warning == "server_idle"

    state.unreachable.add("user00001")
    await sweeper.sweep()
    assert sweeper.metrics.registry.get_sample_value(
        "mig_spawner_service_errors_total", {"kind": "server_unreachable"}) >= 1
    during = ledger.leases.get(lease)
    assert (during.warning, during.warning_deadline) == ("server_idle",
                                                         warned.warning_deadline)

    state.unreachable.clear()
    await sweeper.sweep()
    after = ledger.leases.get(lease)
    assert (after.warning, after.warning_deadline) == ("server_idle", warned.warning_deadline)
    assert [e.kind for e in ledger.warnings.events(lease)] == ["warned"]


async def test_a_lease_granted_while_the_sweep_lists_the_hub_is_read_at_its_address(
        tmp_path, serve_hub, caplog):
    """A waiter's spawn granted and started after the sweep read the ledger, before it
    listed the hub: its lease is read again, and the server at its internal address, not
    through the proxy (where each read counts as the user's activity, and one still
    starting answers 424)."""
    now = datetime.now(UTC)
    state = StandinState.build(1, idle_every=0, kernels_per_server=1, now=now)
    base = serve_hub(state)
    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "kernel_idle_timeout": "1h"}}).build()
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.sqlite") as ledger:
        client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
        sweeper = Sweeper(client, policy, ServiceMetrics(), ledger=ledger)
        read = sweeper._leases

        async def granted_meanwhile() -> list:
            held = await read()
            lease = ledger.leases.claim(LeaseRequest("user00000"), lambda view: Grant(
                group="analysts", profile="1g.18gb", compute_slices=1, mode="pool",
                host="h", gpu_uuid="GPU-0", gpu_index=0, start=0, size=1,
                mig_uuid="MIG-0"))
            ledger.leases.activate(lease.id, server_url=f"{base}/user/user00000/")
            return held

        sweeper._leases = granted_meanwhile
        with caplog.at_level("WARNING"):
            report = await sweeper.sweep()
    assert report.complete and report.servers == 1
    assert state.requests.get(("GET", "user"), 0) >= 1  # its kernels were read...
    assert "records no internal URL" not in caplog.text  # ...at its own address


async def test_a_warned_server_is_stopped_through_the_hub_and_its_warning_carried_out(world):
    """The warning's life ends where its stop is carried out: the service asks the hub to
    stop the server (the hub's stop releases the lease) and marks the warning carried
    out; its rule stays on the lease, as history."""
    base, ledger, leases, now, state = world
    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "server_idle_timeout": "1h", "warn_before": "1m"}}).build()
    clock = [now]
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
    sweeper = Sweeper(client, policy, ServiceMetrics(), ledger=ledger, probe_servers=False,
                      clock=lambda: clock[0])
    idle = leases["user00000"]  # idle for 2 h: warned first, never stopped unannounced
    await sweeper.sweep()
    assert ledger.leases.get(idle).warning_state is WarningState.PENDING and state.stopped == []
    clock[0] += timedelta(minutes=1, seconds=1)  # the warning's minute has passed
    report = await sweeper.sweep()
    assert [d.rule for d in report.carried_out] == [StopRule.SERVER_IDLE]
    assert state.stopped == ["user00000/"]
    stopped = ledger.leases.get(idle)
    assert (stopped.warning, stopped.warning_state) == (StopRule.SERVER_IDLE,
                                                       WarningState.CARRIED_OUT)
    # The other servers, active a minute ago, were never warned.
    assert {ledger.leases.get(x).warning_state for x in leases.values() if x != idle} == {None}
