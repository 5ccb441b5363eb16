"""Errors raised by the lease ledger.

Every message says what went wrong and what to do about it, because these
reach admins through hub logs and the CLI.
"""

from __future__ import annotations

from typing import Any, Protocol


class LeaseFacts(Protocol):
    """What an error says of the lease it is about (a
    :class:`~mig_spawner.ledger.records.Lease`; named here without importing the records,
    which raise these errors)."""

    @property
    def id(self) -> str: ...
    @property
    def user(self) -> str: ...
    @property
    def server_name(self) -> str: ...
    @property
    def profile(self) -> str: ...
    @property
    def state(self) -> Any: ...
    @property
    def mig_uuid(self) -> str | None: ...
    @property
    def gpu_uuid(self) -> str | None: ...
    @property
    def node(self) -> str | None: ...


class LedgerError(Exception):
    """Base class of every ledger error."""


class LedgerConfigError(LedgerError, ValueError):
    """The ledger URL or its database cannot be used as configured."""


class LedgerUnavailable(LedgerError):
    """The ledger database cannot be reached or used now (down, unreachable, locked for
    too long, not a database). Nothing was written; try again later."""


class LedgerMissing(LedgerError):
    """A read-only open found no ledger: no such SQLite file, or a database without the
    ledger's tables. Nothing was created."""


class SchemaError(LedgerError):
    """The database schema is missing or older than this version of mig-spawner expects."""


class InvalidDecision(LedgerError, ValueError):
    """The ``decide`` callback returned a grant that cannot be stored (a programming error)."""


class LeaseNotFound(LedgerError, LookupError):
    """No lease has the given id."""

    def __init__(self, lease_id: str) -> None:
        super().__init__(
            f"no lease with id {lease_id!r} in the ledger; it may belong to another ledger "
            "database (check the ledger URL the hub and the slice service share)"
        )
        self.lease_id = lease_id


class LeaseStateError(LedgerError):
    """The lease is not in a state that allows the operation."""

    def __init__(self, message: str, lease: LeaseFacts | None) -> None:
        super().__init__(message)
        self.lease = lease


class IllegalTransition(LeaseStateError):
    """A write would move a lease or a wait-list entry between two states that the
    transition table (:mod:`mig_spawner.core.lifecycle`) does not link; nothing was
    written. ``lease`` is set for a lease, ``None`` for a wait-list entry."""

    def __init__(self, what: str, old: str, new: str, lease: LeaseFacts | None = None) -> None:
        super().__init__(
            f"{what} is {old}; it cannot become {new} (not a move the ledger allows). "
            "Nothing was written: this is a bug in the caller, please report it.",
            lease,
        )
        self.what = what
        self.old = old
        self.new = new


class Conflict(LedgerError):
    """A claim would break a uniqueness guarantee; nothing was written."""


class DoubleGrant(Conflict):
    """The claim asked for memory slices that another held lease already covers."""

    def __init__(self, host: str, gpu_uuid: str, slices: range) -> None:
        super().__init__(
            f"refused a double grant: memory slices {slices.start}..{slices.stop - 1} of GPU "
            f"{gpu_uuid} on host {host} are already held by another lease; nothing was written. "
            "The allocator decided on a stale view; retry the spawn."
        )
        self.host = host
        self.gpu_uuid = gpu_uuid
        self.slices = slices


class ServerHasLease(Conflict):
    """The server already holds a lease; one server never holds two."""

    def __init__(self, lease: LeaseFacts) -> None:
        where = lease.mig_uuid or lease.gpu_uuid or lease.node or "a slice"
        super().__init__(
            f"server {lease.user}/{lease.server_name} already holds lease {lease.id} "
            f"({lease.profile} on {where}, state {lease.state}); release it before claiming "
            "another one"
        )
        self.lease = lease
