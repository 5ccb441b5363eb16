"""Opening an existing ledger for reading only, for commands that must never write.

``mig-spawner report`` reads the history; run where no ledger exists it must not leave
an empty database behind, and on a live ledger it must not take a write lock. SQLite
is opened through a ``mode=ro`` URI, so the driver itself refuses to create the file or
write to it; other databases are only checked for the ledger's tables, never given any.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL

from .engine import SQLITE_BUSY_TIMEOUT_S, create_ledger_engine, parse_url
from .errors import LedgerMissing


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
