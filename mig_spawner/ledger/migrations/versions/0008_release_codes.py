"""Why a lease ended as a code in its own column, the particulars beside it, and what
still holds a releasing slice in a third.

Revision ID: 0008
Revises: 0007

Frozen like 0001: written by hand, never importing the models or the code enum.
``release_reason`` becomes ``release_detail``; ``release_code`` and ``held_by`` are new.
Existing rows are filled in on a best-effort reading of the sentences earlier versions
wrote (``stopped``, ``server-exited (status 1)``, ``start-failed: OSError``,
``stale: ...``, ``cancelled while waiting``, ``orphan: ...``, each possibly followed by
``; held by: ...``): the words after ``held by:`` go to ``held_by``, the known word in
front becomes the code, what follows it stays as the detail. A text that matches none
(an admin's own words) keeps a NULL code and its whole text as the detail.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"

# Old leading word -> code (the values of mig_spawner.core.lifecycle.ReleaseCode).
_CODES = {
    "stopped": "stopped",
    "server-exited": "server_exited",
    "start-failed": "start_failed",
    "stale": "stale",
    "cancelled": "cancelled",
    "orphan": "orphan",
}
_HELD = "; held by: "


def read_reason(reason: str) -> tuple[str | None, str | None, str | None]:
    """An old ``release_reason`` -> ``(release_code, release_detail, held_by)``."""
    text, _, held_by = reason.partition(_HELD)
    head = text.split(":", 1)[0].split(" (", 1)[0].split(" ", 1)[0].strip()
    code = _CODES.get(head)
    if code is None:
        return None, text.strip() or None, held_by.strip() or None
    detail = text.strip()[len(head):].lstrip(" :").strip()
    if detail.startswith("(") and detail.endswith(")"):
        detail = detail[1:-1]
    return code, detail or None, held_by.strip() or None


def upgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.alter_column("release_reason", new_column_name="release_detail",
                           existing_type=sa.String(255),
                           comment="why it ended, the particulars in free text "
                                   "(beside release_code)")
        batch.add_column(sa.Column(
            "release_code", sa.String(32),
            comment="why it ended: stopped|server_exited|start_failed|stale|cancelled|orphan|"
                    "drain|budget",
        ))
        batch.add_column(sa.Column(
            "held_by", sa.String(255), comment="while releasing: what still holds its slice"))
    leases = sa.table("leases", sa.column("id", sa.String), sa.column("release_detail", sa.String),
                      sa.column("release_code", sa.String), sa.column("held_by", sa.String))
    bind = op.get_bind()
    rows = bind.execute(sa.select(leases.c.id, leases.c.release_detail)
                        .where(leases.c.release_detail.is_not(None))).all()
    for lease_id, reason in rows:
        code, detail, held_by = read_reason(reason)
        bind.execute(sa.update(leases).where(leases.c.id == lease_id).values(
            release_code=code, release_detail=detail, held_by=held_by))


def downgrade() -> None:
    leases = sa.table("leases", sa.column("id", sa.String), sa.column("release_detail", sa.String),
                      sa.column("release_code", sa.String), sa.column("held_by", sa.String))
    bind = op.get_bind()
    rows = bind.execute(sa.select(leases.c.id, leases.c.release_code, leases.c.release_detail,
                                  leases.c.held_by)).all()
    old = {code: word for word, code in _CODES.items()}
    for lease_id, code, detail, held_by in rows:
        if code is None and held_by is None:
            continue
        text = old.get(code, code or "")
        if detail:
            text = f"{text}: {detail}" if text else detail
        if held_by:
            text = f"{text}{_HELD}{held_by}"
        bind.execute(sa.update(leases).where(leases.c.id == lease_id)
                     .values(release_detail=text[:255]))
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("held_by")
        batch.drop_column("release_code")
        batch.alter_column("release_detail", new_column_name="release_reason",
                           existing_type=sa.String(255), comment=None)
