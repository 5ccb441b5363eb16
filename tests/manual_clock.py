"""A clock the test moves by hand, so timestamps in ledgers and reports are exact."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


@dataclass
class Clock:
    """Callable like ``utcnow``; ``advance(minutes=5)`` moves it on."""

    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now
