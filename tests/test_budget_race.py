"""Concurrent spawns never spend a budget twice (issue 37, item 1), on SQLite and PostgreSQL.

The attack: a group with ``budget "2m"`` and ``budget_min_hold "30s"``, 34 s of it left,
and 6 spawns at once: every one was granted (193 s used of 120), because a server
granted a moment ago had used next to nothing. Each claim and grant pass checks the
budget inside its serialised transaction with the leases it read, every running one
charged at least its minimum hold: N spawns at once get as many minimum holds as the
budget has, never more. Real ledgers, the spawner's own decide callback on a simulated
host, the real clock; racers are threads sharing one ledger (a hub's executor),
processes with a ledger each (hub processes on one database), a grant pass of the wait
list, and spawns through ``waiting.claim`` as ``start()`` makes them.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
from datetime import UTC, datetime, timedelta

import pytest
from traitlets.config import Config

from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.gpu import connect
from mig_spawner.ledger import LeaseRequest, Ledger, WaitRequest
from mig_spawner.spawner import LocalMIGSpawner, waiting
from mig_spawner.spawner.decide import make_decide
from tests.mocking import User

SIM = "h200x2:layout=1g.18gb*7"  # 14 one-slice instances: slices never run out here
#: The attack's group: 2 compute-slice-minutes per 10 minutes, a 30 s minimum hold.
TEAM = {"allowed": ["1g.18gb"], "max_slices_per_user": 4, "budget": "2m",
        "budget_window": "10m", "budget_min_hold": "30s", "queue": True, "max_wait": "1h"}
#: Used 14-100 s ago: 86 of the 120 compute-slice-seconds, 34 left (one minimum hold).
USED = (100, 14)
RACERS = 6


def policies(**changes):
    return build_policy(None, None, {"team": {**TEAM, **changes}})


def inventory():
    with connect(simulate=SIM) as adapter:
        return adapter.inventory()


def open_ledger(url: str, found) -> Ledger:
    """A ledger as the hub's runtime opens it: claims read the budgets' window back."""
    ledger = Ledger.open(url)
    ledger.usage.budget_horizon = found.budget_horizon
    return ledger


def spend(url: str, ago: tuple[float, float]) -> None:
    """A 1g lease of the team held from ``ago[0]`` to ``ago[1]`` seconds ago."""
    now = datetime.now(UTC)
    at = [now - timedelta(seconds=ago[0])]
    found = policies()
    mine = found.for_user(["team"])
    with Ledger.open(url, clock=lambda: at[0]) as ledger:
        lease = ledger.leases.claim(LeaseRequest("earlier"), make_decide(
            mine, mine.offer("1g.18gb"), inventory(), "pool", "pack"))
        at[0] = now - timedelta(seconds=ago[1])
        ledger.leases.release(lease.id, "stopped")


def claim(ledger: Ledger, found, host, user: str) -> str:
    """One spawn of a 1g slice: ``granted`` or the refusal's reason."""
    mine = found.for_user(["team"])
    try:
        ledger.leases.claim(LeaseRequest(user), make_decide(mine, mine.offer("1g.18gb"), host,
                                                     "pool", "pack"))
    except Refused as refused:
        assert refused.reason is not Reason.BUDGET_SPENT or refused.retry_at is not None
        return refused.reason.value
    return "granted"


def check_spend(url: str, found, granted: int) -> None:
    """What the granted servers promise (each its minimum hold) fits the budget: had
    each run just that, the window would hold no more than the budget."""
    team = found.group("team")
    with Ledger(url) as ledger:
        held = ledger.leases.active()
        assert len(held) == granted
        used = sum((x.released_at - x.claimed_at).total_seconds()
                   for x in ledger.leases.history() if x.released_at)
    assert used + granted * team.budget_min_hold <= team.budget


def test_threads_sharing_a_ledger_get_one_minimum_hold_from_34_seconds_left(backend_url):
    found = policies()
    spend(backend_url, USED)
    host = inventory()
    answers: list[str] = []
    with open_ledger(backend_url, found) as ledger:
        barrier = threading.Barrier(RACERS)

        def race(n: int) -> None:
            barrier.wait(timeout=60)
            answers.append(claim(ledger, found, host, f"t{n}"))

        threads = [threading.Thread(target=race, args=(n,)) for n in range(RACERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert sorted(answers) == ["budget_spent"] * (RACERS - 1) + ["granted"], answers
    check_spend(backend_url, found, 1)


def _claim_process(url: str, worker: int, barrier, results) -> None:
    try:
        found = policies(budget="1m")
        host = inventory()
        with open_ledger(url, found) as ledger:
            barrier.wait(timeout=120)
            results.put([claim(ledger, found, host, f"p{worker}-{i}") for i in range(2)])
    except Exception as e:  # report instead of dying silently
        results.put([f"worker crashed: {e!r}"])


def test_hub_processes_on_one_database_get_what_two_minimum_holds_pay_for(backend_url):
    # A fresh budget of 60 s pays for two 30 s minimum holds; 8 spawns from 4 processes.
    Ledger.open(backend_url).close()
    context = multiprocessing.get_context("spawn")  # no engine state inherited
    processes = 4
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_claim_process, args=(backend_url, n, barrier, results),
                               daemon=True) for n in range(processes)]
    for worker in workers:
        worker.start()
    answers: list[str] = []
    try:
        for _ in workers:
            answers += results.get(timeout=180)
    except queue.Empty:
        pytest.fail(f"only {len(answers) // 2} of {processes} processes reported in time")
    finally:
        for worker in workers:
            worker.join(timeout=30)
    assert sorted(answers) == ["budget_spent"] * 6 + ["granted"] * 2, answers
    check_spend(backend_url, policies(budget="1m"), 2)


def test_one_grant_pass_grants_only_what_the_budget_pays_for(backend_url):
    # Six spawns wait in line (a group that queues); a release wakes one grant pass:
    # it serves one of them, and the others hear of the budget with its retry time.
    found = policies()
    spend(backend_url, USED)
    host = inventory()
    with open_ledger(backend_url, found) as ledger:
        for n in range(RACERS):
            ledger.waits.join(WaitRequest(f"w{n}", "", "team", 0, "1g.18gb", None),
                             max_waiting=1)

        def decide(entry, view):
            mine = found.for_user([entry.group])
            return make_decide(mine, mine.offer(entry.offer), host, "pool", "pack")(view)

        ids = [e.id for e in ledger.waits.waiting()]
        done = ledger.waits.grant(decide, quotas={}, capacity=14, watch=ids)
        assert len(done.granted) == 1
        assert sorted(done.refused) == sorted(set(ids) - {done.granted[0].id})
        assert {r.reason for r in done.refused.values()} == {Reason.BUDGET_SPENT}
        retry = {r.retry_at for r in done.refused.values()}
        assert len(retry) == 1 and None not in retry
    check_spend(backend_url, found, 1)


# --- through the spawner, as start() claims ---------------------------------------------


def make_spawner(tmp_path, url: str, name: str) -> LocalMIGSpawner:
    c = Config()
    c.MIGSettings.ledger_url = url
    c.MIGSettings.simulate = SIM
    c.MIGSettings.sim_state_file = str(tmp_path / "sim.json")
    c.MIGPolicyConfig.group_policies = {"team": TEAM}
    return LocalMIGSpawner(config=c, user=User(name, ["team"]))


async def start_claim(spawner: LocalMIGSpawner):
    mine = spawner.user_policy(spawner.policies())
    return (await waiting.claim(spawner, mine.offer("1g.18gb"), mine)).lease


async def test_spawns_at_once_through_the_spawner_get_one_minimum_hold(tmp_path, backend_url):
    from mig_spawner.gpu.simulator import SimulatedHost

    SimulatedHost.from_spec(SIM, tmp_path / "sim.json")
    spend(backend_url, USED)
    spawners = [make_spawner(tmp_path, backend_url, f"s{n}") for n in range(RACERS)]
    outcomes = await asyncio.gather(*(start_claim(s) for s in spawners),
                                    return_exceptions=True)
    granted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, Refused)]
    assert len(granted) == 1, outcomes
    assert len(refused) == RACERS - 1 and {r.reason for r in refused} == {
        Reason.BUDGET_SPENT}, outcomes
    # Refused at once, with the time it can succeed: none of them waits in line.
    assert all(r.retry_at is not None and "Retry at" in r.message for r in refused)
    with Ledger(backend_url) as ledger:
        assert ledger.waits.waiting() == []
    check_spend(backend_url, policies(), 1)


async def test_a_spent_budget_is_refused_at_once_when_others_wait(tmp_path, backend_url):
    # Others wait in line, so a spawn joins it rather than claim before them, unless
    # waiting cannot serve it: its budget, spent by leases released earlier, says so
    # with the time it can succeed, read from the same ledger view the claim reads.
    from mig_spawner.gpu.simulator import SimulatedHost

    SimulatedHost.from_spec(SIM, tmp_path / "sim.json")
    spend(backend_url, (120, 20))  # 100 of 120 used: 20 left, a 1g needs 30
    late = make_spawner(tmp_path, backend_url, "late")
    await waiting.loop_for(late.runtime).clear_ghosts()  # this hub's start: none
    with Ledger.open(backend_url) as ledger:
        ledger.waits.join(WaitRequest("other", "", "team", 0, "1g.18gb", None))
    with pytest.raises(Refused) as refused:
        # Joining the line instead would wait there until max_wait (an hour).
        await asyncio.wait_for(start_claim(late), 60)
    assert refused.value.reason is Reason.BUDGET_SPENT and refused.value.retry_at
    with Ledger(backend_url) as ledger:
        assert [e.user for e in ledger.waits.waiting()] == ["other"]
