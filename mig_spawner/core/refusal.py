"""Why a spawn did not get a slice: the one list of reasons and the one refusal type.

Options parsing, the quota check and the allocator all say "no" with a
:class:`Refused`; the spawner turns it into the page the user sees and the status the
hub's REST API answers with (:attr:`Reason.status`). Pure: no I/O, no JupyterHub import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum


class Reason(StrEnum):
    """A stable code for why a spawn failed, with the HTTP status the hub answers.

    The values never change: the ledger's refusals table stores them, the hub's and the
    slice service's metrics label with them and ``mig-spawner report`` groups by them.
    """

    status: int

    def __new__(cls, value: str, status: int) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        return member

    # The request itself is wrong: send something else.
    INVALID_OPTIONS = "invalid_options", 400
    UNKNOWN_PROFILE = "unknown_profile", 400
    # The policy forbids it.
    NOT_ALLOWED = "not_allowed", 403
    NO_GPU_ACCESS = "no_gpu_access", 403
    # A limit is reached or the last run still holds its slice: stop something first.
    USER_LIMIT = "user_limit", 409
    GROUP_QUOTA = "group_quota", 409
    PREVIOUS_LEASE = "previous_lease", 409
    # Nothing fits now: try again later or pick another size.
    NONE_FREE = "none_free", 503
    NO_CAPACITY = "no_capacity", 503
    MIG_DISABLED = "mig_disabled", 503
    NO_GPU_FOR_PROFILE = "no_gpu_for_profile", 503
    # The GPU-hour budget cannot pay for this size now: retry at ``Refused.retry_at``.
    BUDGET_SPENT = "budget_spent", 429
    # Some would be free, but an admin is re-cutting their GPU (docs/layout.md).
    GPU_RECUT = "gpu_recut", 503
    # Some would be free, but their GPU is unhealthy: it reported a hardware fault
    # (docs/health.md), or the cluster reports it unhealthy.
    GPU_UNHEALTHY = "gpu_unhealthy", 503
    # Not refusals but failures (never kept in the refusals table): the spawn broke.
    LEASE_ENDED = "lease_ended", 409
    MIG_CREATE = "mig_create", 503
    # The server exited or did not answer, once more on the same slice too.
    SERVER_START = "server_start", 503
    MIG_BACKEND = "mig_backend", 503
    MIG_CONFIG = "mig_config", 500
    POLICY_CONFIG = "policy_config", 500
    ISOLATION = "isolation", 500


# Not frozen: raising sets __traceback__ (contextlib and pytest set it again), which a
# frozen dataclass forbids. Equal by value: the same question gets the same refusal.
@dataclass
class Refused(Exception):
    """No slice for this request. ``reason`` is the stable code; ``message`` says what is
    wrong in words for the user (``str()`` is the message); ``hint`` what they can do;
    ``free`` (from the allocator) what could be had instead right now: profile name ->
    free (pool) or creatable (dynamic); ``retry_at``: when the same spawn can succeed, where
    that is known (a spent budget)."""

    reason: Reason
    message: str
    hint: str = ""
    free: Mapping[str, int] = field(default_factory=dict)
    retry_at: datetime | None = None

    def __str__(self) -> str:
        return self.message

    def __hash__(self) -> int:
        return hash((self.reason, self.message, self.hint))

    @property
    def sentence(self) -> str:
        """Message and hint as one text, for a page that has room for both."""
        return f"{self.message}. {self.hint}." if self.hint else self.message
