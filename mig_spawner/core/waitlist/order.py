"""The order rule: which waiter a free slice goes to.

Waiters are ordered, across every line, by

1. their group's ``priority`` (higher first),
2. their group's current *share*: slices it holds divided by its ``quota_slices``
   (a group without a quota: divided by the fleet's slice count), lower first, so the
   group furthest below its fair share is served first,
3. first come (``joined_at``, then the entry's id, which the ledger hands out in
   commit order).

A free slice goes to the first waiter in that order it *serves*: the ledger's grant step
asks a callback (policy check plus allocator) for each waiter in turn. A waiter the
callback refuses for a reason other than "does not fit now" (:data:`FIT_REASONS`), e.g.
a user already holding their per-user limit or a group at its quota, is skipped: it
blocks nobody. A waiter that does not fit is *passed over*, and in dynamic mode,
where one line's slice can be carved from another line's room, a
:class:`StarvationGuard` bounds that: once a waiter has been passed over
``max_bypasses`` times, or has waited ``max_age`` seconds, nobody behind it is served
until it fits (released slices then accumulate for it). Pool mode needs no guard: a
released slice of one profile never serves another profile's line, so nobody can
starve another line. Documented with an example in docs/policies.md ("Waiting").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from mig_spawner.core.refusal import Reason, Refused

T = TypeVar("T")

#: Refusals meaning "nothing free fits this waiter right now": the only ones that make
#: a waiter *passed over* (and so count towards the starvation guard).
FIT_REASONS = frozenset({Reason.NONE_FREE, Reason.NO_CAPACITY, Reason.GPU_RECUT,
                         Reason.GPU_UNHEALTHY})


@dataclass(frozen=True)
class Waiter:
    """One waiting spawn. ``offer`` is what the user picked (profile or class key);
    ``group`` and ``priority`` are those of the group it will be charged to;
    ``bypassed`` counts the grants that went to waiters behind it while it did not fit."""

    id: int
    user: str
    server_name: str
    group: str
    priority: int
    offer: str
    joined_at: datetime
    bypassed: int = 0


@dataclass(frozen=True)
class StarvationGuard:
    """Dynamic mode's bound on smaller requests overtaking a larger one (see module doc).

    ``max_bypasses``: how often a waiter may be passed over; ``max_age``: seconds of
    waiting after which it is not passed over any more (``None``: no age bound). The
    age bound is off by default: in ``benchmarks/day.py`` a 10-minute one made every
    line wait behind one large request and raised the p95 wait from 16 to 22 minutes.
    """

    max_bypasses: int = 3
    max_age: float | None = None

    def blocks(self, waiter: Waiter, now: datetime) -> bool:
        """True when ``waiter`` may no longer be passed over."""
        if waiter.bypassed >= self.max_bypasses:
            return True
        waited = (now - waiter.joined_at).total_seconds()
        return self.max_age is not None and waited >= self.max_age


@dataclass(frozen=True)
class Served(Generic[T]):
    """The waiter served, what the callback returned for it, and the waiters ahead of
    it that did not fit (each is now passed over once more)."""

    waiter: Waiter
    result: T
    passed_over: tuple[Waiter, ...] = ()


def group_shares(
    held: Mapping[str, int], quotas: Mapping[str, int | None], capacity: int
) -> dict[str, float]:
    """Each group's current share: slices held over its quota (no quota: over
    ``capacity``, the fleet's slice count). A quota of 0 gives an infinite share."""
    shares = {}
    for group in {*held, *quotas}:
        count = held.get(group, 0)
        quota = quotas.get(group)
        if quota is None:
            shares[group] = count / max(capacity, 1)
        else:
            shares[group] = count / quota if quota else float("inf")
    return shares


def contends(wants: Mapping[str, str], means: Callable[[str], str | None] | None,
             carved: bool) -> bool:
    """Whether a claim for ``wants`` (GPU model key -> the profile it takes there) could
    take what a waiter could be served, whose offer ``means`` a profile per model key
    (``None``: its offer is not known any more, so it may contend). With a fixed layout
    only a slice of the waiter's own profile serves it; where slices are ``carved`` from
    shared room (dynamic mode), any slice of a GPU model it can use takes its room.
    A claim nobody contends with starts at once: it jumps nobody's line."""
    if means is None:
        return True
    for model_key, profile in wants.items():
        theirs = means(model_key)
        if theirs is not None and (carved or theirs == profile):
            return True
    return False


def order(waiters: Iterable[Waiter], shares: Mapping[str, float]) -> list[Waiter]:
    """The waiters in the order the rule serves them (see module doc)."""
    return sorted(
        waiters, key=lambda w: (-w.priority, shares.get(w.group, 0.0), w.joined_at, w.id)
    )


def first_served(
    waiters: Iterable[Waiter],
    serve: Callable[[Waiter], T],
    *,
    shares: Mapping[str, float],
    now: datetime,
    guard: StarvationGuard | None = None,
) -> Served[T] | None:
    """The grant for the first waiter, in :func:`order`, that ``serve`` serves.

    ``serve(waiter)`` returns what the waiter gets or raises :class:`Refused`; it must be
    pure (it runs inside the ledger's grant transaction). ``None``: nobody can be served
    now, either because nothing fits or because a waiter the ``guard`` protects does
    not fit yet.
    """
    passed: list[Waiter] = []
    for waiter in order(waiters, shares):
        try:
            result = serve(waiter)
        except Refused as refusal:
            if refusal.reason not in FIT_REASONS:
                continue  # cannot be served for another reason: blocks nobody
            if guard is not None and guard.blocks(waiter, now):
                return None
            passed.append(waiter)
            continue
        return Served(waiter, result, tuple(passed))
    return None


def positions(
    waiters: Sequence[Waiter],
    shares: Mapping[str, float],
    skipped_users: Iterable[str] = (),
) -> dict[int, int]:
    """Each waiter's place in its line (1 = next), by entry id.

    A line is one offer. Waiters of ``skipped_users`` (at their per-user limit: they
    would be skipped) do not count as ahead of anyone.
    """
    skipped = frozenset(skipped_users)
    ahead: dict[str, int] = {}
    places = {}
    for waiter in order(waiters, shares):
        places[waiter.id] = ahead.get(waiter.offer, 0) + 1
        if waiter.user not in skipped:
            ahead[waiter.offer] = places[waiter.id]
    return places
