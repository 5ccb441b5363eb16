"""What users asked for and got, per profile and group, from the ledger's history.

Pure: takes lease records (granted requests: a :class:`~mig_spawner.ledger.Lease`, or
the report's narrow :class:`~mig_spawner.ledger.reports.LeaseLine`) and
:class:`RefusalRecord` values (refused ones) and returns :class:`UsageRow` figures.
Both also become :class:`Request` values that :mod:`.replay` plays through the
allocator on other layouts.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from mig_spawner.core.catalog import is_whole_gpu
from mig_spawner.core.refusal import Reason
from mig_spawner.ledger import RefusalRecord
from mig_spawner.ledger.refusal_log import once_per_window
from mig_spawner.ledger.reports import LeaseFacts

#: Refusals a different MIG layout could have avoided: no free slice of that profile,
#: no room to create one, or no GPU offering it at all. The others (group quota, user
#: limit, profile not allowed, MIG off) are policy or operations matters.
CAPACITY_REASONS = frozenset({Reason.NONE_FREE, Reason.NO_CAPACITY, Reason.NO_GPU_FOR_PROFILE,
                              Reason.GPU_RECUT})
#: Hold time assumed for a refused request when no granted lease of its profile exists.
DEFAULT_HOLD = timedelta(hours=1)


def wanted(refusal: RefusalRecord) -> str:
    """The profile (or, failing that, the offer key) a refused spawn asked for."""
    return refusal.profile or refusal.offer


def layout_refusal(refusal: RefusalRecord) -> bool:
    """True when another layout could have served it (see ``CAPACITY_REASONS``)."""
    return refusal.reason in CAPACITY_REASONS


def fair(refusals: Iterable[RefusalRecord]) -> list[RefusalRecord]:
    """The refusals that count as demand: per user and profile, once per
    :data:`~mig_spawner.ledger.refusal_log.REFUSAL_WINDOW`, the rule dynamic placement
    also reads demand by (docs/allocator.md). In time order."""
    return once_per_window(refusals, key=lambda r: (r.user, wanted(r)), at=lambda r: r.at)


@dataclass(frozen=True)
class Request:
    """One request for a slice as the replay sees it: arrive, hold, leave."""

    arrive: datetime
    leave: datetime
    profile: str
    group: str
    user: str
    granted: bool  # what happened in reality


@dataclass(frozen=True)
class UsageRow:
    """Figures for one (profile, group) pair over the report window; ``group`` "*" = all.

    ``profile`` is empty for the spawns that asked for a slice class and were refused
    before a slice was chosen (which profile they would have got is not known): one
    row per class, named in ``classes``. On a profile's row ``classes`` names the
    classes its refused spawns asked for (granted leases keep no class).
    """

    profile: str
    group: str
    requests: int
    granted: int
    refused_capacity: int
    refused_policy: int
    hold_hours: float
    median_hold_minutes: float | None
    idle_share: float | None
    peak_concurrent: int

    classes: tuple[str, ...] = ()

    @property
    def refused(self) -> int:
        return self.refused_capacity + self.refused_policy


def lease_end(lease: LeaseFacts, until: datetime) -> datetime:
    """When the lease stopped holding its slice (``until`` if it still holds it)."""
    return lease.released_at or until


def peak_concurrency(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """Most intervals overlapping at one moment (an end at t frees before a start at t)."""
    # Just after the n-th start (in time order), n intervals have begun and those whose
    # end is at or before it are over: starts and ends sorted apart (the starts come in
    # claim order, already sorted), not one list of 350,000 (moment, step) pairs a year.
    pairs = list(intervals)
    ends = sorted(end for _, end in pairs)
    starts = sorted(start for start, _ in pairs)
    return max((n - bisect_right(ends, start) for n, start in enumerate(starts, 1)), default=0)


def median_holds(leases: Iterable[LeaseFacts], until: datetime) -> dict[str, timedelta]:
    """Median hold time per profile of the leases that have ended."""
    holds: dict[str, list[float]] = {}
    for lease in leases:
        if lease.released_at is not None:
            holds.setdefault(lease.profile, []).append(
                (lease.released_at - lease.claimed_at).total_seconds())
    return {p: timedelta(seconds=statistics.median(v)) for p, v in holds.items()}


def requests_of(
    leases: Sequence[LeaseFacts], refusals: Iterable[RefusalRecord], until: datetime
) -> list[Request]:
    """Granted leases and capacity refusals as requests for MIG slices, in arrival order
    (whole GPUs are no part of a MIG layout: they are left out).

    A refused request never held anything, so it is given the median hold time of
    granted leases of its profile (of all profiles when it has none; one hour when
    nothing ended yet): the time it would likely have held a slice. Refusals count
    as :func:`fair` says.
    """
    medians = median_holds(leases, until)
    overall = (
        timedelta(seconds=statistics.median(m.total_seconds() for m in medians.values()))
        if medians else DEFAULT_HOLD
    )
    found = [
        Request(lease.claimed_at, lease_end(lease, until), lease.profile, lease.group,
                lease.user, True)
        for lease in leases
    ]
    found.extend(
        Request(r.at, r.at + medians.get(wanted(r), overall), wanted(r), r.group or "", r.user,
                False)
        for r in fair(refusals) if layout_refusal(r)
    )
    return sorted((q for q in found if not is_whole_gpu(q.profile)),
                  key=lambda q: (q.arrive, q.user))


def usage(
    leases: Sequence[LeaseFacts],
    refusals: Sequence[RefusalRecord],
    since: datetime,
    until: datetime,
    *,
    by_group: bool = True,
) -> list[UsageRow]:
    """Per profile (and group, unless ``by_group`` is False) figures over ``[since, until]``.

    ``idle_share``: of the hold time, the share after the server's last recorded
    activity (the idle tail before a cull or stop); a lower bound of real idleness,
    since idle spells between two activities leave no trace in the ledger. Refusals
    count as :func:`fair` says.
    """
    if since >= until:
        raise ValueError(f"the report window is empty: since {since} is not before {until}")
    # (profile, group, class): the class only where no profile is known (see UsageRow).
    # One pass over the leases, adding each into its key's sums as it goes.
    held: dict[tuple[str, str, str], _Held] = {}
    refused: dict[tuple[str, str, str], list[RefusalRecord]] = {}
    for lease in leases:
        end = lease_end(lease, until)
        if end >= since and lease.claimed_at <= until:
            key = (lease.profile, lease.group if by_group else "*", "")
            (held.get(key) or held.setdefault(key, _Held())).add(lease, end, since, until)
    for r in fair(r for r in refusals if since <= r.at <= until):
        key = (r.profile or "", (r.group or "?") if by_group else "*",
               "" if r.profile else r.offer)
        refused.setdefault(key, []).append(r)
    rows = []
    # Profiles first; the rows of classes with no known profile after them.
    for key in sorted(held.keys() | refused.keys(), key=lambda k: (not k[0], k)):
        sums = held.get(key) or _Held()
        nos = refused.get(key, [])
        rows.append(UsageRow(
            profile=key[0],
            group=key[1],
            requests=sums.granted + len(nos),
            granted=sums.granted,
            refused_capacity=sum(1 for r in nos if layout_refusal(r)),
            refused_policy=sum(1 for r in nos if not layout_refusal(r)),
            hold_hours=sums.hold / 3600,
            median_hold_minutes=statistics.median(sums.ended) if sums.ended else None,
            idle_share=sums.idle / sums.hold if sums.hold else None,
            peak_concurrent=peak_concurrency(sums.spans),
            classes=tuple(sorted({r.offer for r in nos if r.offer != r.profile})),
        ))
    return rows


class _Held:
    """The granted leases of one usage row, summed as they are read."""

    __slots__ = ("ended", "granted", "hold", "idle", "spans")

    def __init__(self) -> None:
        self.granted = 0
        self.hold = self.idle = 0.0
        self.ended: list[float] = []  # minutes held, of the leases that ended
        self.spans: list[tuple[datetime, datetime]] = []  # held inside the window

    def add(self, lease: LeaseFacts, end: datetime, since: datetime, until: datetime) -> None:
        # The seconds of each span inside the window, worked out inline: this runs once
        # per lease, 175,000 times over a year.
        start, stop = max(lease.claimed_at, since), min(end, until)
        self.granted += 1
        self.hold += max(0.0, (stop - start).total_seconds())
        if lease.last_activity_at is not None:
            self.idle += max(0.0, (stop - max(lease.last_activity_at, since)).total_seconds())
        if lease.released_at is not None:
            self.ended.append((lease.released_at - lease.claimed_at).total_seconds() / 60)
        self.spans.append((start, stop))


def held_steps(
    leases: Sequence[LeaseFacts], since: datetime, until: datetime
) -> dict[str, tuple[list[datetime], list[int]]]:
    """Slices held per profile over ``[since, until]`` as an exact step function.

    For each profile: the moments the count changes (from ``since``) and the count from
    each moment on, ending with a point at ``until``, so a slice still held at ``until``
    (now, by default) is counted to the right edge. A release at t comes before a claim
    at t.
    """
    found: dict[str, tuple[list[datetime], list[int]]] = {}
    changes: dict[str, list[tuple[datetime, int]]] = {}
    for lease in leases:
        end = lease_end(lease, until)
        if end < since or lease.claimed_at > until:
            continue
        steps = changes.setdefault(lease.profile, [])
        steps.append((max(lease.claimed_at, since), 1))
        if lease.released_at is not None and lease.released_at <= until:
            steps.append((lease.released_at, -1))
    for profile, steps in changes.items():
        times, counts, held = [since], [0], 0
        for moment, step in sorted(steps):
            held += step
            if moment == times[-1]:
                counts[-1] = held
            else:
                times.append(moment)
                counts.append(held)
        times.append(until)
        counts.append(held)
        found[profile] = (times, counts)
    return found
