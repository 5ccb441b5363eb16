"""``mig-spawner report``: usage per profile and group from the ledger, and layout advice."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.durations import DurationError, parse_duration
from .settings import allowed_by, hub_config, ledger_url, read_inventory

if TYPE_CHECKING:  # the ledger pulls in SQLAlchemy: import it only when the command runs
    from ..core.rightsize import RightsizeRule
    from ..gpu.errors import GpuError
    from ..ledger import Lease, Ledger
    from ..ledger.reports import LeaseFacts
    from ..report.advise import Advice
    from ..report.demand import UsageRow
    from ..report.replay import Fleet
    from ..report.waits import WaitRow

DEFAULT_WINDOW = "30d"
# The advice's minimum sample (mig_spawner.report.advise.MIN_REQUESTS; a test checks).
DEFAULT_MIN_REQUESTS = 50

# Plain text: argparse prints it as it stands.
DESCRIPTION = """\
Usage per MIG profile and group from the lease ledger, and layout advice.

It never writes the ledger: it opens it read-only and never creates it (where there
is no ledger it says so and exits 1). It reads the host's current MIG layout for
--advise and for the capacity lines of the plots, and prints a table. --plots DIR adds PNGs;
--advise replays the history on the layout that would have refused fewest and prints
it as an NVIDIA mig-parted config (--write-config FILE saves it). Below
--min-requests requests the advice proposes nothing; --config-dir names the groups
that would lose a profile the proposal drops. Where users gave a purpose, usage by
purpose follows the table; --rightsize lists the users and groups whose slices are
over- or under-sized by their measured peaks (the thresholds are printed with it).
"""


def parse_when(text: str, now: datetime) -> datetime:
    """A moment: ISO date/time (UTC when no zone is given) or a duration back from ``now``."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            seconds = parse_duration(text, unlimited_ok=False)
        except DurationError as e:
            raise ValueError(
                f"{text!r} is neither a date (2026-11-01, 2026-11-01T08:00) nor a duration "
                f"back from now (30d, 12h): {e}") from None
        return now - timedelta(seconds=seconds)
    return moment if moment.utcoffset() is not None else moment.replace(tzinfo=UTC)


def add_parser(sub: argparse._SubParsersAction, add_global_options: Callable) -> None:
    """Register ``report`` on the ``mig-spawner`` parser (``add_global_options``: main's
    global options: the hub's config, the GPUs for the current layout, the ledger)."""
    p = sub.add_parser(
        "report",
        help="usage per MIG profile and group from the ledger; --advise proposes a layout",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_global_options(p)
    p.add_argument("--since", default=DEFAULT_WINDOW, metavar="WHEN",
                   help="start of the window: a date (2026-11-01) or a duration back from "
                        f"now (default: {DEFAULT_WINDOW})")
    p.add_argument("--until", metavar="WHEN", help="end of the window (default: now)")
    p.add_argument("--no-groups", action="store_true",
                   help="one line per profile instead of per profile and group")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plots", metavar="DIR", type=Path,
                   help="also write concurrency.png and demand.png into DIR")
    p.add_argument("--advise", action="store_true",
                   help="replay the history on other layouts and propose the best one")
    p.add_argument("--write-config", metavar="FILE", type=Path,
                   help="with --advise: write the mig-parted config to FILE")
    p.add_argument("--min-requests", type=int, default=DEFAULT_MIN_REQUESTS, metavar="N",
                   help="with --advise: propose nothing from fewer requests than this "
                        f"(default: {DEFAULT_MIN_REQUESTS})")
    p.add_argument("--rightsize", action="store_true",
                   help="list users and groups whose slices are over- or under-sized, from "
                        "the measured peaks of their sessions (thresholds: "
                        "c.RightsizeConfig of --config-dir, printed with the list)")
    p.add_argument("--min-sessions", type=int, metavar="N",
                   help="with --rightsize: measured sessions needed per size (default: "
                        "c.RightsizeConfig.min_sessions, 3)")
    p.set_defaults(func=cmd_report)


def _fleet(args: argparse.Namespace, held: Sequence[Lease]) -> tuple[Fleet, dict[int, int]]:
    """The MIG layout of this host (or of the ``--simulate`` spec), and how many of the
    ``held`` leases hold a slice on each of its GPUs (by GPU index)."""
    from ..report.replay import fleet_of

    inventory = read_inventory(args)
    index_of = {g.uuid: g.index for g in inventory.gpus}
    on_gpu = Counter(index_of[x.gpu_uuid] for x in held if x.gpu_uuid in index_of)
    return fleet_of(inventory), dict(on_gpu)


def _gpu_error(e: GpuError, doing: str) -> None:
    print(f"error: {doing}: {e}", file=sys.stderr)
    if e.hint:
        print(f"hint: {e.hint}", file=sys.stderr)


def cmd_report(args: argparse.Namespace, now: datetime | None = None) -> int:
    """Run ``mig-spawner report``; returns the exit status."""
    from ..gpu.errors import GpuError
    from ..ledger import Ledger, LedgerError, LedgerMissing
    from ..report.advise import advise, capacity
    from ..report.demand import requests_of, usage
    from ..report.waits import wait_rows

    now = now or datetime.now(UTC)
    try:
        until = parse_when(args.until, now) if args.until else now
        since = parse_when(args.since, now)
        if since >= until:
            raise ValueError(f"--since ({since:%Y-%m-%d %H:%M}) must be before --until "
                             f"({until:%Y-%m-%d %H:%M})")
        if args.write_config and not args.advise:
            raise ValueError("--write-config needs --advise")
        if args.min_requests < 1:
            raise ValueError("--min-requests must be at least 1")
        rule = _rightsize_rule(args) if args.rightsize else None
        allowing = allowed_by(args.config_dir) if args.advise else {}
        with _collector_paused(), Ledger.open_existing(ledger_url(args)) as ledger:
            leases = ledger.reports.leases(since, until)
            refusals = ledger.refusals.between(since, until)
            waits = wait_rows(ledger.waits.joined(since, until))
            held = ledger.leases.active() if args.advise else []
            measured = ledger.usage.summaries_between(since, until) if rule is not None else {}
            budgets = _budgets(args, ledger, now)
            rows = usage(leases, refusals, since, until, by_group=not args.no_groups)
            extra = _purpose_and_rightsize(args, leases, measured, rule, since, until)
        if budgets is not None:
            extra["budgets"] = budgets
    except LedgerMissing as e:
        print(f"error: {e}", file=sys.stderr)
        print("hint: point --ledger-url at the ledger the hub uses (by default "
              "mig_spawner_ledger.sqlite beside the hub's jupyterhub.sqlite)", file=sys.stderr)
        return 1
    except (ValueError, LedgerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fleet: Fleet = ()
    on_gpu: dict[int, int] = {}
    if args.advise or args.plots:
        try:
            fleet, on_gpu = _fleet(args, held)
        except GpuError as e:
            if args.advise:
                _gpu_error(e, "reading the current MIG layout to advise on")
                return 1
            # The plots only use the layout for capacity lines: draw them without.
            print(f"note: no capacity lines in the plots ({e})", file=sys.stderr)
    advice = None
    if args.advise:
        if not fleet:
            print("error: --advise needs a MIG GPU to lay out; this host has none "
                  "(use --simulate with the fleet to plan for)", file=sys.stderr)
            return 1
        advice = advise(fleet, requests_of(leases, refusals, until),
                        min_requests=args.min_requests, allowed_by=allowing, held=on_gpu)
    _print(args, rows, advice, since, until, waits, extra)
    if advice is not None and args.write_config:
        from ..report.render import mig_parted_yaml

        if advice.too_small:
            print(f"error: not writing {args.write_config}: the sample is too small to "
                  "advise on", file=sys.stderr)
            return 1
        args.write_config.write_text(mig_parted_yaml(advice), encoding="utf-8")
        print(f"\nwrote {args.write_config}", file=sys.stderr)
    if args.plots:
        try:
            from ..report.plots import write_plots
        except ImportError as e:
            print(f"error: --plots needs matplotlib ({e}); pip install matplotlib",
                  file=sys.stderr)
            return 1
        for path in write_plots(args.plots, leases, rows, since, until, capacity(fleet)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector while the report reads and adds up the window: a
    year is some 175,000 leases, each a few objects without cycles, and every full
    collection walks them all again (a third of the time over a year, nothing found)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _budgets(args: argparse.Namespace, ledger: Ledger, now: datetime
             ) -> tuple[str, list[dict]] | None:
    """Where each budget stands, with the hub's config (``--config-dir``) only: the
    budgets are in its policies."""
    if not args.config_dir:
        return None
    from .budget import budget_section, hub_policies

    return budget_section(hub_policies(args), ledger, now)


def _rightsize_rule(args: argparse.Namespace) -> RightsizeRule:
    """The right-sizing thresholds: ``c.RightsizeConfig`` of ``--config-dir``, with
    ``--min-sessions`` over it."""
    from traitlets import TraitError

    from ..config import RightsizeConfig

    settings = RightsizeConfig(config=hub_config(args))
    if args.min_sessions is not None:
        if args.min_sessions < 1:
            raise ValueError("--min-sessions must be at least 1")
        settings.min_sessions = args.min_sessions
        settings.recent = max(settings.recent, args.min_sessions)
    try:
        return settings.rule()
    except TraitError as e:
        raise ValueError(str(e)) from None


def _purpose_and_rightsize(args: argparse.Namespace, leases: Sequence[LeaseFacts],
                           measured: dict, rule: RightsizeRule | None, since: datetime,
                           until: datetime) -> dict[str, tuple[str, list]]:
    """Section name -> (its text, its JSON rows): usage by purpose where any lease has
    one, and ``--rightsize``'s verdicts."""
    from ..report.rightsize import purpose_rows, purpose_text, rightsize_rows, rightsize_text

    def section(text: Callable[[], str], rows: Callable[[], list]) -> tuple[str, list]:
        # Only the form this run prints: over a year, the other is thousands of rows
        # built for nothing.
        return ("", rows()) if args.json else (text(), [])

    sections: dict[str, tuple[str, list]] = {}
    if any(x.purpose for x in leases):
        purposes = purpose_rows(leases, since, until)
        sections["purposes"] = section(
            lambda: "Usage by purpose\n\n" + purpose_text(purposes),
            lambda: [asdict(r) for r in purposes])
    if rule is not None:
        verdicts = rightsize_rows(leases, measured, rule)
        sections["rightsize"] = section(
            lambda: rightsize_text(verdicts, rule),
            lambda: [{**asdict(r), "text": r.text} for r in verdicts])
    return sections


def _print(args: argparse.Namespace, rows: list[UsageRow], advice: Advice | None,
           since: datetime, until: datetime, waits: Sequence[WaitRow] = (),
           extra: dict[str, tuple[str, list]] | None = None) -> None:
    from ..report import render
    from ..report.waits import waits_text

    extra = extra or {}
    if args.json:
        data = render.to_json(rows, advice, since, until)
        data["waits"] = [asdict(w) for w in waits]
        data.update({name: found for name, (_, found) in extra.items()})
        print(json.dumps(data, indent=2))
        return
    print(render.usage_text(rows, since, until))
    if waits:
        print()
        print(waits_text(waits))
    for text, _ in extra.values():
        print()
        print(text)
    if advice is not None:
        print()
        print(render.advice_text(advice))
