"""The ``leases`` table as the stores read and write it, always inside a caller's
transaction: rows to frozen :class:`Lease` values and back, the held leases, the row
lock, and the one guarded place a lease's state is written (:func:`move`).

Several stores touch a lease row (the leases store claims and releases it, the wait
list's grant pass claims too, the usage store records activity on it, the warnings
store the pending warning); each goes through these functions, so a lease is read and
written one way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import fields, replace
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    bindparam,
    delete,
    insert,
    literal_column,
    select,
    type_coerce,
    update,
)
from sqlalchemy.exc import IntegrityError

from mig_spawner.core.lifecycle import (
    PendingStop,
    StopRule,
    WarningState,
    in_order,
    lease_move_allowed,
)

from .errors import Conflict, DoubleGrant, IllegalTransition, LeaseStateError
from .models import UtcDateTime, lease_servers, lease_slots, leases
from .records import HELD_STATES, Grant, GrantedSlice, Lease, LeaseRequest, LeaseState, ReleaseCode

log = logging.getLogger(__name__)

# Lease field -> column, where the SQL name differs (``user``/``group`` are SQL keywords).
_COLUMN_FOR = {
    "user": "user_name",
    "group": "group_name",
    "start": "placement_start",
    "size": "placement_size",
}
_FIELDS = tuple(f.name for f in fields(Lease))
_DETAIL_MAX = leases.c.release_detail.type.length or 255
#: Columns only a guarded writer may set: :func:`move` (``state``) and the warnings
#: store's (``warning_state``, and the pending stops the warning shows).
GUARDED = frozenset({"state", "warning_state", "stops"})

#: A lease's columns in the order of its fields: a row of :data:`_SELECT_LEASES` zips
#: with :data:`_FIELDS` into a Lease without a lookup per column. Times are read as the
#: naive UTC they are stored as and made aware in :func:`to_lease`, once per lease
#: rather than through a Python processor per column and row (a tenth of a claim).
_COLUMNS = tuple(
    type_coerce(column, column.type.impl).label(column.name)
    if isinstance(column.type, UtcDateTime) else column
    for column in (leases.c[_COLUMN_FOR.get(name, name)] for name in _FIELDS))
_TIMES = tuple(name for name in _FIELDS
               if isinstance(leases.c[_COLUMN_FOR.get(name, name)].type, UtcDateTime))

# The statements of the hot paths (claim, activation, release, the stale-lease check),
# built once with bound parameters. A statement built anew for each call costs SQLAlchemy
# its construction and a walk for its cache key every time: most of a claim's CPU.
_SELECT_LEASES = select(*_COLUMNS)
_BY_CLAIM = (leases.c.claimed_at, leases.c.id)
#: The held states written into the SQL: they never change, and an IN list of bound
#: values would be rendered again at every execution.
HELD = leases.c.state.in_([literal_column(f"'{state.value}'") for state in HELD_STATES])
_HELD_LEASES = _SELECT_LEASES.where(HELD).order_by(*_BY_CLAIM)
SERVER_LEASE = _SELECT_LEASES.where(
    HELD, leases.c.user_name == bindparam("user"),
    leases.c.server_name == bindparam("server_name")).order_by(*_BY_CLAIM)
_LOCK_LEASE = _SELECT_LEASES.where(leases.c.id == bindparam("lease_id")).with_for_update()
_RELEASED_SINCE = _SELECT_LEASES.where(
    leases.c.state == LeaseState.RELEASED.value,
    leases.c.released_at >= bindparam("since")).order_by(*_BY_CLAIM)
_INSERT_LEASE = insert(leases)
_INSERT_SERVER = insert(lease_servers)
_INSERT_SLOTS = insert(lease_slots)
#: Sets the columns given with the parameters (named as in the table) of lease
#: ``lease_key`` (not ``id``: a parameter named as a column is a value to set).
_UPDATE_LEASE = update(leases).where(leases.c.id == bindparam("lease_key"))
_DELETE_SLOTS = delete(lease_slots).where(lease_slots.c.lease_id == bindparam("lease_id"))
_DELETE_SERVER = delete(lease_servers).where(lease_servers.c.lease_id == bindparam("lease_id"))


def to_lease(row: Row[Any]) -> Lease:
    """A row of the lease statements here (its columns in field order) as a Lease."""
    values = dict(zip(_FIELDS, row, strict=True))
    for name in _TIMES:
        if values[name] is not None:
            values[name] = values[name].replace(tzinfo=UTC)
    values["state"] = LeaseState(values["state"])
    if values["release_code"] is not None:
        values["release_code"] = ReleaseCode(values["release_code"])
    if values["warning"] is not None:
        values["warning"] = StopRule(values["warning"])
    if values["warning_state"] is not None:
        values["warning_state"] = WarningState(values["warning_state"])
    values["stops"] = stops_of(values["stops"])
    return Lease(**values)


def stops_of(stored: str | None) -> tuple[PendingStop, ...]:
    """The pending stops as ``leases.stops`` stores them (JSON ``{rule: [warned_at,
    deadline]}``, naive UTC ISO times), soonest first."""
    if not stored:
        return ()
    return in_order(PendingStop(StopRule(rule), _utc(at), _utc(deadline) if deadline else None)
                    for rule, (at, deadline) in json.loads(stored).items())


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def _stored_stops(stops: Iterable[PendingStop]) -> str | None:
    """``stops`` as ``leases.stops`` stores them (``None``: none pending)."""
    stored = {s.rule.value: [_naive(s.warned_at), s.deadline and _naive(s.deadline)]
              for s in stops}
    return json.dumps(stored, sort_keys=True) if stored else None


def _naive(when: datetime) -> str:
    return when.astimezone(UTC).replace(tzinfo=None).isoformat()


def _to_columns(**values: Any) -> dict[str, Any]:
    if "stops" in values:
        values["stops"] = _stored_stops(values["stops"])
    return {_COLUMN_FOR.get(name, name): value for name, value in values.items()}


def release_code(code: ReleaseCode | str) -> ReleaseCode:
    """``code`` as a :class:`ReleaseCode`; a ``ValueError`` naming the codes if it is none."""
    try:
        return ReleaseCode(code)
    except ValueError:
        raise ValueError(
            f"{code!r} is not a release code; say why the lease ends with one of "
            f"{', '.join(ReleaseCode)} (the particulars go in the detail)"
        ) from None


def clean_text(text: str | None) -> str | None:
    """Free text for a detail column: stripped, cut to the column, ``None`` when empty."""
    text = (text or "").strip()
    return text[:_DETAIL_MAX] or None


def first_why(lease: Lease, code: ReleaseCode, detail: str | None) -> dict[str, Any]:
    """The release code and detail to write: the first ones given are kept."""
    if lease.release_code is not None:
        return {"release_code": lease.release_code, "release_detail": lease.release_detail}
    return {"release_code": code, "release_detail": detail}


def select_leases(connection: Connection, *where: ColumnElement[bool]) -> list[Lease]:
    """The leases ``where`` selects, oldest claim first."""
    rows = connection.execute(_SELECT_LEASES.where(*where).order_by(*_BY_CLAIM))
    return [to_lease(row) for row in rows]


def held_on(connection: Connection, host: str, gpu_uuid: str) -> list[Lease]:
    """The leases that hold a slice of one GPU now."""
    return select_leases(connection, HELD, leases.c.host == host, leases.c.gpu_uuid == gpu_uuid)


def released_since(connection: Connection, since: datetime) -> tuple[Lease, ...]:
    """The leases released at or after ``since``, oldest claim first."""
    return tuple(to_lease(row) for row in connection.execute(_RELEASED_SINCE, {"since": since}))


class HeldLeases:
    """The leases that hold a slice now, as every claim and grant pass reads them all.

    Most are as the last read left them: a row read before (equal in every column) gives
    the same frozen Lease back instead of a new one. Only the rows of the last read are
    kept."""

    def __init__(self) -> None:
        self._rows: dict[tuple[Any, ...], Lease] = {}

    def read(self, connection: Connection) -> list[Lease]:
        """Every held lease, oldest claim first."""
        known, fresh = self._rows, {}
        for row in connection.execute(_HELD_LEASES):
            values = tuple(row)  # a tuple compares in C; a Row in Python
            fresh[values] = known.get(values) or to_lease(row)
        self._rows = fresh
        return list(fresh.values())


def lock_lease(connection: Connection, lease_id: str) -> Lease | None:
    """Lease ``lease_id``, locked until the transaction ends (``None``: unknown)."""
    row = connection.execute(_LOCK_LEASE, {"lease_id": lease_id}).first()
    return None if row is None else to_lease(row)


def write_columns(connection: Connection, lease: Lease, values: dict[str, Any]) -> None:
    """Write ``values`` (lease field -> value) on ``lease``'s row, unchecked: for the
    guarded writers (:func:`move`, the warnings store's)."""
    if values:
        connection.execute(_UPDATE_LEASE, {**_to_columns(**values), "lease_key": lease.id})


def update(connection: Connection, lease: Lease, **changes: Any) -> Lease:
    """Write ``changes`` on ``lease`` (locked by :func:`lock_lease`); not its state nor
    its warning's, which their guarded writers write."""
    guarded = GUARDED.intersection(changes)
    if guarded:
        raise TypeError(f"{', '.join(sorted(guarded))} is written by its guarded writer, "
                        "which checks the move")
    write_columns(connection, lease, changes)
    return replace(lease, **changes)


def move(connection: Connection, lease: Lease, state: LeaseState, **changes: Any) -> Lease:
    """Write ``lease`` (locked in this transaction by :func:`lock_lease`) with ``state``
    and ``changes``: the one place a lease's state is written. A move the transition
    table (:data:`~mig_spawner.core.lifecycle.LEASE_MOVES`) does not allow is logged and
    refused with :class:`IllegalTransition`; nothing is written."""
    if not lease_move_allowed(lease.state, state):
        error = IllegalTransition(f"lease {lease.id} of server {lease.server}",
                                  lease.state, state, lease)
        log.error("refused: %s", error)
        raise error
    values = {**changes, "state": state}
    write_columns(connection, lease, values)
    return replace(lease, **values)


def new_facts(lease: Lease, learnt: dict[str, Any]) -> dict[str, Any]:
    """The facts of ``learnt`` that are given (not None); a :class:`LeaseStateError` when
    one would overwrite a different value ``lease`` records."""
    given = {key: value for key, value in learnt.items() if value is not None}
    changed = [key for key, value in given.items() if getattr(lease, key) not in (None, value)]
    if changed:
        raise LeaseStateError(
            f"lease {lease.id} already records "
            + ", ".join(f"{key}={getattr(lease, key)!r}" for key in changed)
            + f"; refusing to overwrite with {', '.join(repr(given[k]) for k in changed)}",
            lease,
        )
    return given


def new_lease(request: LeaseRequest, decision: Grant, now: datetime) -> Lease:
    """The lease ``decision`` grants ``request`` at ``now`` (not written yet)."""
    granted = {f.name: getattr(decision, f.name) for f in fields(GrantedSlice)}
    return Lease(id=uuid4().hex, user=request.user, server_name=request.server_name,
                 state=LeaseState.CLAIMED, claimed_at=now, **granted)


def insert_lease(connection: Connection, lease: Lease) -> None:
    """Write a new lease, its server row and one slot row per memory slice. The keys
    are the backstop: an overlap raises :class:`DoubleGrant`, a second lease for one
    server :class:`Conflict`; the transaction then rolls back."""
    connection.execute(_INSERT_LEASE, _to_columns(
        **{name: getattr(lease, name) for name in _FIELDS}))
    try:
        connection.execute(_INSERT_SERVER, {
            "user_name": lease.user, "server_name": lease.server_name, "lease_id": lease.id})
    except IntegrityError as e:
        raise Conflict(
            f"server {lease.server} got a lease from a concurrent claim; nothing was "
            "written. Retry: the spawn will find the existing lease."
        ) from e
    slices = lease.memory_slices
    if not slices or lease.host is None or lease.gpu_uuid is None:
        return  # kube mode: the device plugin, not the ledger, places the slice
    try:
        connection.execute(_INSERT_SLOTS, [
            {"host": lease.host, "gpu_uuid": lease.gpu_uuid, "memory_slice": s,
             "lease_id": lease.id}
            for s in slices
        ])
    except IntegrityError as e:
        raise DoubleGrant(lease.host, lease.gpu_uuid, slices) from e


def free_slots(connection: Connection, lease: Lease) -> None:
    """Delete ``lease``'s slot and server rows: its slice is free at commit."""
    connection.execute(_DELETE_SLOTS, {"lease_id": lease.id})
    connection.execute(_DELETE_SERVER, {"lease_id": lease.id})
