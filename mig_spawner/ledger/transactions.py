"""The one transaction helper every store of the ledger shares.

A store (leases, waits, holds, warnings, usage, refusals) never opens a connection
itself: it asks :class:`Transactions` for a read, a write, or a write under the claim
lock, and for the ledger's clock. So every store's write is serialised the same way
(SQLite's ``BEGIN IMMEDIATE``, this process's writers queued on one lock first;
PostgreSQL's ``ledger_lock`` row where a claim's view is at stake), a database that
fails becomes :class:`LedgerUnavailable` everywhere, and the schema is checked once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, ProgrammingError

from . import migrate
from .changes import announce, new_origin
from .engine import lock_claims, prepare_write
from .errors import LedgerUnavailable, SchemaError
from .records import require_aware

Clock = Callable[[], datetime]


class Transactions:
    """Short transactions on the ledger's ``engine``, each on its own pooled connection
    (so one ledger is shared by the hub's executor threads), and the ledger's
    ``clock`` (aware UTC)."""

    def __init__(self, engine: Engine, clock: Clock) -> None:
        self.engine = engine
        self._clock = clock
        self._schema_ok = False
        #: Names this process's change notices, so its own grant loop can skip them.
        self.origin = new_origin()
        # SQLite has one writer at a time: this process's writers queue on a lock in
        # turn rather than in SQLite's busy handler, which sleeps up to 100 ms between
        # tries. Other databases serialise in the database (the claim lock) alone.
        self._writers: AbstractContextManager[Any] = (
            threading.Lock() if engine.dialect.name == "sqlite" else nullcontext())

    @property
    def url(self) -> str:
        """The database URL, password hidden (safe for logs)."""
        return self.engine.url.render_as_string(hide_password=True)

    def schema_checked(self) -> None:
        """Take the schema as checked (it was just migrated)."""
        self._schema_ok = True

    def check_schema(self) -> None:
        """Refuse a database whose schema is not this package's head (once per ledger)."""
        if self._schema_ok:
            return
        current, head = migrate.current_revision(self.engine), migrate.head_revision()
        if current != head:
            raise SchemaError(
                f"the ledger database {self.url} is at schema revision {current or 'none'}, "
                f"this mig-spawner needs {head}: open it with Ledger.open() (which migrates), "
                "or call Ledger.upgrade() once"
            )
        self._schema_ok = True

    @contextmanager
    def database(self) -> Iterator[None]:
        """The database failing (down, unreachable, not a database) becomes
        LedgerUnavailable; constraint violations and SQL mistakes stay as they are."""
        try:
            yield
        except (IntegrityError, ProgrammingError):
            raise
        except DBAPIError as e:
            raise LedgerUnavailable(
                f"the ledger database {self.url} cannot be used: {e.orig}; check that it is "
                "up and reachable from here, and that the URL points at a ledger"
            ) from e

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction."""
        with self.database():
            self.check_schema()
            with self.engine.connect() as connection, connection.begin():
                yield connection

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A serialised writing transaction (SQLite: the database's write lock first)."""
        with self.database(), self._writers:
            self.check_schema()
            with self.engine.connect() as connection:
                prepare_write(connection)
                with connection.begin():
                    yield connection

    @contextmanager
    def claims(self) -> Iterator[Connection]:
        """A writing transaction that queues behind every claim, grant pass, join and
        hold in progress (the claim lock), so that what it reads is what it decides on."""
        with self.write() as connection:
            lock_claims(connection)
            yield connection

    def now(self) -> datetime:
        """The ledger clock's time (aware)."""
        now = self._clock()
        require_aware("the ledger clock's time", now)
        return now

    def announce(self, connection: Connection) -> None:
        """Tell the other processes' grant loops, at this transaction's commit, that a
        slice was freed or the line changed (ledger/changes.py)."""
        announce(connection, self.origin)
