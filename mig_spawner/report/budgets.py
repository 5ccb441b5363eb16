"""GPU-hour budgets as the report shows them: what each group with a budget, and each
of its members, used over the budget window, against what they have.

Pure: the caller reads the leases and the extra hours from the ledger
(``ledger.usage.budget``) and the policies from the hub's config.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from mig_spawner.core import budget
from mig_spawner.core.budget import Extra
from mig_spawner.core.durations import format_duration
from mig_spawner.core.policy import PolicySet


@dataclass(frozen=True)
class BudgetRow:
    """One budget and what is used of it, in compute-slice-hours over ``window``."""

    group: str
    #: ``""``: the group's budget (all members); else one member's use, against their
    #: own budget when the group sets one (``budget_hours`` ``None``: none of their own).
    user: str
    window: str
    used_hours: float
    budget_hours: float | None
    extra_hours: float

    @property
    def left_hours(self) -> float | None:
        if self.budget_hours is None:
            return None
        return self.budget_hours + self.extra_hours - self.used_hours


def budget_rows(policies: PolicySet, leases: Iterable[budget.HeldTime],
                extras: Sequence[Extra], held_ids: set[str], now: datetime) -> list[BudgetRow]:
    """A row per group with a budget and per member who used it within its window.

    ``leases``: every lease that held a slice within the longest window (held ones
    named in ``held_ids``, whose time runs to ``now``)."""
    leases = list(leases)
    spans = budget.spans_of([x for x in leases if x.id in held_ids],
                            [x for x in leases if x.id not in held_ids])
    # Each member's spans found once: a member's own budget reads only theirs (a year
    # of a 3,000-user hub read every span once per member: seconds, not milliseconds).
    by_member: dict[tuple[str, str], list[budget.Span]] = defaultdict(list)
    for span in spans:
        by_member[span.group, span.user].append(span)
    rows = []
    for group in (*policies.groups.values(), policies.default):
        if not group.has_budget:
            continue
        window = format_duration(group.budget_window)
        members = sorted(user for name, user in by_member if name == group.name)
        if group.budget is not None:
            ours = [s for (name, _), found in by_member.items() if name == group.name
                    for s in found]
            whole = budget.standings(group, "", ours, extras, now)[0]
            rows.append(BudgetRow(group.name, "", window, whole.used / 3600,
                                  whole.amount / 3600, whole.extra / 3600))
        for user in members:
            mine = by_member[group.name, user]
            own = [s for s in budget.standings(group, user, mine, extras, now)
                   if s.limit.user is not None]
            if own:
                rows.append(BudgetRow(group.name, user, window, own[0].used / 3600,
                                      own[0].amount / 3600, own[0].extra / 3600))
            else:
                used = sum(s.compute_slices * _overlap(s, now, group.budget_window)
                           for s in mine)
                rows.append(BudgetRow(group.name, user, window, used / 3600, None, 0.0))
    return rows


def _overlap(span: budget.Span, now: datetime, window: float) -> float:
    """Seconds of ``span`` within the window that ends at ``now``."""
    end = span.end or now
    start = max(span.start, now - timedelta(seconds=window))
    return max(0.0, (min(end, now) - start).total_seconds())


def budgets_text(rows: Sequence[BudgetRow]) -> str:
    """The rows as a table, in compute-slice-hours (a whole H200 is 7 an hour), or in
    minutes or seconds, marked, where hours would round to 0."""
    lines = ["GPU budgets (compute-slice-hours, or minutes (m) and seconds (s) where marked; "
             "a whole H200 uses 7 an hour, a 1g slice 1):",
             f"{'group':<16} {'user':<16} {'window':>8} {'used':>8} {'budget':>8} "
             f"{'extra':>7} {'left':>8}"]
    for row in rows:
        used, extra = budget.slice_amounts(row.used_hours * 3600, row.extra_hours * 3600,
                                           short=True)
        budget_text, left = (
            ("-", "-") if row.budget_hours is None or row.left_hours is None
            else budget.slice_amounts(row.budget_hours * 3600, row.left_hours * 3600,
                                      short=True))
        lines.append(f"{row.group:<16} {row.user or '(all)':<16} {row.window:>8} "
                     f"{used:>8} {budget_text:>8} {extra:>7} {left:>8}")
    return "\n".join(lines)
