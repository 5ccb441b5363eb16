"""Extra GPU-hours an admin grants to a group's or a member's budget (issue 24), and an
index on when leases were released (budgets read those of their window).

Revision ID: 0012
Revises: 0011

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    op.create_table(
        "budget_grants",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("group_name", sa.String(255), nullable=False),
        sa.Column("user_name", sa.String(255),
                  comment="the member whose own budget it raises; none: the group's"),
        sa.Column("slice_seconds", sa.Float, nullable=False,
                  comment="extra compute-slice-seconds, valid for one budget window"),
        sa.Column("granted_at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("granted_by", sa.String(255), nullable=False),
        sa.Column("note", sa.String(255), nullable=False),
    )
    op.create_index("ix_budget_grants_granted_at", "budget_grants", ["granted_at"])
    # Budgets read the leases released within their window at every claim and sweep.
    op.create_index("ix_leases_released_at", "leases", ["released_at"])


def downgrade() -> None:
    op.drop_index("ix_leases_released_at", table_name="leases")
    op.drop_index("ix_budget_grants_granted_at", table_name="budget_grants")
    op.drop_table("budget_grants")
