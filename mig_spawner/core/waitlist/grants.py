"""Every grant one pass of the wait list can make, from one view of the fleet.

:func:`next_grants` is the grant loop's whole decision: given the waiters, the leases
held now and a ``serve`` callback built from ONE snapshot of the fleet's supply and the
policies, it returns every waiter that can be served now, in the order the order rule
(:mod:`.order`) serves them. It is exactly what calling the rule once per free slice
gives (each grant counts as held, and each waiter passed over counts as passed over
once more, before the next one is chosen), so a pass needs one read of the fleet and
one ledger transaction, not one of each per waiter. Pure: the ledger runs it inside its
serialised grant transaction, where its answer is final.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Protocol, TypeVar

from .order import Served, StarvationGuard, Waiter, first_served, group_shares

G = TypeVar("G")
H = TypeVar("H", bound="Charged")


class Charged(Protocol):
    """What the order rule reads of a held lease: the group it is charged to."""

    @property
    def group(self) -> str: ...


def next_grants(
    waiters: Sequence[Waiter],
    held: Sequence[H],
    serve: Callable[[Waiter, Sequence[H]], G],
    take: Callable[[Waiter, G], H],
    *,
    quotas: Mapping[str, int | None],
    capacity: int,
    now: datetime,
    guard: StarvationGuard | None = None,
    limit: int | None = None,
) -> list[Served[G]]:
    """The grants one pass makes, first served first.

    ``serve(waiter, held)``: what ``waiter`` gets with ``held`` leased, or raises
    ``Refused`` (built from one snapshot of the fleet and the policies; pure).
    ``take(waiter, grant)``: the held lease the grant becomes. ``quotas``,
    ``capacity`` and ``guard``: as :func:`~.order.group_shares` and
    :func:`~.order.first_served` take them. ``limit``: at most this many grants.
    Each :class:`Served` lists the waiters passed over for it, with the bypass count
    they had then.
    """
    line = list(waiters)
    holding = list(held)
    grants: list[Served[G]] = []
    while line and (limit is None or len(grants) < limit):
        view = tuple(holding)
        shares = group_shares(Counter(h.group for h in view), quotas, capacity)
        served = first_served(line, lambda w, view=view: serve(w, view), shares=shares, now=now,
                              guard=guard)
        if served is None:
            break
        grants.append(served)
        holding.append(take(served.waiter, served.result))
        passed = {w.id for w in served.passed_over}
        line = [replace(w, bypassed=w.bypassed + 1) if w.id in passed else w
                for w in line if w.id != served.waiter.id]
    return grants
