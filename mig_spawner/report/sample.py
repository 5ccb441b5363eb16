"""How much history the advice stands on, and how much its figures depend on it.

:class:`Sample` states the requests and days a replay covers. :func:`refusal_ranges`
gives each replayed layout a range of refusals by resampling the sample's days with
replacement (a seeded day bootstrap): a layout that only wins on the days that happened
to occur shows a range of gains that reaches zero.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from mig_spawner.report.demand import Request

DAY = timedelta(days=1)
#: Resamples of the days; enough for stable 5th/95th percentiles, cheap next to a replay.
RESAMPLES = 1000
#: Percentiles of the resampled refusals shown as the range.
LOW, HIGH = 0.05, 0.95


def plural(count: int, noun: str) -> str:
    """``1 day``, ``3 days``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclass(frozen=True)
class Sample:
    """The requests a replay plays: how many, and over how many days."""

    requests: int
    first: datetime | None
    last: datetime | None

    @classmethod
    def of(cls, requests: Sequence[Request]) -> Sample:
        arrivals = [q.arrive for q in requests]
        return cls(len(arrivals), min(arrivals, default=None), max(arrivals, default=None))

    @property
    def days(self) -> int:
        """Days (24 h from the first arrival) the sample spans, counting quiet ones."""
        if self.first is None or self.last is None:
            return 0
        return (self.last - self.first) // DAY + 1

    def describe(self) -> str:
        """``57 requests over 12 days (2026-11-20 09:00 .. 2026-12-01 17:30 UTC)``."""
        if self.first is None or self.last is None:
            return "no requests"
        return (f"{plural(self.requests, 'request')} over {plural(self.days, 'day')} "
                f"({self.first:%Y-%m-%d %H:%M} .. {self.last:%Y-%m-%d %H:%M} UTC)")


@dataclass(frozen=True)
class Range:
    """The 5th to 95th percentile of a figure over the resampled days."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


@dataclass(frozen=True)
class Ranges:
    """Refusals on the current and the proposed layout, and refusals avoided."""

    before: Range
    after: Range
    gain: Range


def refusal_ranges(requests: Sequence[Request], before: Iterable[int], after: Iterable[int],
                   *, seed: int = 0, resamples: int = RESAMPLES) -> Ranges:
    """Ranges of refusals when the sample's days are drawn again with replacement.

    ``before``/``after``: indexes of the requests each layout refused. Both layouts are
    scored on the same drawn days, so the range of the gain is paired. Seeded: the same
    history always gives the same ranges.
    """
    sample = Sample.of(requests)
    if sample.first is None:
        return Ranges(Range(0, 0), Range(0, 0), Range(0, 0))
    first = sample.first

    def per_day(indexes: Iterable[int]) -> list[int]:
        counts = [0] * sample.days
        for n in indexes:
            counts[(requests[n].arrive - first) // DAY] += 1
        return counts

    vectors = [per_day(before), per_day(after)]
    vectors.append([b - a for b, a in zip(*vectors, strict=True)])
    rng = random.Random(seed)
    days = range(sample.days)
    totals: list[list[int]] = [[], [], []]
    for _ in range(resamples):
        drawn = rng.choices(days, k=sample.days)
        for counts, found in zip(vectors, totals, strict=True):
            found.append(sum(counts[d] for d in drawn))
    return Ranges(*(_percentiles(found) for found in totals))


def _percentiles(values: list[int]) -> Range:
    ordered = sorted(values)
    last = len(ordered) - 1
    return Range(ordered[round(LOW * last)], ordered[round(HIGH * last)])
