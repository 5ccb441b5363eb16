"""Lease, wait-list and warning states as types: every move the transition tables do not
list is refused by the ledger, logged and never written, on SQLite and PostgreSQL; release
codes live in their own columns, readable in plain SQL, and migration 0008 fills them in
from the sentences older versions wrote; migration 0014 gives a pending warning its state,
0016 its own stop (each stop its own warning).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from alembic import command
from sqlalchemy import Connection, create_engine, text

from mig_spawner.core.keep import KeepOutcome
from mig_spawner.core.lifecycle import (
    LEASE_MOVES,
    WAIT_MOVES,
    WARNING_MOVES,
    LeaseState,
    ReleaseCode,
    StopRule,
    WaitState,
    WarningState,
    lease_move_allowed,
    wait_move_allowed,
    warning_move_allowed,
)
from mig_spawner.ledger import (
    IllegalTransition,
    LeaseRequest,
    LeaseStateError,
    Ledger,
    WaitRequest,
    rows,
    waitlist,
)
from mig_spawner.ledger import warnings as warning_store
from mig_spawner.ledger.engine import create_ledger_engine
from mig_spawner.ledger.migrate import alembic_config, upgrade
from tests.support.grants import first_free

ILLEGAL_LEASE_MOVES = [(old, new) for old, new in itertools.product(LeaseState, LeaseState)
                       if not lease_move_allowed(old, new)]
ILLEGAL_WAIT_MOVES = [(old, new) for old, new in itertools.product(WaitState, WaitState)
                      if not wait_move_allowed(old, new)]
#: A lease never warned (``None``) may only begin a warning.
ILLEGAL_WARNING_MOVES = [(old, new) for old, new in itertools.product(
    (None, *WarningState), WarningState) if not warning_move_allowed(old, new)]
_names = itertools.count()


def test_the_tables_name_every_state_and_end_in_final_states():
    assert set(LEASE_MOVES) == set(LeaseState) and set(WAIT_MOVES) == set(WaitState)
    assert LEASE_MOVES[LeaseState.RELEASED] == frozenset()
    assert all(not WAIT_MOVES[s] for s in WaitState if s is not WaitState.WAITING)
    # Every held state can end; nothing comes back from released or from an ended wait.
    assert all(LeaseState.RELEASED in LEASE_MOVES[s] for s in LeaseState
               if s is not LeaseState.RELEASED)
    assert (LeaseState.RELEASING, LeaseState.ACTIVE) in ILLEGAL_LEASE_MOVES
    assert len(ILLEGAL_LEASE_MOVES) == 7 and len(ILLEGAL_WAIT_MOVES) == 21
    # A pending warning ends one of three ways; a new one may follow all but the last.
    assert set(WARNING_MOVES) == set(WarningState)
    assert WARNING_MOVES[WarningState.PENDING] == set(WarningState) - {WarningState.PENDING}
    assert WARNING_MOVES[WarningState.CARRIED_OUT] == frozenset()
    assert (WarningState.WITHDRAWN, WarningState.KEPT) in ILLEGAL_WARNING_MOVES
    assert (None, WarningState.PENDING) not in ILLEGAL_WARNING_MOVES
    assert len(ILLEGAL_WARNING_MOVES) == 13


@pytest.fixture(scope="module",
                params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def ledger(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Ledger]:
    """One ledger per backend for the module: each test uses its own users."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('states') / 'ledger.sqlite'}"
    else:
        server = request.getfixturevalue("postgres_server")
        name = f"states_{next(_names)}"
        server.psql(f"CREATE DATABASE {name}")
        url = server.url(name)
    with Ledger.open(url) as ledger:
        yield ledger


def lease_in(ledger: Ledger, state: LeaseState):
    lease = ledger.leases.claim(LeaseRequest(f"u{next(_names)}"), first_free)
    if state is LeaseState.ACTIVE:
        lease = ledger.leases.activate(lease.id)
    elif state is LeaseState.RELEASING:
        lease = ledger.leases.begin_release(lease.id, ReleaseCode.STOPPED, held_by="a process")
    elif state is LeaseState.RELEASED:
        ledger.leases.release(lease.id, ReleaseCode.STOPPED)
        lease = ledger.leases.get(lease.id)
    assert lease is not None and lease.state is state
    return lease


def refused_move(ledger: Ledger, caplog, old: str, new: str,
                 write: Callable[[Connection], object]) -> IllegalTransition:
    """``write`` (a guarded writer's move from ``old`` to ``new``), in a write
    transaction: refused with IllegalTransition, and logged."""
    with caplog.at_level(logging.ERROR, "mig_spawner.ledger"), pytest.raises(
        IllegalTransition, match=f"is {old}; it cannot become {new}"
    ) as refused, ledger._tx.write() as connection:
        write(connection)
    assert f"it cannot become {new}" in caplog.text
    return refused.value


@pytest.mark.parametrize(("old", "new"), ILLEGAL_LEASE_MOVES, ids=lambda s: str(s))
def test_an_illegal_lease_move_is_refused_logged_and_not_written(ledger, old, new, caplog):
    lease = lease_in(ledger, old)
    refused = refused_move(ledger, caplog, old, new, lambda connection: rows.move(
        connection, rows.lock_lease(connection, lease.id), new))
    assert isinstance(refused, LeaseStateError) and refused.lease == lease
    assert ledger.leases.get(lease.id) == lease  # nothing written


def wait_in(ledger: Ledger, state: WaitState):
    user = f"w{next(_names)}"
    for earlier in ledger.waits.waiting():  # left waiting by another test: not in this one's way
        ledger.waits.cancel(earlier.id, "tidy")
    entry = ledger.waits.join(WaitRequest(user, "", "physics", 0, "1g.10gb", None))
    if state is WaitState.GRANTED:
        entry = ledger.waits.grant(lambda e, view: first_free(view), quotas={}, capacity=14,
                                   limit=1).granted[0]
        ledger.leases.release(entry.lease_id, ReleaseCode.STOPPED)  # leave the slots to others
    elif state is not WaitState.WAITING:
        entry = ledger.waits.cancel(entry.id, "gone", state=state)
    assert entry is not None and entry.user == user and entry.state is state
    return entry


@pytest.mark.parametrize(("old", "new"), ILLEGAL_WAIT_MOVES, ids=lambda s: str(s))
def test_an_illegal_wait_move_is_refused_logged_and_not_written(ledger, old, new, caplog):
    entry = wait_in(ledger, old)
    refused_move(ledger, caplog, old, new, lambda connection: waitlist._close(
        connection, entry, new, ledger._tx.now(), reason="test"))
    assert ledger.waits.entry(entry.id) == entry


def test_public_calls_refuse_what_the_table_refuses(ledger):
    active = ledger.leases.get(lease_in(ledger, LeaseState.ACTIVE).id)
    assert type(active.state) is LeaseState  # read back as the enum
    releasing = lease_in(ledger, LeaseState.RELEASING)
    with pytest.raises(LeaseStateError, match="is releasing"):
        ledger.leases.activate(releasing.id)
    # Ending what has ended is a no-op, never a move.
    released = lease_in(ledger, LeaseState.RELEASED)
    assert ledger.leases.release(released.id, ReleaseCode.ORPHAN) is None
    assert ledger.leases.begin_release(released.id, ReleaseCode.ORPHAN) is None
    assert ledger.leases.get(released.id) == released
    with pytest.raises(ValueError, match=r"not a release code.*stopped, server_exited"):
        ledger.leases.release(lease_in(ledger, LeaseState.ACTIVE).id, "went away")


def warning_in(ledger: Ledger, state: WarningState | None):
    """A held lease whose warning is in ``state``, reached through the public calls."""
    claimed = ledger.leases.claim(LeaseRequest(f"v{next(_names)}"), first_free)
    lease = ledger.leases.activate(claimed.id)
    deadline = lease.claimed_at + timedelta(hours=1)
    if state is not None:
        lease = ledger.warnings.warn(lease.id, StopRule.SERVER_IDLE, deadline, "idle")
    if state is WarningState.WITHDRAWN:
        lease = ledger.warnings.withdraw(lease.id)
    elif state is WarningState.KEPT:
        lease = ledger.warnings.keep(lease.id, extend_by=None, max_extensions=0).lease
    elif state is WarningState.CARRIED_OUT:
        lease = ledger.warnings.carry_out(lease.id)
    assert lease is not None and lease.warning_state is state
    return lease


@pytest.mark.parametrize(("old", "new"), ILLEGAL_WARNING_MOVES, ids=lambda s: str(s))
def test_an_illegal_warning_move_is_refused_logged_and_not_written(ledger, old, new, caplog):
    lease = warning_in(ledger, old)
    try:
        refused = refused_move(ledger, caplog, old or "none", new,
                               lambda connection: warning_store._move(
                                   connection, rows.lock_lease(connection, lease.id), new))
        assert refused.lease == lease
        assert ledger.leases.get(lease.id) == lease  # nothing written
    finally:
        ledger.leases.release(lease.id, ReleaseCode.STOPPED)  # leave the slots to others


def test_public_warning_calls_never_ask_for_an_illegal_move(ledger):
    carried = warning_in(ledger, WarningState.CARRIED_OUT)
    kept = warning_in(ledger, WarningState.KEPT)
    try:
        # Carried out: its server is being stopped; the rule stays on the lease.
        assert carried.warning is StopRule.SERVER_IDLE
        deadline = carried.claimed_at + timedelta(hours=2)
        assert ledger.warnings.warn(carried.id, StopRule.BUDGET, deadline, "spent") is None
        assert ledger.warnings.withdraw(carried.id) == carried
        assert ledger.warnings.carry_out(carried.id) is None
        answer = ledger.warnings.keep(carried.id, extend_by=None, max_extensions=0)
        assert answer.outcome is KeepOutcome.GONE and ledger.leases.get(carried.id) == carried
        # Kept: withdrawing or carrying out what is not pending writes nothing.
        assert ledger.warnings.withdraw(kept.id) == kept
        assert ledger.warnings.carry_out(kept.id) is None and ledger.leases.get(kept.id) == kept
        # A new warning after a kept one begins again.
        again = ledger.warnings.warn(kept.id, StopRule.SERVER_IDLE, deadline, "idle again")
        assert again.warning_state is WarningState.PENDING
        assert [e.kind for e in ledger.warnings.events(kept.id)] == ["warned", "kept", "warned"]
    finally:
        for lease in (carried, kept):
            ledger.leases.release(lease.id, ReleaseCode.STOPPED)


def test_each_stop_keeps_its_own_warning_and_the_lease_shows_the_soonest(ledger):
    """A second rule's warning never moves the first's time; withdrawing one leaves the
    others pending; Keep ends the idle stops' warnings and leaves a drain's."""
    lease = warning_in(ledger, None)
    t = lease.claimed_at
    try:
        ledger.warnings.warn(lease.id, StopRule.DRAIN, t + timedelta(hours=1), "re-cut")
        both = ledger.warnings.warn(lease.id, StopRule.SERVER_IDLE, t + timedelta(minutes=10),
                                    "idle")
        assert [(s.rule, s.deadline - t) for s in both.stops] == [
            (StopRule.SERVER_IDLE, timedelta(minutes=10)), (StopRule.DRAIN, timedelta(hours=1))]
        assert (both.warning, both.warning_deadline) == (StopRule.SERVER_IDLE,
                                                         t + timedelta(minutes=10))
        # The same stop at another time: its deadline moves, no second warning.
        ledger.warnings.warn(lease.id, StopRule.SERVER_IDLE, t + timedelta(minutes=12), "idle")
        assert ledger.leases.get(lease.id).pending_stop(StopRule.SERVER_IDLE).deadline == (
            t + timedelta(minutes=12))
        # The kernel's warning is its own; withdrawn, the others stand.
        ledger.warnings.warn(lease.id, StopRule.KERNEL_IDLE, t + timedelta(minutes=5), "kernel")
        left = ledger.warnings.withdraw(lease.id, StopRule.KERNEL_IDLE)
        assert [s.rule for s in left.stops] == [StopRule.SERVER_IDLE, StopRule.DRAIN]
        assert left.warning is StopRule.SERVER_IDLE and left.warning_state is WarningState.PENDING
        # Keep is activity: the idle stop's warning ends; the re-cut's is still coming.
        kept = ledger.warnings.keep(lease.id, extend_by=None, max_extensions=0).lease
        assert [s.rule for s in kept.stops] == [StopRule.DRAIN]
        assert (kept.warning, kept.warning_state) == (StopRule.DRAIN, WarningState.PENDING)
        assert [(e.kind, e.rule) for e in ledger.warnings.events(lease.id)] == [
            ("warned", StopRule.DRAIN), ("warned", StopRule.SERVER_IDLE),
            ("warned", StopRule.KERNEL_IDLE), ("kept", StopRule.SERVER_IDLE)]
        done = ledger.warnings.carry_out(lease.id, StopRule.DRAIN)
        assert (done.warning, done.warning_state, done.stops) == (
            StopRule.DRAIN, WarningState.CARRIED_OUT, ())
    finally:
        ledger.leases.release(lease.id, ReleaseCode.STOPPED)


def test_migration_0016_gives_a_pending_warning_its_own_stop_and_goes_back(backend_url):
    engine = create_ledger_engine(backend_url)
    insert = text(
        "INSERT INTO leases (id, user_name, server_name, group_name, profile, compute_slices, "
        "mode, state, claimed_at, warning, warned_at, warning_deadline, warning_state) "
        "VALUES (:id, :id, '', 'g', '1g.18gb', 1, 'pool', 'active', '2026-01-01 00:00:00', "
        ":warning, '2026-01-01 01:00:00', '2026-01-01 01:10:00', :state)")
    try:
        assert upgrade(engine, "0015") == "0015"
        with engine.begin() as conn:
            conn.execute(insert, [{"id": "warned", "warning": "server_idle", "state": "pending"},
                                  {"id": "kept", "warning": None, "state": "kept"}])
        assert upgrade(engine, "0016") == "0016"
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT id, stops FROM leases")).all())
        assert rows.stops_of(got["kept"]) == ()
        [stop] = rows.stops_of(got["warned"])
        assert (stop.rule, stop.warned_at.isoformat(), stop.deadline.isoformat()) == (
            StopRule.SERVER_IDLE, "2026-01-01T01:00:00+00:00", "2026-01-01T01:10:00+00:00")
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0015")
        with engine.connect() as conn:
            columns = conn.execute(text("SELECT * FROM leases")).keys()
            assert "stops" not in columns
    finally:
        engine.dispose()


def test_migration_0014_gives_a_pending_warning_its_state_and_goes_back(backend_url):
    engine = create_ledger_engine(backend_url)
    insert = text(
        "INSERT INTO leases (id, user_name, server_name, group_name, profile, compute_slices, "
        "mode, state, claimed_at, warning) VALUES (:id, :id, '', 'g', '1g.18gb', 1, 'pool', "
        "'active', '2026-01-01 00:00:00', :warning)")
    try:
        assert upgrade(engine, "0013") == "0013"
        with engine.begin() as conn:
            conn.execute(insert, [{"id": "warned", "warning": "server_idle"},
                                  {"id": "quiet", "warning": None}])
        assert upgrade(engine, "0014") == "0014"
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT id, warning_state FROM leases")).all())
        assert got == {"warned": "pending", "quiet": None}
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0013")
        with engine.connect() as conn:
            columns = conn.execute(text("SELECT * FROM leases")).keys()
            assert "warning_state" not in columns and "warning" in columns
    finally:
        engine.dispose()


def test_release_codes_are_columns_readable_in_plain_sql(ledger):
    held = lease_in(ledger, LeaseState.ACTIVE)
    ledger.leases.begin_release(held.id, ReleaseCode.SERVER_EXITED, "status 1",
                         held_by="processes still run on its GPU instance (PIDs 7)")
    done = ledger.leases.claim(LeaseRequest(f"u{next(_names)}"), first_free)
    ledger.leases.release(done.id, ReleaseCode.START_FAILED, "FileNotFoundError")
    engine = create_engine(ledger._engine.url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT id, state, release_code, release_detail, held_by FROM leases "
                "WHERE id IN (:a, :b) ORDER BY state"), {"a": held.id, "b": done.id}).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [
        (done.id, "released", "start_failed", "FileNotFoundError", None),
        (held.id, "releasing", "server_exited", "status 1",
         "processes still run on its GPU instance (PIDs 7)"),
    ]


OLD_REASONS = {
    "stopped": ("stopped", None, None),
    "server-exited (status 1)": ("server_exited", "status 1", None),
    "start-failed: FileNotFoundError": ("start_failed", "FileNotFoundError", None),
    "stale: server was not running when it started again":
        ("stale", "server was not running when it started again", None),
    "cancelled while waiting": ("cancelled", "while waiting", None),
    "orphan: hub has not run ana/ for 300s or more (released by the slice service)":
        ("orphan", "hub has not run ana/ for 300s or more (released by the slice service)",
         None),
    "stopped; held by: processes still run on its GPU instance (PIDs 4242)":
        ("stopped", None, "processes still run on its GPU instance (PIDs 4242)"),
    "released by an admin": (None, "released by an admin", None),
}


def test_migration_0008_reads_codes_out_of_the_old_sentences(backend_url):
    engine = create_ledger_engine(backend_url)
    try:
        assert upgrade(engine, "0007") == "0007"
        with engine.begin() as conn:
            for n, reason in enumerate(OLD_REASONS):
                conn.execute(text(
                    "INSERT INTO leases (id, user_name, server_name, group_name, profile, "
                    "compute_slices, mode, state, claimed_at, release_reason) VALUES "
                    "(:id, :user, '', 'g', '1g.18gb', 1, 'pool', :state, :at, :reason)"),
                    {"id": f"old{n}", "user": f"user{n}", "reason": reason,
                     "state": "releasing" if "held by" in reason else "released",
                     "at": "2026-01-01 00:00:00"})
        assert upgrade(engine, "0008") == "0008"
        with engine.connect() as conn:
            got = conn.execute(text(
                "SELECT id, release_code, release_detail, held_by FROM leases")).all()
        assert {row[0]: tuple(row[1:]) for row in got} == {
            f"old{n}": want for n, want in enumerate(OLD_REASONS.values())}
        # And back: 0007's sentences again (what an older mig-spawner reads).
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0007")
        with engine.connect() as conn:
            back = dict(conn.execute(text("SELECT id, release_reason FROM leases")).all())
        assert back["old1"] == "server-exited: status 1"
        assert back["old6"] == (
            "stopped; held by: processes still run on its GPU instance (PIDs 4242)")
        assert back["old7"] == "released by an admin"
    finally:
        engine.dispose()
