"""Each stop a lease's user is warned of keeps its own warning (``leases.stops``: the
rule -> when it was warned and when that stop is due, while it is pending). The
``warning`` columns beside it show the soonest of them. Before, one warning stood for
every stop: a second rule's warning replaced the first, whose stop time was lost (an
idle limit then never applied under a layout change's drain warning). A warning pending
now becomes its rule's entry.

Revision ID: 0016
Revises: 0015

Frozen like 0001: written by hand, never importing the models.
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"


def upgrade() -> None:
    with op.batch_alter_table("leases") as table:
        table.add_column(sa.Column(
            "stops", sa.Text(),
            comment="pending warnings, one per stop: JSON {rule: [warned_at, deadline]} (UTC)"))
    bind = op.get_bind()
    rows = bind.execute(sa.text(
        "SELECT id, warning, warned_at, warning_deadline FROM leases "
        "WHERE warning_state = 'pending' AND warning IS NOT NULL "
        "AND warned_at IS NOT NULL")).all()
    for lease_id, rule, warned_at, deadline in rows:
        # A deadline of NULL: told, never stopped (a GPU fault left to finish).
        stops = {rule: [_iso(warned_at), None if deadline is None else _iso(deadline)]}
        bind.execute(sa.text("UPDATE leases SET stops = :stops WHERE id = :id"),
                     {"stops": json.dumps(stops), "id": lease_id})


def _iso(value: object) -> str:
    """A stored time (naive UTC; SQLite may give it as text) in ISO form."""
    return value if isinstance(value, str) else value.isoformat()  # type: ignore[attr-defined]


def downgrade() -> None:
    with op.batch_alter_table("leases") as table:
        table.drop_column("stops")
