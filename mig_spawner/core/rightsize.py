"""Right-sizing: whether the slices someone uses are bigger or smaller than they need.

The slice service samples each lease's slice over its life (memory used, SM activity);
:func:`summarize` turns one lease's samples into its :class:`Usage` (peak, p95, time
active), and :func:`judge` decides from the last sessions on one size whether the next
smaller size would do or a larger one is needed, by a :class:`RightsizeRule` whose
thresholds are stated with every verdict. The spawn form (a hint for a returning user)
and ``mig-spawner report --rightsize`` both use it. Pure: no I/O. Admin documentation:
docs/analyst-guide.md, "Right-sizing".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from itertools import islice

from mig_spawner.core.catalog import format_gib


@dataclass(frozen=True)
class UsageSample:
    """One look at a lease's slice: memory held of the slice's memory, the share of its
    SMs that were busy (``None``: the GPU cannot tell), and its processes."""

    at: datetime
    memory_used_mib: int
    memory_total_mib: int
    sm_active: float | None = None
    processes: int = 0

    @property
    def active(self) -> bool:
        """Whether the slice worked: SMs busy, or (where SM activity cannot be
        measured) a process on it."""
        if self.sm_active is not None:
            return self.sm_active > 0.0
        return self.processes > 0


@dataclass(frozen=True)
class Usage:
    """What one lease's samples say: ``samples`` taken over ``sampled_seconds``, the most
    memory held (``peak_mib``), the 95th percentile (``p95_mib``), the slice's memory, and
    the time the slice was active (``active_seconds``: the share of active samples times
    the time sampled)."""

    samples: int
    peak_mib: int
    p95_mib: int
    memory_total_mib: int
    sampled_seconds: float
    active_seconds: float


def summarize(samples: Sequence[UsageSample]) -> Usage | None:
    """One lease's :class:`Usage` from its samples (any order); ``None`` without any."""
    if not samples:
        return None
    ordered = sorted(samples, key=lambda s: s.at)
    memory = sorted(s.memory_used_mib for s in ordered)
    # Nearest rank: the smallest value with at least 95 % of the samples at or below it.
    p95 = memory[max(0, math.ceil(0.95 * len(memory)) - 1)]
    span = (ordered[-1].at - ordered[0].at).total_seconds()
    active = sum(1 for s in ordered if s.active)
    return Usage(
        samples=len(ordered), peak_mib=memory[-1], p95_mib=p95,
        memory_total_mib=max(s.memory_total_mib for s in ordered),
        sampled_seconds=span, active_seconds=span * active / len(ordered),
    )


@dataclass(frozen=True)
class RightsizeRule:
    """The thresholds of a verdict (docs/analyst-guide.md, "Right-sizing").

    * ``min_sessions``: measured sessions on a size needed before any verdict;
    * ``min_samples``: samples a session needs to count as measured;
    * ``recent``: how many of the user's (or group's) latest measured sessions on a size
      are judged;
    * ``fits_below``: over-sized when every judged session's peak stayed below this
      share of the next smaller size's memory (the rest is room to grow);
    * ``full_above``: under-sized when a judged session's peak reached this share of its
      own slice's memory (it hit the limit).
    """

    min_sessions: int = 3
    min_samples: int = 5
    recent: int = 5
    fits_below: float = 0.75
    full_above: float = 0.95

    def __post_init__(self) -> None:
        if self.min_sessions < 1 or self.min_samples < 1 or self.recent < self.min_sessions:
            raise ValueError(
                "right-sizing needs min_sessions and min_samples of 1 or more, and recent "
                f"of at least min_sessions (got {self.min_sessions}, {self.min_samples}, "
                f"{self.recent})"
            )
        for name in ("fits_below", "full_above"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a share above 0 and at most 1, "
                                 f"got {getattr(self, name)}")

    def stated(self) -> str:
        """The thresholds in words, printed with every verdict."""
        return (
            f"over-sized: peak below {self.fits_below:.0%} of the next smaller size; "
            f"under-sized: peak at {self.full_above:.0%} or more of the slice; from the "
            f"last {self.recent} sessions with {self.min_samples}+ samples each, at least "
            f"{self.min_sessions} of them"
        )


@dataclass(frozen=True)
class Size:
    """One size someone may pick (an offer or a profile) and its memory."""

    key: str
    memory_mib: int


@dataclass(frozen=True)
class Session:
    """One lease on size ``key``, with what its samples say (``None``: none);
    ``running``: it still holds its slice, so its peak so far is not its peak."""

    key: str
    usage: Usage | None
    running: bool = False


class Verdict(StrEnum):
    """What :func:`judge` concluded."""

    SMALLER = "smaller"  # the next smaller size would do
    LARGER = "larger"  # the slice was full: a larger size is needed
    FITS = "fits"  # this size is right
    TOO_FEW = "too_few"  # not enough measured sessions to say


@dataclass(frozen=True)
class Judgement:
    """A verdict on size ``key``: ``measured`` sessions judged (of ``needed``), their
    highest peak, and the size ``suggested`` instead (for SMALLER and LARGER)."""

    key: str
    verdict: Verdict
    measured: int
    needed: int
    peak_mib: int | None = None
    memory_mib: int | None = None
    suggested: Size | None = None

    def sentence(self, whose: str = "your", named: Callable[[str], str] = str) -> str | None:
        """The verdict in one sentence (``None`` for FITS and TOO_FEW):
        ``"your last 3 sessions on medium peaked at 9.0 GiB: small (16.0 GiB) would do"``;
        ``named``: how the sentence names a size's key (the form: its display name)."""
        if self.suggested is None or self.peak_mib is None:
            return None
        head = (f"{whose} last {self.measured} sessions on {named(self.key)} peaked at "
                f"{format_gib(self.peak_mib)}")
        room = f"{named(self.suggested.key)} ({format_gib(self.suggested.memory_mib)})"
        if self.verdict is Verdict.SMALLER:
            return f"{head}: {room} would do"
        return (f"{head}, the slice's limit of {format_gib(self.memory_mib or 0)}: {room} "
                "would give room")


def judge(sessions: Iterable[Session], key: str, sizes: Sequence[Size],
          rule: RightsizeRule = RightsizeRule()) -> Judgement:
    """The verdict on size ``key`` from ``sessions`` (newest first; those on other sizes
    are ignored) among the ``sizes`` that could be picked instead.

    Only sessions that ended with at least ``rule.min_samples`` samples count (one
    still running has not reached its peak yet); of them the newest ``rule.recent`` are
    judged, and fewer than ``rule.min_sessions`` give TOO_FEW. The spawn form's hint
    and ``report --rightsize`` both pass every session and leave the choice to this.
    Under-sized (LARGER) wins over over-sized: a slice that was full once is not
    offered smaller. A verdict with no size to move to is FITS.
    """
    # Lazily: of a group's thousands of sessions only the newest few are read.
    measured = list(islice((s.usage for s in sessions if s.key == key and not s.running
                            and s.usage is not None and s.usage.samples >= rule.min_samples),
                           rule.recent))
    if len(measured) < rule.min_sessions:
        return Judgement(key, Verdict.TOO_FEW, len(measured), rule.min_sessions)
    peak = max(u.peak_mib for u in measured)
    mine = next((s for s in sizes if s.key == key), None)
    memory = mine.memory_mib if mine else max(u.memory_total_mib for u in measured)
    by_memory = sorted(sizes, key=lambda s: s.memory_mib)
    smaller = [s for s in by_memory if s.memory_mib < memory]
    larger = [s for s in by_memory if s.memory_mib > memory]
    common = {"measured": len(measured), "needed": rule.min_sessions, "peak_mib": peak,
              "memory_mib": memory}
    if any(u.peak_mib >= rule.full_above * u.memory_total_mib for u in measured) and larger:
        return Judgement(key, Verdict.LARGER, suggested=larger[0], **common)
    if smaller and peak < rule.fits_below * smaller[-1].memory_mib:
        return Judgement(key, Verdict.SMALLER, suggested=smaller[-1], **common)
    return Judgement(key, Verdict.FITS, **common)
