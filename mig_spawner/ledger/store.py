"""The lease ledger: the one place that says which server holds which slice.

:class:`Ledger` is a small facade: the database (engine, migrations), one transaction
helper (:class:`~mig_spawner.ledger.transactions.Transactions`, with the claim lock)
and the stores that share it, one per part of the ledger:

- ``ledger.leases``: claims, a lease's life to its release, history (``leases.py``);
- ``ledger.waits``: the wait list and its grant pass (``waitlist.py``);
- ``ledger.holds``: capacity held from new grants: layout changes and GPU faults (``holds.py``);
- ``ledger.warnings``: warnings before a stop, and Keep (``warnings.py``);
- ``ledger.usage``: activity, GPU work, usage samples, budgets (``usage.py``);
- ``ledger.refusals``: refused spawns and the request mix (``refusal_log.py``).

Every public method of a store runs in its own short transaction on its own pooled
connection, so one ``Ledger`` may be shared by the hub's executor threads. Callers get
frozen records back, never live ORM rows. Policy is not here: the checks a write guards
(the budget check, Keep's rule, the wait list's user limit) are pure functions in
:mod:`mig_spawner.core`, called in the store's transaction with the rows it read.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any

from mig_spawner.core.clock import utcnow

from . import migrate
from .changes import CHANGE_MARK, ChangeWatch, MarkChanges, PostgresChanges, SqliteChanges
from .engine import DEFAULT_URL, create_ledger_engine
from .errors import LedgerMissing
from .holds import Holds
from .leases import Leases
from .readonly import readonly_engine
from .refusal_log import RefusalLog
from .reports import Reports
from .transactions import Transactions
from .usage import Usage
from .view import ClaimView
from .waitlist import Waits
from .warnings import Warnings

Clock = Callable[[], datetime]


class Ledger:
    """Durable leases in a SQL database (SQLite file by default, or any SQLAlchemy URL).

    ``Ledger(url)`` only connects; ``Ledger.open(url)`` also migrates the
    schema to the version this package ships, which is what the hub and the
    slice service should call at start-up. ``clock`` gives the timestamps the
    ledger writes (aware UTC; tests pass a fake); ``echo`` logs every SQL statement.
    """

    def __init__(self, url: str = DEFAULT_URL, *, clock: Clock = utcnow, echo: bool = False,
                 readonly: bool = False):
        self._engine = (readonly_engine if readonly else create_ledger_engine)(url, echo=echo)
        self._tx = Transactions(self._engine, clock)
        #: Activity, GPU work, usage samples and budgets.
        self.usage = Usage(self._tx)
        view = ClaimView(self.usage)
        #: Claims, a lease's life to its release, and history.
        self.leases = Leases(self._tx, view)
        #: Spawns waiting for a slice, and the grant pass.
        self.waits = Waits(self._tx, view)
        #: Capacity held from new grants: layout changes.
        self.holds = Holds(self._tx)
        #: Warnings before a stop, and the users' answers ("Keep my server").
        self.warnings = Warnings(self._tx)
        #: Refused spawns (``record``, ``between``, ``request_counts``).
        self.refusals = RefusalLog(self._tx)
        #: What ``mig-spawner report`` reads of a window of leases, narrowly.
        self.reports = Reports(self._tx)

    @classmethod
    def open(cls, url: str = DEFAULT_URL, **kwargs: Any) -> Ledger:
        """Connect to ``url`` and bring its schema up to date."""
        ledger = cls(url, **kwargs)
        try:
            ledger.upgrade()
        except BaseException:
            ledger.close()
            raise
        return ledger

    @classmethod
    def open_existing(cls, url: str = DEFAULT_URL, **kwargs: Any) -> Ledger:
        """Open the ledger at ``url`` for reading only; never creates or migrates anything.

        For commands that only read (``mig-spawner report``). Raises
        :class:`LedgerMissing` when there is no ledger there (no SQLite file, or a
        database without its tables) and :class:`SchemaError` when its schema is not the
        one this package ships (the hub migrates it when it next opens it). A SQLite
        ledger is opened ``mode=ro``: any write fails in the driver.
        """
        ledger = cls(url, readonly=True, **kwargs)
        try:
            with ledger._tx.database():
                if ledger.revision() is None:
                    raise LedgerMissing(
                        f"the database {ledger.url} has no ledger tables: nothing was ever "
                        "recorded there (the hub creates them when it first opens it)")
                ledger._tx.check_schema()
        except BaseException:
            ledger.close()
            raise
        return ledger

    @property
    def url(self) -> str:
        """The database URL, password hidden (safe for logs)."""
        return self._tx.url

    @property
    def dialect(self) -> str:
        """``sqlite``, ``postgresql``, ..."""
        return self._engine.dialect.name

    def upgrade(self) -> str:
        """Run pending migrations (safe to call from several processes at once)."""
        with self._tx.database():
            revision = migrate.upgrade(self._engine)
        self._tx.schema_checked()
        return revision

    def revision(self) -> str | None:
        """The schema revision of the database (``None``: no ledger schema yet)."""
        return migrate.current_revision(self._engine)

    def watch_changes(self) -> ChangeWatch:
        """A watch on releases and line changes made by other processes: PostgreSQL
        ``LISTEN`` (psycopg2), SQLite's data version, else the
        :data:`~mig_spawner.ledger.changes.CHANGE_MARK` alone."""
        with self._tx.database():
            if self.dialect == "postgresql" and self._engine.dialect.driver == "psycopg2":
                return PostgresChanges(self._engine, self._tx.origin)
            if self.dialect == "sqlite":
                return SqliteChanges(self._engine, self._change_mark)
            return MarkChanges(self._change_mark)

    def _change_mark(self) -> tuple[int, ...]:
        with self._tx.read() as connection:
            return tuple(connection.execute(CHANGE_MARK).one())

    def close(self) -> None:
        """Close pooled connections. The data stays; a new ``Ledger`` sees it all."""
        self._engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r})"
