"""The lease ledger on SQLite and on a real PostgreSQL: lifecycle, refusals, restarts, schema.

PostgreSQL variants use the session cluster from ``pg_fixture`` (imported by conftest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, event, inspect, text

from mig_spawner.ledger import (
    DoubleGrant,
    Grant,
    InvalidDecision,
    LeaseNotFound,
    LeaseRequest,
    LeaseStateError,
    Ledger,
    LedgerConfigError,
    LedgerUnavailable,
    LedgerView,
    ReleaseCode,
    SchemaError,
    ServerHasLease,
)
from mig_spawner.ledger.migrate import head_revision
from mig_spawner.ledger.models import VERSION_TABLE, metadata
from mig_spawner.spawner.decide import holdings
from tests.mocking import T0, Clock
from tests.support.grants import GPUS, HOST, NoFreeSlot, first_free


def fixed(start: int, size: int = 1, group: str = "physics", gpu: str = GPUS[0]):
    """A decide callback that ignores the view (to test the database's own guarantee)."""

    def decide(view: LedgerView) -> Grant:
        return Grant(
            group=group,
            profile="x",
            compute_slices=size,
            mode="dynamic",
            host=HOST,
            gpu_uuid=gpu,
            gpu_index=0,
            start=start,
            size=size,
        )

    return decide


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(backend_url: str, clock: Clock):
    with Ledger.open(backend_url, clock=clock) as opened:
        yield opened


def test_claim_activate_release_keeps_history(ledger: Ledger, clock: Clock) -> None:
    lease = ledger.leases.claim(LeaseRequest("alice", "gpu"), first_free)
    assert (lease.state, lease.host, lease.gpu_uuid, lease.start, lease.size) == (
        "claimed",
        HOST,
        GPUS[0],
        0,
        1,
    )
    assert lease.claimed_at == T0 and lease.mig_uuid is None
    assert ledger.leases.active_for_server("alice", "gpu") == lease

    clock.advance(seconds=5)
    active = ledger.leases.activate(lease.id, mig_uuid="MIG-1111", gi_id=7, ci_id=0)
    assert active.state == "active" and active.mig_uuid == "MIG-1111"
    assert active.started_at == T0 + timedelta(seconds=5)
    assert ledger.leases.get(lease.id) == active
    assert ledger.leases.activate(lease.id) == active  # again: harmless

    clock.advance(minutes=1)
    released = ledger.leases.release(lease.id, "stopped")
    assert released is not None
    assert (released.state, released.release_code) == ("released", ReleaseCode.STOPPED)
    assert released.released_at == T0 + timedelta(minutes=1, seconds=5)
    assert ledger.leases.release(lease.id, ReleaseCode.ORPHAN) is None  # idempotent
    assert ledger.leases.active() == [] and ledger.leases.active_for_server("alice", "gpu") is None
    assert ledger.leases.history() == [released]
    # The slice is free again.
    assert ledger.leases.claim(LeaseRequest("bob"), first_free).start == 0


def test_refusal_from_decide_propagates_unchanged_and_writes_nothing(ledger: Ledger) -> None:
    refusal = NoFreeSlot("group physics may hold 2 slices and holds 2")

    def refuse(view: LedgerView) -> Grant:
        raise refusal

    with pytest.raises(NoFreeSlot) as caught:
        ledger.leases.claim(LeaseRequest("alice"), refuse)
    assert caught.value is refusal
    assert ledger.leases.history() == []
    # Nothing half-written blocks the next claim of that server.
    assert ledger.leases.claim(LeaseRequest("alice"), first_free).state == "claimed"


def test_full_gpus_refuse_and_a_release_frees_exactly_that_slice(ledger: Ledger) -> None:
    granted = [ledger.leases.claim(LeaseRequest(f"u{i}"), first_free) for i in range(14)]
    assert {(g.gpu_uuid, g.start) for g in granted} == {(g, s) for g in GPUS for s in range(7)}
    with pytest.raises(NoFreeSlot):
        ledger.leases.claim(LeaseRequest("late"), first_free)
    ledger.leases.release(granted[9].id, ReleaseCode.STOPPED, "idle")
    again = ledger.leases.claim(LeaseRequest("late"), first_free)
    assert (again.gpu_uuid, again.start) == (granted[9].gpu_uuid, granted[9].start)


def test_overlap_is_a_double_grant_enforced_by_the_database(ledger: Ledger) -> None:
    ledger.leases.claim(LeaseRequest("alice"), fixed(start=2, size=2))
    # A decide that ignores the view (a buggy allocator, or another process) cannot
    # get overlapping memory slices: the lease_slots primary key refuses.
    with pytest.raises(DoubleGrant, match=r"slices 0\.\.3 of GPU GPU-aaaa"):
        ledger.leases.claim(LeaseRequest("bob"), fixed(start=0, size=4))
    assert [lease.user for lease in ledger.leases.history()] == ["alice"]
    # Same slices on another GPU are fine.
    assert ledger.leases.claim(LeaseRequest("bob"), fixed(start=0, size=4, gpu=GPUS[1])).size == 4


def test_one_server_never_holds_two_leases(ledger: Ledger) -> None:
    first = ledger.leases.claim(LeaseRequest("alice", "a"), first_free)
    calls: list[LedgerView] = []

    def spy(view: LedgerView) -> Grant:
        calls.append(view)
        return first_free(view)

    with pytest.raises(ServerHasLease, match=f"alice/a already holds lease {first.id}"):
        ledger.leases.claim(LeaseRequest("alice", "a"), spy)
    assert calls == []  # refused before the allocator ran
    ledger.leases.claim(LeaseRequest("alice", "b"), spy)  # another named server may
    ledger.leases.release(first.id, "stopped")
    assert ledger.leases.claim(LeaseRequest("alice", "a"), spy).state == "claimed"


def test_releasing_keeps_the_slice_until_released(ledger: Ledger, clock: Clock) -> None:
    lease = ledger.leases.claim(LeaseRequest("alice"), first_free)
    releasing = ledger.leases.begin_release(lease.id, ReleaseCode.STOPPED, "max-age")
    assert releasing is not None and releasing.state == "releasing"
    assert ledger.leases.begin_release(lease.id, ReleaseCode.STOPPED, "max-age") == releasing
    # A retry says what holds the slice now; the newest word is what users and the map see.
    again = ledger.leases.begin_release(lease.id, ReleaseCode.ORPHAN, held_by="instance busy")
    assert again is not None and again.held_by == "instance busy"
    assert (again.release_code, again.release_detail) == (ReleaseCode.STOPPED, "max-age")
    # Still held: the instance is being destroyed, nobody else may take it yet.
    assert ledger.leases.active() == [again]
    assert ledger.leases.claim(LeaseRequest("bob"), first_free).start == 1
    with pytest.raises(LeaseStateError, match=r"is releasing .*Stop the server"):
        ledger.leases.activate(lease.id, mig_uuid="MIG-x")
    done = ledger.leases.release(lease.id, ReleaseCode.ORPHAN, "destroyed")
    assert done is not None  # the first code and detail are kept; nothing holds it now
    assert (done.release_code, done.release_detail, done.held_by) == (
        ReleaseCode.STOPPED, "max-age", None)
    assert ledger.leases.claim(LeaseRequest("carol"), first_free).start == 0


def test_activate_refuses_unknown_leases_and_contradictions(ledger: Ledger) -> None:
    with pytest.raises(LeaseNotFound, match="no lease with id 'nope'"):
        ledger.leases.activate("nope")
    pool = ledger.leases.claim(LeaseRequest("alice"), lambda view: first_free(view, mode="pool"))
    assert pool.mig_uuid == f"MIG-{GPUS[0]}-0"
    with pytest.raises(LeaseStateError, match="refusing to overwrite"):
        ledger.leases.activate(pool.id, mig_uuid="MIG-other")
    assert ledger.leases.get(pool.id) == pool
    assert ledger.leases.release("nope", "stopped") is None
    assert ledger.usage.touch("nope", T0) is None


def test_a_created_instance_is_recorded_before_the_server_starts(ledger: Ledger) -> None:
    lease = ledger.leases.claim(LeaseRequest("alice"), first_free)
    noted = ledger.leases.record_instance(lease.id, mig_uuid="MIG-9", gi_id=7, ci_id=0)
    # Still only claimed, but a reconciler reading it now knows what to destroy.
    assert (noted.state, noted.gi_id, noted.started_at) == ("claimed", 7, None)
    assert ledger.leases.active_for_server("alice") == noted
    assert ledger.leases.activate(lease.id, mig_uuid="MIG-9").state == "active"
    culled = ledger.leases.claim(LeaseRequest("bob"), first_free)
    ledger.leases.release(culled.id, ReleaseCode.STOPPED, "max-age")
    with pytest.raises(LeaseStateError, match=r"is released .*cannot record an instance"):
        ledger.leases.record_instance(culled.id, mig_uuid="MIG-10", gi_id=8, ci_id=0)


def test_activation_records_the_holder_in_the_same_write(ledger: Ledger) -> None:
    commits = []
    event.listen(ledger._engine, "commit", lambda connection: commits.append(1))
    holder = {"holder_host": "gpu1", "holder_pid": 4242, "holder_start": 987654}
    lease = ledger.leases.claim(LeaseRequest("alice"), first_free)
    commits.clear()
    active = ledger.leases.activate(lease.id, server_url="http://10.0.0.5:8888/user/alice/",
                                    **holder)
    # One transaction: no moment where the process is recorded but the lease not active.
    assert len(commits) == 1
    assert (active.state, active.holder_host, active.holder_pid, active.holder_start) == (
        "active", "gpu1", 4242, 987654)
    assert ledger.leases.get(lease.id) == active
    with pytest.raises(ValueError, match="go together"):
        ledger.leases.activate(lease.id, holder_host="gpu1")
    # Facts refused: the process still runs, so it is recorded for whoever releases.
    pool = ledger.leases.claim(LeaseRequest("bob"), lambda view: first_free(view, mode="pool"))
    with pytest.raises(LeaseStateError, match="refusing to overwrite"):
        ledger.leases.activate(pool.id, mig_uuid="MIG-other", **holder)
    refused = ledger.leases.get(pool.id)
    assert refused is not None and (refused.state, refused.holder_pid) == ("claimed", 4242)
    ledger.leases.release(lease.id, ReleaseCode.STOPPED)
    with pytest.raises(LeaseStateError, match=r"is released .*cannot become active"):
        ledger.leases.activate(lease.id, **{**holder, "holder_pid": 1})
    assert ledger.leases.get(lease.id).holder_pid == 4242


def test_claims_see_held_leases_as_changed_elsewhere(ledger: Ledger, backend_url: str) -> None:
    """Held leases read before and unchanged come back as the same records; a change made
    by another process (or by hand in SQL) is read as it now is."""
    lease = ledger.leases.claim(LeaseRequest("alice"), first_free)
    views: list[LedgerView] = []

    def watch(view: LedgerView) -> Grant:
        views.append(view)
        return first_free(view)

    ledger.leases.claim(LeaseRequest("bob"), watch)
    assert views[-1].leases == (lease,)
    with Ledger.open(backend_url) as other:
        touched = other.usage.touch(lease.id, T0 + timedelta(minutes=5))
    ledger.leases.claim(LeaseRequest("carol"), watch)
    assert [held for held in views[-1].leases if held.id == lease.id] == [touched]
    assert touched != lease
    engine = create_engine(backend_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE leases SET peak_memory_mib = 77 WHERE id = :id"),
                           {"id": lease.id})
    engine.dispose()
    held = {held.user: held for held in ledger.leases.active()}
    assert sorted(held) == ["alice", "bob", "carol"] and held["alice"].peak_memory_mib == 77


def test_touch_only_moves_forward(ledger: Ledger, clock: Clock) -> None:
    lease = ledger.leases.activate(ledger.leases.claim(LeaseRequest("alice"), first_free).id)
    later = T0 + timedelta(minutes=10)
    assert ledger.usage.touch(lease.id, later).last_activity_at == later
    assert ledger.usage.touch(lease.id, T0 + timedelta(minutes=3)).last_activity_at == later
    with pytest.raises(ValueError, match="timezone-aware"):
        ledger.usage.touch(lease.id, datetime(2026, 12, 1, 12, 0))
    # Offsets are normalised: 11:20+01:00 is 10:20 UTC.
    plus_one = datetime(2026, 12, 1, 11, 20, tzinfo=timezone(timedelta(hours=1)))
    assert ledger.usage.touch(lease.id, plus_one).last_activity_at == datetime(
        2026, 12, 1, 10, 20, tzinfo=UTC
    )
    ledger.leases.release(lease.id, "stopped")
    assert ledger.usage.touch(lease.id, later + timedelta(hours=1)) is None


def test_quota_counts_per_user_and_charged_group(ledger: Ledger) -> None:
    ledger.leases.claim(LeaseRequest("alice", "a"), lambda v: first_free(v, size=2))
    ledger.leases.claim(LeaseRequest("alice", "b"), first_free)
    ledger.leases.claim(LeaseRequest("bob"), fixed(start=6, group="chemistry", gpu=GPUS[1]))
    kube = Grant(
        group="chemistry", profile="1g.10gb", compute_slices=1, mode="kube", pod="jupyter-carol"
    )
    carol = ledger.leases.claim(LeaseRequest("carol"), lambda view: kube)
    assert carol.memory_slices == range(0)  # the device plugin places kube slices

    # What the quota check reads (spawner.decide.holdings), from the held leases.
    active = ledger.leases.active()
    assert [len(holdings(active, u)[0]) for u in ("alice", "bob", "nobody")] == [2, 1, 0]
    usage = holdings(active, "alice")[1]
    assert (usage["physics"].slices, usage["physics"].compute_slices) == (2, 3)
    assert (usage["chemistry"].slices, usage["chemistry"].compute_slices) == (2, 2)
    assert sum(lease.size or 0 for lease in active if lease.group == "physics") == 3
    assert sum(lease.size or 0 for lease in active if lease.group == "chemistry") == 1
    assert [lease for lease in ledger.leases.active(host=HOST) if lease.user == "carol"] == []

    def quota_check(view: LedgerView) -> Grant:
        # decide sees the same numbers the policy's quota check needs
        assert holdings(view.leases, "alice")[1] == usage
        raise NoFreeSlot("physics holds 3 of its 3 compute slices")

    with pytest.raises(NoFreeSlot, match="physics holds 3"):
        ledger.leases.claim(LeaseRequest("dave"), quota_check)


def test_history_since(ledger: Ledger, clock: Clock) -> None:
    early = ledger.leases.claim(LeaseRequest("early"), first_free)
    clock.advance(hours=1)
    ledger.leases.release(early.id, "stopped")
    clock.advance(hours=1)
    ledger.leases.claim(LeaseRequest("late"), first_free)
    assert [lease.user for lease in ledger.leases.history()] == ["early", "late"]
    assert [lease.user for lease in ledger.leases.history(T0 + timedelta(minutes=30))] == [
        "early",
        "late",
    ]
    later = T0 + timedelta(hours=1, seconds=1)
    assert [lease.user for lease in ledger.leases.history(later)] == ["late"]
    assert ledger.leases.history(user="early", group="physics")[0].release_code == "stopped"
    assert ledger.leases.history(group="chemistry") == []


def test_request_counts_add_recent_leases_and_refusals_per_profile(
    ledger: Ledger, clock: Clock
) -> None:
    old = ledger.leases.claim(LeaseRequest("old"), first_free)  # 1g.10gb, before the window
    ledger.leases.release(old.id, "stopped")
    clock.advance(days=8)
    since = clock.now
    ledger.leases.claim(LeaseRequest("a"), first_free)
    ledger.leases.claim(LeaseRequest("b"), lambda view: first_free(view, size=2))
    ledger.refusals.record(LeaseRequest("c"), offer="2g.20gb", profile="2g.20gb",
                          reason="no_capacity", group="physics" * 50)
    # A slice class refused where it means several profiles: no profile to count.
    ledger.refusals.record(LeaseRequest("d"), offer="small", reason="none_free")
    assert ledger.refusals.request_counts(since) == {"1g.10gb": 1, "2g.20gb": 2}
    assert ledger.refusals.request_counts(T0) == {"1g.10gb": 2, "2g.20gb": 2}
    assert len(ledger.refusals.between(since)[0].group) == 255  # kept to the column's size


def test_invalid_decisions_are_refused_with_what_is_wrong(ledger: Ledger) -> None:
    with pytest.raises(InvalidDecision, match="pool mode leases an existing instance"):
        Grant(
            group="g",
            profile="1g.10gb",
            compute_slices=1,
            mode="pool",
            host=HOST,
            gpu_uuid="GPU-1",
            gpu_index=0,
            start=0,
            size=1,
        )
    with pytest.raises(InvalidDecision, match="dynamic mode needs host, gpu_uuid"):
        Grant(group="g", profile="1g.10gb", compute_slices=1, mode="dynamic")
    with pytest.raises(InvalidDecision, match="must return a Grant, it returned dict"):
        ledger.leases.claim(LeaseRequest("alice"), lambda view: {"start": 0})
    assert ledger.leases.history() == []


def test_leases_survive_reopening_and_another_process(backend_url: str, clock: Clock) -> None:
    with Ledger.open(backend_url, clock=clock) as first:
        kept = first.leases.activate(first.leases.claim(LeaseRequest("alice"), first_free).id,
                                     mig_uuid="M1")
        gone = first.leases.claim(LeaseRequest("bob"), first_free)
        first.leases.release(gone.id, "stopped")
    with Ledger.open(backend_url) as reopened:  # a new engine: the hub restarted
        assert reopened.leases.active() == [kept]
        assert reopened.leases.get(gone.id).release_code == ReleaseCode.STOPPED
        with pytest.raises(DoubleGrant):  # the slot is still held after the restart
            reopened.leases.claim(LeaseRequest("carol"), fixed(start=0))
    script = (
        "import json, sys\n"
        "from mig_spawner.ledger import Ledger\n"
        "ledger = Ledger.open(sys.argv[1])\n"
        "print(json.dumps([[l.id, l.user, l.mig_uuid, l.state] for l in ledger.leases.active()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, backend_url],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(out) == [[kept.id, "alice", "M1", "active"]]


def test_migrations_build_the_schema_from_empty_and_are_idempotent(backend_url: str) -> None:
    ledger = Ledger(backend_url)
    head = head_revision()  # the newest migration this branch ships
    with pytest.raises(SchemaError, match=rf"revision none, this mig-spawner needs {head}.*open"):
        ledger.leases.active()
    assert ledger.revision() is None
    assert ledger.upgrade() == head
    assert ledger.upgrade() == head
    assert ledger.leases.active() == []
    engine = create_engine(backend_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert tables == {"leases", "lease_slots", "lease_servers", "ledger_lock", "refusals",
                          "waits", "lease_events", "lease_samples", "lease_usage",
                          "budget_grants", "layout_changes", "gpu_faults", VERSION_TABLE}
        with engine.connect() as conn:
            # The migrated schema is exactly what the code declares.
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            diff = compare_metadata(context, metadata)
            assert diff == []
            assert conn.execute(text("SELECT id FROM ledger_lock")).scalars().all() == [1]
    finally:
        engine.dispose()
        ledger.close()


def test_ledger_shares_jupyterhubs_database(backend_url: str) -> None:
    from jupyterhub import orm

    def hub_revision() -> str:
        engine = create_engine(backend_url)
        try:
            with engine.connect() as conn:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        finally:
            engine.dispose()

    orm.new_session_factory(backend_url)().get_bind().dispose()  # the hub creates its tables
    hub_head = hub_revision()
    with Ledger.open(backend_url) as ledger:
        ledger.leases.claim(LeaseRequest("alice"), first_free)
    assert hub_revision() == hub_head
    # The hub restarts: its revision check passes.
    orm.new_session_factory(backend_url)().get_bind().dispose()
    with Ledger.open(backend_url) as ledger:
        assert [lease.user for lease in ledger.leases.active()] == ["alice"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("sqlite://", "in-memory SQLite database: every lease would be lost"),
        ("sqlite:///:memory:", "in-memory"),
        ("sqlite:////nonexistent-dir/l.sqlite", "directory /nonexistent-dir .* does not exist"),
        ("", "the ledger URL is empty"),
        ("postgresql+psycopg2://u@h:notaport/db", "cannot parse ledger URL"),
    ],
)
def test_bad_urls_say_what_to_do(bad: str, message: str) -> None:
    with pytest.raises(LedgerConfigError, match=message):
        Ledger(bad)


def test_a_file_that_is_not_a_database_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "notes.sqlite").write_text("not a database")
    with pytest.raises(LedgerUnavailable, match=r"notes.sqlite cannot be used: file is not a"):
        Ledger.open(f"sqlite:///{tmp_path / 'notes.sqlite'}")


def test_a_bare_path_means_a_sqlite_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with Ledger.open("leases.sqlite") as ledger:
        assert ledger.url == f"sqlite:///{tmp_path / 'leases.sqlite'}"
        ledger.leases.claim(LeaseRequest("alice"), first_free)
    assert (tmp_path / "leases.sqlite").is_file()


def test_user_and_server_names_of_300_characters_claim_release_and_refuse(
    ledger: Ledger,
) -> None:
    # JupyterHub's own names are not limited to 255 characters (its SQLite database
    # takes any length), so neither may the ledger's be, in its keys or its history.
    user, server = "u" * 300, "s" * 300
    lease = ledger.leases.claim(LeaseRequest(user, server), first_free)
    assert ledger.leases.active_for_server(user, server) == lease
    ledger.refusals.record(LeaseRequest(user, server), offer="small", reason="none_free")
    assert [r.user for r in ledger.refusals.between()] == [user]
    released = ledger.leases.release(lease.id, "stopped")
    assert (released.user, released.server_name, released.state) == (user, server, "released")


def test_keep_counts_as_activity_or_extends_up_to_the_limit_and_is_recorded(tmp_path):
    from datetime import timedelta as td
    now = [datetime(2026, 12, 2, 12, 0, tzinfo=UTC)]
    with Ledger.open(f"sqlite:///{tmp_path}/l.sqlite", clock=lambda: now[0]) as ledger:
        def decide(view):
            return Grant(group="g", profile="1g.18gb", compute_slices=1, mode="pool",
                            host="h", gpu_uuid="GPU-0", gpu_index=0, start=0, size=1,
                            mig_uuid="MIG-0", expires_at=view.now + td(hours=8))
        lease = ledger.leases.activate(ledger.leases.claim(LeaseRequest("ana"), decide).id)
        ledger.warnings.warn(lease.id, "server_idle", now[0] + td(minutes=10), "idle 20m of 30m")
        kept = ledger.warnings.keep(lease.id, extend_by=3600, max_extensions=1)
        assert (kept.outcome, kept.lease.kept_at, kept.lease.warning) == ("kept", now[0], None)

        ledger.warnings.warn(lease.id, "max_session_age", lease.expires_at, "age")
        extended = ledger.warnings.keep(lease.id, extend_by=3600, max_extensions=1)
        assert extended.outcome == "extended"
        assert extended.lease.expires_at == lease.expires_at + td(hours=1)
        assert "21:00 UTC" in extended.message and "http" not in extended.message
        ledger.warnings.warn(lease.id, "max_session_age", extended.lease.expires_at, "age")
        refused = ledger.warnings.keep(lease.id, extend_by=3600, max_extensions=1)
        assert refused.outcome == "refused"
        assert refused.message.startswith("This session was already extended 1 time, the most")
        assert ledger.leases.get(lease.id).expires_at == extended.lease.expires_at
        assert [e.kind for e in ledger.warnings.events(lease.id)] == [
            "warned", "kept", "warned", "extended", "warned", "refused"]
        # Pressing again and again (818 rows from one user in 150 s, once): one row per
        # change of state, and a warning moved in time is not a new one.
        for _ in range(20):
            again = ledger.warnings.keep(lease.id, extend_by=3600, max_extensions=1)
            assert again.outcome == "refused"
        ledger.warnings.warn(lease.id, "max_session_age", extended.lease.expires_at, "age, again")
        assert len(ledger.warnings.events(lease.id)) == 6
        ledger.warnings.withdraw(lease.id)
        now[0] += td(seconds=61)
        for _ in range(20):
            again = ledger.warnings.keep(lease.id, extend_by=3600, max_extensions=1)
            assert again.outcome == "kept"
        assert len(ledger.warnings.events(lease.id)) == 6
        assert ledger.leases.get(lease.id).kept_at == now[0]  # activity, once
        ledger.leases.release(lease.id, "stopped")
        assert ledger.warnings.keep(lease.id, extend_by=3600, max_extensions=1).outcome == "gone"




def test_ledgers_opened_at_once_in_threads_all_migrate(tmp_path):
    """alembic's ``op`` and ``context`` are process-wide: two threads migrating at once
    ran one's DDL on the other's connection ("bad parameter or other API misuse", and
    a segfault in libsqlite3 seen in a full run). Run in a child, so that a crash fails
    this test rather than killing the test process."""
    script = f"""
from concurrent.futures import ThreadPoolExecutor
from mig_spawner.ledger import Ledger
from mig_spawner.ledger.migrate import head_revision

def one(i):
    with Ledger.open("sqlite:///{tmp_path}/l%d.sqlite" % i) as ledger:
        return ledger.revision()

for round_ in range(3):
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, range(round_ * 6, round_ * 6 + 6)))
    assert got == [head_revision()] * 6, got
print("all at head")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0 and "all at head" in done.stdout, done.stderr[-2000:]
