"""Running the ledger's alembic migrations from code.

Upgrades run inside one serialised transaction so that the hub and the slice
service may both start at once and call ``Ledger.upgrade()`` safely: SQLite's
``BEGIN IMMEDIATE`` and PostgreSQL's transaction-scoped advisory lock make
the second one wait, then find the schema already at head.
"""

from __future__ import annotations

import threading
from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from .engine import prepare_write
from .errors import SchemaError
from .models import VERSION_TABLE

_INI = Path(__file__).with_name("alembic.ini")
#: alembic's ``op`` and ``context``, which every migration and env.py use, are
#: process-wide proxies: two threads migrating at once (two ledgers opened together in
#: one hub, or a spawner's worker thread beside the service's) would run one's DDL on
#: the other's connection, which crashes SQLite. One migration at a time per process;
#: across processes the database's own lock below orders them.
MIGRATING = threading.Lock()
#: Arbitrary constant key for ``pg_advisory_xact_lock`` ("migspawn" in ASCII).
_PG_UPGRADE_LOCK = 0x6D6967737061776E


def alembic_config(connection: Connection | None = None) -> Config:
    """The packaged alembic config, bound to ``connection`` when given."""
    config = Config(str(_INI))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@cache
def head_revision() -> str:
    """The newest migration shipped with this version of mig-spawner."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001
        raise RuntimeError("no ledger migrations found; the package is broken")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or ``None`` when it has no ledger schema yet."""
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> str:
    """Migrate the database to ``revision`` and return the revision it ends at."""
    with engine.connect() as connection:
        prepare_write(connection)
        with connection.begin():
            if connection.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_UPGRADE_LOCK}
                )
            with MIGRATING:
                command.upgrade(alembic_config(connection), revision)
    current = current_revision(engine)
    if current is None:
        raise SchemaError(f"upgrading the ledger to {revision!r} left it without a schema")
    return current
