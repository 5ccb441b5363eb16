"""The ledger's wait list: join, cancel, expire, grant by the order rule; and races.

The race test runs joins, cancels, claims (join, and cancel when not granted at once)
and releases from 4 processes on SQLite and PostgreSQL, then checks the history
against a model of the order rule: no slot held twice at once, every grant in order,
nobody left waiting while a slot is free, no lease without its entry.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import random
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, func, select

from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import StarvationGuard
from mig_spawner.ledger import Grant, Ledger, LedgerView, WaitEntry, WaitRequest, waitlist
from mig_spawner.ledger.models import lease_slots
from tests.mocking import Clock

HOST, GPU, SLOTS = "wait-host", "GPU-wait", 6
PRIORITY = {"staff": 1, "students": 0}


def first_free(entry: WaitEntry, view: LedgerView) -> Grant:
    """A tiny allocator: the first of SLOTS one-slice placements nobody holds."""
    taken = view.taken(HOST, GPU)
    for start in range(SLOTS):
        if start not in taken:
            return Grant(group=entry.group, profile="1g.18gb", compute_slices=1,
                            mode="dynamic", host=HOST, gpu_uuid=GPU, gpu_index=0,
                            start=start, size=1)
    raise Refused(Reason.NONE_FREE, "none free")


def asks(user: str, group: str = "students", server: str = "", max_wait: float | None = 1800):
    return WaitRequest(user, server, group, PRIORITY[group], "1g.18gb", max_wait)


def grant_one(ledger: Ledger, decide=first_free, **kw) -> WaitEntry | None:
    """One grant at most: the entry granted, or None when nobody could be served."""
    done = ledger.waits.grant(decide, quotas={}, capacity=SLOTS, limit=1, **kw)
    return done.granted[0] if done.granted else None


def drain(ledger: Ledger) -> list[WaitEntry]:
    granted = []
    while (entry := grant_one(ledger)) is not None:
        granted.append(entry)
    return granted


def fill(ledger: Ledger) -> None:
    """Every slot held, by users h0, h1, ... granted through the wait list."""
    for n in range(SLOTS):
        ledger.waits.join(asks(f"h{n}"))
    drain(ledger)


def test_waiters_are_granted_in_order_as_slots_free(backend_url: str) -> None:
    clock = Clock()
    with Ledger.open(backend_url, clock=clock) as ledger:
        holders = []
        for n in range(SLOTS):
            ledger.waits.join(asks(f"h{n}"))
            holders += drain(ledger)
        assert len(holders) == SLOTS and {e.state for e in holders} == {"granted"}
        late = [ledger.waits.join(asks("ann")), ledger.waits.join(asks("bob")),
                ledger.waits.join(asks("cat", "staff"))]
        assert drain(ledger) == []
        assert [e.user for e in ledger.waits.waiting()] == ["ann", "bob", "cat"]
        ledger.leases.release(holders[0].lease_id, "stopped")
        (first,) = drain(ledger)
        assert first.user == "cat"  # staff's priority goes first
        lease = ledger.leases.get(first.lease_id)
        assert lease is not None and (lease.user, lease.start) == ("cat", 0)
        assert ledger.waits.cancel(late[0].id, "user cancelled").state == "cancelled"
        ledger.leases.release(holders[1].lease_id, "stopped")
        assert [e.user for e in drain(ledger)] == ["bob"]
        # Cancelling after the grant: the caller learns it owns the lease.
        assert ledger.waits.cancel(first.id, "too late").state == "granted"
        assert ledger.waits.entry(late[0].id).reason == "user cancelled"


def test_joining_twice_limits_and_expiry(backend_url: str) -> None:
    clock = Clock()
    with Ledger.open(backend_url, clock=clock) as ledger:
        fill(ledger)
        entry = ledger.waits.join(asks("ann", server="a"), max_waiting=1)
        assert ledger.waits.join(asks("ann", server="a"), max_waiting=1) == entry
        with pytest.raises(Refused, match="already wait for 1 of 1") as refused:
            ledger.waits.join(asks("ann", server="b"), max_waiting=1)
        assert refused.value.reason is Reason.USER_LIMIT
        with pytest.raises(Refused) as holds:
            ledger.waits.join(asks("h0"))
        assert holds.value.reason is Reason.PREVIOUS_LEASE
        clock.advance(minutes=31)
        assert grant_one(ledger) is None
        ended = ledger.waits.entry(entry.id)
        assert (ended.state, ended.reason) == ("expired", "waited max_wait")
        assert ledger.waits.waiting() == []


def test_passed_over_waiters_count_and_the_guard_blocks(backend_url: str) -> None:
    with Ledger.open(backend_url, clock=Clock()) as ledger:
        big = ledger.waits.join(asks("big"))
        small = ledger.waits.join(asks("small"))

        def only_small(entry: WaitEntry, view: LedgerView) -> Grant:
            if entry.user == "big":
                raise Refused(Reason.NO_CAPACITY, "no room for a large one")
            return first_free(entry, view)

        guard = StarvationGuard(max_bypasses=1, max_age=None)
        granted = grant_one(ledger, only_small, guard=guard)
        assert granted is not None and granted.id == small.id
        assert ledger.waits.entry(big.id).bypassed == 1
        ledger.waits.join(asks("third"))
        assert grant_one(ledger, only_small, guard=guard) is None


# --- races --------------------------------------------------------------------------

PROCESSES, OPS = 4, 30


def _worker(backend_url: str, worker: int, barrier, results) -> None:
    rng = random.Random(worker)
    errors: list[str] = []
    try:
        ledger = Ledger.open(backend_url)
        barrier.wait(timeout=120)
        mine: list[int] = []
        for op in range(OPS):
            try:
                kind = rng.choice(["join", "join", "claim", "cancel", "release", "release"])
                if kind in ("join", "claim"):
                    entry = ledger.waits.join(
                        asks(f"p{worker}-{op}", rng.choice(sorted(PRIORITY)))
                    )
                    drain(ledger)
                    if kind == "claim" and ledger.waits.entry(entry.id).waiting:
                        entry = ledger.waits.cancel(entry.id, "queue off: none free")
                    mine.append(entry.id)
                elif kind == "cancel" and mine:
                    ended = ledger.waits.cancel(rng.choice(mine), "user cancelled")
                    if ended is not None and ended.state == "granted" and rng.random() < 0.5:
                        ledger.leases.release(ended.lease_id, "cancelled", "after grant")
                        drain(ledger)
                elif kind == "release" and (held := ledger.leases.active()):
                    ledger.leases.release(rng.choice(held).id, "stopped")
                    drain(ledger)
            except Exception as e:  # anything unexpected fails the test
                errors.append(f"{kind}: {e!r}")
        ledger.close()
    except Exception as e:
        errors.append(f"worker crashed: {e!r}")
    results.put(errors)


def test_racing_joins_cancels_claims_and_releases_follow_the_order_rule(backend_url: str) -> None:
    with Ledger.open(backend_url) as ledger:  # start full, with nobody waiting
        for n in range(SLOTS):
            ledger.waits.join(asks(f"seed{n}"))
        assert len(drain(ledger)) == SLOTS
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(backend_url, n, barrier, results), daemon=True)
               for n in range(PROCESSES)]
    for worker in workers:
        worker.start()
    errors: list[str] = []
    try:
        for _ in workers:
            errors += results.get(timeout=240)
    except queue.Empty:
        pytest.fail("a racing process did not report in time")
    finally:
        for worker in workers:
            worker.join(timeout=30)
    assert errors == []
    with Ledger(backend_url) as ledger:
        check_against_model(ledger)
        engine = create_engine(backend_url)
        try:
            with engine.connect() as conn:
                slot_rows = conn.execute(select(func.count()).select_from(lease_slots)).scalar()
        finally:
            engine.dispose()
        assert slot_rows == len(ledger.leases.active())


def check_against_model(ledger: Ledger) -> None:
    with ledger._tx.read() as connection:  # every entry, ended or not
        entries = waitlist._entries(connection)
    leases = {lease.id: lease for lease in ledger.leases.history()}
    granted = [e for e in entries if e.state == "granted"]
    # Every lease came from exactly one entry, for that entry's server.
    assert Counter(e.lease_id for e in granted).most_common(1)[0][1] == 1
    assert set(leases) == {e.lease_id for e in granted}
    for e in granted:
        assert (leases[e.lease_id].user, leases[e.lease_id].server_name) == (e.user, e.server_name)
    # No slot held by two leases at once.
    by_slot: dict[int, list] = {}
    for lease in leases.values():
        by_slot.setdefault(lease.start, []).append(lease)
    for held in by_slot.values():
        held.sort(key=lambda lease: lease.claimed_at)
        for before, after in itertools.pairwise(held):
            assert before.released_at is not None and before.released_at <= after.claimed_at
    # Order: whoever was ahead (priority, then first come) and already waiting when a
    # grant happened had been granted or had left by then.
    for g in granted:
        for e in entries:
            ahead = (-e.priority, e.id) < (-g.priority, g.id)
            if ahead and e.joined_at < g.closed_at:
                assert e.closed_at is not None and e.closed_at <= g.closed_at, (e, g)
    # Nobody skipped: a free slot and a waiter never remain together.
    assert not (ledger.waits.waiting() and len(ledger.leases.active()) < SLOTS)
    assert any(e.state == "cancelled" for e in entries) and len(granted) > SLOTS


def test_max_wait_none_never_expires(backend_url: str) -> None:
    clock = Clock()
    with Ledger.open(backend_url, clock=clock) as ledger:
        fill(ledger)
        entry = ledger.waits.join(asks("patient", max_wait=None))
        clock.advance(days=3)
        drain(ledger)
        assert ledger.waits.entry(entry.id).waiting
        assert entry.deadline is None and entry.joined_at + timedelta(days=3) == clock.now


def test_one_grant_pass_serves_every_waiter_a_release_made_room_for(backend_url: str) -> None:
    """A grant pass grants in one transaction what passes of one grant each grant one at
    a time (the same order, the same slots), and returns the line it left; the leases a
    pass counts as held while it goes on are the very ones it writes."""
    with Ledger.open(backend_url, clock=Clock()) as ledger:
        fill(ledger)
        late = [ledger.waits.join(asks(name)) for name in ("ann", "bob", "cy", "dee")]
        freed = ledger.leases.active()[:3]
        for holder in freed:
            ledger.leases.release(holder.id, "stopped")
        seen: list[LedgerView] = []

        def watching(entry: WaitEntry, view: LedgerView) -> Grant:
            seen.append(view)
            return first_free(entry, view)

        done = ledger.waits.grant(watching, quotas={}, capacity=lambda held: SLOTS,
                                  watch=[e.id for e in late])
        assert [e.user for e in done.granted] == ["ann", "bob", "cy"]
        # dee's decision, the last, saw the pass's grants as the leases written for them.
        counted = {x.id for x in seen[-1].leases} - {x.id for x in seen[0].leases}
        assert counted == {e.lease_id for e in done.granted}
        assert sorted(ledger.leases.get(e.lease_id).start for e in done.granted) == sorted(
            h.start for h in freed)
        assert [e.user for e in done.line] == ["dee"] and len(done.held) == SLOTS
        assert {e.user: e.state for e in done.watched.values()} == {
            "ann": "granted", "bob": "granted", "cy": "granted", "dee": "waiting"}
        assert done.capacity == SLOTS
        assert ledger.waits.grant(first_free, quotas={}, capacity=SLOTS).granted == []
