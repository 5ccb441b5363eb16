"""No double grant under real contention: processes and threads racing for 28 slices.

4 simulated GPUs x 7 one-slice placements. Every claim's decide callback picks
the first free placement in its view, so without serialisation the racers
would all pick the same one. Exactly 28 claims may win, each a different
slice, and no racer may see a ``DoubleGrant`` (the lock makes them queue; the
slot keys are the backstop).
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections import Counter

import pytest
from sqlalchemy import create_engine, func, select

from mig_spawner.ledger import Conflict, DoubleGrant, Grant, LeaseRequest, Ledger, LedgerView
from mig_spawner.ledger import transactions as ledger_transactions
from mig_spawner.ledger.models import lease_slots

HOST = "race-host"
GPUS = tuple(f"GPU-{n:04d}" for n in range(4))
SLICES = len(GPUS) * 7
PROCESSES, CLAIMS_PER_PROCESS = 4, 25


class Full(Exception):
    """The stand-in allocator's refusal."""


def first_free(view: LedgerView) -> Grant:
    for index, gpu in enumerate(GPUS):
        taken = view.taken(HOST, gpu)
        for start in range(7):
            if start not in taken:
                return Grant(
                    group="race",
                    profile="1g.10gb",
                    compute_slices=1,
                    mode="dynamic",
                    host=HOST,
                    gpu_uuid=gpu,
                    gpu_index=index,
                    start=start,
                    size=1,
                )
    raise Full("all 28 slices are leased")


def claim_many(
    ledger: Ledger, who: str, count: int
) -> tuple[list[tuple[str, int]], int, list[str]]:
    """Claim ``count`` times; return (granted slices, refusals, unexpected errors)."""
    granted: list[tuple[str, int]] = []
    refused = 0
    errors: list[str] = []
    for i in range(count):
        try:
            lease = ledger.leases.claim(LeaseRequest(f"{who}-{i}"), first_free)
        except Full:
            refused += 1
        except Exception as e:  # anything else, DoubleGrant included, fails the test
            errors.append(repr(e))
        else:
            granted.append((lease.gpu_uuid, lease.start))
    return granted, refused, errors


def _race_process(backend_url: str, worker: int, barrier, results) -> None:
    # Every worker migrates the fresh database itself: concurrent upgrades must be safe too.
    try:
        ledger = Ledger.open(backend_url)
        barrier.wait(timeout=120)
        results.put((worker, *claim_many(ledger, f"p{worker}", CLAIMS_PER_PROCESS)))
        ledger.close()
    except Exception as e:  # report instead of dying silently
        results.put((worker, [], 0, [f"worker crashed: {e!r}"]))


def check_outcome(
    backend_url: str, outcomes: list[tuple[list[tuple[str, int]], int, list[str]]]
) -> None:
    granted = [slot for outcome in outcomes for slot in outcome[0]]
    refused = sum(outcome[1] for outcome in outcomes)
    errors = [error for outcome in outcomes for error in outcome[2]]
    assert errors == []
    assert len(granted) == SLICES, f"{len(granted)} grants for {SLICES} slices"
    doubles = {slot: n for slot, n in Counter(granted).items() if n > 1}
    assert doubles == {}, f"double grants: {doubles}"
    assert refused == sum(len(o[0]) + o[1] for o in outcomes) - SLICES
    with Ledger(backend_url) as ledger:
        assert len(ledger.leases.active()) == SLICES
        assert {(lease.gpu_uuid, lease.start) for lease in ledger.leases.active()} == set(granted)
    engine = create_engine(backend_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(lease_slots)).scalar() == SLICES
    finally:
        engine.dispose()


def test_racing_processes_never_double_grant(backend_url: str) -> None:
    context = multiprocessing.get_context("spawn")  # no engine state inherited through fork
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    workers = [
        context.Process(target=_race_process, args=(backend_url, n, barrier, results), daemon=True)
        for n in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    outcomes = []
    try:
        for _ in workers:
            _, *outcome = results.get(timeout=180)
            outcomes.append(tuple(outcome))
    except queue.Empty:
        pytest.fail(f"only {len(outcomes)} of {PROCESSES} racing processes reported in time")
    finally:
        for worker in workers:
            worker.join(timeout=30)
    check_outcome(backend_url, outcomes)
    assert sum(len(o[0]) + o[1] for o in outcomes) == PROCESSES * CLAIMS_PER_PROCESS


def test_threads_can_share_one_ledger(backend_url: str) -> None:
    # The hub calls one Ledger from its executor's threads.
    threads, per_thread = 8, 5
    with Ledger.open(backend_url) as ledger:
        barrier = threading.Barrier(threads)
        outcomes: list = []

        def run(n: int) -> None:
            barrier.wait(timeout=60)
            outcomes.append(claim_many(ledger, f"t{n}", per_thread))

        pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=120)
    check_outcome(backend_url, outcomes)


@pytest.mark.postgres
def test_database_keys_refuse_what_the_lock_would_have_prevented(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Take the claim lock away, then let another ledger commit between our read
    # and our write: the primary keys alone must still refuse both kinds of conflict.
    monkeypatch.setattr(ledger_transactions, "lock_claims", lambda connection: None)
    with Ledger.open(postgres_url) as ours, Ledger(postgres_url) as theirs:

        def interleaved(user: str):
            def decide(view: LedgerView) -> Grant:
                theirs.leases.claim(LeaseRequest(user), first_free)  # commits after our read
                return first_free(view)  # now a stale view

            return decide

        with pytest.raises(Conflict, match="got a lease from a concurrent claim") as caught:
            ours.leases.claim(LeaseRequest("alice"), interleaved("alice"))
        assert type(caught.value) is Conflict
        with pytest.raises(DoubleGrant, match=r"slices 1\.\.1 of GPU GPU-0000"):
            ours.leases.claim(LeaseRequest("carol"), interleaved("bob"))
        assert [(lease.user, lease.start) for lease in ours.leases.history()] == [
            ("alice", 0),
            ("bob", 1),
        ]
