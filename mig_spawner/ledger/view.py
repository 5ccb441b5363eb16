"""What a claim and a grant pass decide on, read in their own transaction under the
claim lock: every held lease, and what :class:`LedgerView` adds to them (the budgets'
past leases and extra hours, every hold). So a check (policy, budget, hold) and the
write it guards are one transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from .holds import HoldCause, merge_holds, read_holds
from .records import Lease
from .rows import HeldLeases
from .usage import Usage


class ClaimView:
    """Reads a claim's view for the leases store and the wait list's grant pass."""

    def __init__(self, usage: Usage) -> None:
        self._usage = usage
        self._held = HeldLeases()

    def held(self, connection: Connection) -> list[Lease]:
        """Every lease that holds a slice now, oldest claim first."""
        return self._held.read(connection)

    def books(self, connection: Connection, now: datetime) -> dict[str, Any]:
        """The rest of a :class:`LedgerView` at ``now``: ``past`` and ``extras`` (the
        budgets', within their horizon), ``holds`` (every cause) and ``faulty`` (the
        GPU faults' part of them, so a refusal can say why)."""
        past, extras = self._usage.book(connection, now)
        faulty = read_holds(connection, (HoldCause.FAULT,))
        layout = read_holds(connection, (HoldCause.LAYOUT,))
        return {"past": past, "extras": extras, "holds": merge_holds((layout, faulty)),
                "faulty": faulty}
