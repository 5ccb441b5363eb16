"""The wait list's grant loop in-process: waiting costs nothing per waiter, and a release
by another process (a second Ledger, as the slice service releases) wakes it.

Real LocalMIGSpawners on a simulated H200 cut into 3 x 1g.18gb, a real ledger (SQLite
file, and PostgreSQL), no hub: the spawns go through ``waiting.claim`` exactly as
``start()`` does, so all three slices are held and W more spawns wait in line.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mig_spawner.gpu import GpuAdapter
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Lease, Ledger, ReleaseCode
from mig_spawner.spawner import LocalMIGSpawner, waiting
from tests.support.polling import until_async
from tests.support.spawners import make_spawner, mig_config

SIM = "h200x1:layout=1g.18gb*3"
WAITERS = 12
#: The waits' ``max_wait``: the loop's one timer is their deadline, far beyond any test's
#: time (pyproject.toml's per-test timeout), so whatever grants here was woken by an
#: event, not by a timer.
MAX_WAIT = "1h"
MAX_WAIT_SECONDS = 3600
#: How long a grant may take on a loaded machine: liveness only, not a speed (the
#: release-to-grant gaps are printed; benchmarks/burst measures them).
GRANTED_WITHIN = 60


def crowd_spawner(tmp_path, url: str, name: str) -> LocalMIGSpawner:
    """``name``'s spawner in the group ``crowd``, which may wait for a 1g.18gb."""
    return make_spawner(mig_config(url, sim=SIM, sim_state=tmp_path / "sim.json", policies={
        "crowd": {"allowed": ["1g.18gb"], "queue": True, "max_wait": MAX_WAIT}}),
        name, ["crowd"])


async def start_claim(spawner: LocalMIGSpawner):
    mine = spawner.user_policy(spawner.policies())
    offer = mine.offer("1g.18gb")
    return (await waiting.claim(spawner, offer, mine)).lease


@pytest.fixture
def inventory_reads(monkeypatch) -> list[float]:
    """When the GPUs were read (each read of the driver or simulator)."""
    reads: list[float] = []
    real = GpuAdapter.inventory

    def counted(self):
        reads.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(GpuAdapter, "inventory", counted)
    return reads


async def test_waiting_costs_nothing_per_waiter_and_a_release_elsewhere_wakes_the_loop(
    tmp_path, backend_url, inventory_reads
) -> None:
    SimulatedHost.from_spec(SIM, tmp_path / "sim.json")
    holders = [crowd_spawner(tmp_path, backend_url, f"h{i}") for i in range(3)]
    leases = [await start_claim(s) for s in holders]
    crowd = [crowd_spawner(tmp_path, backend_url, f"w{i:02d}") for i in range(WAITERS)]
    tasks = []
    with Ledger.open(backend_url) as ledger:
        for n, s in enumerate(crowd, 1):
            tasks.append(asyncio.ensure_future(start_claim(s)))
            # Each in line before the next one asks: they join in this order.
            await until_async(lambda n=n: len(ledger.waits.waiting()) == n, 20, f"{n} in line",
                              show=ledger.waits.waiting)
        # Every waiter hears its place.
        await until_async(lambda: all(s.progress_log.events and "in line" in
                                      s.progress_log.events[-1]["message"] for s in crowd),
                          10, "every waiter told its place",
                          show=lambda: [s.progress_log.events[-1:] for s in crowd])
        line = [e.user for e in ledger.waits.waiting()]  # in the order they joined
        by_name = {s.user.name: s for s in crowd}
        assert [by_name[u].progress_log.events[-1]["message"].split(" in line")[0]
                for u in line] == [waiting.ordinal(n) for n in range(1, WAITERS + 1)]

        # Nobody releases, nobody joins: nothing reads the GPUs, however many wait. Only
        # the loop's passes read them, and it sleeps until woken: its one timer is the
        # waits' deadline (the old loop re-read every waiter's GPUs every 0.5 s).
        grant_loop = waiting.loop_for(crowd[0].runtime)
        assert grant_loop._until_due() > MAX_WAIT_SECONDS - 300
        before = len(inventory_reads)

        # The slice service (another process: another Ledger) releases one lease.
        async def release_elsewhere(lease, waiter: str) -> tuple[float, Lease]:
            released = ledger.leases.release(lease.id, ReleaseCode.STOPPED, "idle")
            tic = time.monotonic()
            granted = await asyncio.wait_for(tasks[crowd.index(by_name[waiter])],
                                             GRANTED_WITHIN)
            woke = time.monotonic() - tic
            gap = (granted.claimed_at - released.released_at).total_seconds()
            print(f"release elsewhere -> grant: {gap:.3f} s (seen after {woke:.3f} s)")
            return gap, granted

        _, first = await release_elsewhere(leases[0], line[0])
        # ...and that pass read the GPUs once, not once per waiter.
        assert len(inventory_reads) - before <= 2
        await until_async(lambda: by_name[line[1]].progress_log.events[-1]["message"]
                          .startswith("1st in line"), 10, f"{line[1]} 1st in line",
                          show=lambda: by_name[line[1]].progress_log.events)
        assert by_name[line[-1]].progress_log.events[-1]["message"].startswith(
            f"{waiting.ordinal(WAITERS - 1)} in line")
        ledger.leases.release(first.id, ReleaseCode.STOPPED)
        # That release granted line[1]; two more releases, two more samples.
        await asyncio.wait_for(tasks[crowd.index(by_name[line[1]])], GRANTED_WITHIN)
        for lease, waiter in zip(leases[1:], line[2:4], strict=True):
            await release_elsewhere(lease, waiter)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
