"""What each server is for (``leases.purpose``) and its measured GPU use over its life
(``lease_samples``), for the slice map, ``status``, the report and right-sizing.

Revision ID: 0011
Revises: 0010

Frozen like 0001: written by hand, never importing the models. Existing leases get no
purpose and no samples: right-sizing says so rather than guess from them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("purpose", sa.String(255),
                                   comment="what the server is for, as its user said"))
    op.create_table(
        "lease_samples",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(32), sa.ForeignKey("leases.id"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("memory_used_mib", sa.Integer, nullable=False,
                  comment="GPU memory the slice held"),
        sa.Column("memory_total_mib", sa.Integer, nullable=False,
                  comment="the slice's memory"),
        sa.Column("sm_active", sa.Float, comment="share of SMs busy (None: not measurable)"),
        sa.Column("processes", sa.Integer, nullable=False),
    )
    op.create_index("ix_lease_samples_lease", "lease_samples", ["lease_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_lease_samples_lease", table_name="lease_samples")
    op.drop_table("lease_samples")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("purpose")
