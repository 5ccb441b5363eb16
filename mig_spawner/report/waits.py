"""The wait list in ``mig-spawner report``: how many waited, how it ended, for how long.

Pure: rows from the ledger's wait entries (``ledger.waits.joined``), one per offer and group.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mig_spawner.core.lifecycle import WaitState
from mig_spawner.ledger import WaitEntry

HEADER = ("OFFER", "GROUP", "WAITS", "GRANTED", "CANCELLED", "EXPIRED", "ABANDONED",
          "WAITING", "MEDIAN MIN", "P95 MIN")


@dataclass(frozen=True)
class WaitRow:
    """Waits of one group for one offer: how they ended, and minutes to a grant."""

    offer: str
    group: str
    waits: int
    granted: int
    cancelled: int
    expired: int
    abandoned: int
    waiting: int
    median_minutes: float | None
    p95_minutes: float | None


def _p95(values: Sequence[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def wait_rows(entries: Iterable[WaitEntry]) -> list[WaitRow]:
    """One :class:`WaitRow` per (offer, group), sorted by offer then group."""
    groups: dict[tuple[str, str], list[WaitEntry]] = {}
    for entry in entries:
        groups.setdefault((entry.offer, entry.group), []).append(entry)
    rows = []
    for (offer, group), mine in sorted(groups.items()):
        states = [e.state for e in mine]
        waited = sorted((e.closed_at - e.joined_at).total_seconds() / 60 for e in mine
                        if e.state == WaitState.GRANTED and e.closed_at)
        rows.append(WaitRow(
            offer, group, len(mine), *(states.count(state) for state in (
                WaitState.GRANTED, WaitState.CANCELLED, WaitState.EXPIRED, WaitState.ABANDONED,
                WaitState.WAITING)),
            statistics.median(waited) if waited else None,
            _p95(waited) if waited else None,
        ))
    return rows


def waits_text(rows: Sequence[WaitRow]) -> str:
    """The wait list section of the report (empty when nobody waited)."""
    if not rows:
        return ""

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [HEADER, *((r.offer, r.group, *(str(n) for n in (
        r.waits, r.granted, r.cancelled, r.expired, r.abandoned, r.waiting)),
        fmt(r.median_minutes), fmt(r.p95_minutes)) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    table = "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(line, widths, strict=True)))
                      .rstrip() for line in lines)
    return "\n".join([
        "Wait list", "", table, "",
        "EXPIRED = waited max_wait without a grant; ABANDONED = the hub restarted while "
        "it waited.",
        "MEDIAN/P95 MIN = minutes from joining to the grant, of the granted waits.",
    ])
