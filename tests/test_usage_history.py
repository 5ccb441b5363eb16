"""History that stays small (issue 36, item 5): a released lease's usage summary is
kept before its raw samples are pruned, so right-sizing reads the same figures after;
pruning never deletes a sample of a lease still held; the slice service prunes at its
``usage_sample_retention``; migration 0015 up and down, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from alembic import command
from sqlalchemy import inspect, text

from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.rightsize import UsageSample
from mig_spawner.ledger import Grant, LeaseRequest, Ledger, ReleaseCode
from mig_spawner.ledger.engine import create_ledger_engine
from mig_spawner.ledger.migrate import alembic_config, upgrade
from mig_spawner.service.app import SliceServiceApp
from tests.support.hub_standin import StandinState, standin_sweeper

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)
POLICY = MIGPolicyConfig(group_policies={
    "analysts": {"allowed": ["1g.18gb"], "server_idle_timeout": "1h"},
}).build()
WINDOW = timedelta(days=30)
GIB = 1024


def grant(start: int):
    return lambda view: Grant(group="analysts", profile="1g.18gb", compute_slices=1,
                              mode="pool", host="h", gpu_uuid="GPU-0", gpu_index=0,
                              start=start, size=1, mig_uuid=f"MIG-{start}")


def sampled(ledger: Ledger, user: str, start: int, days_ago: list[float]) -> str:
    """A lease with one sample per day in ``days_ago``, its memory peaking in the
    oldest (so that the summary depends on the samples pruning takes)."""
    lease = ledger.leases.claim(LeaseRequest(user, ""), grant(start))
    for n, ago in enumerate(sorted(days_ago, reverse=True)):
        ledger.usage.record_samples({lease.id: UsageSample(
            NOW - timedelta(days=ago), (9 if n == 0 else 2 + n % 3) * GIB, 18 * GIB,
            0.5 if n % 2 else 0.0, 1)})
    return lease.id


def same_by_window(ledger: Ledger) -> None:
    """The report's read of a window (summaries joined to it) gives what reading them
    lease by lease gives."""
    since, until = NOW - timedelta(days=365), datetime.now(UTC) + timedelta(days=1)
    ids = [x.id for x in ledger.reports.leases(since, until)]
    assert ledger.usage.summaries_between(since, until) == ledger.usage.summaries(ids)


def test_summaries_read_the_same_after_pruning_and_held_leases_keep_every_sample(
        backend_url):
    with Ledger.open(backend_url) as ledger:
        ended = sampled(ledger, "ann", 0, [45, 40, 35, 31, 20, 2])
        held = sampled(ledger, "bob", 1, [50, 44, 33, 10, 1])  # held for 50 days
        sampled(ledger, "cy", 2, [])  # never sampled: in no summary
        ledger.leases.release(ended, ReleaseCode.STOPPED)
        before = ledger.usage.summaries([ended, held])
        assert set(before) == {ended, held}
        same_by_window(ledger)
        raw_held = ledger.usage.samples([held])

        pruned = ledger.usage.prune(NOW - WINDOW)
        assert ledger.usage.samples([held]) == raw_held  # nothing of a held lease goes
        assert ledger.usage.summaries([ended, held]) == before
        assert pruned == (1, 4)  # one summary kept, four samples deleted
        same_by_window(ledger)
        assert [s.at for s in ledger.usage.samples([ended])[ended]] == [
            NOW - timedelta(days=20), NOW - timedelta(days=2)]
        # Again, and once every sample of the ended lease is old: the same summary.
        assert ledger.usage.prune(NOW - WINDOW) == (0, 0)
        assert ledger.usage.prune(NOW + timedelta(days=1)) == (0, 2)
        assert ledger.usage.summaries([ended, held]) == before
        assert ledger.usage.samples([ended]) == {}
        # The service's summary of a lease it saw end is written once, then kept.
        ledger.leases.release(held, ReleaseCode.STOPPED)
        same_by_window(ledger)  # released, not yet summarised: from its samples
        assert ledger.usage.summarize_released([held, ended, "unknown"]) == 1
        same_by_window(ledger)
        assert ledger.usage.summarize_released([held]) == 0
        assert ledger.usage.prune(NOW + timedelta(days=1)) == (0, 5)
        assert ledger.usage.summaries([ended, held]) == before


async def test_the_service_prunes_old_samples_at_its_retention(serve_hub, ledger, ledger_url):
    base = serve_hub(StandinState.build(3))
    ended = sampled(ledger, "ghost", 0, [40, 35, 1])
    held = sampled(ledger, "user00001", 1, [40, 35, 1])  # the stand-in runs its server
    ledger.leases.release(ended, ReleaseCode.STOPPED)
    before = ledger.usage.summaries([ended, held])
    sweeper = standin_sweeper(base, POLICY, ledger=ledger, orphan_grace=float("inf"),
                          usage_retention=WINDOW.total_seconds(), clock=lambda: NOW)
    await sweeper.sweep()
    await sweeper.close()  # waits for the prune it started
    with Ledger.open(ledger_url) as again:
        assert len(again.usage.samples([ended])[ended]) == 1
        assert len(again.usage.samples([held])[held]) == 3
        assert again.usage.summaries([ended, held]) == before


def test_the_retention_is_a_duration_or_never():
    assert SliceServiceApp().usage_sample_retention == 30 * 86400
    assert SliceServiceApp(usage_sample_retention="90d").usage_sample_retention == 90 * 86400
    assert SliceServiceApp(usage_sample_retention="never").usage_sample_retention == float(
        "inf")
    with pytest.raises(ValueError, match=r"usage_sample_retention: 'a month' is not a"):
        SliceServiceApp(usage_sample_retention="a month")


def test_migration_0017_adds_the_summaries_and_goes_back(backend_url):
    engine = create_ledger_engine(backend_url)
    try:
        assert upgrade(engine, "0016") == "0016"
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO leases (id, user_name, server_name, group_name, profile, "
                "compute_slices, mode, state, claimed_at, released_at) VALUES ('old', 'ann',"
                " '', 'g', '1g.18gb', 1, 'pool', 'released', :at, :at)"),
                {"at": "2026-01-01 00:00:00"})
            conn.execute(text(
                "INSERT INTO lease_samples (lease_id, at, memory_used_mib, memory_total_mib,"
                " processes) VALUES ('old', :at, 4096, 18432, 1)"),
                [{"at": f"2026-01-01 00:0{m}:00"} for m in range(3)])
        assert upgrade(engine, "0017") == "0017"
        assert "lease_usage" in inspect(engine).get_table_names()
        with Ledger.open(backend_url) as ledger:
            # No summary yet: read from the samples, then kept by a prune.
            before = ledger.usage.summaries(["old"])
            assert before["old"].peak_mib == 4096 and before["old"].samples == 3
            assert ledger.usage.prune(NOW) == (1, 3)
            assert ledger.usage.summaries(["old"]) == before
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0016")
        inspector = inspect(engine)
        assert "lease_usage" not in inspector.get_table_names()
        assert [i["name"] for i in inspector.get_indexes("lease_samples")] == [
            "ix_lease_samples_lease"]
        assert upgrade(engine, "0017") == "0017"
    finally:
        engine.dispose()
