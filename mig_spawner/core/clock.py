"""The one default clock: aware UTC now.

Everything that keeps time (the ledger, the slice service, the slice map) takes a
``clock`` callable and defaults to :func:`utcnow`; tests pass a manual clock instead.
Reading the time is the only thing here: the core stays free of other I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Aware UTC now (the default clock)."""
    return datetime.now(UTC)
