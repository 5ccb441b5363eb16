"""Layout changes per GPU: the target, the plan's state and the slices held from grants.

Revision ID: 0010
Revises: 0008

Frozen like 0001: written by hand, never importing the models; times are naive UTC.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0008"


def upgrade() -> None:
    op.create_table(
        "layout_changes",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("gpu_uuid", sa.String(64), nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=False),
        sa.Column("target", sa.String(1000), nullable=False,
                  comment="the GPU's target as JSON: mig_enabled and instances per profile"),
        sa.Column("state", sa.String(16), nullable=False,
                  comment="pending|draining|applying|done|failed"),
        sa.Column("held_slices", sa.BigInteger, nullable=False,
                  comment="memory slices held from new grants, a bit per slice"),
        sa.Column("whole_gpu", sa.Integer, nullable=False,
                  comment="1: every slice is held (drain)"),
        sa.Column("created_at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("notice_from", sa.DateTime(timezone=False),
                  comment="when the holders were warned"),
        sa.Column("detail", sa.String(255), comment="the last step done, or why it failed"),
    )
    op.create_index("ix_layout_changes_state", "layout_changes", ["state"])


def downgrade() -> None:
    op.drop_index("ix_layout_changes_state", "layout_changes")
    op.drop_table("layout_changes")
