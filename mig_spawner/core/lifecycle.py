"""The life of a lease, of a wait-list entry and of a warning before a stop: their
states, the moves allowed between them, the codes that say why a lease ended and the
rules the slice service stops a server by.

The ledger stores these values and refuses, in the same transaction as the write, any
move the tables below do not list (docs/architecture.md, "States and transitions").
Pure: no I/O, no JupyterHub import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


class LeaseState(StrEnum):
    """Where a lease is in its life. The values never change: the ledger stores them."""

    #: Granted; its server is being made or started.
    CLAIMED = "claimed"
    #: Its server runs.
    ACTIVE = "active"
    #: Being given back: it still holds its slice (a holder or an instance is in the way).
    RELEASING = "releasing"
    #: Given back; the row stays as history and never changes again.
    RELEASED = "released"


#: The moves a lease may make. Staying in a state is not a move (an active lease learns
#: its pod, a releasing one what holds it now), except for ``released``: history is final.
LEASE_MOVES: Mapping[LeaseState, frozenset[LeaseState]] = {
    LeaseState.CLAIMED: frozenset(
        {LeaseState.ACTIVE, LeaseState.RELEASING, LeaseState.RELEASED}),
    LeaseState.ACTIVE: frozenset({LeaseState.RELEASING, LeaseState.RELEASED}),
    LeaseState.RELEASING: frozenset({LeaseState.RELEASED}),
    LeaseState.RELEASED: frozenset(),
}

#: States in which a lease still holds its slice (its slot rows exist).
HELD_STATES: tuple[LeaseState, ...] = (
    LeaseState.CLAIMED, LeaseState.ACTIVE, LeaseState.RELEASING)


class WaitState(StrEnum):
    """Where a wait-list entry is. The values never change: the ledger stores them.
    The end states are also the code of why a wait ended (the row's ``reason`` is the
    free-text detail)."""

    WAITING = "waiting"
    #: Served: the entry names the lease it got.
    GRANTED = "granted"
    #: The user (or the hub, for its spawner) gave up waiting.
    CANCELLED = "cancelled"
    #: Waited ``max_wait`` without a slice.
    EXPIRED = "expired"
    #: The hub restarted while it waited; nobody waits for it any more.
    ABANDONED = "abandoned"


#: The moves a wait-list entry may make: out of ``waiting`` once, never back.
WAIT_MOVES: Mapping[WaitState, frozenset[WaitState]] = {
    WaitState.WAITING: frozenset(
        {WaitState.GRANTED, WaitState.CANCELLED, WaitState.EXPIRED, WaitState.ABANDONED}),
    WaitState.GRANTED: frozenset(),
    WaitState.CANCELLED: frozenset(),
    WaitState.EXPIRED: frozenset(),
    WaitState.ABANDONED: frozenset(),
}


def lease_move_allowed(old: LeaseState, new: LeaseState) -> bool:
    """Whether a lease in ``old`` may be written with state ``new`` (see
    :data:`LEASE_MOVES`; staying put is allowed while the lease is held)."""
    return new in LEASE_MOVES[old] or (old == new and old is not LeaseState.RELEASED)


def wait_move_allowed(old: WaitState, new: WaitState) -> bool:
    """Whether a wait-list entry in ``old`` may be written with state ``new``."""
    return new in WAIT_MOVES[old]


class ReleaseCode(StrEnum):
    """A stable code for why a lease ended, with what the user and the slice map say.

    The values never change: the ledger stores them (``leases.release_code``), the hub's
    metrics label with them. What is particular to one release (an exit status, an
    exception's name) goes in the free-text detail beside it, never in the code.
    """

    words: str

    def __new__(cls, value: str, words: str) -> ReleaseCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.words = words
        return member

    STOPPED = "stopped", "its server was stopped"
    SERVER_EXITED = "server_exited", "its server exited"
    START_FAILED = "start_failed", "its server failed to start"
    STALE = "stale", "its server was gone when it started again"
    CANCELLED = "cancelled", "its wait was cancelled as it was granted"
    ORPHAN = "orphan", "the hub no longer ran its server"
    #: Its GPU is re-cut or drained (docs/layout.md): the slice service stops the server
    #: through the hub at the end of its drain notice.
    DRAIN = "drain", "its GPU is being drained"
    #: Its GPU-hour budget is spent (docs/policies.md, "Budgets"): the slice service
    #: stops the server through the hub.
    BUDGET = "budget", "its group's budget is spent"
    #: Its GPU (or its MIG device) reported a hardware fault (docs/health.md): the slice
    #: service stops the server through the hub after its group's ``fault_grace``.
    GPU_FAULT = "gpu_fault", "its GPU reported a hardware fault"


class StopRule(StrEnum):
    """Why the slice service stops a server or shuts a kernel down: the rule a warning
    names (``leases.warning``, ``lease_events.rule``) and the ``reason`` label of its
    metrics. The values never change: the ledger stores them. A new reason to stop a
    server is a new member here, with its release code in :data:`STOP_CODES` where the
    stop is not an ordinary one."""

    #: A kernel idle past the group's ``kernel_idle_timeout`` (the kernel alone stops).
    KERNEL_IDLE = "kernel_idle"
    #: A server idle past the group's ``server_idle_timeout``.
    SERVER_IDLE = "server_idle"
    #: A server older than the group's ``max_session_age`` (its lease's ``expires_at``).
    MAX_SESSION_AGE = "max_session_age"
    #: The GPU-hour budget the lease is charged to is spent.
    BUDGET = "budget"
    #: The server's GPU is re-cut or drained, and its drain notice has ended.
    DRAIN = "drain"
    #: The server's GPU or MIG device reported a hardware fault (docs/health.md), and
    #: its group's ``fault_grace`` has passed since.
    GPU_FAULT = "gpu_fault"


#: The release code the slice service records before it asks the hub to stop a server
#: for these rules (the hub's stop keeps the first code given). A stop for any other
#: rule ends as a stop does (``stopped``).
STOP_CODES: Mapping[StopRule, ReleaseCode] = {
    StopRule.BUDGET: ReleaseCode.BUDGET,
    StopRule.DRAIN: ReleaseCode.DRAIN,
    StopRule.GPU_FAULT: ReleaseCode.GPU_FAULT,
}


class WarningState(StrEnum):
    """Where a lease's latest warning before a stop stands (``leases.warning_state``;
    ``None``: never warned). The values never change: the ledger stores them."""

    #: The user is warned; the stop is due at the warning's deadline.
    PENDING = "pending"
    #: The stop is no longer due (the user came back, the layout change ended).
    WITHDRAWN = "withdrawn"
    #: The user answered with Keep: activity, or max session age moved on.
    KEPT = "kept"
    #: The slice service stopped the server for it (asked the hub to).
    CARRIED_OUT = "carried_out"


#: The moves a warning may make. A pending warning ends withdrawn, kept or carried out;
#: after a withdrawn or kept one a new warning may begin; a warning carried out is the
#: last (its server is being stopped). Staying pending is not a move (a pending warning
#: learns a nearer deadline or another rule); a refused Keep is an event, not a move.
WARNING_MOVES: Mapping[WarningState, frozenset[WarningState]] = {
    WarningState.PENDING: frozenset(
        {WarningState.WITHDRAWN, WarningState.KEPT, WarningState.CARRIED_OUT}),
    WarningState.WITHDRAWN: frozenset({WarningState.PENDING}),
    WarningState.KEPT: frozenset({WarningState.PENDING}),
    WarningState.CARRIED_OUT: frozenset(),
}


def warning_move_allowed(old: WarningState | None, new: WarningState) -> bool:
    """Whether a lease's warning in ``old`` (``None``: never warned, which may only begin
    one) may be written with ``new`` (see :data:`WARNING_MOVES`)."""
    if old is None:
        return new is WarningState.PENDING
    return new in WARNING_MOVES[old] or old is new is WarningState.PENDING


@dataclass(frozen=True)
class PendingStop:
    """One stop a lease's user is warned of, while that warning is pending: its own
    warning, whatever else is pending (``leases.stops``). Its ``deadline`` is the time
    the user was told and the stop is carried out at, unless activity or Keep withdraws
    it; another rule's warning never moves it."""

    rule: StopRule
    warned_at: datetime
    #: ``None``: told, never stopped (a GPU fault where the group leaves servers to finish).
    deadline: datetime | None


def in_order(stops: Iterable[PendingStop]) -> tuple[PendingStop, ...]:
    """``stops`` soonest first (by rule where two fall at once; one never stopped, only
    told, counts from when it was told): the first is the one a lease's ``warning``
    shows."""
    return tuple(sorted(stops, key=lambda s: (s.deadline or s.warned_at, s.rule)))


class WarningEvent(StrEnum):
    """What happened to a warning, one ``lease_events`` row each (``kind``). The values
    never change: the ledger stores them."""

    #: The user was warned of a stop (or of another stop than the one pending).
    WARNED = "warned"
    #: A Keep answered it as activity.
    KEPT = "kept"
    #: A Keep moved max session age on.
    EXTENDED = "extended"
    #: A Keep that could not put the stop off (recorded once per warning).
    REFUSED = "refused"
