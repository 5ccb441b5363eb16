"""GPU faults (docs/health.md): a GPU or MIG device found faulty, what was seen and when;
while a fault is not cleared its slices are held from new grants.

Revision ID: 0015
Revises: 0014

Frozen like 0001: written by hand, never importing the models; times are naive UTC.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"


def upgrade() -> None:
    op.create_table(
        "gpu_faults",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("gpu_uuid", sa.String(64), nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False,
                  comment="xid|ecc|row_remap|retired_pages|lost|missing_instance"),
        sa.Column("detail", sa.String(255), nullable=False, comment="what the driver said"),
        sa.Column("xid", sa.Integer, comment="the Xid of an Xid event"),
        sa.Column("device_uuid", sa.String(64),
                  comment="the MIG device it concerns; none: the whole GPU"),
        sa.Column("held_slices", sa.BigInteger, nullable=False,
                  comment="memory slices held from new grants, a bit per slice"),
        sa.Column("whole_gpu", sa.Integer, nullable=False, comment="1: every slice is held"),
        sa.Column("seen_at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("cleared_at", sa.DateTime(timezone=False),
                  comment="when an admin cleared it; none: it holds"),
        sa.Column("cleared_by", sa.String(255)),
    )
    op.create_index("ix_gpu_faults_cleared_at", "gpu_faults", ["cleared_at"])


def downgrade() -> None:
    op.drop_index("ix_gpu_faults_cleared_at", "gpu_faults")
    op.drop_table("gpu_faults")
