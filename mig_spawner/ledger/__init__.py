"""Lease ledger adapter: durable leases in SQL (SQLite file or any SQLAlchemy URL).

See ``docs/ledger.md`` for what is stored and how double grants are made impossible.
"""

from .engine import DEFAULT_URL, LEDGER_FILE, url_beside_hub_db
from .errors import (
    Conflict,
    DoubleGrant,
    IllegalTransition,
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
from .holds import KUBE_NODE, FaultHold, GpuFault, LayoutChange
from .leases import Decide
from .readonly import PROBE_TIMEOUT_S, probe
from .records import (
    HELD_STATES,
    MODES,
    STATES,
    Grant,
    KeepResult,
    Lease,
    LeaseEvent,
    LeaseRequest,
    LeaseState,
    LedgerView,
    RefusalRecord,
    ReleaseCode,
)
from .store import Ledger
from .waitlist import WAIT_STATES, GrantDecide, WaitEntry, WaitRequest, WaitState

__all__ = [
    "DEFAULT_URL",
    "HELD_STATES",
    "KUBE_NODE",
    "LEDGER_FILE",
    "MODES",
    "PROBE_TIMEOUT_S",
    "STATES",
    "WAIT_STATES",
    "Conflict",
    "Decide",
    "DoubleGrant",
    "FaultHold",
    "GpuFault",
    "Grant",
    "GrantDecide",
    "IllegalTransition",
    "InvalidDecision",
    "KeepResult",
    "LayoutChange",
    "Lease",
    "LeaseEvent",
    "LeaseNotFound",
    "LeaseRequest",
    "LeaseState",
    "LeaseStateError",
    "Ledger",
    "LedgerConfigError",
    "LedgerError",
    "LedgerMissing",
    "LedgerUnavailable",
    "LedgerView",
    "RefusalRecord",
    "ReleaseCode",
    "SchemaError",
    "ServerHasLease",
    "WaitEntry",
    "WaitRequest",
    "WaitState",
    "probe",
    "url_beside_hub_db",
]
