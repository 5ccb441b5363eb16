"""What the slice service learns while a lease runs: where to reach its server
without going through the proxy, and what its slice did on the GPU.

Revision ID: 0005
Revises: 0002
Create Date: 2026-12-02

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = (
    ("server_url", sa.String(1000), "internal URL of the server, read without the proxy"),
    ("gpu_active_at", sa.DateTime(timezone=False), "last time the slice did GPU work"),
    ("peak_memory_mib", sa.Integer, "most GPU memory the slice held (MiB)"),
)


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for name, type_, comment in COLUMNS:
            batch.add_column(sa.Column(name, type_, comment=comment))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        for name, _, _ in reversed(COLUMNS):
            batch.drop_column(name)
