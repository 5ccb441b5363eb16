"""The durable wait list: spawns that wait for a slice, and the grant step.

:class:`WaitList` is a base of :class:`~mig_spawner.ledger.store.Ledger` (it uses the
ledger's transactions and its claim's lease insertion). Joins, cancels and grants all
take the claim lock (``lock_claims``; SQLite's ``BEGIN IMMEDIATE``), so they run one at
a time with claims and releases: the grant step reads every waiter and every held
lease, picks by the order rule (:func:`mig_spawner.core.waitlist.next_grants`) and
claims every slice it can give in ONE transaction. A slice therefore never goes to two
waiters, and a waiter is never granted after it was cancelled. How the spawner uses it:
docs/ledger.md, "Wait list".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, insert, select, update

from mig_spawner.core.lifecycle import WaitState, wait_move_allowed
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import StarvationGuard, Waiter, next_grants

from .changes import announce
from .engine import lock_claims
from .errors import IllegalTransition, InvalidDecision
from .holds import read_holds
from .models import leases, waits
from .records import HELD_STATES, Grant, Lease, LeaseRequest, LedgerView
from .usage import Usage

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


class WaitList:
    """The ledger's wait list (see the module docstring)."""

    # Provided by Ledger.
    _read: Callable[[], AbstractContextManager[Connection]]
    _write: Callable[[], AbstractContextManager[Connection]]
    _now: Callable[[], datetime]
    _new_lease: Callable[[LeaseRequest, Grant, datetime], Lease]
    _insert: Callable[[Connection, Lease], None]
    _select: Callable[..., list[Lease]]
    _held: Callable[[Connection], list[Lease]]
    usage: Usage
    _origin: str

    def join_wait(self, request: WaitRequest, *, max_waiting: int = 1) -> WaitEntry:
        """Put a server on the wait list; call :meth:`grant_next` after it.

        Joining again while the server waits returns its entry unchanged (a restarted
        hub resumes that way). Raises ``Refused`` (``user_limit``) when the user already
        waits for ``max_waiting`` other servers, or (``previous_lease``) when the
        server holds a slice.
        """
        with self._write() as connection:
            lock_claims(connection)
            now = self._now()
            mine = [e for e in self._waiting(connection)
                    if e.user == request.user]
            for entry in mine:
                if entry.server_name == request.server_name:
                    return entry
            if len(mine) >= max_waiting:
                raise Refused(
                    Reason.USER_LIMIT,
                    f"you already wait for {len(mine)} of {max_waiting} servers",
                    "cancel a waiting server to wait for this one",
                )
            if self._select(connection, leases.c.state.in_(HELD_STATES),
                            leases.c.user_name == request.user,
                            leases.c.server_name == request.server_name):
                raise Refused(Reason.PREVIOUS_LEASE, "this server still holds a slice",
                              "stop it first")
            deadline = None if request.max_wait is None else now + timedelta(
                seconds=request.max_wait)
            values = {
                "user_name": request.user, "server_name": request.server_name,
                "group_name": request.group, "priority": request.priority,
                "offer": request.offer, "state": "waiting", "joined_at": now,
                "deadline": deadline, "bypassed": 0,
            }
            new_id = connection.execute(insert(waits).values(values)).inserted_primary_key[0]
            announce(connection, self._origin)
            return self._entries(connection, id=new_id)[0]

    def cancel_wait(
        self, entry_id: int, reason: str, state: WaitState = WaitState.CANCELLED,
    ) -> WaitEntry | None:
        """End a wait that has not been granted; returns the entry as it now stands
        (``None``: unknown id). If a grant came first, the entry comes back ``granted``:
        the caller then owns that lease and must start or release it."""
        if state not in WAIT_ENDS:
            raise ValueError(f"a wait ends cancelled, expired or abandoned, not {state!r}")
        state = WaitState(state)
        with self._write() as connection:
            lock_claims(connection)
            found = self._entries(connection, id=entry_id)
            if not found or not found[0].waiting:
                return found[0] if found else None
            self._close(connection, found[0], state, self._now(), reason=reason)
            announce(connection, self._origin)
            return self._entries(connection, id=entry_id)[0]

    def wait_entry(self, entry_id: int) -> WaitEntry | None:
        """One entry by id, waiting or not."""
        with self._read() as connection:
            found = self._entries(connection, id=entry_id)
        return found[0] if found else None

    def waits(self, since: datetime, until: datetime | None = None) -> list[WaitEntry]:
        """Every entry that joined in ``[since, until]``, ended or not, in join order
        (for ``mig-spawner report``)."""
        query = select(waits).where(waits.c.joined_at >= since).order_by(waits.c.id)
        if until is not None:
            query = query.where(waits.c.joined_at <= until)
        with self._read() as connection:
            return [_to_entry(row) for row in connection.execute(query)]

    def waiting(self) -> list[WaitEntry]:
        """Every entry still waiting, in join order (order them with
        :func:`mig_spawner.core.waitlist.order` and the groups' shares)."""
        with self._read() as connection:
            return self._waiting(connection)

    def grant_next(
        self,
        decide: GrantDecide,
        *,
        quotas: Mapping[str, int | None],
        capacity: int,
        guard: StarvationGuard | None = None,
    ) -> WaitEntry | None:
        """Give a free slice to the first waiter it serves (:meth:`grant_waiting` with
        one grant at most); the granted entry, or ``None``: nobody could be served."""
        done = self.grant_waiting(decide, quotas=quotas, capacity=capacity, guard=guard,
                                  limit=1)
        return done.granted[0] if done.granted else None

    def grant_waiting(
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
        with self._write() as connection:
            lock_claims(connection)
            entries = self._waiting(connection)
            held = tuple(self._held(connection))
            # Read after the held leases (as claim does): a release they show ended
            # before this time, so the history never shows one slot held twice.
            now = self._now()
            waiting = []
            for entry in entries:
                if entry.deadline is not None and entry.deadline <= now:
                    self._close(connection, entry, WaitState.EXPIRED, now,
                                reason="waited max_wait")
                else:
                    waiting.append(entry)
            by_id = {entry.id: entry for entry in waiting}
            past, extras = self.usage.book(connection, now)
            holds = read_holds(connection)
            refused: dict[int, Refused] = {}

            def serve(waiter: Waiter, view: Sequence[Lease]) -> Grant:
                entry = by_id[waiter.id]
                if any((lease.user, lease.server_name) == (entry.user, entry.server_name)
                       for lease in view):
                    raise Refused(Reason.PREVIOUS_LEASE, "this server holds a slice")
                try:
                    decision = decide(entry, LedgerView(
                        request=entry.request, leases=tuple(view), now=now, past=past,
                        extras=extras, holds=holds))
                except Refused as refusal:
                    refused[waiter.id] = refusal  # the latest word wins
                    raise
                if not isinstance(decision, Grant):
                    raise InvalidDecision(
                        f"decide() must return a Grant, it returned {type(decision).__name__}"
                    )
                return decision

            def take(waiter: Waiter, grant: Grant) -> Lease:
                return self._new_lease(by_id[waiter.id].request, grant, now)

            fleet = capacity(held) if callable(capacity) else capacity
            served = next_grants([e.waiter for e in waiting], held, serve, take,
                                 quotas=quotas, capacity=fleet, now=now, guard=guard,
                                 limit=limit)
            granted_ids = []
            for grant in served:
                entry = by_id[grant.waiter.id]
                lease = self._new_lease(entry.request, grant.result, now)
                self._insert(connection, lease)
                self._close(connection, entry, WaitState.GRANTED, now, lease_id=lease.id)
                granted_ids.append(entry.id)
                for passed in grant.passed_over:
                    connection.execute(
                        update(waits).where(waits.c.id == passed.id)
                        .values(bypassed=waits.c.bypassed + 1)
                    )
            if served:
                announce(connection, self._origin)
            ids = {*granted_ids, *watch}
            known = {e.id: e for e in self._entries(connection, ids=ids)} if ids else {}
            return GrantRound(
                granted=[known[i] for i in granted_ids],
                line=self._waiting(connection),
                held=tuple(self._held(connection)),
                watched={i: known[i] for i in watch if i in known},
                capacity=fleet,
                refused={i: refused[i] for i in watch
                         if i in refused and i in known and known[i].waiting},
            )

    @staticmethod
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
            .where(waits.c.id == entry.id, waits.c.state == "waiting")
            .values(state=state, closed_at=now, lease_id=lease_id,
                    reason=None if reason is None else reason.strip()[:_REASON_MAX])
        )

    @staticmethod
    def _waiting(connection: Connection) -> list[WaitEntry]:
        """Every entry still waiting, in join order."""
        return [_to_entry(row) for row in connection.execute(_LINE)]

    @staticmethod
    def _entries(connection: Connection, **where: Any) -> list[WaitEntry]:
        query = select(waits).order_by(waits.c.id)
        for name, value in where.items():
            if name == "ids":
                query = query.where(waits.c.id.in_(value))
            else:
                query = query.where(waits.c[name] == value)
        return [_to_entry(row) for row in connection.execute(query)]
