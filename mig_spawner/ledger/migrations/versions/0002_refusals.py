"""Refused spawns, kept for usage reports (``mig-spawner report``).

Revision ID: 0002
Revises: 0001

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.create_table(
        "refusals",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("user_name", sa.String(255), nullable=False),
        sa.Column("server_name", sa.String(255), nullable=False),
        sa.Column("offer", sa.String(64), nullable=False,
                  comment="what was asked for: a profile or a slice class"),
        sa.Column("profile", sa.String(64), comment="the concrete profile, when known"),
        sa.Column("reason", sa.String(32), nullable=False,
                  comment="stable refusal code: none_free, no_capacity, group_quota, ..."),
        sa.Column("group_name", sa.String(255), comment="group it would have been charged to"),
        sa.Column("host", sa.String(255)),
        sa.Column("message", sa.String(1000), nullable=False),
    )
    op.create_index("ix_refusals_at", "refusals", ["at"])


def downgrade() -> None:
    op.drop_index("ix_refusals_at", table_name="refusals")
    op.drop_table("refusals")
