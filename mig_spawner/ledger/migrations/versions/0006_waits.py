"""The wait list: spawns waiting for a slice (issue 15).

Revision ID: 0006
Revises: 0005

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.create_table(
        "waits",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True,
                  comment="handed out in commit order: first come"),
        sa.Column("user_name", sa.String(255), nullable=False),
        sa.Column("server_name", sa.String(255), nullable=False),
        sa.Column("group_name", sa.String(255), nullable=False,
                  comment="group it will be charged to"),
        sa.Column("priority", sa.Integer, nullable=False,
                  comment="that group's priority at join"),
        sa.Column("offer", sa.String(64), nullable=False,
                  comment="profile or slice class asked for"),
        sa.Column("state", sa.String(16), nullable=False,
                  comment="waiting|granted|cancelled|expired|abandoned"),
        sa.Column("joined_at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=False),
                  comment="joined_at + max_wait; none: no limit"),
        sa.Column("bypassed", sa.Integer, nullable=False, comment="grants that passed it over"),
        sa.Column("closed_at", sa.DateTime(timezone=False)),
        sa.Column("lease_id", sa.String(32), sa.ForeignKey("leases.id"),
                  comment="set when granted"),
        sa.Column("reason", sa.String(255), comment="why it ended, when not granted"),
    )
    op.create_index("ix_waits_state", "waits", ["state"])


def downgrade() -> None:
    op.drop_index("ix_waits_state", table_name="waits")
    op.drop_table("waits")
