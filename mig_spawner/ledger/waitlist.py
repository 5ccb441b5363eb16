"""The wait-list store: spawns that wait for a slice, and the grant step.

``ledger.waits``. Joins, cancels and grants all take the claim lock (SQLite's
``BEGIN IMMEDIATE``, PostgreSQL's ``ledger_lock`` row), so they run one at a time with
claims and releases: the grant step reads every waiter and every held lease, picks by
the order rule (:func:`mig_spawner.core.waitlist.next_grants`) and claims every slice
it can give in ONE transaction. A slice therefore never goes to two waiters, and a
waiter is never granted after it was cancelled. Who may join is the pure rule
:func:`mig_spawner.core.waitlist.check_join`, run in the join's transaction. How the
spawner uses it: docs/ledger.md, "Wait list".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, insert, select, update

from mig_spawner.core.lifecycle import WaitState, wait_move_allowed
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import StarvationGuard, Waiter, check_join, next_grants

from .errors import IllegalTransition
from .models import waits
from .records import Grant, Lease, LeaseRequest, LedgerView, check_grant
from .rows import SERVER_LEASE, insert_lease, new_lease
from .transactions import Transactions
from .view import ClaimView

WAIT_STATES: tuple[WaitState, ...] = tuple(WaitState)
#: How a wait may end without a grant.
WAIT_ENDS = (WaitState.CANCELLED, WaitState.EXPIRED, WaitState.ABANDONED)
log = logging.getLogger(__name__)
#: The grant step's callback: policy check plus allocator for one waiter, pure and quick.
#: Raise ``Refused`` when it cannot be served (see ``FIT_REASONS`` for which refusals
#: count as "does not fit now").
GrantDecide = Callable[["WaitEntry", LedgerView], Grant]

_COLUMN_FOR = {"user": "user_name", "group": "group_name"}
_REASON_MAX = waits.c.reason.type.length or 255
#: The line in join order, built once: every claim looks at it first.
_LINE = select(waits).where(waits.c.state == WaitState.WAITING.value).order_by(waits.c.id)


@dataclass(frozen=True)
class WaitRequest:
    """A spawn that asks to wait: which server, for what, charged to which group (and
    that group's priority), for at most ``max_wait`` seconds (``None``: no limit)."""

    user: str
    server_name: str
    group: str
    priority: int
    offer: str
    max_wait: float | None


@dataclass(frozen=True)
class WaitEntry(Waiter):
    """One row of the wait list: the waiter as the order rule knows it, and the row's
    own state. ``lease_id`` is set once ``granted``; ``reason`` says why a wait ended
    otherwise."""

    state: WaitState = WaitState.WAITING
    deadline: datetime | None = None
    closed_at: datetime | None = None
    lease_id: str | None = None
    reason: str | None = None

    @property
    def waiting(self) -> bool:
        return self.state == WaitState.WAITING

    @property
    def waiter(self) -> Waiter:
        """The entry as the order rule sees it."""
        return Waiter(**{f.name: getattr(self, f.name) for f in fields(Waiter)})

    @property
    def request(self) -> LeaseRequest:
        return LeaseRequest(self.user, self.server_name)


_FIELDS = tuple(f.name for f in fields(WaitEntry))


@dataclass(frozen=True)
class GrantRound:
    """What one grant transaction did and saw: the entries it ``granted``, the
    ``line`` still waiting and the ``held`` leases after it, the ``watched`` entries
    as they stand, and the fleet's slice count it used for shares (``capacity``);
    ``refused``: why ``decide`` last refused each watched entry still waiting (a spent
    budget, with the time it can be served), where the pass asked it."""

    granted: list[WaitEntry]
    line: list[WaitEntry]
    held: tuple[Lease, ...]
    watched: dict[int, WaitEntry]
    capacity: int
    refused: dict[int, Refused] = field(default_factory=dict)


def _to_entry(row: Row[Any]) -> WaitEntry:
    values = {name: row._mapping[_COLUMN_FOR.get(name, name)] for name in _FIELDS}
    return WaitEntry(**{**values, "state": WaitState(values["state"])})


class Waits:
    """The ledger's wait-list store (see the module docstring)."""

    def __init__(self, tx: Transactions, view: ClaimView) -> None:
        self._tx = tx
        self._view = view

    def join(self, request: WaitRequest, *, max_waiting: int = 1) -> WaitEntry:
        """Put a server on the wait list; run a grant pass (:meth:`grant`) after it.

        Joining again while the server waits returns its entry unchanged (a restarted
        hub resumes that way). Raises ``Refused`` (``user_limit``) when the user already
        waits for ``max_waiting`` other servers, or (``previous_lease``) when the
        server holds a slice (:func:`~mig_spawner.core.waitlist.check_join`).
        """
        with self._tx.claims() as connection:
            now = self._tx.now()
            holds_slice = connection.execute(SERVER_LEASE, {
                "user": request.user, "server_name": request.server_name}).first() is not None
            found = check_join(request.user, request.server_name, _waiting(connection),
                               max_waiting=max_waiting, holds_slice=holds_slice)
            if found is not None:
                return found
            deadline = None if request.max_wait is None else now + timedelta(
                seconds=request.max_wait)
            values = {
                "user_name": request.user, "server_name": request.server_name,
                "group_name": request.group, "priority": request.priority,
                "offer": request.offer, "state": WaitState.WAITING, "joined_at": now,
                "deadline": deadline, "bypassed": 0,
            }
            new_id = connection.execute(insert(waits).values(values)).inserted_primary_key[0]
            self._tx.announce(connection)
            return _entries(connection, id=new_id)[0]

    def cancel(
        self, entry_id: int, reason: str, state: WaitState = WaitState.CANCELLED,
    ) -> WaitEntry | None:
        """End a wait that has not been granted; returns the entry as it now stands
        (``None``: unknown id). If a grant came first, the entry comes back ``granted``:
        the caller then owns that lease and must start or release it."""
        if state not in WAIT_ENDS:
            raise ValueError(f"a wait ends cancelled, expired or abandoned, not {state!r}")
        state = WaitState(state)
        with self._tx.claims() as connection:
            found = _entries(connection, id=entry_id)
            if not found or not found[0].waiting:
                return found[0] if found else None
            _close(connection, found[0], state, self._tx.now(), reason=reason)
            self._tx.announce(connection)
            return _entries(connection, id=entry_id)[0]

    def entry(self, entry_id: int) -> WaitEntry | None:
        """One entry by id, waiting or not."""
        with self._tx.read() as connection:
            found = _entries(connection, id=entry_id)
        return found[0] if found else None

    def joined(self, since: datetime, until: datetime | None = None) -> list[WaitEntry]:
        """Every entry that joined in ``[since, until]``, ended or not, in join order
        (for ``mig-spawner report``)."""
        query = select(waits).where(waits.c.joined_at >= since).order_by(waits.c.id)
        if until is not None:
            query = query.where(waits.c.joined_at <= until)
        with self._tx.read() as connection:
            return [_to_entry(row) for row in connection.execute(query)]

    def waiting(self) -> list[WaitEntry]:
        """Every entry still waiting, in join order (order them with
        :func:`mig_spawner.core.waitlist.order` and the groups' shares)."""
        with self._tx.read() as connection:
            return _waiting(connection)

    def grant(
        self,
        decide: GrantDecide,
        *,
        quotas: Mapping[str, int | None],
        capacity: int | Callable[[tuple[Lease, ...]], int],
        guard: StarvationGuard | None = None,
        limit: int | None = None,
        watch: Collection[int] = (),
    ) -> GrantRound:
        """Give free slices to every waiter they serve now, in ONE serialised transaction.

        Waits past their deadline end ``expired`` first. Then the held leases are read,
        the groups' shares computed (``quotas``: group -> ``quota_slices``;
        ``capacity``: slices of the fleet, for groups without a quota, or a function of
        the held leases giving it), and :func:`~mig_spawner.core.waitlist.next_grants`
        asks ``decide(entry, view)`` for the waiters in the order rule's order, each
        grant counted as held before the next is chosen. Each grant is claimed as a
        lease and its entry becomes ``granted`` with the lease id. Call it after every
        release and join. ``guard``: dynamic mode's bound on passing over a larger
        request; ``limit``: at most this many grants. Returns what was granted and the
        line and held leases as this transaction left them; ``watch``: entry ids whose
        state to return too (a pass's own waiters).
        """
        with self._tx.claims() as connection:
            entries = _waiting(connection)
            held = tuple(self._view.held(connection))
            # Read after the held leases (as a claim does): a release they show ended
            # before this time, so the history never shows one slot held twice.
            now = self._tx.now()
            waiting = []
            for entry in entries:
                if entry.deadline is not None and entry.deadline <= now:
                    _close(connection, entry, WaitState.EXPIRED, now, reason="waited max_wait")
                else:
                    waiting.append(entry)
            by_id = {entry.id: entry for entry in waiting}
            books = self._view.books(connection, now)
            refused: dict[int, Refused] = {}
            made: dict[int, Lease] = {}

            def serve(waiter: Waiter, view: Sequence[Lease]) -> Grant:
                entry = by_id[waiter.id]
                if any((lease.user, lease.server_name) == (entry.user, entry.server_name)
                       for lease in view):
                    raise Refused(Reason.PREVIOUS_LEASE, "this server holds a slice")
                try:
                    decision = decide(entry, LedgerView(
                        request=entry.request, leases=tuple(view), now=now, **books))
                except Refused as refusal:
                    refused[waiter.id] = refusal  # the latest word wins
                    raise
                return check_grant(decision)

            def take(waiter: Waiter, grant: Grant) -> Lease:
                # The lease the order rule counts as held is the one written.
                made[waiter.id] = new_lease(by_id[waiter.id].request, grant, now)
                return made[waiter.id]

            fleet = capacity(held) if callable(capacity) else capacity
            served = next_grants([e.waiter for e in waiting], held, serve, take,
                                 quotas=quotas, capacity=fleet, now=now, guard=guard,
                                 limit=limit)
            granted_ids = []
            for grant in served:
                entry = by_id[grant.waiter.id]
                lease = made[entry.id]
                insert_lease(connection, lease)
                _close(connection, entry, WaitState.GRANTED, now, lease_id=lease.id)
                granted_ids.append(entry.id)
                for passed in grant.passed_over:
                    connection.execute(
                        update(waits).where(waits.c.id == passed.id)
                        .values(bypassed=waits.c.bypassed + 1)
                    )
            if served:
                self._tx.announce(connection)
            ids = {*granted_ids, *watch}
            known = {e.id: e for e in _entries(connection, ids=ids)} if ids else {}
            return GrantRound(
                granted=[known[i] for i in granted_ids],
                line=_waiting(connection),
                held=tuple(self._view.held(connection)),
                watched={i: known[i] for i in watch if i in known},
                capacity=fleet,
                refused={i: refused[i] for i in watch
                         if i in refused and i in known and known[i].waiting},
            )


def _close(
    connection: Connection, entry: WaitEntry, state: WaitState, now: datetime,
    *, reason: str | None = None, lease_id: str | None = None,
) -> None:
    """End ``entry`` (read under the claim lock in this transaction) with ``state``:
    the one place a wait-list entry's state is written. A move the transition table
    (:data:`~mig_spawner.core.lifecycle.WAIT_MOVES`) does not allow is logged and
    refused with :class:`IllegalTransition`; nothing is written."""
    if not wait_move_allowed(entry.state, state):
        error = IllegalTransition(f"wait-list entry {entry.id} of {entry.user}/"
                                  f"{entry.server_name}", entry.state, state)
        log.error("refused: %s", error)
        raise error
    connection.execute(
        update(waits)
        .where(waits.c.id == entry.id, waits.c.state == WaitState.WAITING)
        .values(state=state, closed_at=now, lease_id=lease_id,
                reason=None if reason is None else reason.strip()[:_REASON_MAX])
    )


def _waiting(connection: Connection) -> list[WaitEntry]:
    """Every entry still waiting, in join order."""
    return [_to_entry(row) for row in connection.execute(_LINE)]


def _entries(connection: Connection, **where: Any) -> list[WaitEntry]:
    """The entries ``where`` selects (a column's value, or ``ids``), ended or not."""
    query = select(waits).order_by(waits.c.id)
    for name, value in where.items():
        if name == "ids":
            query = query.where(waits.c.id.in_(value))
        else:
            query = query.where(waits.c[name] == value)
    return [_to_entry(row) for row in connection.execute(query)]
