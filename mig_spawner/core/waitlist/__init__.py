"""The wait list's rules: who a free slice goes to, and how long a wait will be.

Pure (no I/O): :mod:`.order` is the order rule, :mod:`.grants` every grant one pass
makes by it (what the ledger's grant transaction runs), :mod:`.join` who may join the
line (what the ledger's join transaction checks), :mod:`.estimate` turns hold-time
history into an honest range. Admin documentation: docs/policies.md,
"Waiting".
"""

from .estimate import (
    MIN_HISTORY,
    Estimate,
    Holder,
    HoldLimits,
    estimate_wait,
    history_for,
)
from .grants import Charged, next_grants
from .join import check_join
from .order import (
    FIT_REASONS,
    Served,
    StarvationGuard,
    Waiter,
    contends,
    first_served,
    group_shares,
    order,
    positions,
)

__all__ = [
    "FIT_REASONS",
    "MIN_HISTORY",
    "Charged",
    "Estimate",
    "HoldLimits",
    "Holder",
    "Served",
    "StarvationGuard",
    "Waiter",
    "check_join",
    "contends",
    "estimate_wait",
    "first_served",
    "group_shares",
    "history_for",
    "next_grants",
    "order",
    "positions",
]
