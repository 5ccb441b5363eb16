"""Engines for the ledger: SQLite tuned for several processes, or any SQLAlchemy URL.

Why the SQLite settings:

* WAL journal: readers (the admin page, metrics) never block the writer.
* busy timeout 30 s: a process that finds the database locked waits instead of failing.
* foreign keys on: slot rows must point at a real lease.
* SQLAlchemy emits ``BEGIN`` itself (pysqlite's own transaction handling is
  turned off), so that writing transactions can say ``BEGIN IMMEDIATE`` and
  take SQLite's single write lock *before* reading; two claims then run one
  after the other instead of both reading the same free slot.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from .errors import LedgerConfigError
from .models import ledger_lock

#: JupyterHub keeps ``jupyterhub.sqlite`` in its working directory; the ledger sits beside it.
LEDGER_FILE = "mig_spawner_ledger.sqlite"
DEFAULT_URL = f"sqlite:///{LEDGER_FILE}"
SQLITE_BUSY_TIMEOUT_S = 30.0
#: Execution option that makes a SQLite transaction start with ``BEGIN IMMEDIATE``.
_BEGIN_OPTION = "mig_spawner_sqlite_begin"
#: The claim lock (built once: every claim takes it).
_LOCK_CLAIMS = select(ledger_lock.c.id).with_for_update()


def url_beside_hub_db(hub_db_url: str | None) -> str:
    """The default ledger: a SQLite file beside the hub's own SQLite database.

    The spawner and the slice service both derive it from ``JupyterHub.db_url``, so they
    find the same file; with a non-SQLite hub database (or none), the working directory.
    """
    if hub_db_url:
        url = make_url(hub_db_url)
        if url.drivername.startswith("sqlite") and url.database:
            return f"sqlite:///{Path(url.database).resolve().parent / LEDGER_FILE}"
    return f"sqlite:///{Path.cwd() / LEDGER_FILE}"


def parse_url(url: str) -> URL:
    """Parse a ledger URL; a bare file path means a SQLite file there."""
    if "://" not in url:
        if not url.strip():
            raise LedgerConfigError("the ledger URL is empty; set it to e.g. " + DEFAULT_URL)
        url = "sqlite:///" + str(Path(url).expanduser().absolute())
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as e:  # ValueError: e.g. a port that is not a number
        raise LedgerConfigError(
            f"cannot parse ledger URL {url!r}: {e}. Use a SQLAlchemy URL such as "
            f"{DEFAULT_URL} or postgresql+psycopg2://user:password@host/dbname"
        ) from e
    if parsed.get_backend_name() == "sqlite":
        _check_sqlite_file(parsed)
    return parsed


def _check_sqlite_file(url: URL) -> None:
    database = url.database or ""
    if database in ("", ":memory:") or url.query.get("mode") == "memory":
        raise LedgerConfigError(
            f"ledger URL {url} is an in-memory SQLite database: every lease would be lost "
            "when the process exits, and other processes could not see it. Use a file, "
            "e.g. sqlite:////srv/jupyterhub/mig_spawner_ledger.sqlite"
        )
    if url.query.get("uri"):
        return  # a file: URI; sqlite3 resolves it, we cannot check it reliably
    path = Path(database).expanduser().absolute()
    if not path.parent.is_dir():
        raise LedgerConfigError(
            f"the directory {path.parent} for the ledger database {database} does not "
            "exist; create it or point the ledger URL somewhere that exists"
        )


def _create_private(url: URL) -> None:
    """Create a new ledger file readable by its owner only (0600): it names who holds
    which slice. SQLite gives the ``-wal`` and ``-shm`` files the database file's mode,
    so they follow. An existing file keeps the mode its admin chose. Only the writing
    engine does this: a read-only open must never create the file."""
    if url.query.get("uri") or not url.database:
        return  # a file: URI; sqlite3 resolves it
    path = Path(url.database).expanduser().absolute()
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


#: How each database driver is told how long to try to connect (libpq's parameter for
#: PostgreSQL), for :func:`create_ledger_engine`'s ``connect_timeout``.
_CONNECT_TIMEOUT_ARG = {"psycopg2": "connect_timeout", "psycopg": "connect_timeout",
                        "pg8000": "timeout", "pymysql": "connect_timeout"}


def create_ledger_engine(url: str, *, echo: bool = False,
                         connect_timeout: float | None = None) -> Engine:
    """Create a thread-safe engine for ``url`` (see the module docstring for SQLite).

    ``connect_timeout``: seconds to try to connect to a database server, where its
    driver takes such a limit (``None``: the driver's own; libpq's waits for the
    operating system, minutes for a host that drops packets)."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        try:
            arg = _CONNECT_TIMEOUT_ARG.get(parsed.get_driver_name())  # loads the dialect
            connect_args = {arg: max(1, round(connect_timeout))} if (
                arg and connect_timeout is not None) else {}
            # pre_ping: a hub runs for months; PostgreSQL restarts must not break claims.
            return create_engine(parsed, echo=echo, pool_pre_ping=True,
                                 connect_args=connect_args)
        except NoSuchModuleError as e:  # SQLAlchemy has no such dialect or driver
            raise LedgerConfigError(
                f"the ledger URL names the database driver {parsed.drivername!r}, which "
                f"SQLAlchemy does not know; use e.g. {DEFAULT_URL} or "
                "postgresql+psycopg2://user:password@host/dbname"
            ) from e
        except ImportError as e:  # SQLAlchemy imports the URL's driver here
            raise LedgerConfigError(
                f"the ledger URL's database driver {parsed.drivername!r} needs the Python "
                f"module {e.name or e}, which is not installed in this environment: install "
                "it, or name an installed driver in the URL (e.g. postgresql+psycopg2://)"
            ) from e
    _create_private(parsed)
    engine = create_engine(
        parsed,
        echo=echo,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
    )
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Turn off pysqlite's implicit BEGIN: _sqlite_on_begin emits the right one.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    mode = connection.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
    connection.exec_driver_sql(f"BEGIN {mode}")


def prepare_write(connection: Connection) -> None:
    """Make the next transaction on ``connection`` a serialised writer.

    Call before ``connection.begin()``. SQLite: ``BEGIN IMMEDIATE`` takes the
    database write lock up front. Elsewhere: READ COMMITTED, so that after
    ``lock_claims`` returns, every read sees what earlier claims committed
    (under REPEATABLE READ the snapshot could predate the lock wait).
    """
    if connection.dialect.name == "sqlite":
        connection.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
    else:
        connection.execution_options(isolation_level="READ COMMITTED")


def lock_claims(connection: Connection) -> None:
    """Queue behind any other claim in progress, until this transaction ends.

    SQLite's ``BEGIN IMMEDIATE`` (see ``prepare_write``) already did it; other
    databases lock the one row of ``ledger_lock``.
    """
    if connection.dialect.name != "sqlite":
        connection.execute(_LOCK_CLAIMS)
