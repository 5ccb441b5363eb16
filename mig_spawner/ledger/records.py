"""Plain, immutable values that go in and out of the ledger.

Nothing here touches a database: callers (the spawner, the slice service, the
allocator through a ``decide`` callback) get frozen copies, never live ORM
objects, so nothing can lazy-load outside a transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime

from mig_spawner.core.budget import Extra
from mig_spawner.core.keep import KeepOutcome

# Re-exported: the ledger's callers name the states and codes through it.
from mig_spawner.core.kinds import Kind, rules_of
from mig_spawner.core.lifecycle import HELD_STATES as HELD_STATES
from mig_spawner.core.lifecycle import LeaseState as LeaseState
from mig_spawner.core.lifecycle import PendingStop, StopRule, WarningEvent, WarningState
from mig_spawner.core.lifecycle import ReleaseCode as ReleaseCode

from .errors import InvalidDecision

MODES: tuple[str, ...] = tuple(Kind)
#: Every lease state, held ones first (:data:`HELD_STATES` re-exported from the core).
STATES: tuple[LeaseState, ...] = tuple(LeaseState)


def require_aware(name: str, value: datetime | None) -> None:
    """Refuse naive datetimes: the ledger stores UTC and cannot guess a naive value's zone."""
    if value is not None and value.utcoffset() is None:
        raise ValueError(
            f"{name} must be a timezone-aware datetime (e.g. datetime.now(timezone.utc)), "
            f"got naive {value.isoformat()}"
        )


@dataclass(frozen=True)
class LeaseRequest:
    """Who asks for a slice: one named server of one user (``server_name`` "" is the default)."""

    user: str
    server_name: str = ""

    def __post_init__(self) -> None:
        if not self.user:
            raise ValueError("a lease request needs a user name")


@dataclass(frozen=True, kw_only=True)
class GrantedSlice:
    """What a grant and the lease made from it share: the slice, where it lies, and whom
    it is charged to. Keyword-only, so the two records cannot drift apart in order.

    ``mode`` is the kind of slice (``mig_spawner.core.kinds``). ``start``/``size`` are
    memory slices on the GPU; they are what the ledger's uniqueness guarantee covers (a
    whole GPU covers all of them). A dynamic lease's ``mig_uuid``, ``gi_id`` and
    ``ci_id`` are ``None`` until the instance exists (see ``ledger.leases.activate``). On
    Kubernetes the device plugin picks the device, so the GPU fields may be ``None``
    and ``node``/``pod`` say where the server runs.
    """

    group: str
    profile: str
    compute_slices: int
    #: A lease's kind as ``leases.mode`` stores it (:class:`~mig_spawner.core.kinds.Kind`).
    mode: str
    host: str | None = None
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    start: int | None = None
    size: int | None = None
    mig_uuid: str | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    node: str | None = None
    pod: str | None = None
    #: When the server is stopped whatever it does (max session age); None: never.
    expires_at: datetime | None = None

    @property
    def memory_slices(self) -> range:
        """The memory slices this slice covers (empty when the placement is unknown)."""
        if self.start is None or self.size is None:
            return range(0)
        return range(self.start, self.start + self.size)


@dataclass(frozen=True, kw_only=True)
class Grant(GrantedSlice):
    """What the ``decide`` callback grants: one slice, checked before the ledger stores it."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise InvalidDecision(
                f"cannot record grant of {self.profile!r} ({self.mode}): " + "; ".join(problems)
            )

    def _problems(self) -> list[str]:
        problems: list[str] = []
        try:
            rules = rules_of(self.mode)
        except ValueError:
            problems.append(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
            rules = None
        if not self.group:
            problems.append("group (who is charged) is empty")
        if not self.profile:
            problems.append("profile is empty")
        if self.compute_slices < 1:
            problems.append(f"compute_slices must be >= 1, got {self.compute_slices}")
        if rules is not None and rules.placed:
            missing = [
                name
                for name in ("host", "gpu_uuid", "gpu_index", "start", "size")
                if getattr(self, name) in (None, "")
            ]
            if missing:
                problems.append(f"{self.mode} mode needs {', '.join(missing)}")
        if rules is not None and rules.device_at_claim and not self.mig_uuid:
            problems.append(f"{self.mode} mode leases an existing instance, so it needs "
                            "mig_uuid")
        if (self.start is None) != (self.size is None):
            problems.append("start and size go together")
        if self.start is not None and self.start < 0:
            problems.append(f"start must be >= 0, got {self.start}")
        if self.size is not None and self.size < 1:
            problems.append(f"size must be >= 1, got {self.size}")
        if self.size is not None and not self.gpu_uuid:
            problems.append("a placement (start/size) needs the gpu_uuid it lies on")
        if self.expires_at is not None and self.expires_at.utcoffset() is None:
            problems.append("expires_at must be timezone-aware")
        return problems


def check_grant(decision: object) -> Grant:
    """``decision`` (what a ``decide`` callback returned) if it is a :class:`Grant`."""
    if not isinstance(decision, Grant):
        raise InvalidDecision(
            f"decide() must return a Grant, it returned {type(decision).__name__}")
    return decision


@dataclass(frozen=True, kw_only=True)
class Lease(GrantedSlice):
    """One row of the ledger: a server bound to a slice, from claim to release."""

    id: str
    user: str
    server_name: str
    state: LeaseState
    claimed_at: datetime
    started_at: datetime | None = None
    last_activity_at: datetime | None = None
    released_at: datetime | None = None
    #: Why it ends (set from ``releasing`` on; the first code given is kept).
    release_code: ReleaseCode | None = None
    #: What is particular to this end, in free text (an exit status, an error's name).
    release_detail: str | None = None
    #: While ``releasing``: what still holds its slice, in plain words for its user.
    held_by: str | None = None
    #: The server process, recorded as soon as it exists (local hosts): where it runs,
    #: its PID and its start time in clock ticks since boot (tells a reused PID apart).
    holder_host: str | None = None
    holder_pid: int | None = None
    holder_start: int | None = None
    #: Where the slice service reaches the server directly (not through the proxy,
    #: whose routes would count its reads as the user's activity).
    server_url: str | None = None
    gpu_active_at: datetime | None = None
    peak_memory_mib: int | None = None
    #: The stop the user was warned of, while that warning is pending or carried out.
    warning: StopRule | None = None
    warned_at: datetime | None = None
    warning_deadline: datetime | None = None
    #: The user's last "Keep my server"; counts as activity.
    kept_at: datetime | None = None
    #: How often ``expires_at`` was moved on by a keep.
    extensions: int | None = None
    #: Kubernetes: the UID of the pod named in ``pod`` (a pod recreated under that name
    #: has another UID and is not this lease's holder).
    holder_pod_uid: str | None = None
    #: What the server is for, as its user said at spawn (sanitised, at most 80 characters).
    purpose: str | None = None
    #: Where its latest warning stands (``None``: never warned); ``warning`` is its rule
    #: while it is pending or carried out.
    warning_state: WarningState | None = None
    #: Every stop its user is warned of while that warning is pending, each with its
    #: own time (``warning`` above shows the soonest).
    stops: tuple[PendingStop, ...] = ()

    def pending_stop(self, rule: StopRule) -> PendingStop | None:
        """The pending warning of ``rule``'s stop (``None``: not warned of it)."""
        return next((s for s in self.stops if s.rule is rule), None)

    @property
    def held(self) -> bool:
        """True until the lease is released: its slice is not free for anyone else."""
        return self.state != LeaseState.RELEASED

    @property
    def server(self) -> str:
        """``user/server_name``, the way JupyterHub names a server in its logs."""
        return f"{self.user}/{self.server_name}"


@dataclass(frozen=True)
class KeepResult:
    """What a "Keep my server" did (:class:`~mig_spawner.core.keep.KeepOutcome`), and the
    lease as it now stands. ``message`` is for the user: plain words, no URLs or hosts."""

    outcome: KeepOutcome
    message: str
    lease: Lease | None = None


@dataclass(frozen=True)
class LeaseEvent:
    """A warning before a stop, or the user's answer to one."""

    lease_id: str
    at: datetime
    kind: WarningEvent
    rule: StopRule
    detail: str


@dataclass(frozen=True)
class RefusalRecord:
    """A spawn that got no slice: when, who, what they asked for, and the refusal code."""

    at: datetime
    user: str
    server_name: str
    offer: str
    reason: str
    profile: str | None = None  # the concrete profile, when the offer names one
    group: str | None = None  # the group it would have been charged to, when known
    host: str | None = None
    message: str = ""


@dataclass(frozen=True)
class LedgerView:
    """What ``decide`` sees inside the claim transaction: every held lease, and the clock.

    Where budgets apply (``ledger.usage.budget_horizon`` set), also the leases released within
    that horizon (``past``) and the admin's extra hours given within it (``extras``),
    read in the same transaction."""

    request: LeaseRequest
    leases: tuple[Lease, ...]
    now: datetime
    # Named only: each feature reads its own part, and a positional argument would land
    # in another's.
    _: KW_ONLY
    past: tuple[Lease, ...] = ()
    extras: tuple[Extra, ...] = ()
    #: Slices held from new grants, whatever the cause (a layout change, a GPU fault):
    #: (host, GPU UUID) -> memory slices.
    holds: Mapping[tuple[str, str], frozenset[int]] = field(default_factory=dict)
    #: The part of :attr:`holds` that GPU faults hold (docs/health.md).
    faulty: Mapping[tuple[str, str], frozenset[int]] = field(default_factory=dict)

    def taken(self, host: str, gpu_uuid: str) -> frozenset[int]:
        """Memory slices of one GPU that held leases cover."""
        return frozenset(
            slice_
            for lease in self.leases
            if lease.host == host and lease.gpu_uuid == gpu_uuid
            for slice_ in lease.memory_slices
        )

    def held_mig_uuids(self) -> frozenset[str]:
        """MIG device UUIDs that held leases use (pool mode: these instances are taken)."""
        return frozenset(lease.mig_uuid for lease in self.leases if lease.mig_uuid)
