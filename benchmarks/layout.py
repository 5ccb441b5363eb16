"""Layout change benchmark: time from ``apply`` to done, and servers stopped unwarned.

Run: ``.venv/bin/python benchmarks/layout.py`` (under a minute on 2 cores).

Two simulated H200s carry 7x 1g.18gb each and are re-cut to a 3g.71gb + 2g.35gb +
2x 1g.18gb (ten instances destroyed, four created). N of the instances that must go are
held by servers that would end on their own after an exponential time (mean 40 min);
the group's ``drain_notice`` is the default hour; the slice service's sweep runs every
minute of simulated time (its default ``cull_every``), calling the same
:class:`~mig_spawner.layout.LayoutApplier` and giving back the leases whose notice
ended (code ``drain``). Real ledger (SQLite), real simulator, a simulated clock.

Prints, for N = 0, 1, 4, 10: the simulated minutes from apply to done (median over
seeds), the wall time the apply steps took, and the servers stopped by the drain, the
ones warned before that, and the ones stopped without a warning (goal: 0). The N = 0
run is the baseline the others are put against.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mig_spawner.core.layout import parse_spec, plan_layout
from mig_spawner.gpu import connect
from mig_spawner.layout import LayoutApplier, begin, holders_of
from mig_spawner.ledger import Grant, LeaseRequest, Ledger, ReleaseCode

TARGET = "3g.71gb,2g.35gb,1g.18gb*2"
NOTICE = 3600.0
SWEEP = 60.0
MEAN_SESSION_LEFT = 40 * 60.0
SEEDS = 5


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 1, 9, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def one_run(held: int, seed: int, workdir: Path) -> tuple[float, float, int, int, int]:
    """(simulated minutes to done, wall seconds in steps, stopped, warned first, unwarned)."""
    rng = random.Random(seed)
    state = workdir / f"sim-{held}-{seed}.json"
    gpus = connect(simulate="h200x2:layout=1g.18gb*7", state_file=str(state))
    clock = Clock()
    ledger = Ledger.open(f"sqlite:///{workdir / f'ledger-{held}-{seed}.sqlite'}", clock=clock)
    inventory = gpus.inventory()
    # Holders on instances the plan destroys (starts 2..6 of each GPU).
    places = rng.sample([(g, s) for g in (0, 1) for s in range(2, 7)], held)
    ends = {}
    for n, (g, start) in enumerate(places):
        device = next(d for d in inventory.mig_devices if (d.gpu_index, d.start) == (g, start))
        lease = ledger.leases.claim(LeaseRequest(f"user{n}"), lambda view, d=device: Grant(
            group="analysts", profile=d.profile, compute_slices=1, mode="pool",
            host=inventory.host, gpu_uuid=d.gpu_uuid, gpu_index=d.gpu_index, start=d.start,
            size=d.size, mig_uuid=d.uuid, gi_id=d.gi_id, ci_id=d.ci_id))
        ends[lease.id] = clock.now + timedelta(seconds=rng.expovariate(1 / MEAN_SESSION_LEFT))
    target = parse_spec(TARGET)
    plan = plan_layout(inventory, target, holders_of(ledger.leases.active()))
    begin(ledger, inventory.host, plan, target)
    applier = LayoutApplier(ledger, gpus, lambda group: NOTICE, clock=clock)
    started, wall, stopped = clock.now, 0.0, []
    while ledger.holds.changes():
        for lease_id, end in ends.items():  # servers that ended on their own
            if end <= clock.now:
                ledger.leases.release(lease_id, ReleaseCode.STOPPED)
        t0 = time.perf_counter()
        done = applier.step()
        for lease in done.due:  # the sweep gives these back (through the Releaser)
            if ledger.leases.release(lease.id, ReleaseCode.DRAIN, "drain notice ended"):
                stopped.append(lease.id)
        if done.due:
            applier.step()
        wall += time.perf_counter() - t0
        if ledger.holds.changes():
            clock.now += timedelta(seconds=SWEEP)
    warned = sum(1 for x in stopped if any(e.kind == "warned" and e.rule == "drain"
                                           for e in ledger.warnings.events(x)))
    minutes = (clock.now - started).total_seconds() / 60
    ledger.close()
    gpus.close()
    return minutes, wall, len(stopped), warned, len(stopped) - warned


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for held in (0, 1, 4, 10):
            runs = [one_run(held, seed, Path(tmp)) for seed in range(SEEDS)]
            rows[held] = (statistics.median(r[0] for r in runs),
                          statistics.median(r[1] for r in runs),
                          sum(r[2] for r in runs), sum(r[3] for r in runs),
                          sum(r[4] for r in runs))
    base_wall = rows[0][1]
    print(f"re-cut of 2 H200 (7x 1g.18gb -> {TARGET}), drain_notice {NOTICE / 60:.0f} min, "
          f"sweep every {SWEEP:.0f} s, {SEEDS} seeds")
    print(f"{'held':>5} {'apply->done (sim min)':>22} {'step wall ms':>13} {'x base':>7} "
          f"{'stopped':>8} {'warned':>7} {'unwarned':>9}")
    for held, (minutes, wall, stopped, warned, unwarned) in rows.items():
        print(f"{held:>5} {minutes:>22.0f} {wall * 1000:>13.1f} {wall / base_wall:>7.2f} "
              f"{stopped:>8} {warned:>7} {unwarned:>9}")


if __name__ == "__main__":
    main()
