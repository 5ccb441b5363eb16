"""The day of ``benchmarks/day.py`` with GPU-hour budgets: how the hours split.

Run: ``.venv/bin/python benchmarks/day_budgets.py`` (some seconds; ``--days N``,
``--budget``, ``--user-budget`` to move the research group's budgets).

Same trace, same host (2 x H200 = 14 compute slices) and the same setup as row (c) of
``day.py`` (pool + wait list, the shipped idle limits), run twice: without budgets (the
baseline) and with the ``research`` group on a budget over a 1-day window (the trace is
one day): by default 30 compute-slice-hours for the group and 4 for each member, the
shipped ``budget_min_hold`` (30 min) and ``budget_action`` ``stop``. The budgets are
the product's (:mod:`mig_spawner.core.budget`, through ``check_claim``'s ``afford``):
a spawn the budget cannot pay a minimum hold for is refused (the user retries as in
``day.py``), a waiter whose budget is spent is passed over (``first_served`` skips a
``budget_spent`` refusal), and a sweep stops a server whose budget is spent.

Measured per group: sessions served, compute-slice-hours held (worked or idle) and
their share of all hours held, and the p95 wait; plus the servers stopped for a spent
budget. Ratios are to the run without budgets.

Figures (20 days, seed 1): see the docstring's table in docs/policies.md ("Budgets").
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from day import (
    COMPUTE_OF,
    DAY,
    GROUPS,
    Day,
    H,
    Lease,
    M,
    Result,
    Session,
    Setup,
    Want,
    pct,
    shipped_limits,
    trace,
    when,
)

from mig_spawner.core import budget
from mig_spawner.core.durations import parse_duration
from mig_spawner.core.policy import GroupPolicy, check_claim, tally
from mig_spawner.core.refusal import Reason, Refused


class BudgetDay(Day):
    """:class:`day.Day` with budgets: ``budgets`` is group -> budget settings (as an
    admin writes them); hours are counted from each lease's start to its end."""

    def __init__(self, setup: Setup, sessions: list[Session],
                 budgets: dict[str, dict[str, object]]) -> None:
        super().__init__(setup, sessions)
        groups = dict(self.policies.groups)
        for name, spec in budgets.items():
            groups[name] = replace(groups[name], **{
                key: value if key == "budget_action" else parse_duration(value)
                for key, value in spec.items()})
        self.policies = replace(self.policies, groups=MappingProxyType(groups))
        self.closed: list[budget.Span] = []
        self.now = 0.0
        self.held_s: Counter[str] = Counter()
        self.served_by: Counter[str] = Counter()
        self.waits_by: dict[str, list[float]] = defaultdict(list)
        self.budget_stops = 0
        self.budget_refusals = 0

    def spans(self) -> list[budget.Span]:
        running = [budget.Span(x.group, x.user, COMPUTE_OF[x.profile], when(x.since), None)
                   for x in self.leases.values()]
        return self.closed + running

    def check(self, session: Session) -> None:
        """The claim check with the group's budgets (``check_claim``'s ``afford``)."""
        user_policy = self.policies.for_user([session.group])
        mine = [self.holding(x) for x in self.leases.values() if x.user == session.user]
        everyone = tally(self.holding(x) for x in self.leases.values())
        compute = COMPUTE_OF[session.profile]
        spans, now = self.spans(), when(self.now)

        def afford(group: GroupPolicy) -> Refused | None:
            if not group.has_budget:
                return None
            return budget.refusal(group, session.user, compute, spans, [], now)

        try:
            check_claim(user_policy, session.profile, compute, mine, everyone, afford)
        except Refused as refused:
            if refused.reason is Reason.BUDGET_SPENT:
                self.budget_refusals += 1
            raise

    def count_served(self, want: Want, now: float) -> None:
        if not want.again:
            self.served_by[want.session.group] += 1
            self.waits_by[want.session.group].append(now - want.first_ask)
        super().count_served(want, now)

    def end(self, lease: Lease, now: float) -> None:
        self.closed.append(budget.Span(lease.group, lease.user, COMPUTE_OF[lease.profile],
                                       when(lease.since), when(now)))
        self.held_s[lease.group] += (now - lease.since) * COMPUTE_OF[lease.profile]
        super().end(lease, now)

    # The claim check reads the clock: every path to it passes through one of these.
    def on_ask(self, now: float, want: Want) -> None:
        self.now = now
        super().on_ask(now, want)

    def allocate(self, want: Want, now: float) -> Lease:
        self.now = now
        return super().allocate(want, now)

    def on_sweep(self, now: float, data: object) -> None:
        """The slice service's budget rule first: a server whose budget is spent stops."""
        self.now = now
        spent = False
        for lease in list(self.leases.values()):
            group = self.policies.group(lease.group)
            if not group.has_budget or group.budget_action != "stop":
                continue
            standing = budget.standings(group, lease.user, self.spans(), [], when(now))
            if any(s.remaining <= 0 for s in standing):
                self.end(lease, now)
                self.budget_stops += 1
                spent = True
        if spent:
            self.grant_waiters(now)
        super().on_sweep(now, data)


def split(days: list[BudgetDay], results: list[Result]) -> dict[str, dict[str, float]]:
    """Per group: served, compute-slice-hours held and their share, p95 wait."""
    total = sum(sum(d.held_s.values()) for d in days) or 1.0
    out = {}
    for group in GROUPS:
        held = sum(d.held_s[group] for d in days)
        waits = [w for d in days for w in d.waits_by[group]]
        out[group] = {
            "served": sum(d.served_by[group] for d in days) / len(days),
            "held sl-h": held / H / len(days),
            "share %": 100 * held / total,
            "wait p95": pct(waits, 0.95) / M,
        }
    out["(all)"] = {
        "served": sum(r.served for r in results) / len(days),
        "held sl-h": total / H / len(days),
        "share %": 100.0,
        "wait p95": pct([w for r in results for w in r.waits], 0.95) / M,
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--days", type=int, default=20, help="days (seeds) to average")
    parser.add_argument("--budget", default="30h",
                        help="research's group budget per day, compute-slice-hours")
    parser.add_argument("--user-budget", default="4h",
                        help="each research member's own budget per day")
    args = parser.parse_args(argv)
    setup = Setup("(c) pool+wait", "pool", True, shipped_limits())
    budgets = {"research": {"budget": args.budget, "user_budget": args.user_budget,
                            "budget_window": "1d"}}
    traces = [trace(args.seed + d) for d in range(args.days)]
    tables, stops, refusals = {}, {}, {}
    for name, spec in (("without budgets", {}), ("with budgets", budgets)):
        days = [BudgetDay(setup, t, spec) for t in traces]
        results = [d.run() for d in days]
        tables[name] = split(days, results)
        stops[name] = sum(d.budget_stops for d in days) / len(days)
        refusals[name] = sum(d.budget_refusals for d in days) / len(days)
    print(f"How the hours split between groups, row (c) of day.py, mean of {args.days} "
          f"days (seed {args.seed}..); budgets: research {args.budget} a day, "
          f"{args.user_budget} per member (compute-slice-hours):")
    columns = ["served", "held sl-h", "share %", "wait p95"]
    print(f"{'':30}" + "".join(f"{c:>11}" for c in columns) + "   ratio to without")
    base = tables["without budgets"]
    for name, table in tables.items():
        for group, values in table.items():
            ratios = " ".join(
                f"{values[c] / base[group][c]:5.2f}" if base[group][c] else "    -"
                for c in columns)
            print(f"{name + ' ' + group:30}" + "".join(f"{values[c]:11.1f}" for c in columns)
                  + f"   {ratios}")
        print(f"{'':30} servers stopped for a spent budget: {stops[name]:.1f} a day, "
              f"spawns refused for one: {refusals[name]:.1f} a day")
    assert DAY == 24 * H  # the 1-day window is the whole trace
    return tables


if __name__ == "__main__":
    main()
