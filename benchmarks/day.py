"""A day on a shared GPU host: static profiles vs pool vs wait list vs dynamic.

Run: ``.venv/bin/python benchmarks/day.py`` (some seconds; ``--seed N``, ``--days N``
to average over more days; ``--max-bypasses`` and the idle limits to move parameters;
``--search`` to try a grid of idle limits against the goals, a few minutes).

Figures (20 days, seeds 1-20, shipped limits 30m / 40m unwaited / 25m waited / warn
10m), ratio to (a): (c) served 1.31x, idle slice-hours 0.38x, p95 wait 15.2 min; (d)
1.39x, 0.42x, 18.1 min. (a) interrupts nobody (every break of the trace is shorter than
its hour); (c) and (d) interrupt 0.015 per served session (0.8-0.9 a day).

Against the limit, the clairvoyant rows (c*) and (d*) (below), on seeds 1-20, 21-40 and
41-60 each, nobody answering: served >= 0.95x the clairvoyant row's, idle slice-hours
<= 0.40x (a)'s, interruptions <= 0.02 per served session, p95 wait <= 1.25x the
clairvoyant row's. No setting of the idle limits meets all four (``--search`` tries 37
on the three seed sets, the trace unchanged): the pool misses the p95 wait (1.5-2.3x the
bound's 6 minutes at best), dynamic slicing the idle slice-hours (0.42-0.48x) and, by a
hair, served (docs/policies.md, "Against the limit", says why).

The trace (seeded, one synthetic working day, 00:00-24:00, on 2 x H200 = 14 compute
slices), 40 users in three groups:

* ``teaching``: 20 users, each 2 sessions a day on average (Poisson), ask for a small
  slice (1g.18gb), work a lognormal time (median 40 min, sigma 0.6);
* ``research``: 12 users, priority 1, 1.5 sessions a day, ask 2g.35gb (60 %) or
  3g.71gb (40 %), work median 90 min (sigma 0.6);
* ``staff``: 8 users, 1.5 sessions a day, ask 1g.18gb (70 %) or 2g.35gb (30 %),
  work median 60 min (sigma 0.6).

Session starts are uniform over 08:00-17:00. A third of the sessions take one break
in the middle (uniform 10-40 min, the server idle). When the work is done, 60 % of the
users forget their server (it stays up, idle) and 40 % stop it. A user who comes back
while their old server still runs uses it again, and a later session of a user takes
their server over (the earlier one's rest is not done: they are back); a user who
waits already waits once (the product's ``max_waiting_per_user``), and a session of
theirs that starts meanwhile is served with that wait or gives up with it. A user
refused a slice tries again after 15 minutes, at most twice, then gives up. A server
stopped while its user is on a break is an "interruption"; they ask again for the rest
of the work when back.

Policies, each on the same trace:

* (a) **today**: a fixed layout (GPU 0: 7 x 1g.18gb; GPU 1: 3g.71gb + 2g.35gb +
  1g.18gb), offered as KubeSpawner-style static profiles, first come first served, no
  per-user or group limits, jupyterhub-idle-culler with ``--timeout=3600
  --cull-every=600``. That culler judges by the hub's activity, which an open browser
  tab keeps fresh: half the forgotten servers (and breaks) keep their tab open until
  the user leaves in the evening (19:00), after which the hour starts.
* (b) **pool**: the same layout through the real policy (``build_policy``,
  ``check_claim``: one slice per user, group quotas) and allocator (``pick_pool``); the
  slice service sweeps every minute with the product's own rules
  (:func:`mig_spawner.service.cull_rules.idle_limit` and ``idle_deadline``): idleness
  is what the user does, an open tab does not count (``open_tab_counts`` off, every
  user in JupyterLab); the idle limits are the shipped snippet's "analysts" ones for
  every group (``--idle``, ``--unwaited-idle``, ``--waited-idle``, ``--warn-before``
  move them); a stop comes only after a warning ``warn_before`` ahead, and a user back
  from a break before the stop keeps the server; ``max_session_age`` 8 h. With no wait
  list nobody is ever seen waiting, so the limit while nobody waits applies. A refusal
  is retried as in (a).
* (c) **pool + wait list**: as (b) with ``queue`` on, ``max_wait`` 30 min; while
  someone waits for a profile its idle holders get ``server_idle_timeout_when_waited``,
  warned first; the released slice goes by the real order rule
  (:func:`mig_spawner.core.waitlist.first_served`). An expired wait is a refusal and
  the user gives up.
* (d) **dynamic + wait list**: as (c), but slices are created to fit
  (``Occupancy.pick_dynamic``, weighing the requests per profile as the product does
  with a week's history: the trace's mix) with the starvation guard (3 bypasses; no
  age bound).
* (c*) and (d*) **clairvoyant**: (c) and (d) with the best reclaim any policy could
  have on the same trace, layout and wait list: each slice is released the moment its
  user's work ends and never during a break (it knows which idle is a break), with no
  idle limit. The goals are judged against these rows.
* (c) and (d) again with ``--answer-share`` (25 %) of the warned users whose tab is open
  pressing Keep at a random time before the stop (it counts as activity). Assumed, not
  measured: half the users keep a tab open, and a toast is seen only while its tab is
  in front, so about half of those would notice one within its 10 minutes. The goals
  are judged with nobody answering (rows (b)-(d)).

Measured: sessions served (got to work, including reuse of a running server),
refusals (every refused attempt and expired wait), users who gave up, interruptions
(a server stopped during its user's break) and per served session, warnings sent,
median and p95 wait (first ask to slice, served sessions), slice-hours held idle
(compute-slice-hours held while nobody worked on them), GPU utilisation
(compute-slice-hours worked over 14 x 24 h), and the wait estimate's error from
:func:`mig_spawner.core.waitlist.estimate_wait`, quoted at join (with the sweep interval
as slack) and judged against the range the user reads (``Estimate.bounds``): waits
inside it, and the median distance of a wait outside it.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mig_spawner.config import MIGPolicyConfig, load_config_files
from mig_spawner.core.allocator import GpuSlots, Occupancy, Placement, pick_pool
from mig_spawner.core.allocator.tables import table
from mig_spawner.core.catalog import model
from mig_spawner.core.durations import format_duration
from mig_spawner.core.idle import idle_deadline, idle_limit
from mig_spawner.core.inventory import Gpu, Inventory, MigDevice
from mig_spawner.core.policy import (
    GroupPolicy,
    Holding,
    PolicySet,
    build_policy,
    check_claim,
    tally,
)
from mig_spawner.core.refusal import Refused
from mig_spawner.core.waitlist import (
    Holder,
    StarvationGuard,
    Waiter,
    estimate_wait,
    first_served,
    group_shares,
    history_for,
    positions,
)

H, M = 3600.0, 60.0
DAY = 24 * H
T0 = datetime(2026, 12, 2, tzinfo=UTC)
COMPUTE = 14  # 2 x H200
EVENING = 19 * H  # users with a tab left open leave then
LAYOUT = (
    tuple(("1g.18gb", n) for n in range(7)),
    (("3g.71gb", 0), ("2g.35gb", 4), ("1g.18gb", 6)),
)
# group -> (users, sessions a day, {profile: share}, median work minutes, priority)
GROUPS = {
    "teaching": (20, 2.0, {"1g.18gb": 1.0}, 40, 0),
    "research": (12, 1.5, {"2g.35gb": 0.6, "3g.71gb": 0.4}, 90, 1),
    "staff": (8, 1.5, {"1g.18gb": 0.7, "2g.35gb": 0.3}, 60, 0),
}
COMPUTE_OF = {"1g.18gb": 1, "2g.35gb": 2, "3g.71gb": 3}
#: What the product's dynamic placement weighs (``demand``: a week's requests per
#: profile, from the ledger): with the wait list nearly every request is a claim, so
#: the trace's expected sessions per profile.
DEMAND = {
    profile: sum(users * per_day * mix.get(profile, 0.0)
                 for users, per_day, mix, _, _ in GROUPS.values())
    for profile in COMPUTE_OF
}


# --- the trace --------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    user: str
    group: str
    profile: str
    arrive: float
    work: float
    break_at: float | None  # seconds of work before the break
    break_len: float
    forgets: bool
    tab_open: bool  # a JupyterLab tab stays open while idle
    answers: float  # uniform 0..1: answers a warning when below the assumed share


def poisson(rng: random.Random, mean: float) -> int:
    count, t = 0, rng.expovariate(1.0)
    while t < mean:
        count += 1
        t += rng.expovariate(1.0)
    return count


def trace(seed: int) -> list[Session]:
    """The seeded day described in the module docstring."""
    rng = random.Random(seed)
    sessions = []
    for group, (users, per_day, mix, median, _) in GROUPS.items():
        for u in range(users):
            for _ in range(poisson(rng, per_day)):
                profile = rng.choices(list(mix), weights=list(mix.values()))[0]
                work = rng.lognormvariate(0, 0.6) * median * M
                has_break = rng.random() < 1 / 3
                sessions.append(Session(
                    f"{group}-{u}", group, profile, rng.uniform(8 * H, 17 * H), work,
                    rng.uniform(0.3, 0.7) * work if has_break else None,
                    rng.uniform(10, 40) * M, rng.random() < 0.6, rng.random() < 0.5,
                    rng.random(),
                ))
    return sorted(sessions, key=lambda s: s.arrive)


# --- the policies -----------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One policy. Product modes take their limits from the group policies; ``static``
    has none but the culler's ``culler_timeout``."""

    name: str
    mode: str  # static | pool | dynamic
    queue: bool
    limits: Limits | None = None  # the product's idle limits (None: static)
    sweep: float = M  # how often idleness is judged
    culler_timeout: float | None = None
    guard: StarvationGuard | None = None
    answer_share: float = 0.0  # of warnings shown in an open tab, the share answered
    #: The bound: each slice released the moment its user's work ends, never during a
    #: break (it knows which idle is a break), and no idle limit.
    clairvoyant: bool = False


@dataclass(frozen=True)
class Limits:
    """The idle limits every group of the trace gets (seconds)."""

    idle: float | None  # server_idle_timeout
    unwaited: float | None  # server_idle_timeout_when_unwaited
    waited: float | None  # server_idle_timeout_when_waited
    warn: float | None  # warn_before

    def describe(self) -> str:
        return (f"server_idle_timeout {format_duration(self.idle)}, when_unwaited "
                f"{format_duration(self.unwaited)}, when_waited "
                f"{format_duration(self.waited)}, warn_before {format_duration(self.warn)}")


def shipped_limits() -> Limits:
    """The idle limits of the shipped snippet's notebook group ("analysts"), which the
    benchmark gives every group: what it chose them by (docs/policies.md)."""
    snippet = Path(__file__).resolve().parents[1] / "jupyterhub_config.d" / "20-groups.py"
    group = MIGPolicyConfig(config=load_config_files(snippet)).build().group("analysts")
    return Limits(group.server_idle_timeout, group.server_idle_timeout_when_unwaited,
                  group.server_idle_timeout_when_waited, group.warn_before)


def policy_set(queue: bool, limits: Limits | None) -> PolicySet:
    """The groups of the trace as an admin writes them, through ``build_policy``."""
    limits = limits or Limits(None, None, None, None)
    groups = {
        name: {
            "allowed": list(mix), "quota_slices": None if name == "teaching" else 6,
            "priority": prio, "server_idle_timeout": limits.idle,
            "server_idle_timeout_when_unwaited": limits.unwaited,
            "server_idle_timeout_when_waited": limits.waited, "warn_before": limits.warn,
            "max_session_age": "8h", "queue": queue, "max_wait": "30m",
        }
        for name, (_, _, mix, _, prio) in GROUPS.items()
    }
    return build_policy({}, {}, groups, None, [model("h200")])


def pool_inventory() -> Inventory:
    h200 = model("h200")
    gpus = []
    for g, layout in enumerate(LAYOUT):
        uuid = f"GPU-{g}"
        devices = tuple(
            MigDevice(f"MIG-{g}-{start}", g, uuid, n, name, name, 0, 0, start,
                      h200.profile(name).placement_size, 0, 0)
            for n, (name, start) in enumerate(layout)
        )
        gpus.append(Gpu(g, uuid, "NVIDIA H200", "h200", g, h200.memory_mib, True, True,
                        mig_devices=devices))
    return Inventory("day", "580", "13.0", 13000, tuple(gpus))


# --- the simulation ---------------------------------------------------------------------


@dataclass
class Lease:
    user: str
    group: str
    profile: str
    where: object  # MIG uuid (pool/static) or Placement (dynamic)
    since: float
    idle_since: float | None = None
    idle_visible: float | None = None  # the activity the culler judges idleness from
    idle_total: float = 0.0
    token: int = 0  # the session currently using it
    warned: float | None = None  # the pending idle warning's deadline
    tab_open: bool = False
    answers: bool = False  # its user answers warnings
    on_break: bool = False  # its user is away and will come back to it


@dataclass
class Want:
    session: Session
    work: float  # still to do
    first_ask: float
    tries: int = 0
    again: bool = False  # asking again after a cull: not a new session


@dataclass
class Result:
    served: int = 0
    refusals: int = 0
    gave_up: int = 0
    interrupted: int = 0
    warnings: int = 0
    kept: int = 0
    waits: list[float] = field(default_factory=list)
    idle_slice_s: float = 0.0
    worked_slice_s: float = 0.0
    estimates: list[tuple[float, float, float]] = field(default_factory=list)


class Day:
    """One policy over one trace, on a simulated clock (events in a heap, no sleeps)."""

    def __init__(self, setup: Setup, sessions: list[Session]) -> None:
        self.s = setup
        self.policies = policy_set(setup.queue, setup.limits)
        self.inventory = pool_inventory()
        key = "h200"
        self.occupancy = Occupancy(tuple(
            GpuSlots(g, f"GPU-{g}", key, "on", 0, table(key).zero_counts) for g in range(2)
        ))
        self.leases: dict[str, Lease] = {}  # user -> lease
        self.waiting: list[tuple[Waiter, Want, tuple[float, float] | None]] = []
        # user -> sessions that arrived while they waited: one wait a user (the product's
        # max_waiting_per_user), the later sessions are served or given up with it
        self.also: dict[str, list[Want]] = {}
        self.latest: dict[str, int] = {}  # user -> the token of their latest session
        self.history: list[tuple[str, str, float]] = []  # (profile, group, held)
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.ids = itertools.count()
        self.r = Result()
        self.rng = random.Random(len(sessions))  # when a warned user answers
        for session in sessions:
            self.at(session.arrive, "ask", Want(session, session.work, session.arrive))
        t = setup.sweep
        while t < DAY:
            self.at(t, "sweep", None)
            t += setup.sweep

    def at(self, when: float, kind: str, data: object) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, data))

    def run(self) -> Result:
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            if now >= DAY:
                break
            getattr(self, f"on_{kind}")(now, data)
        for lease in list(self.leases.values()):
            self.end(lease, DAY)
        return self.r

    # -- granting ------------------------------------------------------------------------

    def check(self, session: Session) -> None:
        """The policy's claim check (per-user limit, group quota); raises Refused.
        Static profiles have no such limits."""
        if self.s.mode == "static":
            return
        user_policy = self.policies.for_user([session.group])
        mine = [self.holding(lease) for lease in self.leases.values()
                if lease.user == session.user]
        everyone = tally(self.holding(lease) for lease in self.leases.values())
        check_claim(user_policy, session.profile, COMPUTE_OF[session.profile], mine, everyone)

    def allocate(self, want: Want, now: float) -> Lease:
        """Policy check plus allocator for one request; raises Refused."""
        session = want.session
        self.check(session)
        if self.s.mode == "dynamic":
            picked = self.occupancy.pick_dynamic(session.profile, demand=DEMAND)
            if isinstance(picked, Refused):
                raise picked
            self.occupancy = self.occupancy.place(picked)
            where: object = picked
        else:
            held = {lease.where for lease in self.leases.values()}
            grant = pick_pool(self.inventory, held, session.profile)
            if isinstance(grant, Refused):
                raise grant
            where = grant.uuid
        return Lease(session.user, session.group, session.profile, where, now)

    @staticmethod
    def holding(lease: Lease) -> Holding:
        return Holding("", lease.profile, COMPUTE_OF[lease.profile], lease.group)

    def start(self, want: Want, lease: Lease, now: float) -> None:
        self.leases[lease.user] = lease
        self.count_served(want, now)
        self.work(lease, want, now)

    def count_served(self, want: Want, now: float) -> None:
        if not want.again:
            self.r.served += 1
            self.r.waits.append(now - want.first_ask)

    def work(self, lease: Lease, want: Want, now: float) -> None:
        lease.idle_visible = lease.warned = None
        lease.on_break = False
        lease.token = self.latest[lease.user] = next(self.ids)
        s = want.session
        lease.tab_open = s.tab_open
        lease.answers = s.answers < self.s.answer_share
        if s.break_at is not None and want.work == s.work:
            self.at(now + s.break_at, "pause", (lease, lease.token, want))
        else:
            self.at(now + want.work, "done", (lease, lease.token, want))

    def grant_waiters(self, now: float) -> None:
        while self.waiting:
            by_id = {w.id: (w, want, est) for w, want, est in self.waiting}
            shares = group_shares(
                Counter(lease.group for lease in self.leases.values()),
                {g: p.quota_slices for g, p in self.policies.groups.items()}, COMPUTE,
            )
            grant = first_served(
                [w for w, _, _ in self.waiting],
                lambda w, wants=by_id: self.allocate(wants[w.id][1], now),
                shares=shares, now=T0 + timedelta(seconds=now), guard=self.s.guard,
            )
            if grant is None:
                return
            waiter, want, est = by_id[grant.waiter.id]
            passed = {w.id for w in grant.passed_over}
            self.waiting = [
                (Waiter(**{**w.__dict__, "bypassed": w.bypassed + (w.id in passed)}), wt, e)
                for w, wt, e in self.waiting if w.id != waiter.id
            ]
            if est is not None:
                self.r.estimates.append((*est, now - want.first_ask))
            self.start(want, grant.result, now)
            for later in self.also.pop(waiter.user, []):  # the latest session takes over
                self.count_served(later, now)
                self.work(grant.result, later, now)

    # -- events ----------------------------------------------------------------------------

    def on_ask(self, now: float, want: Want) -> None:
        s = want.session
        mine = self.leases.get(s.user)
        if mine is not None:  # their server still runs: use it again
            self.count_served(want, now)
            self.settle_idle(mine, now)
            self.work(mine, want, now)
            return
        if self.s.queue:
            if any(w.user == s.user for w, _, _ in self.waiting):
                self.also.setdefault(s.user, []).append(want)  # they wait already
                return
            try:
                self.check(s)  # only "none free" is ever queued
            except Refused:
                self.refused(want, now)
                return
            self.join(want, now)
            return
        try:
            lease = self.allocate(want, now)
        except Refused:
            self.refused(want, now)
            return
        self.start(want, lease, now)

    def join(self, want: Want, now: float) -> None:
        s = want.session
        waiter = Waiter(next(self.ids), s.user, "", s.group,
                        self.policies.group(s.group).priority, s.profile,
                        T0 + timedelta(seconds=now))
        self.waiting.append((waiter, want, None))
        self.grant_waiters(now)
        if not any(w.id == waiter.id for w, _, _ in self.waiting):
            return  # served at once
        shares = group_shares(Counter(lease.group for lease in self.leases.values()),
                              {g: p.quota_slices for g, p in self.policies.groups.items()},
                              COMPUTE)
        place = positions([w for w, _, _ in self.waiting], shares)[waiter.id]
        holders = [
            self.holder(lease, now) for lease in self.leases.values()
            if self.s.mode == "dynamic" or lease.profile == s.profile
        ]
        history = history_for(self.history, s.profile, s.group)
        est = estimate_wait(place, holders, history, slack=self.s.sweep)
        self.waiting = [
            (w, wt, est.bounds if w.id == waiter.id and est else e)
            for w, wt, e in self.waiting
        ]

    def holder(self, lease: Lease, now: float) -> Holder:
        """What the service knows of a holder: its age, and the limit that ends it."""
        max_age = self.max_age(lease)
        ends = [] if max_age is None else [max_age - (now - lease.since)]
        stop = self.idle_stop(lease, now)
        if stop is not None:
            ends.append(stop - now)
        return Holder(now - lease.since, min(ends, default=None))

    def max_age(self, lease: Lease) -> float | None:
        return None if self.s.mode == "static" else self.policies.group(lease.group).max_session_age

    def idle_limit(self, lease: Lease) -> float | None:
        """The idle limit that applies now, by the product's rule: its group's limit
        while nobody waits for the lease's profile, the shorter one while someone does."""
        if self.s.mode == "static":
            return self.s.culler_timeout
        group: GroupPolicy = self.policies.group(lease.group)
        return idle_limit(group, any(w.offer == lease.profile for w, _, _ in self.waiting))

    def idle_stop(self, lease: Lease, now: float) -> float | None:
        """When the idle lease is stopped, by the product's rule (warned first, the
        warned time holds); ``None`` while it is in use or without an idle limit."""
        limit = self.idle_limit(lease)
        if lease.idle_visible is None or limit is None:
            return None
        if self.s.mode == "static":
            return lease.idle_visible + limit
        warn = self.policies.group(lease.group).warn_before
        deadline = idle_deadline(
            when(now), when(lease.idle_visible), limit, warn,
            None if lease.warned is None else when(lease.warned))
        return (deadline - T0).total_seconds()

    def refused(self, want: Want, now: float) -> None:
        self.r.refusals += 1
        if want.tries < 2:
            want.tries += 1
            self.at(now + 15 * M, "ask", want)
        elif not want.again:  # a session cut short by a cull was counted as served
            self.r.gave_up += 1

    def on_pause(self, now: float, data: tuple[Lease, int, Want]) -> None:
        lease, token, want = data
        if lease.token != token:
            return
        s = want.session
        self.go_idle(lease, now, s.tab_open)
        lease.on_break = True
        rest = Want(s, s.work - (s.break_at or 0), want.first_ask, want.tries)
        self.at(now + s.break_len, "back", (lease, token, rest))

    def on_back(self, now: float, data: tuple[Lease, int, Want]) -> None:
        lease, token, want = data
        if self.latest[lease.user] != token:  # a later session of theirs took over
            return
        if self.leases.get(lease.user) is lease:
            self.settle_idle(lease, now)
            lease.idle_visible = lease.warned = None  # back before the stop: kept
            lease.on_break = False
            self.at(now + want.work, "done", (lease, token, want))
            return
        # stopped during the break (an interruption, counted then): ask again for the rest
        self.on_ask(now, Want(want.session, want.work, now, again=True))

    def on_done(self, now: float, data: tuple[Lease, int, Want]) -> None:
        lease, token, want = data
        if self.leases.get(lease.user) is not lease or lease.token != token:
            return
        if want.session.forgets and not self.s.clairvoyant:
            self.go_idle(lease, now, want.session.tab_open)
        else:
            self.end(lease, now)
            self.grant_waiters(now)

    def go_idle(self, lease: Lease, now: float, tab_open: bool) -> None:
        lease.idle_since = now
        # The static culler reads the hub's activity, which an open tab keeps fresh; the
        # product judges by what the user does (open_tab_counts off, the default).
        lease.idle_visible = max(now, EVENING) if self.s.mode == "static" and tab_open else now

    def warn(self, lease: Lease, now: float, stop: float | None) -> None:
        """The product's warning: sent when the stop is within warn_before, withdrawn
        when it is not; a user who answers presses Keep at some time before the stop
        (activity: the idle clock starts again)."""
        warn = self.policies.group(lease.group).warn_before
        if stop is None or warn is None or stop - now > warn:
            lease.warned = None
            return
        if lease.warned is None:
            self.r.warnings += 1
            if lease.tab_open and lease.answers:
                self.at(self.rng.uniform(now, stop), "keep", (lease, lease.token))
        lease.warned = stop

    def on_keep(self, now: float, data: tuple[Lease, int]) -> None:
        lease, token = data
        if self.leases.get(lease.user) is lease and lease.token == token and lease.warned:
            lease.idle_visible, lease.warned = now, None
            self.r.kept += 1

    def settle_idle(self, lease: Lease, now: float) -> None:
        """Book the idle stretch that ends now (the user is back, or the lease ends)."""
        if lease.idle_since is not None:
            lease.idle_total += now - lease.idle_since
            lease.idle_since = None

    def end(self, lease: Lease, now: float) -> None:
        self.settle_idle(lease, now)
        compute = COMPUTE_OF[lease.profile]
        self.r.idle_slice_s += lease.idle_total * compute
        self.r.worked_slice_s += (now - lease.since - lease.idle_total) * compute
        del self.leases[lease.user]
        if isinstance(lease.where, Placement):
            self.occupancy = self.occupancy.release(lease.where)
        self.history.append((lease.profile, lease.group, now - lease.since))

    def on_sweep(self, now: float, _: object) -> None:
        culled = False
        for lease in list(self.leases.values()):
            age, max_age = now - lease.since, self.max_age(lease)
            stop = self.idle_stop(lease, now)
            if (max_age is not None and age >= max_age) or (stop is not None and now >= stop):
                self.r.interrupted += lease.on_break
                self.end(lease, now)
                culled = True
            elif self.s.mode != "static":
                self.warn(lease, now, stop)
        expired = [
            (w, want) for w, want, _ in self.waiting
            if (limit := self.policies.group(w.group).max_wait) is not None
            and now - (w.joined_at - T0).total_seconds() >= limit
        ]
        self.r.refusals += len(expired)
        self.r.gave_up += sum(not want.again for _, want in expired)
        self.r.gave_up += sum(not later.again for w, _ in expired
                              for later in self.also.pop(w.user, []))
        if expired:
            gone = {w.id for w, _ in expired}
            self.waiting = [entry for entry in self.waiting if entry[0].id not in gone]
        if culled:
            self.grant_waiters(now)


def when(seconds: float) -> datetime:
    """The simulated clock as the product's rules read it."""
    return T0 + timedelta(seconds=seconds)


# --- the table ------------------------------------------------------------------------


#: The share of warnings (shown in an open tab) that the second row assumes are answered.
ANSWER_SHARE = 0.25


def setups(max_bypasses: int, guard_age: float | None, limits: Limits,
           answer_share: float) -> list[Setup]:
    """The four policies of the module docstring, and (c) and (d) again with a share of
    the warned users answering."""
    guard = StarvationGuard(max_bypasses=max_bypasses, max_age=guard_age)
    return [
        Setup("(a) static+culler 1h", "static", False, sweep=10 * M, culler_timeout=H),
        Setup("(b) pool", "pool", False, limits),
        Setup("(c) pool+wait", "pool", True, limits),
        Setup("(d) dynamic+wait", "dynamic", True, limits, guard=guard),
        Setup(CLAIRVOYANT["pool"], "pool", True, clairvoyant=True),
        Setup(CLAIRVOYANT["dynamic"], "dynamic", True, guard=guard, clairvoyant=True),
        Setup(f"(c) {answer_share:.0%} answer", "pool", True, limits,
              answer_share=answer_share),
        Setup(f"(d) {answer_share:.0%} answer", "dynamic", True, limits, guard=guard,
              answer_share=answer_share),
    ]


#: The bound of each mode: its row with the wait list and a clairvoyant reclaim.
CLAIRVOYANT = {"pool": "(c*) clairvoyant", "dynamic": "(d*) clairvoyant"}


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(results: list[Result]) -> dict[str, float]:
    waits = [w for r in results for w in r.waits]
    est = [e for r in results for e in r.estimates]
    inside = [lo <= actual <= hi for lo, hi, actual in est]
    off = [max(lo - actual, actual - hi) for lo, hi, actual in est if not lo <= actual <= hi]
    days = len(results)
    return {
        "served": sum(r.served for r in results) / days,
        "refused": sum(r.refusals for r in results) / days,
        "gave up": sum(r.gave_up for r in results) / days,
        "interrupt": sum(r.interrupted for r in results) / days,
        "int/served": sum(r.interrupted for r in results) / max(1, sum(r.served
                                                                       for r in results)),
        "warned": sum(r.warnings for r in results) / days,
        "wait p50": statistics.median(waits) / M if waits else 0.0,
        "wait p95": pct(waits, 0.95) / M,
        "idle sl-h": sum(r.idle_slice_s for r in results) / H / days,
        "util %": 100 * sum(r.worked_slice_s for r in results) / (COMPUTE * DAY * days),
        "est in %": 100 * sum(inside) / len(inside) if inside else float("nan"),
        "est off": statistics.median(off) / M if off else float("nan"),
    }


def _cell(value: float, digits: int) -> str:
    return f"{'-':>10}" if math.isnan(value) else f"{value:10.{digits}f}"


#: The goals, against the bound of the row's mode (its clairvoyant row), today's row (a)
#: or the figure itself: (column, comparison, bound, against).
GOALS = (
    ("served", ">=", 0.95, "bound"),
    ("idle sl-h", "<=", 0.40, "today"),
    ("int/served", "<=", 0.02, "figure"),
    ("wait p95", "<=", 1.25, "bound"),
)
GOALS_TEXT = ("served >= 0.95x the clairvoyant row's, idle slice-hours <= 0.40x (a)'s, "
              "interruptions <= 0.02 per served session, p95 wait <= 1.25x the clairvoyant "
              "row's")
#: The rows judged: the product's, with nobody answering a warning.
JUDGED = ("(b) pool", "(c) pool+wait", "(d) dynamic+wait")


def goals(values: dict[str, float], today: dict[str, float], bound: dict[str, float]
          ) -> list[tuple[str, float, bool]]:
    """Each goal: (column, the figure it is judged on, met)."""
    out = []
    for column, op, limit, against in GOALS:
        base = {"bound": bound, "today": today}.get(against)
        figure = values[column] if base is None else (
            values[column] / base[column] if base[column] else math.inf)
        out.append((column, figure, figure >= limit if op == ">=" else figure <= limit))
    return out


def judge(tables: list[dict[str, dict[str, float]]]) -> dict[str, list[list[tuple]]]:
    """The goals of each judged row on each seed set's table."""
    return {
        name: [goals(t[name], t["(a) static+culler 1h"],
                     t[CLAIRVOYANT["dynamic" if "dynamic" in name else "pool"]])
               for t in tables]
        for name in JUDGED
    }


def run_sets(args: argparse.Namespace, limits: Limits, sets: int,
             only: tuple[str, ...] | None = None) -> list[dict[str, dict[str, float]]]:
    """The table of each seed set (``sets`` sets of ``args.days`` days from ``args.seed``);
    ``only``: those rows alone."""
    out = []
    for n in range(sets):
        traces = [trace(args.seed + n * args.days + d) for d in range(args.days)]
        out.append({
            s.name: row([Day(s, t).run() for t in traces])
            for s in setups(args.max_bypasses, args.guard_age * M or None, limits,
                            args.answer_share)
            if only is None or s.name in only
        })
    return out


def print_goals(judged: dict[str, list[list[tuple]]], args: argparse.Namespace) -> None:
    sets = ", ".join(f"{args.seed + n * args.days}-{args.seed + (n + 1) * args.days - 1}"
                     for n in range(len(next(iter(judged.values())))))
    print(f"goals, each on seeds {sets}, nobody answering: {GOALS_TEXT}")
    for name, per_set in judged.items():
        cells = []
        for (column, op, limit, against), *figures in zip(GOALS, *per_set, strict=True):
            unit = "" if against == "figure" else "x"
            shown = " / ".join(f"{f:.3f}{unit}" for _, f, _ in figures)
            met = all(m for _, _, m in figures)
            cells.append(f"{column} {shown} {op} {limit:g}{unit}: "
                         f"{'met' if met else 'MISSED'}")
        print(f"{name:21} " + "; ".join(cells))


def search(args: argparse.Namespace) -> None:
    """Every setting of the idle limits on a grid, on every seed set: how close each
    policy comes to the goals, the trace as it is."""
    grid = []
    for unwaited, waited, warn in itertools.product(
            (20, 30, 40, 45, 60), (5, 10, 15, 20, 25, 30), (5, 10)):
        if warn < waited < unwaited:  # as the policy check requires
            grid.append(Limits(unwaited * M, unwaited * M, waited * M, warn * M))
    bounds = run_sets(args, grid[0], 3, ("(a) static+culler 1h", *CLAIRVOYANT.values()))
    found: dict[str, list[tuple[tuple[float, int], Limits, list[list[tuple]]]]] = {}
    for limits in grid:
        tables = [{**b, **t} for b, t in zip(bounds, run_sets(args, limits, 3, JUDGED),
                                            strict=True)]
        for name, per_set in judge(tables).items():
            met = sum(all(m for _, _, m in figures) for figures in zip(*per_set, strict=True))
            found.setdefault(name, []).append(((_shortfall(per_set), -met), limits, per_set))
    print(f"\nsearch: {len(grid)} settings of (unwaited, waited, warn_before), idle = unwaited; "
          "the closest per policy (the least shortfall: how far each missed goal is from "
          "its bound, relative, summed over the goals and the three seed sets):")
    for name, results in found.items():
        results.sort(key=lambda r: r[0])
        for (short, met), limits, per_set in results[:3]:
            missed = [
                f"{column} {' / '.join(f'{f:.3f}' for _, f, _ in figures)} "
                f"({op} {limit:g})"
                for (column, op, limit, _), *figures in zip(GOALS, *per_set, strict=True)
                if not all(m for _, _, m in figures)]
            print(f"{name:21} shortfall {short:.2f}, {-met}/4 goals met on every set: "
                  f"{limits.describe()}; missed: {'; '.join(missed) or 'none'}")


def _shortfall(per_set: list[list[tuple]]) -> float:
    """How far the missed goals are from their bounds, relative, summed."""
    total = 0.0
    for figures in per_set:
        for (_, _, limit, _), (_, figure, met) in zip(GOALS, figures, strict=True):
            if not met:
                total += abs(figure - limit) / limit if math.isfinite(figure) else 10.0
    return total


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--days", type=int, default=20, help="days (seeds) to average")
    parser.add_argument("--max-bypasses", type=int, default=3,
                        help="(d): how often a larger request may be passed over")
    parser.add_argument("--guard-age", type=float, default=0.0,
                        help="(d): minutes after which a waiter blocks smaller ones (0: off)")
    shipped = shipped_limits()
    for flag, value, what in (
        ("--idle", shipped.idle, "server_idle_timeout"),
        ("--unwaited-idle", shipped.unwaited, "server_idle_timeout_when_unwaited"),
        ("--waited-idle", shipped.waited, "server_idle_timeout_when_waited"),
        ("--warn-before", shipped.warn, "warn_before"),
    ):
        parser.add_argument(flag, type=float, default=(value or 0) / M,
                            help=f"{what} in minutes (0: none; default: the shipped snippet's "
                            f"analysts, {format_duration(value)})")
    parser.add_argument("--answer-share", type=float, default=ANSWER_SHARE,
                        help="the last row: share of warnings in an open tab answered")
    parser.add_argument("--search", action="store_true",
                        help="try a grid of idle limits on three seed sets (a minute or two)")
    args = parser.parse_args(argv)
    limits = Limits(*(v * M or None for v in (
        args.idle, args.unwaited_idle, args.waited_idle, args.warn_before)))
    tables = run_sets(args, limits, 3)
    table_rows = tables[0]
    names = list(next(iter(table_rows.values())))
    base = table_rows["(a) static+culler 1h"]
    sessions = sum(len(trace(args.seed + d)) for d in range(args.days)) / args.days
    print(f"A day on 2 x H200 (14 compute slices), 40 users, {sessions:.0f} sessions a day, "
          f"mean of {args.days} seeded days (seed {args.seed}..); (b)-(d): "
          f"{limits.describe()}; (c*), (d*): each slice released the moment its user's "
          "work ends, never during a break:")
    print(f"{'':21}" + "".join(f"{n:>11}" for n in names))
    for name, values in table_rows.items():
        print(f"{name:21}" + "".join(" " + _cell(values[n], 3 if n == "int/served" else 1)
                                     for n in names))
    print("ratio to (a)  (waits in minutes; est off: median minutes outside the range)")
    for name, values in table_rows.items():
        cells = "".join(" " + _cell(values[n] / base[n] if base[n] else math.nan, 2)
                        for n in names)
        print(f"{name:21}" + cells)
    print_goals(judge(tables), args)
    if args.search:
        search(args)
    return table_rows


if __name__ == "__main__":
    main()
