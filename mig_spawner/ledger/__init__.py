"""Lease ledger adapter: durable leases in SQL (SQLite file or any SQLAlchemy URL).

See ``docs/ledger.md`` for what is stored and how double grants are made impossible.
"""

from .engine import DEFAULT_URL, LEDGER_FILE, url_beside_hub_db
from .errors import (
    Conflict,
    DoubleGrant,
    InvalidDecision,
    LeaseNotFound,
    LeaseStateError,
    LedgerConfigError,
    LedgerError,
    LedgerMissing,
    LedgerUnavailable,
    SchemaError,
    ServerHasLease,
)
from .records import (
    HELD_STATES,
    MODES,
    STATES,
    Grant,
    KeepResult,
    Lease,
    LeaseEvent,
    LeaseRequest,
    LedgerView,
    RefusalRecord,
)
from .store import Decide, Ledger
from .waitlist import WAIT_STATES, GrantDecide, WaitEntry, WaitRequest

__all__ = [
    "DEFAULT_URL",
    "HELD_STATES",
    "LEDGER_FILE",
    "MODES",
    "STATES",
    "WAIT_STATES",
    "Conflict",
    "Decide",
    "DoubleGrant",
    "Grant",
    "GrantDecide",
    "InvalidDecision",
    "KeepResult",
    "Lease",
    "LeaseEvent",
    "LeaseNotFound",
    "LeaseRequest",
    "LeaseStateError",
    "Ledger",
    "LedgerConfigError",
    "LedgerError",
    "LedgerMissing",
    "LedgerUnavailable",
    "LedgerView",
    "RefusalRecord",
    "SchemaError",
    "ServerHasLease",
    "WaitEntry",
    "WaitRequest",
    "url_beside_hub_db",
]
