"""Refused spawns, and the request mix that leases and refusals show together.

:class:`RefusalLog` is the ledger's refusals store (``ledger.refusals``), on the
ledger's shared transactions and clock. A refusal changes no lease: it is written
outside any claim transaction and never read by claims.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import fields
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import ColumnElement, and_, func, insert, select

from .models import leases, refusals
from .records import LeaseRequest, RefusalRecord, require_aware
from .transactions import Transactions

T = TypeVar("T")

#: A user's refusals for one profile count once per this window as demand (for dynamic
#: placement and ``mig-spawner report``): retries and scripted bursts are one unmet
#: need, while the same need on another day counts again (docs/allocator.md).
REFUSAL_WINDOW = timedelta(hours=1)

_MESSAGE_MAX = refusals.c.message.type.length or 1000
_GROUP_MAX = refusals.c.group_name.type.length or 255
# RefusalRecord field -> column, where the SQL name differs.
_REFUSAL_COLUMN_FOR = {"user": "user_name", "group": "group_name"}


def once_per_window(
    events: Iterable[T], key: Callable[[T], Hashable], at: Callable[[T], datetime],
    window: timedelta = REFUSAL_WINDOW,
) -> list[T]:
    """The ``events`` that count: per ``key``, the first, then each one at least
    ``window`` after the last that counted. In time order."""
    last: dict[Hashable, datetime] = {}
    kept = []
    for event in sorted(events, key=at):
        k, moment = key(event), at(event)
        if k not in last or moment - last[k] >= window:
            last[k] = moment
            kept.append(event)
    return kept


class RefusalLog:
    """The ledger's record of refused spawns (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self._tx = tx

    def record(
        self,
        request: LeaseRequest,
        *,
        offer: str,
        reason: str,
        message: str = "",
        profile: str | None = None,
        group: str | None = None,
        host: str | None = None,
    ) -> RefusalRecord:
        """Keep a refused spawn for usage reports; it changes no lease.

        ``reason`` is the refusal's stable code (``none_free``, ``group_quota``, ...),
        ``offer`` what the user picked, ``profile`` the concrete profile when known and
        ``group`` the group the lease would have been charged to.
        """
        if not offer or not reason:
            raise ValueError("a refusal needs the offer asked for and the refusal code")
        record = RefusalRecord(
            at=self._tx.now(), user=request.user, server_name=request.server_name, offer=offer,
            reason=reason, profile=profile, group=group[:_GROUP_MAX] if group else None,
            host=host,
            message=(message or "")[:_MESSAGE_MAX],
        )
        values = {
            _REFUSAL_COLUMN_FOR.get(f.name, f.name): getattr(record, f.name)
            for f in fields(RefusalRecord)
        }
        with self._tx.write() as connection:
            connection.execute(insert(refusals).values(values))
        return record

    def between(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> list[RefusalRecord]:
        """Refused spawns in ``[since, until]`` (both optional), oldest first."""
        where: list[ColumnElement[bool]] = []
        for name, moment in (("since", since), ("until", until)):
            require_aware(name, moment)
        if since is not None:
            where.append(refusals.c.at >= since)
        if until is not None:
            where.append(refusals.c.at <= until)
        with self._tx.read() as connection:
            rows = connection.execute(
                select(refusals).where(and_(True, *where)).order_by(refusals.c.at, refusals.c.id)
            )
            return [
                RefusalRecord(**{
                    f.name: row._mapping[_REFUSAL_COLUMN_FOR.get(f.name, f.name)]
                    for f in fields(RefusalRecord)
                })
                for row in rows
            ]

    def request_counts(self, since: datetime) -> dict[str, int]:
        """How often each profile was asked for since ``since``: leases claimed plus
        refusals that name a concrete profile, in one read. For the allocator's
        ``demand`` (docs/allocator.md).

        Refusals count once per user per profile per :data:`REFUSAL_WINDOW`
        (:func:`once_per_window`): one user retrying, or scripting 300 forbidden
        requests, must not move where everyone's slices go."""
        require_aware("since", since)
        granted = (
            select(leases.c.profile, func.count())
            .where(leases.c.claimed_at >= since)
            .group_by(leases.c.profile)
        )
        refused = (
            select(refusals.c.user_name, refusals.c.profile, refusals.c.at)
            .where(refusals.c.at >= since, refusals.c.profile.is_not(None))
        )
        counts: Counter[str] = Counter()
        with self._tx.read() as connection:
            for profile, n in connection.execute(granted):
                counts[profile] += n
            rows = connection.execute(refused).all()
        for _user, profile, _at in once_per_window(
            rows, key=lambda row: (row[0], row[1]), at=lambda row: row[2]
        ):
            counts[profile] += 1
        return dict(counts)
