"""A year of history: `report`, `report --rightsize`, the budget check and the slice
map's JSON over a generated year of a 100-slice, 3,000-user fleet, with raw usage
samples only (the baseline: no summaries, nothing pruned) and then as the slice service
leaves the ledger (each ended lease's summary kept, raw samples older than 30 days
pruned); the ledger's size on disk for both; and the slice map at 3,000 running servers
against the map at 100 (the same code, in the same run).

The fleet: 100 slices (1g.18gb on H200s), each held back to back by sessions of 4 h on
average with gaps of 1 h, by 3,000 users in 10 groups with budgets; the last session on
every slice still runs. Samples every ``--interval`` seconds (600 by default, a tenth of
the service's 60 s so that the baseline ledger is generated in a minute or two: at 60 s
the raw table, and the baseline's reading of it, is ten times larger again; the pruned
ledger keeps 30 days of it, also ten times larger, while the summaries stay one row per
lease). SQLite on disk, as the hub's default ledger. The two ``report`` commands run in
a process of their own (this one's heap, after a year generated and read raw, made them
some 0.2 s slower), timed after their imports, and again whole as an admin waits for them.
Not a timed test: it prints seconds and ratios.
Run: ``nice -n 19 .venv/bin/python benchmarks/history.py``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import insert, text

from mig_spawner.cli.budget import budget_section
from mig_spawner.core.catalog import model
from mig_spawner.core.inventory import Gpu, GpuInstance, Inventory, MigDevice
from mig_spawner.core.policy import PolicySet, build_policy
from mig_spawner.ledger import Ledger
from mig_spawner.ledger.models import lease_samples, leases
from mig_spawner.observe.slicemap import slicemap_json
from mig_spawner.observe.source import SliceSource
from mig_spawner.report.demand import usage

PROFILE = "1g.18gb"
PER_GPU = 7  # 1g.18gb instances of an H200
GROUPS = 10
WINDOW = timedelta(days=30)  # the slice service's default usage_sample_retention


def fleet(slices: int) -> Inventory:
    """H200s cut into 1g.18gb instances, ``slices`` of them in all."""
    m, p = model("h200"), model("h200").profile(PROFILE)
    gpus = []
    for index in range(-(-slices // PER_GPU)):
        uuid_ = f"GPU-{index:08d}-0000-0000-0000-000000000000"
        count = min(PER_GPU, slices - index * PER_GPU)
        gis = tuple(GpuInstance(n + 1, p.name, p.profile_id, n, 1) for n in range(count))
        devs = tuple(MigDevice(mig_uuid(index, n), index, uuid_, n, "NVIDIA H200 MIG 1g.18gb",
                               p.name, n + 1, 0, n, 1, p.memory_mib, 0) for n in range(count))
        gpus.append(Gpu(index, uuid_, "NVIDIA H200", "h200", index, m.memory_mib, True, True,
                        gpu_instances=gis, mig_devices=devs))
    return Inventory("bench", "580.65", "13.580", 13000, tuple(gpus))


class Gpus:
    """What the slice map reads of the GPUs: this inventory."""

    def __init__(self, inventory: Inventory) -> None:
        self._inventory = inventory

    def inventory(self) -> Inventory:
        return self._inventory


def mig_uuid(gpu: int, n: int) -> str:
    return f"MIG-{gpu:08d}-{n:04d}-0000-0000-000000000000"


def policy() -> PolicySet:
    return build_policy(offers=None, classes=None, groups={
        f"g{n}": {"allowed": [PROFILE], "budget": "400h", "user_budget": "150h",
                  "budget_window": "7d"} for n in range(GROUPS)})


def lease_row(slot: int, user: int, start: datetime, end: datetime | None,
              peak: int) -> dict:
    gpu, n = divmod(slot, PER_GPU)
    return {"id": uuid.uuid4().hex, "user_name": f"user{user:05d}", "server_name": "",
            "group_name": f"g{user % GROUPS}", "profile": PROFILE, "compute_slices": 1,
            "mode": "pool", "state": "released" if end else "active", "host": "bench",
            "gpu_uuid": f"GPU-{gpu:08d}-0000-0000-0000-000000000000", "gpu_index": gpu,
            "placement_start": n, "placement_size": 1, "mig_uuid": mig_uuid(gpu, n),
            "gi_id": n + 1, "ci_id": 0, "claimed_at": start, "started_at": start,
            "last_activity_at": end or start, "released_at": end,
            "release_code": "stopped" if end else None, "peak_memory_mib": peak}


def generate(ledger: Ledger, now: datetime, slices: int, users: int, interval: float,
             seed: int = 36) -> tuple[int, int]:
    """A year of back-to-back sessions on every slice (the last one running), sampled
    every ``interval`` seconds; returns (leases, samples) written."""
    rng = random.Random(seed)
    memory = model("h200").profile(PROFILE).memory_mib
    rows, samples = [], []
    written = 0

    def flush(force: bool = False) -> None:
        nonlocal written
        if len(samples) < 200_000 and not force:
            return
        with ledger._tx.write() as connection:  # bulk load: the benchmark's own rows
            if rows:
                connection.execute(insert(leases), rows)
            if samples:
                connection.execute(insert(lease_samples), samples)
        written += len(samples)
        rows.clear()
        samples.clear()

    count = 0
    for slot in range(slices):
        at = now - timedelta(days=365) + timedelta(minutes=rng.uniform(0, 60))
        while True:
            hold = timedelta(hours=max(0.1, rng.expovariate(1 / 4)))
            end = at + hold
            running = end >= now - timedelta(hours=1)
            peak = int(memory * rng.uniform(0.05, 1.0))
            row = lease_row(slot, rng.randrange(users), at, None if running else end, peak)
            rows.append(row)
            count += 1
            t, stop = at, (now if running else end)
            while t < stop:
                samples.append({"lease_id": row["id"], "at": t,
                                "memory_used_mib": int(peak * rng.uniform(0.3, 1.0)),
                                "memory_total_mib": memory,
                                "sm_active": rng.choice((0.0, 0.0, 0.4, 0.9)),
                                "processes": 1})
                t += timedelta(seconds=interval)
            flush()
            if running:
                break
            at = end + timedelta(hours=rng.expovariate(1))
    flush(force=True)
    return count, written


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) / 2**20


def timed(fn: Callable[[], object], repeat: int = 2) -> float:
    """The best of ``repeat`` runs; one alone when it takes more than 5 s."""
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
        if best > 5:
            break
    return best


#: Times ``mig-spawner <argv>`` in a process of its own, best of 2, its imports done
#: before the clock starts: what the command does, not what this process's heap (a
#: year generated and read raw) would add to it.
_COMMAND = """
import contextlib, io, sys, time
from mig_spawner.cli.main import main
best = float("inf")
for _ in range(2):
    began = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(sys.argv[1:]) == 0, sys.argv
    best = min(best, time.perf_counter() - began)
print(best)
"""


def command(argv: list[str]) -> tuple[float, float]:
    """Seconds of ``mig-spawner <argv>``: its work (see :data:`_COMMAND`) and the whole
    command as an admin waits for it (Python's start and the imports too)."""
    work = float(subprocess.run([sys.executable, "-c", _COMMAND, *argv], check=True,
                                capture_output=True, text=True).stdout)
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mig_spawner.cli.main", *argv], check=True,
                   stdout=subprocess.DEVNULL)
    return work, time.perf_counter() - began


def queries(url: str, ledger: Ledger, inventory: Inventory, now: datetime
            ) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of each thing an admin asks of the year; and of the two commands with
    Python's start and their imports."""
    rules = policy()
    source = SliceSource(Gpus(inventory), ledger, rules, max_age=0)  # type: ignore[arg-type]
    base = ["report", "--ledger-url", url, "--since", "365d"]
    plain, rightsize = command(base), command([*base, "--rightsize"])
    return {
        "report": plain[0],
        "report --rightsize": rightsize[0],
        "budget check": timed(lambda: budget_section(rules, ledger, now)),
        "map JSON": timed(lambda: json.dumps(slicemap_json(source.snapshot()))),
    }, {"report": plain[1], "report --rightsize": rightsize[1]}


def report_read(ledger: Ledger, now: datetime) -> tuple[float, float]:
    """Seconds for the leases of the year and the report's usage rows from them: read as
    full Lease records (``leases.history``, what the report read before) and as the
    report's columns (``reports.leases``, what it reads now); the same rows either way."""
    since = now - timedelta(days=365)

    def figures(read: Callable[[], list]) -> Callable[[], object]:
        return lambda: usage(read(), [], since, now)

    full = figures(lambda: [x for x in ledger.leases.history(since) if x.claimed_at <= now])
    narrow = figures(lambda: ledger.reports.leases(since, now))
    assert full() == narrow()
    return timed(full), timed(narrow)


def running_map(folder: Path, servers: int, now: datetime) -> float:
    """Seconds for the slice map's JSON with ``servers`` running servers, one slice each."""
    url = f"sqlite:///{folder / f'map{servers}.sqlite'}"
    rng = random.Random(servers)
    with Ledger.open(url) as ledger:
        with ledger._tx.write() as connection:
            connection.execute(insert(leases), [
                lease_row(slot, slot, now - timedelta(minutes=rng.uniform(1, 600)), None,
                          1000) for slot in range(servers)])
        source = SliceSource(Gpus(fleet(servers)), ledger, policy(),  # type: ignore[arg-type]
                             max_age=0)
        view = source.snapshot()
        assert view.count("leased") + view.count("idle") == servers, view.count("leased")
        return timed(lambda: json.dumps(slicemap_json(source.snapshot())), repeat=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", type=int, default=100)
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--interval", type=float, default=600.0,
                        help="seconds between two samples of a slice (the service: 60)")
    parser.add_argument("--servers", type=int, default=3000,
                        help="running servers for the slice map")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    now = datetime.now(UTC)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ledger.sqlite"
        url = f"sqlite:///{path}"
        inventory = fleet(args.slices)
        with Ledger.open(url) as ledger:
            began = time.perf_counter()
            count, samples = generate(ledger, now, args.slices, args.users, args.interval)
            print(f"generated a year: {count:,} leases, {samples:,} samples every "
                  f"{args.interval:g} s in {time.perf_counter() - began:.0f} s")
            with ledger._tx.write() as connection:
                connection.execute(text("ANALYZE"))
            raw, raw_whole = queries(url, ledger, inventory, now)
            raw_size = size_mib(path)

            held = {x.id for x in ledger.leases.active()}
            with ledger._tx.read() as connection:
                ended = [i for i in connection.execute(
                    text("SELECT id FROM leases WHERE state = 'released'")).scalars()
                    if i not in held]
            began = time.perf_counter()
            kept = ledger.usage.summarize_released(ended)
            summarised = time.perf_counter() - began
            began = time.perf_counter()
            _, deleted = ledger.usage.prune(now - WINDOW)
            pruned = time.perf_counter() - began
            print(f"the service's work, all at once here: {kept:,} summaries in "
                  f"{summarised:.1f} s; {deleted:,} samples older than 30 days pruned in "
                  f"{pruned:.1f} s")
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            db.execute("VACUUM")  # give the pruned pages back to the file system
        with Ledger.open(url) as ledger:
            small, small_whole = queries(url, ledger, inventory, now)
            small_size = size_mib(path)
            full, narrow = report_read(ledger, now)

        print(f"\n{'query (best of 2)':<22}{'raw samples':>14}{'summaries':>12}{'ratio':>8}"
              f"{'goal':>8}")
        for name, before in raw.items():
            after = small[name]
            print(f"{name:<22}{before:>13.3f}s{after:>11.3f}s{after / before:>8.2f}"
                  f"{'≤ 2 s':>8}")
        print(f"{'ledger on disk':<22}{raw_size:>12.0f}MiB{small_size:>9.0f}MiB"
              f"{small_size / raw_size:>8.2f}")
        print("the two commands in a process of their own, imports before the clock; "
              "as an admin waits for them (Python's start and imports too):")
        for name, before in raw_whole.items():
            print(f"  {name:<20}{before:>13.3f}s{small_whole[name]:>11.3f}s")

        print(f"the report's read of the year and its usage figures: full leases "
              f"{full:.3f} s (the read before), report columns {narrow:.3f} s; ratio "
              f"{narrow / full:.2f}")

        few, many = running_map(Path(folder), args.slices, now), running_map(
            Path(folder), args.servers, now)
        print(f"\nslice map JSON, {args.slices} running servers: {few:.3f} s; "
              f"{args.servers:,}: {many:.3f} s (goal ≤ 0.5 s); ratio {many / few:.1f} for "
              f"{args.servers / args.slices:.0f}x the servers")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
