"""User and server names of any length: unbounded name columns on PostgreSQL.

Revision ID: 0003
Revises: 0002

JupyterHub accepts user and server names longer than 255 characters, and PostgreSQL
refused them in ``varchar(255)`` (every spawn of such a user failed). The name columns
of ``leases``, ``lease_servers`` (its primary key) and ``refusals`` become ``text``.
SQLite never enforces a declared length, so its tables stay as they are (rebuilding
them would mean copying the lease history for nothing). Frozen like 0001.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"

_NAME_COLUMNS = (
    ("leases", "user_name"),
    ("leases", "server_name"),
    ("lease_servers", "user_name"),
    ("lease_servers", "server_name"),
    ("refusals", "user_name"),
    ("refusals", "server_name"),
)


def _alter(type_: sa.types.TypeEngine, existing: sa.types.TypeEngine) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    for table, column in _NAME_COLUMNS:
        op.alter_column(table, column, type_=type_, existing_type=existing,
                        existing_nullable=False)


def upgrade() -> None:
    _alter(sa.Text(), sa.String(255))


def downgrade() -> None:
    # Fails, as it should, while a name longer than 255 characters is stored.
    _alter(sa.String(255), sa.Text())
