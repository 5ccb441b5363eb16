"""The report's narrow read of the leases (``ledger.reports``) gives the figures the full
read (``ledger.leases.history``) gave, on a generated history, SQLite and PostgreSQL."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from mig_spawner.core.catalog import model
from mig_spawner.core.rightsize import RightsizeRule
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.report.demand import held_steps, requests_of, usage
from mig_spawner.report.rightsize import purpose_rows, rightsize_rows
from tests.mocking import Clock

START = datetime(2026, 11, 1, tzinfo=UTC)
PROFILES = ("1g.18gb", "2g.35gb", "3g.71gb")
COLUMNS = ("id", "user", "group", "profile", "claimed_at", "released_at", "last_activity_at",
           "purpose", "held")


def generate(ledger: Ledger, clock: Clock, leases: int, seed: int = 36) -> None:
    """``leases`` sessions over ten days through the ledger's own claim, activity, purpose
    and release, in time order; about one in eight still held at the end."""
    rng = random.Random(seed)
    events = []
    for n in range(leases):
        start = timedelta(hours=rng.uniform(0, 240))
        hold = timedelta(hours=rng.expovariate(1 / 6))
        events.append((start, 0, n))
        if rng.random() < 0.6:
            events.append((start + hold * rng.random(), 1, n))  # activity
        if rng.random() < 0.875:
            events.append((start + hold, 2, n))  # release
    ids: dict[int, str] = {}
    for moment, kind, n in sorted(events):
        clock.now = START + moment
        if kind == 0:
            profile = PROFILES[n % len(PROFILES)]
            grant = Grant(group=f"g{n % 4}", profile=profile,
                          compute_slices=model("h200").profile(profile).compute_slices,
                          mode="kube")
            ids[n] = ledger.leases.claim(LeaseRequest(f"user{n % 23}", str(n)),
                                         lambda view, g=grant: g).id
            if n % 3:
                ledger.leases.record_purpose(ids[n], ("teaching", "thesis")[n % 2])
        elif kind == 1:
            ledger.usage.touch(ids[n], clock.now)
        else:
            ledger.leases.release(ids[n], "stopped")


def test_the_narrow_read_gives_the_full_reads_figures(backend_url):
    clock = Clock(START)
    with Ledger.open(backend_url, clock=clock) as ledger:
        generate(ledger, clock, 300)
        rule = RightsizeRule(min_sessions=1)
        # Windows that cut leases at both ends, one inside the history, one past it.
        for since, until in ((START + timedelta(days=3), START + timedelta(days=6)),
                             (START - timedelta(days=1), START + timedelta(days=30))):
            full = [x for x in ledger.leases.history(since) if x.claimed_at <= until]
            narrow = ledger.reports.leases(since, until)
            assert len(full) > 50
            assert [tuple(getattr(x, c) for c in COLUMNS) for x in narrow] == [
                tuple(getattr(x, c) for c in COLUMNS) for x in full]
            for by_group in (True, False):
                assert usage(narrow, [], since, until, by_group=by_group) == usage(
                    full, [], since, until, by_group=by_group)
            assert requests_of(narrow, [], until) == requests_of(full, [], until)
            assert held_steps(narrow, since, until) == held_steps(full, since, until)
            assert purpose_rows(narrow, since, until) == purpose_rows(full, since, until)
            assert rightsize_rows(narrow, {}, rule) == rightsize_rows(full, {}, rule)
