"""How long `mig-spawner report --advise` takes, against replaying through the allocator.

Synthetic month-like histories (a mix of 1g/2g/3g requests with overlapping holds) on
fleets of 2 and 8 H200 whose layout does not fit the demand. For each size it times:

* baseline: one replay of the history through the allocator (``replay_pool``), the
  cost of checking ONE candidate layout the faithful way;
* the fast count of one layout (``count_refusals``), what the search uses;
* the day resampling that gives the advice's ranges (``refusal_ranges``);
* the whole ``advise`` (search + the two faithful replays + the ranges it reports).

Prints a table and the ratios against the baseline measured in the same run.
Run: ``.venv/bin/python benchmarks/report_advise.py``
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from mig_spawner.report.advise import advise, count_refusals
from mig_spawner.report.demand import Request
from mig_spawner.report.replay import GpuLayout, layout_inventory, replay_pool
from mig_spawner.report.sample import refusal_ranges

START = datetime(2026, 11, 1, tzinfo=UTC)
MIX = (("1g.18gb", 0.6, 3), ("2g.35gb", 0.25, 5), ("3g.71gb", 0.15, 8))  # profile, share, hours


def history(requests: int, seed: int = 7) -> list[Request]:
    """``requests`` arrivals spread over 30 days, holds around each profile's mean."""
    rng = random.Random(seed)
    found = []
    for n in range(requests):
        profile = rng.choices([m[0] for m in MIX], weights=[m[1] for m in MIX])[0]
        mean = next(m[2] for m in MIX if m[0] == profile)
        arrive = START + timedelta(minutes=rng.uniform(0, 30 * 24 * 60))
        hold = timedelta(hours=rng.expovariate(1 / mean))
        found.append(Request(arrive, arrive + hold, profile, "g", f"u{n}", True))
    return sorted(found, key=lambda q: q.arrive)


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    rows = []
    for gpus, requests in ((2, 500), (2, 5000), (8, 5000), (8, 20000)):
        fleet = tuple(GpuLayout(i, "h200", {"1g.18gb": 7}) for i in range(gpus))
        demand = history(requests)
        inventory = layout_inventory(fleet)
        baseline = timed(lambda: replay_pool(inventory, demand))  # noqa: B023
        fast = timed(lambda: count_refusals(fleet, demand))  # noqa: B023
        whole = timed(lambda: advise(fleet, demand), repeat=1)  # noqa: B023
        result = advise(fleet, demand)
        ranges = timed(lambda: refusal_ranges(
            demand, result.before.refused_requests, result.after.refused_requests))  # noqa: B023
        rows.append((gpus, requests, baseline, fast, ranges, whole, result.before.refused,
                     result.after.refused))
    header = ("GPUs", "requests", "allocator replay", "fast count", "ranges", "advise",
              "fast/replay", "ranges/replay", "advise/replay", "refused before", "after")
    print("  ".join(f"{h:>14}" for h in header))
    for gpus, requests, baseline, fast, ranges, whole, before, after in rows:
        print("  ".join(f"{c:>14}" for c in (
            gpus, requests, f"{baseline * 1000:.1f} ms", f"{fast * 1000:.1f} ms",
            f"{ranges * 1000:.1f} ms", f"{whole:.2f} s", f"{fast / baseline:.3f}x",
            f"{ranges / baseline:.3f}x", f"{whole / baseline:.1f}x", before, after)))


if __name__ == "__main__":
    main()
