"""The wait list's grant loop in-process: waiting costs nothing per waiter, and a release
by another process (a second Ledger, as the slice service releases) wakes it at once.

Real LocalMIGSpawners on a simulated H200 cut into 3 x 1g.18gb, a real ledger (SQLite
file, and PostgreSQL), no hub: the spawns go through ``waiting.claim`` exactly as
``start()`` does, so all three slices are held and W more spawns wait in line.
"""

from __future__ import annotations

import asyncio
import statistics
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
#: The old loop re-read every waiter's GPUs every 0.5 s; over this the count must not move.
IDLE = 1.5
#: A release by another process reaches the next waiter's grant within this (the median
#: of three: one sample once took 0.64 s on a loaded 2-core CI runner, a stall of the
#: whole test process, while 0.015-0.1 s is usual here even with eight busy loops beside
#: it; the loop's only timer here is the waits' one-hour deadline).
WAKE_WITHIN = 0.5


def crowd_spawner(tmp_path, url: str, name: str) -> LocalMIGSpawner:
    """``name``'s spawner in the group ``crowd``, which may wait for a 1g.18gb."""
    return make_spawner(mig_config(url, sim=SIM, sim_state=tmp_path / "sim.json", policies={
        "crowd": {"allowed": ["1g.18gb"], "queue": True, "max_wait": "1h"}}),
        name, ["crowd"])


async def start_claim(spawner: LocalMIGSpawner):
    mine = spawner.user_policy(spawner.policies())
    offer = mine.offer("1g.18gb")
    lease, _plan = await waiting.claim(spawner, offer, mine)
    return lease


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
    for s in crowd:
        tasks.append(asyncio.ensure_future(start_claim(s)))
        await asyncio.sleep(0.01)  # join in this order
    with Ledger.open(backend_url) as ledger:
        await until_async(lambda: len(ledger.waiting()) == WAITERS, 20, "all in line",
                          show=ledger.waiting)
        # Every waiter hears its place.
        await until_async(lambda: all(s.progress_log.events and "in line" in
                                      s.progress_log.events[-1]["message"] for s in crowd),
                          10, "every waiter told its place",
                          show=lambda: [s.progress_log.events[-1:] for s in crowd])
        line = [e.user for e in ledger.waiting()]  # in the order they joined
        by_name = {s.user.name: s for s in crowd}
        assert [by_name[u].progress_log.events[-1]["message"].split(" in line")[0]
                for u in line] == [waiting.ordinal(n) for n in range(1, WAITERS + 1)]

        # Nobody releases, nobody joins: nothing reads the GPUs, however many wait.
        await asyncio.sleep(0.3)
        before = len(inventory_reads)
        await asyncio.sleep(IDLE)
        assert len(inventory_reads) == before, "the GPUs were read while nothing happened"

        # The slice service (another process: another Ledger) releases one lease.
        async def release_elsewhere(lease, waiter: str) -> tuple[float, Lease]:
            released = ledger.release(lease.id, ReleaseCode.STOPPED, "idle")
            tic = time.monotonic()
            granted = await asyncio.wait_for(tasks[crowd.index(by_name[waiter])], 5)
            woke = time.monotonic() - tic
            gap = (granted.claimed_at - released.released_at).total_seconds()
            print(f"release elsewhere -> grant: {gap:.3f} s (seen after {woke:.3f} s)")
            return gap, granted

        gap, first = await release_elsewhere(leases[0], line[0])
        gaps = [gap]
        # ...and that pass read the GPUs once, not once per waiter.
        assert len(inventory_reads) - before <= 2
        await until_async(lambda: by_name[line[1]].progress_log.events[-1]["message"]
                          .startswith("1st in line"), 5, f"{line[1]} 1st in line",
                          show=lambda: by_name[line[1]].progress_log.events)
        assert by_name[line[-1]].progress_log.events[-1]["message"].startswith(
            f"{waiting.ordinal(WAITERS - 1)} in line")
        ledger.release(first.id, ReleaseCode.STOPPED)
        # That release granted line[1]; two more releases, two more samples.
        await asyncio.wait_for(tasks[crowd.index(by_name[line[1]])], 5)
        for lease, waiter in zip(leases[1:], line[2:4], strict=True):
            gaps.append((await release_elsewhere(lease, waiter))[0])
        assert statistics.median(gaps) <= WAKE_WITHIN, gaps
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
