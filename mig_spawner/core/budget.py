"""GPU-hour budgets: what a group (and each of its members) has used over a rolling
window, whether a new server is covered, when it will be, and when a running one runs
out.

Budgets are counted in *compute-slice-seconds*: a lease holding a profile of ``c``
compute slices (the catalog's count for its profile; a whole H200 is 7) for ``d``
seconds uses ``c * d``, from its claim to its release (time held, not time busy). A
budget is spent over a rolling ``window``: at time ``t`` the usage is what leases held
within ``[t - window, t]``. An admin's extra hours (:class:`Extra`) add to a budget for
one window from when they were given.

A spawn is covered when the budget pays for ``budget_min_hold`` of its size, and every
server that runs is charged at least that minimum hold from its claim
(:func:`covered`): a server granted a moment ago has used next to nothing, but it was
granted its minimum hold, so spawns granted one after another in the same instant (the
claim's and the grant pass's serialised transactions call this rule with the leases
they read, those just granted included) never promise together more than the budget
has. Usage (:func:`standings`, :func:`exhausted_at`: what the slice service stops by)
is the time actually held.

Every time is computed on whole microseconds, so the answers are exact: with no
running servers, :func:`retry_at` is the first whole second at which :func:`covered`
holds, and one second earlier it does not. Pure: no I/O, no JupyterHub import.
Admin documentation: docs/policies.md, "Budgets".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from mig_spawner.core.durations import format_duration, period_words
from mig_spawner.core.refusal import Reason, Refused

_US = 1_000_000  # microseconds in a second
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Span:
    """The time one lease held its slice. ``end`` ``None``: it still holds it."""

    group: str
    user: str
    compute_slices: int
    start: datetime
    end: datetime | None = None


@dataclass(frozen=True)
class Extra:
    """Extra compute-slice-seconds an admin granted to a group's budget (``user``
    ``None``) or to one member's own budget, valid for one window from ``at``."""

    group: str
    user: str | None
    slice_seconds: float
    at: datetime


@dataclass(frozen=True)
class Limit:
    """One budget that applies to a spawn: the group's, or one member's own."""

    group: str
    #: ``None``: the group's budget (every member's leases count); else this member's.
    user: str | None
    #: Compute-slice-seconds per window.
    amount: float
    window: float
    #: The group's ``budget_min_hold``: what a spawn needs, per compute slice, and what
    #: a running lease is charged at least.
    min_hold: float = 0.0

    def counts(self, span: Span) -> bool:
        """Whether ``span`` is charged to this budget."""
        return span.group == self.group and (self.user is None or span.user == self.user)

    def adds(self, extra: Extra) -> bool:
        """Whether ``extra`` raises this budget."""
        return extra.group == self.group and extra.user == self.user

    @property
    def what(self) -> str:
        """``your own GPU budget`` or ``the GPU budget of group 'x'``, for messages."""
        return ("your own GPU budget" if self.user is not None
                else f"the GPU budget of group {self.group!r}")


class BudgetPolicy(Protocol):
    """What :mod:`mig_spawner.core.policy`'s ``GroupPolicy`` says of budgets."""

    name: str
    budget: float | None
    user_budget: float | None
    budget_window: float
    budget_min_hold: float


class HeldTime(Protocol):
    """What budgets read of a lease (a ledger ``Lease``)."""

    id: str
    group: str
    user: str
    compute_slices: int
    claimed_at: datetime
    released_at: datetime | None


def spans_of(held: Iterable[HeldTime], past: Iterable[HeldTime] = ()) -> list[Span]:
    """The time each lease held its slice: ``held`` leases run on, ``past`` (released)
    ones end at their release; a lease in both counts as held."""
    held = list(held)
    ids = {lease.id for lease in held}
    spans = [Span(lease.group, lease.user, lease.compute_slices, lease.claimed_at, None)
             for lease in held]
    spans += [Span(lease.group, lease.user, lease.compute_slices, lease.claimed_at,
                   lease.released_at or lease.claimed_at)
              for lease in past if lease.id not in ids and lease.released_at is not None]
    return spans


def limits(group: BudgetPolicy, user: str) -> tuple[Limit, ...]:
    """The budgets a lease of ``user`` charged to ``group`` spends: the group's, then
    the member's own (each only where set)."""
    found = []
    if group.budget is not None:
        found.append(Limit(group.name, None, group.budget, group.budget_window,
                           group.budget_min_hold))
    if group.user_budget is not None:
        found.append(Limit(group.name, user, group.user_budget, group.budget_window,
                           group.budget_min_hold))
    return tuple(found)


def _us(when: datetime) -> int:
    return (when - _EPOCH) // timedelta(microseconds=1)


def _time(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _ceil_second(us: int) -> int:
    return -(-us // _US) * _US


@dataclass(frozen=True)
class _Book:
    """One budget's spans and extras in microseconds, ready to evaluate."""

    amount: int  # compute-slice-microseconds
    window: int
    hold: int  # the minimum hold a running span is charged at least
    spans: tuple[tuple[int, int, int | None], ...]  # (compute slices, start, end or None)
    extras: tuple[tuple[int, int], ...]  # (amount, at)

    @classmethod
    def of(cls, limit: Limit, spans: Iterable[Span], extras: Iterable[Extra]) -> _Book:
        return cls(
            amount=round(limit.amount * _US),
            window=round(limit.window * _US),
            hold=round(limit.min_hold * _US),
            spans=tuple((s.compute_slices, _us(s.start), None if s.end is None else _us(s.end))
                        for s in spans if limit.counts(s)),
            extras=tuple((round(e.slice_seconds * _US), _us(e.at))
                         for e in extras if limit.adds(e)),
        )

    def _end(self, start: int, end: int | None, now: int) -> int:
        """Where a span is charged to from ``now`` on: a released one to its release, a
        running one to the later of ``now`` and the end of its minimum hold."""
        return end if end is not None else max(now, start + self.hold)

    def used(self, t: int) -> int:
        """Compute-slice-microseconds used within ``[t - window, t]``, running spans
        running on to ``t``."""
        since = t - self.window
        return sum(compute * max(0, min(t, t if end is None else end) - max(start, since))
                   for compute, start, end in self.spans)

    def charged(self, t: int, now: int) -> int:
        """What a spawn at ``t >= now`` finds spent: the usage within ``[t - window,
        t]``, with every span that runs at ``now`` charged from its claim to the later
        of ``now`` and the end of its minimum hold (as if it stopped then: the end of
        that hold may be after ``t``)."""
        since = t - self.window
        total = 0
        for compute, start, end in self.spans:
            until = min(t, end) if end is not None else self._end(start, end, now)
            total += compute * max(0, until - max(start, since))
        return total

    def granted(self, t: int) -> int:
        return sum(amount for amount, at in self.extras if at <= t < at + self.window)

    def remaining(self, t: int) -> int:
        """What is left at ``t`` of what leases used, the running ones running on."""
        return self.amount + self.granted(t) - self.used(t)

    def free(self, t: int, now: int) -> int:
        """What a spawn at ``t >= now`` can have (:meth:`charged`)."""
        return self.amount + self.granted(t) - self.charged(t, now)

    def breaks(self, now: int, charged: bool) -> set[int]:
        """Times after ``now`` where :meth:`free` (``charged``) or :meth:`remaining` may
        change its slope or level."""
        points = {a + self.window for _, a in self.extras}
        for _, start, end in self.spans:
            points.add(start + self.window)
            if end is not None or charged:
                until = self._end(start, end, now)
                points.update((until, until + self.window))
        return {p for p in points if p > now}


def _first(now: int, breaks: Iterable[int], linear: Sequence[Callable[[int], int]],
           need: Sequence[int], every: bool) -> int | None:
    """The first whole second ``t >= now`` at which ``linear[i](t) >= need[i]`` for every
    ``i`` (``every``) or for some ``i``; each function is linear between two
    consecutive ``breaks``. ``None``: never."""
    points = sorted({now, *breaks})
    for a, b in zip(points, [*points[1:], None], strict=True):
        times = []
        for f, target in zip(linear, need, strict=True):
            t = _ceil_second(a)
            if b is not None and t >= b:
                times.append(None)
                continue
            level = f(a)
            slope = f(a + 1) - level
            if f(t) < target:
                t = _ceil_second(a + -(-(target - level) // slope)) if slope > 0 else None
                if t is not None and b is not None and t >= b:
                    t = None
            times.append(t)
        if every and all(t is not None for t in times):
            return max(times)  # type: ignore[type-var]
        if not every and any(t is not None for t in times):
            return min(t for t in times if t is not None)
    return None


@dataclass(frozen=True)
class Standing:
    """Where one budget stands at ``now``: its size with extras, what is used, and what
    the minimum holds of its running servers set aside beyond that."""

    limit: Limit
    amount: float
    extra: float
    used: float
    #: Compute-slice-seconds of the running servers' minimum holds not used yet: a
    #: spawn cannot have them (:func:`covered`).
    reserved: float = 0.0

    @property
    def remaining(self) -> float:
        return self.amount + self.extra - self.used

    @property
    def free(self) -> float:
        """What a spawn now can have: what remains less what is set aside."""
        return self.remaining - self.reserved

    @property
    def share_used(self) -> float:
        total = self.amount + self.extra
        return 1.0 if total <= 0 else self.used / total


def standings(group: BudgetPolicy, user: str, spans: Iterable[Span], extras: Iterable[Extra],
              now: datetime) -> tuple[Standing, ...]:
    """Each budget ``user``'s leases charged to ``group`` spend, as it stands at ``now``."""
    spans, extras = tuple(spans), tuple(extras)
    t = _us(now)
    out = []
    for limit in limits(group, user):
        book = _Book.of(limit, spans, extras)
        used = book.used(t)
        out.append(Standing(limit, limit.amount, book.granted(t) / _US, used / _US,
                            (book.charged(t, t) - used) / _US))
    return tuple(out)


def covered(group: BudgetPolicy, user: str, compute_slices: int, spans: Iterable[Span],
            extras: Iterable[Extra], now: datetime) -> bool:
    """Whether every budget of ``group`` (and ``user``'s own in it) pays for
    ``budget_min_hold`` of a lease of ``compute_slices`` at ``now``, every running lease
    (``spans`` without an end, those granted a moment ago included) charged at least its
    own minimum hold from its claim.

    The claim's and the wait list's grant transactions call it with the leases they
    read, one spawn after another, so N spawns at once are granted only as many
    minimum holds as the budget has."""
    spans, extras = tuple(spans), tuple(extras)
    need = round(compute_slices * group.budget_min_hold * _US)
    t = _us(now)
    return all(_Book.of(limit, spans, extras).free(t, t) >= need
               for limit in limits(group, user))


def retry_at(group: BudgetPolicy, user: str, compute_slices: int, spans: Iterable[Span],
             extras: Iterable[Extra], now: datetime) -> datetime | None:
    """The first whole second from ``now`` on at which a spawn of ``compute_slices`` is
    covered, assuming the servers that run now stop as soon as they may: now, or once
    they have run their minimum hold (so, with servers running, the earliest time: it is
    later if they run on). ``None``: never (the budget, with no usage at all, cannot pay
    for the minimum hold)."""
    spans, extras = tuple(spans), tuple(extras)
    t = _us(now)
    need = round(compute_slices * group.budget_min_hold * _US)
    books = [_Book.of(limit, spans, extras) for limit in limits(group, user)]
    if not books:
        return _time(_ceil_second(t))
    breaks = set().union(*(b.breaks(t, charged=True) for b in books))
    found = _first(t, breaks, [lambda x, b=b: b.free(x, t) for b in books],
                   [need] * len(books), every=True)
    return None if found is None else _time(found)


def exhausted_at(group: BudgetPolicy, user: str, spans: Iterable[Span],
                 extras: Iterable[Extra], now: datetime) -> datetime | None:
    """When the first budget of ``user`` in ``group`` is spent (nothing left) if the
    servers that run now keep running and nobody starts another; ``None``: never
    (nothing runs, or what runs fits the window). At or before ``now``: spent already.
    Counts the time actually held (a minimum hold is what a spawn needs, not a charge
    that stops a server early). For many members at once, :class:`Exhaustion`."""
    return Exhaustion(spans, extras, now).at(group, user)


class Exhaustion:
    """:func:`exhausted_at` for many members of many groups at one ``now``: the spans and
    extra hours are sorted by group and member once, a group's own budget is worked out
    once for all its members, and a member's own budget from that member's spans alone
    (so a slice map or a sweep of N servers costs N small answers, not N passes over
    every span)."""

    def __init__(self, spans: Iterable[Span], extras: Iterable[Extra],
                 now: datetime) -> None:
        #: The time the answers are worked out from.
        self.now = now
        self._t = _us(now)
        self._spans: dict[tuple[str, str | None], list[Span]] = {}
        for s in spans:
            self._spans.setdefault((s.group, None), []).append(s)
            self._spans.setdefault((s.group, s.user), []).append(s)
        self._extras: dict[tuple[str, str | None], list[Extra]] = {}
        for e in extras:
            self._extras.setdefault((e.group, e.user), []).append(e)
        self._found: dict[tuple[str, str | None], int | None] = {}

    def at(self, group: BudgetPolicy, user: str) -> datetime | None:
        """When the first budget of ``user`` in ``group`` is spent (:func:`exhausted_at`)."""
        found = [t for t in (self._first_spent(limit) for limit in limits(group, user))
                 if t is not None]
        return _time(min(found)) if found else None

    def _first_spent(self, limit: Limit) -> int | None:
        # Each budget's remainder is linear between its own breaks, so the first of
        # several budgets to run out is the earliest of each one's first.
        key = (limit.group, limit.user)
        if key not in self._found:
            book = _Book.of(limit, self._spans.get(key, ()), self._extras.get(key, ()))
            self._found[key] = _first(self._t, book.breaks(self._t, charged=False),
                                      [lambda x: -book.remaining(x)], [0], every=False)
        return self._found[key]


def leaving(group: BudgetPolicy, when: datetime) -> datetime:
    """The time whose hours leave the window at ``when``."""
    return when - timedelta(seconds=group.budget_window)


def refusal(group: BudgetPolicy, user: str, compute_slices: int, spans: Iterable[Span],
            extras: Iterable[Extra], now: datetime) -> Refused | None:
    """``None`` when the budgets cover a spawn of ``compute_slices`` at ``now``; else the
    refusal with the time it can succeed (:attr:`Refused.retry_at`)."""
    spans, extras = tuple(spans), tuple(extras)
    if covered(group, user, compute_slices, spans, extras, now):
        return None
    when = retry_at(group, user, compute_slices, spans, extras, now)
    need = compute_slices * group.budget_min_hold
    low = min(standings(group, user, spans, extras, now), key=lambda s: s.free)
    hold = format_duration(group.budget_min_hold)
    if low.reserved > 0:
        left, total, aside, needed = slice_amounts(max(0.0, low.free), low.amount + low.extra,
                                                   low.reserved, need)
        total += (f" per {format_duration(group.budget_window)} (after {aside} set aside for "
                  f"the servers started less than {hold} ago)")
    else:
        left, total, needed = slice_amounts(max(0.0, low.free), low.amount + low.extra, need)
        total += f" per {format_duration(group.budget_window)}"
    message = (f"{low.limit.what} has {left} left of {total}; this size needs {needed} "
               f"({hold} of {compute_slices} compute slice{'s' if compute_slices != 1 else ''})")
    if when is None:
        hint = "pick a smaller size, or ask an admin for more hours"
    else:
        running = [s for s in spans if s.end is None and low.limit.counts(s)]
        hint = (f"Retry at {when_text(when)}, when the hours used "
                f"{when_text(leaving(group, when), day_only=True)} leave the window")
        if running:
            hint += " (the earliest time: it assumes your group's running servers stop now"
            if low.reserved > 0:
                hint += f", those started less than {hold} ago once they have run {hold}"
            hint += ")"
    return Refused(Reason.BUDGET_SPENT, message, hint, retry_at=when)


def form_line(group: BudgetPolicy, user: str, compute_slices: int, spans: Iterable[Span],
              extras: Iterable[Extra], now: datetime) -> str | None:
    """What the spawn form says beside a size of ``compute_slices``: the budget a spawn
    can have (the lower of the group's and the member's own), in compute-slice-hours
    and in hours of this size; ``None`` when ``group`` has no budget."""
    found = standings(group, user, spans, extras, now)
    if not found:
        return None
    low = min(found, key=lambda s: s.free)
    left = max(0.0, low.free)
    minutes = left / compute_slices // 60
    last = format_duration(60 * minutes) if minutes else "under a minute"
    whose = "your own budget" if low.limit.user is not None else "your group's budget"
    left_text, total = slice_amounts(left, low.amount + low.extra, unit_last=True)
    (whole,) = slice_amounts(left / 7, noun="whole-GPU ")
    return (f"{left_text} of {total} left in {whose} in the last "
            f"{period_words(group.budget_window)} ({whole}): this size uses "
            f"{compute_slices} an hour, so about {last}")


def when_text(when: datetime, day_only: bool = False) -> str:
    """``Thursday 14:20 UTC`` (rounded up to the minute, so that a retry then
    succeeds); ``day_only``: ``on Monday``."""
    if day_only:
        return f"on {when:%A}"
    minute = when.replace(second=0, microsecond=0)
    if minute < when:
        minute += timedelta(minutes=1)
    return f"{minute:%A %H:%M} UTC"


#: The units budget amounts are said in: (seconds, word, the table's mark).
_UNITS = ((3600, "hour", ""), (60, "minute", "m"), (1, "second", "s"))


def _unit(slice_seconds: float) -> tuple[int, str, str]:
    """Hours, unless they would round to 0 (a budget of minutes); then minutes, unless
    under one; then seconds."""
    if round(slice_seconds / 3600, 1) > 0:
        return _UNITS[0]
    return _UNITS[1] if slice_seconds >= 60 else _UNITS[2]


def slice_amounts(*slice_seconds: float, unit_last: bool = False, noun: str = "compute-slice-",
                  short: bool = False) -> list[str]:
    """Budget amounts as every budget message says them, in the order it says them:
    each in compute-slice-hours, or in minutes or seconds where hours would round to 0.

    The unit is named once per run of amounts in the same unit, at its first amount
    (``"1 compute-slice-hour"``, ``"400"``, ``"3.5"``) or, ``unit_last``, at its last
    (``"12"``, ``"40 compute-slice-hours"``); a 0 takes the unit of the amount after it
    (else before it); a negative one (a budget overspent), the unit of its size.
    ``noun``: e.g. ``"whole-GPU "`` for whole-GPU hours. ``short``: for a table whose
    heading says compute-slice-hours: hours as ``14.0``, minutes and seconds marked
    (``2m``, ``34s``)."""
    found: list[tuple[int, str, str] | None] = [_unit(abs(x)) if x else None
                                                for x in slice_seconds]
    units = [unit or next((u for u in [*found[i + 1:], *found[:i][::-1]] if u), _UNITS[0])
             for i, unit in enumerate(found)]
    out = []
    for i, (amount, unit) in enumerate(zip(slice_seconds, units, strict=True)):
        size, word, mark = unit
        if short:
            out.append(f"{amount / size:.1f}" if not mark
                       else f"{amount / size:.1f}".removesuffix(".0") + mark)
            continue
        number = f"{amount / size:.1f}".removesuffix(".0")
        beside = i + 1 if unit_last else i - 1
        if 0 <= beside < len(units) and units[beside] == unit:
            out.append(number)
        else:
            out.append(f"{number} {noun}{word}{'' if number == '1' else 's'}")
    return out
