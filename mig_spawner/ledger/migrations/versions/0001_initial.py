"""Initial ledger schema: leases (kept as history), lease slots, server keys, claim lock.

Revision ID: 0001
Revises:

Written by hand and frozen: migrations never import ``mig_spawner.ledger.models``,
because the models move on and a migration must keep meaning what it meant.
Timestamps are naive UTC ``DateTime`` columns (``models.UtcDateTime`` converts).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("id", sa.String(32), primary_key=True, comment="uuid4 hex; never reused"),
        sa.Column("user_name", sa.String(255), nullable=False),
        sa.Column("server_name", sa.String(255), nullable=False),
        sa.Column(
            "group_name", sa.String(255), nullable=False, comment="group charged for the slice"
        ),
        sa.Column("profile", sa.String(64), nullable=False),
        sa.Column("compute_slices", sa.Integer, nullable=False),
        sa.Column("mode", sa.String(16), nullable=False, comment="pool | dynamic | kube"),
        sa.Column(
            "state", sa.String(16), nullable=False, comment="claimed|active|releasing|released"
        ),
        sa.Column("host", sa.String(255)),
        sa.Column("gpu_uuid", sa.String(64)),
        sa.Column("gpu_index", sa.Integer),
        sa.Column("placement_start", sa.Integer),
        sa.Column("placement_size", sa.Integer),
        sa.Column("mig_uuid", sa.String(64)),
        sa.Column("gi_id", sa.Integer),
        sa.Column("ci_id", sa.Integer),
        sa.Column("node", sa.String(255), comment="Kubernetes node"),
        sa.Column("pod", sa.String(255), comment="Kubernetes pod"),
        sa.Column("claimed_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime()),
        sa.Column("last_activity_at", sa.DateTime()),
        sa.Column("expires_at", sa.DateTime(), comment="max session age"),
        sa.Column("released_at", sa.DateTime()),
        sa.Column("release_reason", sa.String(255)),
    )
    op.create_index("ix_leases_state", "leases", ["state"])
    op.create_index("ix_leases_server", "leases", ["user_name", "server_name"])
    op.create_index("ix_leases_claimed_at", "leases", ["claimed_at"])

    op.create_table(
        "lease_slots",
        sa.Column("host", sa.String(255), primary_key=True),
        sa.Column("gpu_uuid", sa.String(64), primary_key=True),
        sa.Column("memory_slice", sa.Integer, primary_key=True),
        sa.Column("lease_id", sa.String(32), sa.ForeignKey("leases.id"), nullable=False),
    )
    op.create_index("ix_lease_slots_lease_id", "lease_slots", ["lease_id"])

    op.create_table(
        "lease_servers",
        sa.Column("user_name", sa.String(255), primary_key=True),
        sa.Column("server_name", sa.String(255), primary_key=True),
        sa.Column(
            "lease_id", sa.String(32), sa.ForeignKey("leases.id"), nullable=False, unique=True
        ),
    )

    lock = op.create_table(
        "ledger_lock",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    )
    op.bulk_insert(lock, [{"id": 1}])


def downgrade() -> None:
    op.drop_table("ledger_lock")
    op.drop_table("lease_servers")
    op.drop_table("lease_slots")
    op.drop_index("ix_leases_claimed_at", table_name="leases")
    op.drop_index("ix_leases_server", table_name="leases")
    op.drop_index("ix_leases_state", table_name="leases")
    op.drop_table("leases")
