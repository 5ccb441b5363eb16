"""Per-lease usage summaries (``lease_usage``), kept forever, so that the slice service
may prune raw ``lease_samples`` older than its ``usage_sample_retention``; and an index
on ``lease_samples.at`` for that pruning.

Revision ID: 0017
Revises: 0016

Frozen like 0001: written by hand, never importing the models. Existing leases get no
summary here: the slice service writes those of released leases before it prunes their
samples, and until then the ledger summarises their samples when read. Going down drops
the summaries; samples pruned meanwhile are gone either way.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"


def upgrade() -> None:
    op.create_table(
        "lease_usage",
        sa.Column("lease_id", sa.String(32), sa.ForeignKey("leases.id"), primary_key=True),
        sa.Column("samples", sa.Integer, nullable=False, comment="samples summarised"),
        sa.Column("peak_mib", sa.Integer, nullable=False, comment="most memory held"),
        sa.Column("p95_mib", sa.Integer, nullable=False,
                  comment="95th percentile (nearest rank)"),
        sa.Column("memory_total_mib", sa.Integer, nullable=False,
                  comment="the slice's memory"),
        sa.Column("sampled_seconds", sa.Float, nullable=False,
                  comment="first to last sample"),
        sa.Column("active_seconds", sa.Float, nullable=False,
                  comment="share of samples active times sampled_seconds"),
    )
    op.create_index("ix_lease_samples_at", "lease_samples", ["at"])


def downgrade() -> None:
    op.drop_index("ix_lease_samples_at", table_name="lease_samples")
    op.drop_table("lease_usage")
