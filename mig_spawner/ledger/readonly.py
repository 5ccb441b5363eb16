"""Opening an existing ledger for reading only, for commands that must never write.

``mig-spawner report`` reads the history; run where no ledger exists it must not leave
an empty database behind, and on a live ledger it must not take a write lock. SQLite
is opened through a ``mode=ro`` URI, so the driver itself refuses to create the file or
write to it; other databases are only checked for the ledger's tables, never given any.
:func:`probe` checks, the same way, that a ledger can be used at all (at start-up).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from .engine import SQLITE_BUSY_TIMEOUT_S, create_ledger_engine, parse_url
from .errors import LedgerConfigError, LedgerMissing, LedgerUnavailable

#: How long :func:`probe` tries to connect to a database server: a hub starting waits
#: this long at most for a ledger that does not answer.
PROBE_TIMEOUT_S = 10.0


def readonly_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine on the ledger at ``url`` that cannot create or change it.

    Raises :class:`LedgerMissing` when ``url`` is a SQLite file that does not exist.
    """
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        # The schema check (Ledger.open_existing) refuses a database without the tables;
        # PostgreSQL also runs the report's transactions read-only.
        engine = create_ledger_engine(url, echo=echo)
        if parsed.get_backend_name() == "postgresql":
            engine = engine.execution_options(postgresql_readonly=True)
        return engine
    uri = _readonly_sqlite_uri(parsed)
    # The engine keeps the URL the admin gave (for messages); connections use the URI.
    return create_engine(parsed, echo=echo, creator=lambda: sqlite3.connect(
        uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False))


def _readonly_sqlite_uri(url: URL) -> str:
    """A ``file:`` URI with ``mode=ro`` for the SQLite ledger ``url``."""
    database = url.database or ""
    if url.query.get("uri"):  # already a file: URI; sqlite3 resolves it
        base, _, query = database.partition("?")
        options = dict(parse_qsl(query))
        options.update({k: v for k, v in url.query.items() if k != "uri"}, mode="ro")
        return f"{base}?{urlencode(options)}"
    path = Path(database).expanduser().absolute()
    if not path.is_file():
        raise LedgerMissing(
            f"there is no ledger at {path}: nothing was ever recorded there (the hub "
            "creates its ledger when it first opens it)"
        )
    return f"file:{quote(str(path))}?mode=ro"


def probe(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Check that the ledger at ``url`` can be used from here now; create and change
    nothing (``mig-spawner doctor`` runs it too).

    A database server must answer a query within ``timeout`` seconds of connecting. A
    SQLite ledger must be a database this process may write, or not exist yet in a
    folder where it may create it. Raises :class:`LedgerConfigError` for a URL that
    cannot work (no such folder, a driver not installed) and :class:`LedgerUnavailable`
    for a database that does not answer, refuses this process, or is no database.
    """
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        _probe_sqlite(parsed)
        return
    engine = create_ledger_engine(url, connect_timeout=timeout)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except DBAPIError as e:
        raise LedgerUnavailable(
            f"the ledger database {parsed.render_as_string(hide_password=True)} cannot be "
            f"used: {' '.join(str(e.orig).split())}") from e  # libpq's lines, as one
    finally:
        engine.dispose()


def _probe_sqlite(url: URL) -> None:
    """A SQLite ledger file: writable and a database, or creatable where it will be."""
    if url.query.get("uri"):
        return  # a file: URI; sqlite3 resolves it, we cannot check it reliably
    path = Path(url.database or "").expanduser().absolute()
    if not path.exists():
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise LedgerConfigError(f"the ledger {path} does not exist yet, and this "
                                    f"process may not create files in {path.parent}")
        return
    if not os.access(path, os.R_OK | os.W_OK):
        raise LedgerConfigError(f"this process may not read and write the ledger {path}")
    try:
        connection = sqlite3.connect(_readonly_sqlite_uri(url), uri=True,
                                     timeout=SQLITE_BUSY_TIMEOUT_S)
        try:
            connection.execute("PRAGMA schema_version").fetchone()
        finally:
            connection.close()
    except sqlite3.Error as e:
        raise LedgerUnavailable(f"the ledger {path} cannot be read: {e}") from e
