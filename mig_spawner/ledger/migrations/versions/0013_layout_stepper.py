"""Who steps a layout change now: one stepper per change at a time (the slice service and
`mig-spawner layout apply --wait` both step changes), and when it last showed life.

Revision ID: 0013
Revises: 0012

Frozen like 0001: written by hand, never importing the models; times are naive UTC.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    with op.batch_alter_table("layout_changes") as table:
        table.add_column(sa.Column(
            "stepper", sa.String(255),
            comment="the process stepping the change now (host, pid, start); none: nobody"))
        table.add_column(sa.Column(
            "stepper_seen", sa.DateTime(timezone=False),
            comment="when that stepper last took or checked a step"))


def downgrade() -> None:
    with op.batch_alter_table("layout_changes") as table:
        table.drop_column("stepper_seen")
        table.drop_column("stepper")
