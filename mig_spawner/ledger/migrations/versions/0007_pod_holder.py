"""Which pod runs the server of a Kubernetes lease: its UID (the name is in ``pod``).

Revision ID: 0007
Revises: 0006

Frozen like 0001: written by hand, never importing the models. A pod deleted and
recreated under the same name has another UID: it is not the lease's holder.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column(
            "holder_pod_uid", sa.String(64),
            comment="UID of the server's pod (Kubernetes), so a recreated pod is told",
        ))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("holder_pod_uid")
