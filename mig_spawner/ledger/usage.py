"""The usage store: what held slices did (activity, GPU work, usage samples) and the
budgets their hours spend (extra hours given, the leases a budget counts).

``ledger.usage`` records what the slice service sees at each sweep and reads it back
for the slice map, right-sizing and budgets. Claims and grant passes read the budgets'
part in their own transaction through :meth:`Usage.book`, so that the budget check
(:mod:`mig_spawner.core.budget`, called by ``decide``) sees exactly the hours the
claim is decided on (docs/policies.md, "Budgets").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, delete, insert, or_, select

from mig_spawner.core.budget import Extra
from mig_spawner.core.rightsize import Usage as UsageSummary
from mig_spawner.core.rightsize import UsageSample, summarize

from .models import budget_grants, lease_samples, lease_usage, leases
from .records import HELD_STATES, Lease, require_aware
from .reports import held_between
from .rows import lock_lease, released_since, select_leases, update
from .transactions import Transactions

_EXTRAS = select(budget_grants).order_by(budget_grants.c.id)
_EXTRAS_SINCE = _EXTRAS.where(budget_grants.c.granted_at >= bindparam("since"))
#: Lease ids per read of samples: bounds the IN list.
_SAMPLES_PER_READ = 500
#: ``lease_usage``'s figures in the order of :class:`UsageSummary`'s fields.
_SUMMARY_COLUMNS = tuple(lease_usage.c[f.name] for f in fields(UsageSummary))


class Usage:
    """The ledger's usage store (see the module docstring)."""

    #: Seconds back that claims read released leases and extra hours for the budgets
    #: (the policies' longest ``budget_window``); ``None``: no budget, nothing read.
    budget_horizon: float | None = None

    def __init__(self, tx: Transactions) -> None:
        self._tx = tx

    # -- what a held slice did --------------------------------------------------------

    def touch(self, lease_id: str, last_activity_at: datetime) -> Lease | None:
        """Record activity; the time only moves forward. ``None`` if released or unknown."""
        require_aware("last_activity_at", last_activity_at)
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            if lease.last_activity_at is not None and lease.last_activity_at >= last_activity_at:
                return lease
            return update(connection, lease, last_activity_at=last_activity_at)

    def record_gpu(
        self, lease_id: str, *, gpu_active_at: datetime | None = None,
        peak_memory_mib: int | None = None,
    ) -> Lease | None:
        """Record the slice's GPU work and memory; both only move forward (the last
        work, the peak). ``None`` if the lease is released or unknown."""
        if gpu_active_at is not None:
            require_aware("gpu_active_at", gpu_active_at)
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            changes: dict[str, Any] = {}
            if gpu_active_at is not None and (
                lease.gpu_active_at is None or gpu_active_at > lease.gpu_active_at
            ):
                changes["gpu_active_at"] = gpu_active_at
            if peak_memory_mib is not None and peak_memory_mib > (lease.peak_memory_mib or 0):
                changes["peak_memory_mib"] = peak_memory_mib
            return update(connection, lease, **changes) if changes else lease

    # -- measured use, for right-sizing (docs/ledger.md, "Usage samples") --------------

    def record_samples(self, samples: Mapping[str, UsageSample]) -> int:
        """Store one sample per lease id in one transaction; those of leases released or
        unknown meanwhile are dropped. Returns how many were stored."""
        if not samples:
            return 0
        with self._tx.write() as connection:
            held = set(connection.execute(
                select(leases.c.id).where(leases.c.id.in_(list(samples)),
                                          leases.c.state.in_(HELD_STATES))).scalars())
            rows = [{"lease_id": lease_id, "at": sample.at,
                     "memory_used_mib": sample.memory_used_mib,
                     "memory_total_mib": sample.memory_total_mib,
                     "sm_active": sample.sm_active, "processes": sample.processes}
                    for lease_id, sample in samples.items() if lease_id in held]
            if rows:
                connection.execute(insert(lease_samples), rows)
        return len(rows)

    def samples(self, lease_ids: Iterable[str]) -> dict[str, list[UsageSample]]:
        """The raw samples of each of ``lease_ids`` still kept (oldest first; a lease
        without any is left out): those older than the slice service's
        ``usage_sample_retention`` are pruned once the lease is released."""
        with self._tx.read() as connection:
            return _samples(connection, list(dict.fromkeys(lease_ids)))

    def summaries(self, lease_ids: Iterable[str]) -> dict[str, UsageSummary]:
        """Each lease's measured :class:`~mig_spawner.core.rightsize.Usage` (peak, p95,
        time active), for the leases that have samples: the summary kept for a released
        lease, else summarised from its samples (a held lease, one released since the
        slice service last looked), so it reads the same before and after pruning."""
        wanted = list(dict.fromkeys(lease_ids))
        with self._tx.read() as connection:
            found = _stored(connection, wanted)
            return _with_computed(connection, found, [x for x in wanted if x not in found])

    def summaries_between(self, since: datetime, until: datetime
                          ) -> dict[str, UsageSummary]:
        """:meth:`summaries` of every lease that held a slice at some moment of ``[since,
        until]`` (the leases ``ledger.reports.leases`` lists), read by joining the kept
        summaries to the window rather than naming each lease: a year is some 175,000."""
        # One pass over the window's leases; those without a kept summary come back
        # with NULLs (held ones, ones released since the service last looked).
        statement = select(leases.c.id, *_SUMMARY_COLUMNS).outerjoin(
            lease_usage, lease_usage.c.lease_id == leases.c.id).where(
            held_between(since, until))
        with self._tx.read() as connection:
            rows = connection.execute(statement).all()
            found = {row[0]: UsageSummary(*row[1:]) for row in rows if row[1] is not None}
            return _with_computed(connection, found, [r[0] for r in rows if r[1] is None])

    def summarize_released(self, lease_ids: Iterable[str]) -> int:
        """Keep the summary of each of ``lease_ids`` that is released, has samples and
        no summary yet (the slice service calls it for the leases it saw end). Returns
        how many were written."""
        wanted = list(dict.fromkeys(lease_ids))
        written = 0
        for start in range(0, len(wanted), _SAMPLES_PER_READ):
            with self._tx.write() as connection:
                written += _summarize(connection, wanted[start:start + _SAMPLES_PER_READ])
        return written

    def prune(self, before: datetime, *, leases_per_write: int = 200) -> tuple[int, int]:
        """Delete the samples taken before ``before`` of released leases, each lease's
        summary kept first; a held lease's samples are never deleted. Short writes of
        ``leases_per_write`` leases each, so claims are not held up. Returns (summaries
        written, samples deleted)."""
        require_aware("before", before)
        written = deleted = 0
        while True:
            with self._tx.write() as connection:
                ids = list(connection.execute(
                    select(lease_samples.c.lease_id).distinct()
                    .join(leases, leases.c.id == lease_samples.c.lease_id)
                    .where(lease_samples.c.at < before, leases.c.state.not_in(HELD_STATES))
                    .limit(leases_per_write)).scalars())
                if not ids:
                    return written, deleted
                written += _summarize(connection, ids)
                # Only under a kept summary: released is final, and a summary is kept
                # for released leases alone, so no held lease loses a sample.
                deleted += connection.execute(delete(lease_samples).where(
                    lease_samples.c.lease_id.in_(ids), lease_samples.c.at < before,
                    lease_samples.c.lease_id.in_(
                        select(lease_usage.c.lease_id).where(lease_usage.c.lease_id.in_(ids)))
                )).rowcount

    # -- budgets ------------------------------------------------------------------

    def book(self, connection: Connection, now: datetime
             ) -> tuple[tuple[Lease, ...], tuple[Extra, ...]]:
        """Released leases and extra hours within ``budget_horizon`` of ``now``, read in
        the caller's transaction (a claim's, a grant pass's)."""
        if self.budget_horizon is None:
            return (), ()
        since = now - timedelta(seconds=self.budget_horizon)
        return released_since(connection, since), tuple(_extras(connection, since))

    def grant_hours(self, group: str, user: str | None, slice_seconds: float, *,
                    by: str, note: str = "") -> Extra:
        """Give ``group``'s budget (``user`` ``None``) or one member's own budget extra
        compute-slice-seconds, valid for one budget window from now."""
        if not group or slice_seconds <= 0:
            raise ValueError("a grant needs a group and a positive number of hours")
        now = self._tx.now()
        with self._tx.write() as connection:
            connection.execute(insert(budget_grants).values(
                group_name=group, user_name=user or None, slice_seconds=float(slice_seconds),
                granted_at=now, granted_by=by[:255], note=(note or "")[:255]))
            self._tx.announce(connection)  # a waiter may be served now
        return Extra(group, user or None, float(slice_seconds), now)

    def budget(self, since: datetime) -> tuple[list[Lease], list[Extra]]:
        """Every lease that held a slice from ``since`` on, and the extra hours given
        from then on, in one read: what budgets are counted from."""
        require_aware("since", since)
        with self._tx.read() as connection:
            held = select_leases(connection, or_(leases.c.released_at.is_(None),
                                                 leases.c.released_at >= since))
            return held, _extras(connection, since)


def _samples(connection: Connection, lease_ids: list[str]) -> dict[str, list[UsageSample]]:
    found: dict[str, list[UsageSample]] = {}
    for start in range(0, len(lease_ids), _SAMPLES_PER_READ):
        rows = connection.execute(
            select(lease_samples).where(
                lease_samples.c.lease_id.in_(lease_ids[start:start + _SAMPLES_PER_READ]))
            .order_by(lease_samples.c.lease_id, lease_samples.c.at))
        for row in rows:
            found.setdefault(row.lease_id, []).append(UsageSample(
                at=row.at, memory_used_mib=row.memory_used_mib,
                memory_total_mib=row.memory_total_mib, sm_active=row.sm_active,
                processes=row.processes))
    return found


def _stored(connection: Connection, lease_ids: list[str]) -> dict[str, UsageSummary]:
    """The kept summaries of ``lease_ids``."""
    found: dict[str, UsageSummary] = {}
    for start in range(0, len(lease_ids), _SAMPLES_PER_READ):
        found.update((lease_id, UsageSummary(*figures)) for lease_id, *figures in (
            connection.execute(select(lease_usage.c.lease_id, *_SUMMARY_COLUMNS).where(
                lease_usage.c.lease_id.in_(lease_ids[start:start + _SAMPLES_PER_READ])))))
    return found


def _with_computed(connection: Connection, found: dict[str, UsageSummary],
                   rest: list[str]) -> dict[str, UsageSummary]:
    """``found`` (kept summaries) with the leases of ``rest`` (none kept) summarised from
    their samples, those without samples left out."""
    computed = {lease_id: usage for lease_id, kept in _samples(connection, rest).items()
                if (usage := summarize(kept)) is not None}
    # A prune that committed between the two reads (PostgreSQL reads each statement
    # afresh) may have taken samples: its summary then holds them all.
    found.update(computed)
    found.update(_stored(connection, list(computed)))
    return found


def _summarize(connection: Connection, lease_ids: list[str]) -> int:
    """Write the summary of each of ``lease_ids`` (at most one read's worth) that is
    released, has samples and has none yet, in the caller's write."""
    due = list(connection.execute(
        select(leases.c.id).where(
            leases.c.id.in_(lease_ids), leases.c.state.not_in(HELD_STATES),
            ~select(lease_usage.c.lease_id).where(
                lease_usage.c.lease_id == leases.c.id).exists())).scalars())
    rows = [{"lease_id": lease_id, **asdict(usage)}
            for lease_id, kept in _samples(connection, due).items()
            if (usage := summarize(kept)) is not None]
    if rows:
        connection.execute(insert(lease_usage), rows)
    return len(rows)


def _extras(connection: Connection, since: datetime | None) -> list[Extra]:
    rows = (connection.execute(_EXTRAS) if since is None
            else connection.execute(_EXTRAS_SINCE, {"since": since}))
    return [Extra(r.group_name, r.user_name, r.slice_seconds, r.granted_at) for r in rows]
