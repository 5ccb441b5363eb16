"""Honest wait estimates: a range from how long slices were held, or none at all.

The n-th waiter in a line gets a slice at the n-th release of a slice that line can use.
Each current holder releases after its *remaining* hold time, estimated from past holds
of the same profile that lasted longer than the holder's age so far (a session that
has run for 2 h is not judged by the 10-minute ones), and never later than the limit
that ends it (``max_session_age``, or an idle limit already running). A slice released
to a waiter is then held for a fresh hold time before it frees again. Doing that with
the lower and with the upper quartile of the hold times gives the range; a wider truth
is not hidden behind one number. With fewer than :data:`MIN_HISTORY` past holds the
range comes from the limits instead, marked as such: a hold lasts from the waiting
group's idle limit to its ``max_session_age`` (:class:`HoldLimits`), and each current
holder's by its own limits (its session's end, and the idle limit it is under while
others wait, from its last activity: ``Holder.idle_within``); without a session limit
either the answer is ``None``: "no estimate yet".
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mig_spawner.core.policy import GroupPolicy

#: Past holds needed before any estimate is given.
MIN_HISTORY = 5
# Quartiles of the hold times: the range covers the middle half of what happened.
_LOW, _HIGH = 0.25, 0.75


@dataclass(frozen=True)
class Holder:
    """A lease that holds a slice the line can use: ``age`` seconds since it was claimed,
    ended at the latest ``ends_within`` seconds from now (``None``: no limit known), and
    ``idle_within`` seconds from now by its own idle limit if nobody uses it from now on
    (the limit in force while others wait, from its last activity; ``None``: none)."""

    age: float
    ends_within: float | None = None
    idle_within: float | None = None


@dataclass(frozen=True)
class HoldLimits:
    """What a group's limits say of a hold while there is too little history: a server
    left unused is stopped after ``idle`` seconds (``server_idle_timeout``), none is
    held beyond ``session`` seconds (``max_session_age``); ``None``: no such limit."""

    idle: float | None = None
    session: float | None = None

    @classmethod
    def of(cls, group: GroupPolicy | None) -> HoldLimits | None:
        """The limits of ``group`` (``None`` without a group): its idle limit while
        others wait (``server_idle_timeout_when_waited``, where set), its session limit."""
        if group is None:
            return None
        idle = group.server_idle_timeout_when_waited or group.server_idle_timeout
        return cls(idle, group.max_session_age)


@dataclass(frozen=True)
class Estimate:
    """A wait of ``low`` to ``high`` seconds from now; ``from_limits``: from the group's
    limits, for want of history."""

    low: float
    high: float
    from_limits: bool = False

    def said(self, lead: str) -> str:
        """The estimate in a sentence: ``lead`` and the range from history (``"usually
        5-15 min"``), or the range marked as coming from the group's limits."""
        if self.from_limits:
            return f"{self.text} by the limits in force (too few past sessions yet)"
        return f"{lead} {self.text}"

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


def _capped(holder: Holder, left: float) -> float:
    """``left`` seconds, or sooner when a limit already ends the holder."""
    return left if holder.ends_within is None else min(left, max(holder.ends_within, 0.0))


def _remaining(holder: Holder, history: Sequence[float], q: float) -> float:
    longer = [h - holder.age for h in history if h > holder.age]
    # Older than every past hold: it may end any moment, or last as long as a median one.
    fallback = 0.0 if q <= 0.5 else statistics.median(history)
    return _capped(holder, _quantile(longer, q) if longer else fallback)


def _nth_release(
    position: int, holders: Sequence[Holder], remaining: Callable[[Holder], float],
    fresh: float,
) -> float:
    """When the ``position``-th release comes: each holder releases after ``remaining``
    of it, and a slice given to a waiter is held ``fresh`` seconds before it frees."""
    releases = [remaining(h) for h in holders]
    heapq.heapify(releases)
    at = 0.0
    for _ in range(position):
        at = heapq.heappop(releases)
        heapq.heappush(releases, at + fresh)  # that slice goes to the waiter, who holds it
    return at


def estimate_wait(
    position: int, holders: Sequence[Holder], history: Sequence[float], *, slack: float = 0.0,
    limits: HoldLimits | None = None,
) -> Estimate | None:
    """The wait of the ``position``-th in line (1 = next), from ``history`` (seconds each
    past lease of this profile was held; pass the charged group's own when it has
    :data:`MIN_HISTORY`, else the profile's), or with less history than that from the
    group's ``limits`` (``from_limits``); ``None`` without either, or without any
    ``holders`` whose release would serve the line. ``slack``: how late a limit is
    carried out (the slice service's sweep interval), added to the upper end."""
    if position < 1:
        raise ValueError(f"a position in line starts at 1, got {position}")
    if not holders:
        return None
    if len(history) >= MIN_HISTORY:
        low, high = (_nth_release(position, holders, lambda h, q=q: _remaining(h, history, q),
                                  _quantile(history, q)) for q in (_LOW, _HIGH))
        return Estimate(min(low, high), max(low, high) + slack)
    if limits is None or limits.session is None:
        return None
    # A hold lasts from the idle limit (a server left unused from its start) to the
    # session limit: the range's two ends. A holder's own limits bound both: its
    # session's end, and the idle limit it is under while others wait (a holder left
    # idle goes then, which is what servers in a queue usually do).
    shortest = min(limits.idle if limits.idle is not None else 0.0, limits.session)

    def held(holder: Holder, hold: float) -> float:
        left = max(hold - holder.age, 0.0)
        if holder.idle_within is not None:
            left = min(left, max(holder.idle_within, 0.0))
        return _capped(holder, left)

    low, high = (_nth_release(position, holders, lambda h, d=d: held(h, d), d)
                 for d in (shortest, limits.session))
    return Estimate(low, high + slack, from_limits=True)
