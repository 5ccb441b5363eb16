"""The warnings store: the warning before the slice service stops a server, and the
user's "Keep my server".

A warning lives on its lease (``warning``: the :class:`StopRule`, ``warned_at``,
``warning_deadline``, and ``warning_state``: where it stands); every warning and every
answer is also a ``lease_events`` row (:class:`WarningEvent`), kept with the lease's
history. Each stop has its own warning (``stops``: its rule, when it was warned and
its deadline), so a second rule's warning never moves the first one's time; the
``warning`` columns show the soonest. A warning is ``pending`` until it is withdrawn
(the stop is no longer due), kept (the user's Keep) or carried out (the service
stopped the server for it); the moves allowed are the table
:data:`~mig_spawner.core.lifecycle.WARNING_MOVES`, and :func:`_move` is the one place
that writes them. What a Keep does is decided by the pure rule
:func:`mig_spawner.core.keep.answer_keep`, on the lease read under its lock; this store
writes the answer in that same transaction.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, insert, select

from mig_spawner.core.keep import KeepOutcome, answer_keep
from mig_spawner.core.lifecycle import (
    PendingStop,
    StopRule,
    WarningEvent,
    WarningState,
    in_order,
    warning_move_allowed,
)

from .errors import IllegalTransition
from .models import lease_events
from .records import KeepResult, Lease, LeaseEvent, require_aware
from .rows import lock_lease, update, write_columns
from .transactions import Transactions

_DETAIL_MAX = lease_events.c.detail.type.length or 255
log = logging.getLogger(__name__)


class Warnings:
    """The ledger's warnings store (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self._tx = tx

    def warn(self, lease_id: str, rule: StopRule | str, deadline: datetime | None,
             detail: str) -> Lease | None:
        """Record that the user was warned of a stop (``rule``) due at ``deadline``
        (``None``: told, never stopped: a GPU fault where the group leaves servers to
        finish). Each stop has its own warning: another rule's pending warning keeps its
        time, and the lease's ``warning`` shows the soonest. The same rule's pending
        warning at another time only moves its deadline (no new event). ``None`` if the
        lease is released or unknown, or its server is being stopped for a warning
        carried out."""
        rule = StopRule(rule)
        if deadline is not None:
            require_aware("deadline", deadline)
        now = self._tx.now()
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held or (
                    lease.warning_state is WarningState.CARRIED_OUT):
                return None
            known = lease.pending_stop(rule)
            if known is not None and known.deadline == deadline:
                return lease
            if known is None:
                _event(connection, lease.id, now, WarningEvent.WARNED, rule, detail)
            stop = PendingStop(rule, known.warned_at if known else now, deadline)
            return _show(connection, lease, (*_without(lease, {rule}), stop))

    def withdraw(self, lease_id: str, rule: StopRule | None = None) -> Lease | None:
        """The warned stop of ``rule`` (``None``: every one) is no longer due (the user
        came back, a layout change ended): forget its warning; the others keep theirs.
        Returns the lease as it now stands (``None``: unknown)."""
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or not lease.held or lease.warning_state is not WarningState.PENDING:
                return lease
            rules = {rule} if rule is not None else {s.rule for s in lease.stops}
            if lease.stops and not rules.intersection(s.rule for s in lease.stops):
                return lease
            return _show(connection, lease, _without(lease, rules))

    def carry_out(self, lease_id: str, rule: StopRule | None = None) -> Lease | None:
        """The slice service has asked the hub to stop the lease's server (for ``rule``):
        a pending warning is carried out (the rule's, when it was warned of; it stays on
        the lease, as history). ``None`` when no warning is pending (or the lease is
        unknown)."""
        with self._tx.write() as connection:
            lease = lock_lease(connection, lease_id)
            if lease is None or lease.warning_state is not WarningState.PENDING:
                return None
            stop = lease.pending_stop(rule) if rule is not None else None
            shown = ({"warning": stop.rule, "warned_at": stop.warned_at,
                      "warning_deadline": stop.deadline} if stop is not None else {})
            return _move(connection, lease, WarningState.CARRIED_OUT, stops=(), **shown)

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
            if answer.ends_warning:
                # Activity ends the idle stops' warnings; an extension the session's too.
                left = _without(lease, _KEPT_OFF[answer.event])
                lease = _move(connection, lease, WarningState.KEPT, **answer.changes,
                              stops=left)
                if left:  # a stop Keep does not put off is still coming
                    lease = _show(connection, lease, left)
            elif answer.changes:
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


#: The stops whose warnings a Keep ends: it counts as activity, and an extension moves
#: the session's end too.
_KEPT_OFF: dict[WarningEvent | None, frozenset[StopRule]] = {
    WarningEvent.KEPT: frozenset({StopRule.SERVER_IDLE, StopRule.KERNEL_IDLE}),
    WarningEvent.EXTENDED: frozenset(
        {StopRule.SERVER_IDLE, StopRule.KERNEL_IDLE, StopRule.MAX_SESSION_AGE}),
}


def _without(lease: Lease, rules: set[StopRule] | frozenset[StopRule]
             ) -> tuple[PendingStop, ...]:
    return tuple(s for s in lease.stops if s.rule not in rules)


def _show(connection: Connection, lease: Lease, stops: tuple[PendingStop, ...]) -> Lease:
    """Write ``stops`` as ``lease``'s pending warnings, its ``warning`` showing the
    soonest; with none left, a pending warning is withdrawn."""
    stops = in_order(stops)  # as a read gives them
    if stops:
        first = stops[0]
        return _move(connection, lease, WarningState.PENDING, stops=stops, warning=first.rule,
                     warned_at=first.warned_at, warning_deadline=first.deadline)
    if lease.warning_state is WarningState.PENDING:
        return _move(connection, lease, WarningState.WITHDRAWN, stops=(), warning=None,
                     warning_deadline=None)
    return lease


def _move(connection: Connection, lease: Lease, state: WarningState, **changes: Any) -> Lease:
    """Write ``lease``'s warning (the lease locked in this transaction) with ``state`` and
    ``changes``: the one place a warning's state is written. A move the transition table
    (:data:`~mig_spawner.core.lifecycle.WARNING_MOVES`) does not allow is logged and
    refused with :class:`IllegalTransition`; nothing is written."""
    if not warning_move_allowed(lease.warning_state, state):
        error = IllegalTransition(f"the warning of lease {lease.id} of server {lease.server}",
                                  lease.warning_state or "none", state, lease)
        log.error("refused: %s", error)
        raise error
    values = {**changes, "warning_state": state}
    write_columns(connection, lease, values)
    return replace(lease, **values)


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
