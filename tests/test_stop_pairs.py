"""Every limit keeps applying whatever else is pending: the soonest stop wins, and each
stop has its own warning, whose time is the one carried out unless activity or Keep
withdraws it (docs/culling.md, "Warnings and Keep my server").

Each pair of an idle limit (the server's, a connected kernel's) and another stop (a
layout change's drain, a budget, the session's age, the other idle limit), swept by the
slice service against the stand-in hub and a real SQLite ledger, on a clock the test
moves. The shipped analysts' limits: servers idle 30 min, kernels 15 min, a warning 10
min ahead (a kernel's at most half its limit: 7.5 min), a drain notice of 1 h.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.lifecycle import StopRule, WarningEvent
from mig_spawner.hub.client import HubClient
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper
from tests.support.hub_standin import StandinState, iso

MIN = timedelta(minutes=1)
LIMITS = {"allowed": ["1g.18gb"], "server_idle_timeout": "30m", "kernel_idle_timeout": "15m",
          "warn_before": "10m", "drain_notice": "1h"}
USER = "user00000"


class World:
    """One user's server on the stand-in hub, its lease (claimed 90 min before T0), and a
    sweeper whose clock the test sets."""

    def __init__(self, base: str, ledger: Ledger, state: StandinState, lease: str,
                 t0: datetime, **limits: object) -> None:
        self.ledger, self.state, self.lease, self.t0 = ledger, state, lease, t0
        self.now = t0
        policy = MIGPolicyConfig(group_policies={"analysts": {**LIMITS, **limits}}).build()
        client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
        self.sweeper = Sweeper(client, policy, ServiceMetrics(), ledger=ledger,
                               clock=lambda: self.now)

    def server_active(self, ago: timedelta) -> None:
        model = self.state.users[USER]
        model["last_activity"] = model["servers"][""]["last_activity"] = iso(self.now - ago)

    def open_kernel(self, idle_for: timedelta) -> None:
        """A notebook open on a kernel idle for ``idle_for``: its user loses its memory."""
        self.state.kernels[USER] = [{
            "id": "k1", "name": "python3", "last_activity": iso(self.now - idle_for),
            "execution_state": "idle", "connections": 1}]

    async def sweep_at(self, after_t0: timedelta) -> list[StopRule]:
        """Sweep at T0 + ``after_t0``; the rules carried out."""
        self.now = self.t0 + after_t0
        report = await self.sweeper.sweep()
        assert report.error is None, report.error
        return [d.rule for d in report.carried_out]

    def warned(self) -> list[StopRule]:
        """The rules the user was warned of, in the order the warnings came."""
        return [e.rule for e in self.ledger.warnings.events(self.lease)
                if e.kind is WarningEvent.WARNED]

    def told(self, rule: StopRule) -> datetime | None:
        """The stop time the pending warning of ``rule`` tells (``None``: none pending)."""
        stop = self.ledger.leases.get(self.lease).pending_stop(rule)
        return None if stop is None else stop.deadline


@pytest.fixture
async def world(tmp_path, serve_hub):
    """Makes the :class:`World` (``session_left``: its session ends that long after T0)."""
    t0 = datetime.now(UTC)
    state = StandinState.build(1, idle_every=0, now=t0)  # active a minute ago
    base = serve_hub(state)
    claimed = t0 - 90 * MIN
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.sqlite", clock=lambda: claimed) as ledger:
        def make(session_left: timedelta | None = None, **limits: object) -> World:
            ends = {} if session_left is None else {"expires_at": t0 + session_left}

            def decide(view):
                return Grant(group="analysts", profile="1g.18gb", compute_slices=1,
                             mode="pool", host="h", gpu_uuid="GPU-0", gpu_index=0, start=0,
                             size=1, mig_uuid="MIG-0", **ends)
            lease = ledger.leases.activate(ledger.leases.claim(LeaseRequest(USER), decide).id)
            return World(base, ledger, state, lease.id, t0, **limits)
        yield make


async def test_an_idle_server_is_warned_and_stopped_though_its_gpu_is_being_re_cut(world):
    """The bug report: a re-cut waiting for its drain notice (1 h) left the GPU's idle
    holders alone; the idle limit applies, with its own warning, the drain's kept."""
    w = world()
    drain_at = w.t0 + 60 * MIN
    w.ledger.warnings.warn(w.lease, StopRule.DRAIN, drain_at, "GPU 0 is re-cut")
    w.server_active(ago=20 * MIN)  # idle 20 of 30 min: its stop is 10 min away
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.DRAIN, StopRule.SERVER_IDLE]
    assert w.told(StopRule.SERVER_IDLE) == w.t0 + 10 * MIN
    assert w.told(StopRule.DRAIN) == drain_at  # the re-cut's warning stands, untouched
    assert await w.sweep_at(9 * MIN) == []
    # The service's /metrics count the stops to come by rule (no user label).
    assert {rule: w.sweeper.metrics.registry.get_sample_value(
        "mig_spawner_service_pending_stops", {"rule": rule}) for rule in StopRule} == {
        **dict.fromkeys(StopRule, 0.0), StopRule.DRAIN: 1.0, StopRule.SERVER_IDLE: 1.0}
    assert await w.sweep_at(10 * MIN) == [StopRule.SERVER_IDLE]
    assert w.state.stopped == [f"{USER}/"]
    assert w.warned() == [StopRule.DRAIN, StopRule.SERVER_IDLE]


async def test_an_open_idle_kernel_is_warned_and_shut_down_though_its_gpu_is_being_re_cut(
        world):
    w = world()
    w.ledger.warnings.warn(w.lease, StopRule.DRAIN, w.t0 + 60 * MIN, "GPU 0 is re-cut")
    w.open_kernel(idle_for=10 * MIN)  # its stop is 5 min away, within its 7.5 min lead
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.DRAIN, StopRule.KERNEL_IDLE]
    assert w.told(StopRule.KERNEL_IDLE) == w.t0 + 7.5 * MIN  # no sooner than its lead
    assert await w.sweep_at(7.5 * MIN) == [StopRule.KERNEL_IDLE]
    assert w.state.kernels[USER] == [] and w.state.stopped == []
    # The kernel is gone: its warning is withdrawn, the drain's stays.
    await w.sweep_at(8 * MIN)
    assert w.told(StopRule.KERNEL_IDLE) is None
    assert w.told(StopRule.DRAIN) == w.t0 + 60 * MIN


async def test_a_kernels_warning_does_not_move_the_servers_idle_stop(world):
    """Both due at once (the report: warned at 22:33, warned again at 22:34:41, stopped at
    22:37:41): each stop has its own warning; the server stops at the time first told."""
    w = world()
    w.server_active(ago=25 * MIN)
    w.open_kernel(idle_for=20 * MIN)  # the server's latest activity: its stop is 10 min away
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.KERNEL_IDLE, StopRule.SERVER_IDLE]
    assert w.told(StopRule.SERVER_IDLE) == w.t0 + 10 * MIN
    assert await w.sweep_at(7.5 * MIN) == [StopRule.KERNEL_IDLE]
    assert await w.sweep_at(8 * MIN) == []
    assert w.told(StopRule.SERVER_IDLE) == w.t0 + 10 * MIN
    assert await w.sweep_at(10 * MIN) == [StopRule.SERVER_IDLE]
    assert w.warned() == [StopRule.KERNEL_IDLE, StopRule.SERVER_IDLE]  # once each


async def test_an_idle_server_spending_a_budget_is_warned_of_both_and_the_sooner_wins(world):
    """A budget warned of since 70 % was spent (1.5 h of 2 h: it runs out in 30 min); the
    idle stop comes first, with its own warning; activity withdraws the idle warning
    only, and the budget is not warned of again."""
    w = world(budget="2h", budget_warn_share=0.7)  # 1.5 h of 2 h spent: 75 %
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.BUDGET]
    runs_out = w.told(StopRule.BUDGET)
    assert abs(runs_out - (w.t0 + 30 * MIN)) < timedelta(seconds=1)  # counted in seconds
    w.server_active(ago=19 * MIN)
    assert await w.sweep_at(1 * MIN) == []
    assert w.warned() == [StopRule.BUDGET, StopRule.SERVER_IDLE]
    assert w.told(StopRule.SERVER_IDLE) == w.t0 + 11 * MIN
    w.server_active(ago=0 * MIN)  # the user is back: the idle stop is off
    assert await w.sweep_at(2 * MIN) == []
    assert w.told(StopRule.SERVER_IDLE) is None
    assert w.told(StopRule.BUDGET) == runs_out
    assert w.warned() == [StopRule.BUDGET, StopRule.SERVER_IDLE]  # no second budget warning


async def test_an_open_idle_kernel_is_shut_down_before_a_budget_stop_and_the_budget_stands(
        world):
    w = world(budget="2h", budget_warn_share=0.7)
    w.open_kernel(idle_for=10 * MIN)
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.KERNEL_IDLE, StopRule.BUDGET]
    runs_out = w.told(StopRule.BUDGET)
    assert await w.sweep_at(7.5 * MIN) == [StopRule.KERNEL_IDLE]
    await w.sweep_at(8 * MIN)
    assert w.told(StopRule.BUDGET) == runs_out
    assert w.told(StopRule.KERNEL_IDLE) is None
    assert w.warned() == [StopRule.KERNEL_IDLE, StopRule.BUDGET]


async def test_an_idle_server_whose_session_ends_sooner_stops_for_its_age(world):
    w = world(session_left=5 * MIN)
    w.server_active(ago=20 * MIN)  # its idle stop: 10 min away; its session's end: 5 min
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.MAX_SESSION_AGE, StopRule.SERVER_IDLE]
    assert await w.sweep_at(5 * MIN) == [StopRule.MAX_SESSION_AGE]


async def test_an_idle_server_stops_at_its_idle_limit_before_its_session_ends(world):
    w = world(session_left=15 * MIN)
    w.server_active(ago=20 * MIN)  # its idle stop: 10 min away; its session's end: 15 min
    assert await w.sweep_at(0 * MIN) == []
    assert await w.sweep_at(6 * MIN) == []
    assert w.warned() == [StopRule.SERVER_IDLE, StopRule.MAX_SESSION_AGE]
    assert w.told(StopRule.SERVER_IDLE) == w.t0 + 10 * MIN
    assert await w.sweep_at(10 * MIN) == [StopRule.SERVER_IDLE]


async def test_an_open_idle_kernel_is_shut_down_before_the_session_ends(world):
    w = world(session_left=9 * MIN)
    w.open_kernel(idle_for=10 * MIN)
    assert await w.sweep_at(0 * MIN) == []
    assert w.warned() == [StopRule.KERNEL_IDLE, StopRule.MAX_SESSION_AGE]
    assert await w.sweep_at(7.5 * MIN) == [StopRule.KERNEL_IDLE]
    assert w.told(StopRule.MAX_SESSION_AGE) is not None
