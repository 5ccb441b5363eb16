"""Where a lease's warning before a stop stands (``leases.warning_state``: pending,
withdrawn, kept, carried_out), written by the warnings store's one guarded writer
against the transition table in ``core/lifecycle.py``. A warning pending now (its rule
in ``leases.warning``) is ``pending``; a lease never warned has none.

Revision ID: 0014
Revises: 0013

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    with op.batch_alter_table("leases") as table:
        table.add_column(sa.Column(
            "warning_state", sa.String(16),
            comment="where its latest warning stands: pending|withdrawn|kept|carried_out"))
    op.execute("UPDATE leases SET warning_state = 'pending' WHERE warning IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("leases") as table:
        table.drop_column("warning_state")
