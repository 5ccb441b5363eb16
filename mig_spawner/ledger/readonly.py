"""Opening an existing ledger for reading only, for commands that must never write.

``mig-spawner report`` reads the history; run where no ledger exists it must not leave
an empty database behind, and on a live ledger it must not take a write lock. SQLite
is opened through a ``mode=ro`` URI, so the driver itself refuses to create the file or
write to it; other databases are only checked for the ledger's tables, never given any.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

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
    return create_engine(_readonly_sqlite_url(parsed), echo=echo,
                         connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S,
                                       "check_same_thread": False})


def _readonly_sqlite_url(url: URL) -> URL:
    database = url.database or ""
    if url.query.get("uri"):  # already a file: URI; sqlite3 resolves it, add mode=ro
        return url.update_query_dict({"mode": "ro"})
    path = Path(database).expanduser().absolute()
    if not path.is_file():
        raise LedgerMissing(
            f"there is no ledger at {path}: nothing was ever recorded there (the hub "
            "creates its ledger when it first opens it)"
        )
    return URL.create("sqlite", database="file:" + quote(str(path)),
                      query={"mode": "ro", "uri": "true"})
