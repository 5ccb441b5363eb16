"""Who runs the server of a lease: its holder (host, PID and process start time).

Revision ID: 0004
Revises: 0003

Frozen like 0001: written by hand, never importing the models. A lease is released
only once its holder is provably gone; these columns say which process to check.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"

def _columns() -> tuple[sa.Column, ...]:
    return (
        sa.Column("holder_host", sa.String(255), comment="host the server process runs on"),
        sa.Column("holder_pid", sa.Integer, comment="PID of the server process"),
        sa.Column("holder_start", sa.BigInteger,
                  comment="its start time (/proc/<pid>/stat field 22), so a reused PID is told"),
    )


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for column in _columns():
            batch.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for column in reversed(_columns()):
            batch.drop_column(column.name)
