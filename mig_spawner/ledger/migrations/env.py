"""Alembic environment for the lease ledger.

``Ledger.upgrade()`` passes an open connection (already inside the transaction
that serialises concurrent upgrades) in ``config.attributes["connection"]``.
The alembic CLI instead passes ``-x url=...``; logging is configured only then,
so that running migrations inside the hub leaves the hub's logging alone.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from mig_spawner.ledger.engine import create_ledger_engine
from mig_spawner.ledger.models import VERSION_TABLE, metadata

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things; batch mode rebuilds tables instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("give the ledger database: alembic -x url=<SQLAlchemy URL> ...")
    engine = create_ledger_engine(url)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("the ledger migrations run online only (Ledger.upgrade or alembic -x url=)")
run_migrations_online()
