"""CPU of the ledger's writes per spawn: claim, activation, stale-lease read, release.

What a spawner's worker thread spends in the ledger for each server it starts and
stops, measured as that thread's CPU time (``time.thread_time``: the database
server's own CPU is not in it, the hub's is), with ``--held`` leases held meanwhile
(a class in session), on SQLite and PostgreSQL (a throwaway cluster, as the tests
start one; skipped when its binaries are missing):

* **stale read**: ``active_for_server`` of a server about to start (nothing found);
* **line read**: ``waiting`` (nobody waits), which the spawner asks before it claims;
* **claim**: ``ledger.leases.claim`` with a minimal ``decide`` (first free slot);
* **activation**: the server process recorded as the lease's holder and the lease
  made active (``ledger.leases.activate`` with the holder);
* **release**: ``ledger.leases.release``.

``--baseline REF`` also loads ``mig_spawner/ledger`` as it is at the git revision REF
(e.g. ``main``) into this process, under another name, and runs the same operations
through it on a database of its own, the two alternating round by round, so that the
ratios are taken under the same load. A baseline without a holder parameter on
``activate`` is timed the way its spawner called it: ``record_holder``, then
``activate``.

Run from the repository root::

    .venv/bin/python -m benchmarks.ledger --baseline main
    .venv/bin/python -m benchmarks.ledger --held 50 --rounds 200 --no-postgres

It prints figures and ratios; it is a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Any

import mig_spawner.ledger as current
from tests.support import pg_fixture

GPUS = 16
SLICES = 7
OPS = ("stale read", "line read", "claim", "activation", "release")
HOLDER = {"host": "bench-host", "pid": 4242, "start": 123456}


def baseline_package(ref: str, into: Path) -> ModuleType:
    """``mig_spawner/ledger`` at git revision ``ref``, imported as ``ledger_at_<ref>``."""
    name = "ledger_at_" + "".join(c if c.isalnum() else "_" for c in ref)
    archive = subprocess.run(["git", "archive", ref, "mig_spawner/ledger"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "mig_spawner" / "ledger").rename(into / name)
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


class Bench:
    """One ledger implementation on a database of its own, ``held`` leases held."""

    def __init__(self, label: str, package: ModuleType, url: str, held: int):
        self.label = label
        self.package = package
        # Each implementation's own migrations make its schema (a baseline may be older).
        self.ledger = package.Ledger.open(url)
        # A ledger of stores (ledger.leases, ledger.waits), or one from before them.
        self.leases = getattr(self.ledger, "leases", self.ledger)
        self.line = (self.ledger.waiting if callable(self.ledger.waits)
                     else self.ledger.waits.waiting)
        self.cpu: dict[str, list[float]] = {op: [] for op in OPS}
        self._with_holder = "holder_host" in inspect.signature(self.leases.activate).parameters
        self._round = 0
        for i in range(held):
            request = self.package.LeaseRequest(f"held{i:03d}")
            self.leases.activate(self.leases.claim(request, self.decide).id)

    def decide(self, view: Any) -> Any:
        """The first free slot: a pure, quick decision (the allocator is not timed)."""
        for gpu in range(GPUS):
            uuid = f"GPU-{gpu:04d}"
            taken = view.taken("bench-host", uuid)
            for start in range(SLICES):
                if start not in taken:
                    return self.package.Grant(
                        group="class", profile="1g.18gb", compute_slices=1, mode="pool",
                        host="bench-host", gpu_uuid=uuid, gpu_index=gpu, start=start, size=1,
                        mig_uuid=f"MIG-{gpu:04d}-{start}")
        raise RuntimeError("no free slot: lower --held")

    def activate(self, lease_id: str) -> None:
        url = "http://127.0.0.1:50000/user/x/"
        if self._with_holder:
            self.leases.activate(lease_id, server_url=url, holder_host=HOLDER["host"],
                                 holder_pid=HOLDER["pid"], holder_start=HOLDER["start"])
        else:
            self.ledger.record_holder(lease_id, **HOLDER)
            self.leases.activate(lease_id, server_url=url)

    def round(self) -> None:
        """One spawn and stop: stale read, line read, claim, activation, release."""
        self._round += 1
        user = f"u{self._round:05d}"
        lease = timed(self.cpu["stale read"], self.leases.active_for_server, user, "")
        assert lease is None
        assert not timed(self.cpu["line read"], self.line)
        lease = timed(self.cpu["claim"], self.leases.claim, self.package.LeaseRequest(user),
                      self.decide)
        timed(self.cpu["activation"], self.activate, lease.id)
        timed(self.cpu["release"], self.leases.release, lease.id, "stopped")

    def close(self) -> None:
        self.ledger.close()


def timed(into: list[float], fn: Callable[..., Any], *args: Any) -> Any:
    tic = time.thread_time()
    result = fn(*args)
    into.append(time.thread_time() - tic)
    return result


def run(urls: dict[str, str], packages: dict[str, ModuleType], held: int, rounds: int,
        warmup: int) -> dict[str, Bench]:
    benches = {label: Bench(label, packages[label], urls[label], held) for label in packages}
    try:
        for n in range(warmup + rounds):
            for bench in benches.values():
                bench.round()
            if n + 1 == warmup:
                for bench in benches.values():
                    bench.cpu = {op: [] for op in OPS}
    finally:
        for bench in benches.values():
            bench.close()
    return benches


def report(database: str, benches: dict[str, Bench], held: int) -> None:
    labels = list(benches)
    print(f"\n{database}, {held} leases held: CPU ms per operation (median; mean)")
    header = f"{'operation':<12}" + "".join(f"{label:>24}" for label in labels)
    if len(labels) == 2:
        header += f"{'ratio':>8}"
    print(header)
    for op in (*OPS, "per spawn"):
        cells, medians = "", []
        for label in labels:
            cpu = benches[label].cpu
            samples = ([sum(parts) for parts in zip(*cpu.values(), strict=True)]
                       if op == "per spawn" else cpu[op])
            median, mean = statistics.median(samples) * 1e3, statistics.fmean(samples) * 1e3
            medians.append(median)
            cells += f"{median:>15.2f}; {mean:>6.2f}"
        if len(labels) == 2:
            cells += f"{medians[0] / medians[1]:>7.2f}x"
        print(f"{op:<12}{cells}")
    if len(labels) == 2:
        print(f"(ratio: {labels[0]} / {labels[1]}, medians)")


@contextlib.contextmanager
def postgres() -> Iterator[Callable[[str], str] | None]:
    """A function giving a fresh database's URL on a throwaway cluster; ``None`` when
    the PostgreSQL binaries are missing."""
    if pg_fixture._find_bin_dir() is None:
        print("\nPostgreSQL: server binaries not found, skipped")
        yield None
        return
    with pg_fixture.postgres_cluster() as server:
        def fresh(name: str) -> str:
            server.psql(f"CREATE DATABASE {name}")
            return server.url(name)
        yield fresh


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, default=50, help="leases held meanwhile")
    parser.add_argument("--rounds", type=int, default=200, help="spawns measured per database")
    parser.add_argument("--warmup", type=int, default=20, help="spawns run before measuring")
    parser.add_argument("--baseline", metavar="REF",
                        help="also time mig_spawner/ledger at this git revision")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    args = parser.parse_args(argv)
    if args.held >= GPUS * SLICES:
        parser.error(f"--held must stay below {GPUS * SLICES}")

    with tempfile.TemporaryDirectory() as tmp:
        packages = {"this tree": current}
        if args.baseline:
            packages[args.baseline] = baseline_package(args.baseline, Path(tmp) / "base")
        print(f"{args.held} held leases, {args.rounds} spawns (after {args.warmup} unmeasured) "
              f"per implementation and database, pid {os.getpid()}, at {datetime.now():%H:%M}")
        sqlite = {label: f"sqlite:///{tmp}/{n}.sqlite" for n, label in enumerate(packages)}
        report("SQLite", run(sqlite, packages, args.held, args.rounds, args.warmup), args.held)
        if args.no_postgres:
            return
        with postgres() as fresh:
            if fresh is not None:
                urls = {label: fresh(f"bench{n}") for n, label in enumerate(packages)}
                report("PostgreSQL", run(urls, packages, args.held, args.rounds, args.warmup),
                       args.held)


if __name__ == "__main__":
    main()
