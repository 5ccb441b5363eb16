"""How a hub process hears that another process changed the wait list's world.

The grant loop of each hub process (``spawner/waiting.py``) runs a pass when a slice
is released or someone joins or leaves the line. Its own process wakes it directly;
for the others (the slice service's culls, a second hub on the same PostgreSQL
ledger) the ledger says so:

* PostgreSQL: every release, join, cancel and grant sends ``NOTIFY`` on
  :data:`CHANNEL` in its own transaction (:func:`announce`), so the note arrives
  exactly when the change is committed; :class:`PostgresChanges` LISTENs on a
  connection of its own, whose socket the loop watches: nothing runs while nothing
  happens.
* SQLite: :class:`SqliteChanges` reads ``PRAGMA data_version`` on a connection of its
  own (it changes when any other connection commits; a few microseconds, no lock) and
  only when it moved, the :data:`CHANGE_MARK`, a handful of indexed counts, to tell
  releases and line changes from the slice service's activity writes. Other
  databases (or drivers without ``LISTEN``): the mark alone (:class:`MarkChanges`).

Neither costs anything per waiter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol
from uuid import uuid4

from sqlalchemy import Connection, Engine, func, select, text

from mig_spawner.core.layout import PlanState
from mig_spawner.core.lifecycle import HELD_STATES, WaitState

from .models import layout_changes, leases, waits

#: Numbers that move when a slice is released or the wait list changes: leases no
#: longer held, the newest wait entry, entries waiting, layout changes ended (which give
#: their held slices back). Indexed counts, read in one statement.
CHANGE_MARK = select(
    select(func.count()).select_from(leases)
    .where(leases.c.state.not_in(HELD_STATES)).scalar_subquery(),
    select(func.coalesce(func.max(waits.c.id), 0)).scalar_subquery(),
    select(func.count()).select_from(waits)
    .where(waits.c.state == WaitState.WAITING).scalar_subquery(),
    select(func.count()).select_from(layout_changes)
    .where(layout_changes.c.state.in_((PlanState.DONE, PlanState.FAILED))).scalar_subquery(),
)
#: The PostgreSQL channel of wait-list changes.
CHANNEL = "mig_spawner_grants"
_NOTIFY = text("SELECT pg_notify(:channel, :origin)")  # built once: every release sends it


def new_origin() -> str:
    """A ledger object's signature on what it announces: the changes a process makes
    through its own ledger wake its loop directly, so its watch ignores their notes."""
    return uuid4().hex


def announce(connection: Connection, origin: str) -> None:
    """Tell the other processes, when this transaction commits, that slices were
    released or the line changed (PostgreSQL; SQLite's readers see the commit)."""
    if connection.dialect.name == "postgresql":
        connection.execute(_NOTIFY, {"channel": CHANNEL, "origin": origin})


class ChangeWatch(Protocol):
    """A cheap way to learn that another process changed the wait list's world."""

    def fileno(self) -> int | None:
        """A socket that becomes readable on a change, or ``None``: ask :meth:`changed`
        every so often instead."""

    def changed(self) -> bool:
        """Whether something changed since the last call (blocking, but quick)."""

    def close(self) -> None:
        """Drop the watch's own connection."""


class PostgresChanges:
    """``LISTEN`` on a psycopg2 connection of its own."""

    def __init__(self, engine: Engine, origin: str) -> None:
        self._origin = origin
        args, params = engine.dialect.create_connect_args(engine.url)
        self._connection: Any = engine.dialect.loaded_dbapi.connect(*args, **params)
        self._connection.autocommit = True
        with self._connection.cursor() as cursor:
            cursor.execute(f"LISTEN {CHANNEL}")

    def fileno(self) -> int | None:
        return self._connection.fileno()

    def changed(self) -> bool:
        self._connection.poll()
        notes = [n for n in self._connection.notifies if n.payload != self._origin]
        self._connection.notifies.clear()
        return bool(notes)

    def close(self) -> None:
        self._connection.close()


class MarkChanges:
    """The ledger's change mark, compared with the last one (any database)."""

    def __init__(self, mark: Callable[[], tuple[int, ...]]) -> None:
        self._mark = mark
        self._last = mark()

    def fileno(self) -> int | None:
        return None

    def changed(self) -> bool:
        mark = self._mark()
        moved, self._last = mark != self._last, mark
        return moved

    def close(self) -> None:
        pass


class SqliteChanges(MarkChanges):
    """``PRAGMA data_version`` on a connection of its own; the mark only when it moved.

    :meth:`changed` runs in a worker thread; :meth:`close` may come from the event loop
    while it does (the loop's task cancelled at shutdown). Closing an SQLite connection
    while another thread runs a statement on it crashes the process, so the two take a
    lock, and a closed watch reports no change."""

    def __init__(self, engine: Engine, mark: Callable[[], tuple[int, ...]]) -> None:
        raw = engine.raw_connection()
        self._connection: Any = raw.driver_connection
        raw.detach()  # its own for good: the pool neither counts nor recycles it
        self._lock = threading.Lock()
        self._closed = False
        self._version = self._data_version()
        super().__init__(mark)

    def _data_version(self) -> int:
        return self._connection.execute("PRAGMA data_version").fetchone()[0]

    def changed(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            version = self._data_version()
        if version == self._version:
            return False
        self._version = version
        return super().changed()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._connection.close()
