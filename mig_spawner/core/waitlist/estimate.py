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
from collections.abc import Sequence
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
        if self.high < 60:
            return "under 1 min"
        low_min = math.floor(self.low / 60)
        high_min = max(math.ceil(self.high / 60), low_min + 1)
        if high_min <= 120:
            return f"{low_min}-{high_min} min"
        low_h = math.floor(self.low / 3600)
        return f"{low_h}-{max(math.ceil(self.high / 3600), low_h + 1)} h"


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
    position: int, holders: Sequence[Holder], history: Sequence[float]
) -> Estimate | None:
    """The wait of the ``position``-th in line (1 = next), or ``None`` without enough
    ``history`` (seconds each past lease of this profile was held; pass the charged
    group's own when it has :data:`MIN_HISTORY`, else the profile's) or without any
    ``holders`` whose release would serve the line."""
    if position < 1:
        raise ValueError(f"a position in line starts at 1, got {position}")
    if len(history) < MIN_HISTORY or not holders:
        return None
    low = _nth_release(position, holders, history, _LOW)
    high = _nth_release(position, holders, history, _HIGH)
    return Estimate(min(low, high), max(low, high))
