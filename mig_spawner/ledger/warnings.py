"""The warnings store: the warning before the slice service stops a server, and the
user's "Keep my server".

A warning lives on its lease (``warning``: the :class:`StopRule`, ``warned_at``,
``warning_deadline``); every warning and every answer is also a ``lease_events`` row
(:class:`WarningEvent`), kept with the lease's history. What a Keep does is decided by
the pure rule :func:`mig_spawner.core.keep.answer_keep`, on the lease read under its
lock; this store writes the answer in that same transaction.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, insert, select

from mig_spawner.core.keep import KeepOutcome, answer_keep
from mig_spawner.core.lifecycle import StopRule, WarningEvent

from .models import lease_events
from .records import KeepResult, Lease, LeaseEvent, require_aware
from .rows import lock_lease, update
from .transactions import Transactions

_DETAIL_MAX = lease_events.c.detail.type.length or 255


class Warnings:
    """The ledger's warnings store (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self._tx = tx

    def warn(self, lease_id: str, rule: StopRule | str, deadline: datetime, detail: str
             ) -> Lease | None:
        """Record that the user was warned of a stop (``rule``) due at ``deadline``; the
        same pending warning at another time only moves its deadline (no new event).
        ``None`` if the lease is released or unknown."""
        rule = StopRule(rule)
        require_aware("deadline", deadline)
        now = self._tx.now()
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return None
            if lease.warning == rule:
                return update(connection, lease, warning_deadline=deadline)
            _event(connection, lease.id, now, WarningEvent.WARNED, rule, detail)
            return update(connection, lease, warning=rule, warned_at=now,
                          warning_deadline=deadline)

    def withdraw(self, lease_id: str) -> Lease | None:
        """The warned stop is no longer due (the user came back): forget the warning."""
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held or lease.warning is None:
                return lease
            return update(connection, lease, warning=None, warning_deadline=None)

    def keep(self, lease_id: str, *, extend_by: float | None, max_extensions: int
             ) -> KeepResult:
        """The user pressed "Keep my server" (:func:`mig_spawner.core.keep.answer_keep`
        says what that does). At most one event row per change of state."""
        now = self._tx.now()
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held:
                return KeepResult(KeepOutcome.GONE, "This server is not running any more.")
            answer = answer_keep(lease, now, extend_by=extend_by, max_extensions=max_extensions,
                                 refused_before=_last_event(connection, lease) is
                                 WarningEvent.REFUSED)
            if answer.changes:
                lease = update(connection, lease, **answer.changes)
            if answer.event is not None:
                _event(connection, lease.id, now, answer.event, answer.rule, answer.detail)
            return KeepResult(answer.outcome, answer.message, lease)

    def events(self, lease_id: str) -> list[LeaseEvent]:
        """The warnings and answers of one lease, oldest first."""
        with self._tx.read() as connection:
            rows = connection.execute(
                select(lease_events).where(lease_events.c.lease_id == lease_id)
                .order_by(lease_events.c.id))
            return [LeaseEvent(r.lease_id, r.at, WarningEvent(r.kind), StopRule(r.rule),
                               r.detail) for r in rows]


def _last_event(connection: Connection, lease: Lease) -> WarningEvent | None:
    """The kind of the lease's latest event (``None``: none yet)."""
    last = connection.execute(
        select(lease_events.c.kind).where(lease_events.c.lease_id == lease.id)
        .order_by(lease_events.c.id.desc()).limit(1)).scalar()
    return None if last is None else WarningEvent(last)


def _event(connection: Connection, lease_id: str, at: datetime, kind: WarningEvent,
           rule: StopRule, detail: str) -> None:
    connection.execute(insert(lease_events).values(
        lease_id=lease_id, at=at, kind=kind, rule=rule, detail=detail[:_DETAIL_MAX]))
