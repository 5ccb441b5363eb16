"""What the slice service learns while a lease runs: where to reach its server
without going through the proxy, what its slice did on the GPU, and the warnings
before a stop with what the user answered (kept, extended).

Revision ID: 0005
Revises: 0004

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"

COLUMNS = (
    ("server_url", sa.String(1000), "internal URL of the server, read without the proxy"),
    ("gpu_active_at", sa.DateTime(timezone=False), "last time the slice did GPU work"),
    ("peak_memory_mib", sa.Integer, "most GPU memory the slice held (MiB)"),
    ("warning", sa.String(32), "the stop the user was warned of (a rule), if pending"),
    ("warned_at", sa.DateTime(timezone=False), None),
    ("warning_deadline", sa.DateTime(timezone=False), "when that stop is due"),
    ("kept_at", sa.DateTime(timezone=False), "last 'Keep my server' (counts as activity)"),
    ("extensions", sa.Integer, "times max session age was extended"),
)


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for name, type_, comment in COLUMNS:
            batch.add_column(sa.Column(name, type_, comment=comment))
    op.create_table(
        "lease_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("lease_id", sa.String(32), sa.ForeignKey("leases.id"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=False), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False,
                  comment="warned | kept | extended | refused"),
        sa.Column("rule", sa.String(32), nullable=False),
        sa.Column("detail", sa.String(255), nullable=False),
    )
    op.create_index("ix_lease_events_lease_id", "lease_events", ["lease_id"])


def downgrade() -> None:
    op.drop_index("ix_lease_events_lease_id", table_name="lease_events")
    op.drop_table("lease_events")
    with op.batch_alter_table("leases") as batch:
        for name, _, _ in reversed(COLUMNS):
            batch.drop_column(name)
