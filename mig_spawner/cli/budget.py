"""``mig-spawner budget``: where each GPU-hour budget stands, and extra hours for one.

``mig-spawner budget`` prints each budget of the hub's config (``--config-dir``) with
what its group and members used over its window; ``mig-spawner budget grant GROUP
HOURS [--user NAME]`` adds compute-slice-hours to the group's budget (or one member's
own) for one budget window from now. The grant is kept in the ledger, so every hub
process and the slice service count it at once (docs/policies.md, "Budgets").
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from ..core.budget import slice_amounts
from ..core.durations import DurationError, parse_duration
from ..core.policy import PolicySet
from .settings import hub_config, ledger_url

if TYPE_CHECKING:
    from ..ledger import Ledger


def add_parser(sub: argparse._SubParsersAction, add_global_options: Callable) -> None:
    """Register ``budget`` (and ``budget grant``) on the ``mig-spawner`` parser."""
    p = sub.add_parser("budget", help="GPU-hour budgets: usage per group and member; "
                                      "'grant' adds hours",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_global_options(p)
    p.add_argument("--json", action="store_true", help="print the usage as JSON")
    p.set_defaults(func=cmd_budget)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    grant = actions.add_parser("grant", help="add compute-slice-hours to a budget for one "
                                             "window from now")
    add_global_options(grant)
    grant.add_argument("group", help="the JupyterHub group whose budget it raises")
    grant.add_argument("hours", help="compute-slice-hours, e.g. 10h (a whole H200 uses 7 "
                                     "an hour)")
    grant.add_argument("--user", metavar="NAME",
                       help="raise this member's own budget (user_budget) instead")
    grant.add_argument("--note", default="", help="why, kept with the grant")
    grant.set_defaults(func=cmd_grant)


def hub_policies(args: argparse.Namespace) -> PolicySet:
    """The policies of the hub's config (``--config-dir``)."""
    from ..config import MIGPolicyConfig

    return MIGPolicyConfig(config=hub_config(args)).build()


def cmd_grant(args: argparse.Namespace) -> int:
    """Run ``mig-spawner budget grant``; returns the exit status."""
    from ..ledger import Ledger, LedgerError

    try:
        seconds = parse_duration(args.hours, unlimited_ok=False)
    except DurationError as e:
        print(f"error: hours: {e}", file=sys.stderr)
        return 2
    policies = hub_policies(args)
    group = policies.groups.get(args.group)
    if group is None or not group.has_budget:
        print(f"error: group {args.group!r} has no budget in the hub's config "
              f"(groups with one: {', '.join(_budgeted(policies)) or 'none'})", file=sys.stderr)
        return 2
    if args.user and group.user_budget is None:
        print(f"error: group {args.group!r} sets no user_budget; grant to the group "
              "(without --user)", file=sys.stderr)
        return 2
    url = ledger_url(args)
    try:
        Ledger.open_existing(url).close()  # there, and at this package's schema
        with Ledger(url) as ledger:
            extra = ledger.usage.grant_hours(args.group, args.user, seconds, by=getpass.getuser(),
                                       note=args.note)
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    whose = f"{args.user}'s own budget in" if args.user else "the budget of"
    until = extra.at + timedelta(seconds=group.budget_window)
    (amount,) = slice_amounts(seconds)
    print(f"granted {amount} to {whose} group {args.group!r}, valid until "
          f"{until:%Y-%m-%d %H:%M} UTC")
    return 0


def cmd_budget(args: argparse.Namespace, now: datetime | None = None) -> int:
    """Run ``mig-spawner budget``: the budget table; returns the exit status."""
    from ..ledger import Ledger, LedgerError

    try:
        with Ledger.open_existing(ledger_url(args)) as ledger:
            section = budget_section(hub_policies(args), ledger, now or datetime.now(UTC))
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if section is None:
        print("no group of the hub's config has a budget (see docs/policies.md, "
              "\"Budgets\")", file=sys.stderr)
        return 0
    text, rows = section
    print(json.dumps(rows, indent=2) if args.json else text)
    return 0


def budget_section(policies: PolicySet, ledger: Ledger, now: datetime
                   ) -> tuple[str, list[dict]] | None:
    """Where each budget of ``policies`` stands at ``now``: the table as text and its rows
    as JSON (``mig-spawner budget``, and ``report`` with ``--config-dir``); ``None`` when
    no group has a budget."""
    from ..report.budgets import budget_rows, budgets_text

    if policies.budget_horizon is None:
        return None
    leases, extras = ledger.usage.budget(now - timedelta(seconds=policies.budget_horizon))
    rows = budget_rows(policies, leases, extras, {x.id for x in leases if x.held}, now)
    return budgets_text(rows), [{**asdict(r), "left_hours": r.left_hours} for r in rows]


def _budgeted(policies: PolicySet) -> list[str]:
    return [name for name, g in policies.groups.items() if g.has_budget]
