"""What ``mig-spawner report`` reads of the leases: a narrow read of a window.

``ledger.reports``. A year of a 100-slice fleet is some 175,000 leases; turning each
into a full :class:`~mig_spawner.ledger.Lease` (30 fields, enums, pending stops) was
most of a report's time. The report only asks who held which profile when, and what
for: :class:`LeaseLine` carries those columns and nothing else (docs/ledger.md,
"Reading a year of history").
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import NamedTuple

from sqlalchemy import ColumnElement, select, type_coerce

from .models import leases
from .records import Lease, LeaseState, require_aware
from .transactions import Transactions


class LeaseLine(NamedTuple):
    """The part of a :class:`~mig_spawner.ledger.Lease` a usage report reads; the
    fields mean what the Lease's of the same name mean. A named tuple: a year's
    175,000 are built some three times faster than frozen dataclasses."""

    id: str
    user: str
    group: str
    profile: str
    claimed_at: datetime
    released_at: datetime | None
    last_activity_at: datetime | None
    purpose: str | None
    held: bool


#: A lease as the report's pure functions read it: in full, or only its report columns.
LeaseFacts = Lease | LeaseLine

# Times read as the naive UTC they are stored as and made aware once per row here,
# not through a Python processor per column and row (as rows._COLUMNS does).
_TIME_COLUMNS = ("claimed_at", "released_at", "last_activity_at")
_SELECT = select(
    leases.c.id, leases.c.user_name, leases.c.group_name, leases.c.profile,
    *(type_coerce(leases.c[name], leases.c[name].type.impl) for name in _TIME_COLUMNS),
    leases.c.purpose, leases.c.state,
).order_by(leases.c.claimed_at, leases.c.id)
_RELEASED = LeaseState.RELEASED.value


def held_between(since: datetime, until: datetime) -> ColumnElement[bool]:
    """The leases that held a slice at some moment of ``[since, until]``: claimed at or
    before ``until``; still held, or released at or after ``since``."""
    require_aware("since", since)
    require_aware("until", until)
    return ((leases.c.released_at.is_(None)) | (leases.c.released_at >= since)) & (
        leases.c.claimed_at <= until)


class Reports:
    """The ledger's report reads (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self._tx = tx

    def leases(self, since: datetime, until: datetime) -> list[LeaseLine]:
        """The leases that held a slice at some moment of ``[since, until]`` (claimed at
        or before ``until``; still held, or released at or after ``since``), oldest
        claim first: the leases of ``ledger.leases.history(since)`` claimed by
        ``until``, in their report columns."""
        statement = _SELECT.where(held_between(since, until))
        with self._tx.read() as connection:
            return [
                LeaseLine(id_, user, group, profile, claimed.replace(tzinfo=UTC),
                          released and released.replace(tzinfo=UTC),
                          active and active.replace(tzinfo=UTC), purpose, state != _RELEASED)
                for id_, user, group, profile, claimed, released, active, purpose, state
                in connection.execute(statement).all()
            ]
