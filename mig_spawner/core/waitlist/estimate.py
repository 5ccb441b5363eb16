"""Honest wait estimates: a range from how long slices were held, or none at all.

The n-th waiter in a line gets a slice at the n-th release of a slice that line can use.
Each current holder releases after its *remaining* hold time, estimated from past holds
of the same profile that lasted longer than the holder's age so far (a session that
has run for 2 h is not judged by the 10-minute ones), and never later than the limit
that ends it (``max_session_age``, or an idle limit already running). A slice released
to a waiter is then held for a fresh hold time before it frees again. Doing that with
the lower and with the upper quartile of the hold times gives the range; a wider truth
is not hidden behind one number. With fewer than :data:`MIN_HISTORY` past holds the
answer is ``None``: "no estimate yet".
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Past holds needed before any estimate is given.
MIN_HISTORY = 5
# Quartiles of the hold times: the range covers the middle half of what happened.
_LOW, _HIGH = 0.25, 0.75


@dataclass(frozen=True)
class Holder:
    """A lease that holds a slice the line can use: ``age`` seconds since it was claimed,
    ended at the latest ``ends_within`` seconds from now (``None``: no limit known)."""

    age: float
    ends_within: float | None = None


@dataclass(frozen=True)
class Estimate:
    """A wait of ``low`` to ``high`` seconds from now."""

    low: float
    high: float

    @property
    def text(self) -> str:
        """``"5-15 min"``, ``"under 1 min"``, ``"2-4 h"``: what a user reads."""
        low, high = self.bounds
        if high <= 60:
            return "under 1 min"
        if high <= 120 * 60:
            return f"{low // 60:.0f}-{high // 60:.0f} min"
        return f"{low // 3600:.0f}-{high // 3600:.0f} h"

    @property
    def bounds(self) -> tuple[float, float]:
        """The range :attr:`text` shows, in seconds (rounded out to whole minutes, or
        whole hours above two hours): what an estimate is judged against."""
        unit = 60 if self.high <= 120 * 60 else 3600
        low = math.floor(self.low / unit) * unit
        return low, max(math.ceil(self.high / unit) * unit, low + unit)


def history_for(holds: Iterable[tuple[str, str, float]], profile: str, group: str) -> list[float]:
    """The past holds to judge a wait of ``group`` for ``profile`` by: ``holds`` are
    ``(profile, group, seconds held)`` of ended leases; the group's own when it has
    :data:`MIN_HISTORY` of them (groups use slices differently), else the profile's."""
    of_profile = [(g, seconds) for p, g, seconds in holds if p == profile]
    own = [seconds for g, seconds in of_profile if g == group]
    return own if len(own) >= MIN_HISTORY else [seconds for _, seconds in of_profile]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1]


def _remaining(holder: Holder, history: Sequence[float], q: float) -> float:
    longer = [h - holder.age for h in history if h > holder.age]
    # Older than every past hold: it may end any moment, or last as long as a median one.
    fallback = 0.0 if q <= 0.5 else statistics.median(history)
    left = _quantile(longer, q) if longer else fallback
    return left if holder.ends_within is None else min(left, max(holder.ends_within, 0.0))


def _nth_release(
    position: int, holders: Sequence[Holder], history: Sequence[float], q: float
) -> float:
    releases = [_remaining(h, history, q) for h in holders]
    heapq.heapify(releases)
    fresh = _quantile(history, q)
    at = 0.0
    for _ in range(position):
        at = heapq.heappop(releases)
        heapq.heappush(releases, at + fresh)  # that slice goes to the waiter, who holds it
    return at


def estimate_wait(
    position: int, holders: Sequence[Holder], history: Sequence[float], *, slack: float = 0.0
) -> Estimate | None:
    """The wait of the ``position``-th in line (1 = next), or ``None`` without enough
    ``history`` (seconds each past lease of this profile was held; pass the charged
    group's own when it has :data:`MIN_HISTORY`, else the profile's) or without any
    ``holders`` whose release would serve the line. ``slack``: how late a limit is
    carried out (the slice service's sweep interval), added to the upper end."""
    if position < 1:
        raise ValueError(f"a position in line starts at 1, got {position}")
    if len(history) < MIN_HISTORY or not holders:
        return None
    low = _nth_release(position, holders, history, _LOW)
    high = _nth_release(position, holders, history, _HIGH)
    return Estimate(min(low, high), max(low, high) + slack)
