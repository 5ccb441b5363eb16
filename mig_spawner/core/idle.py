"""The idle limit in force and when an idle server is stopped: pure rules that the
slice service applies and the slice map and ``status`` show (docs/culling.md, "Idle
limits and the wait list"). No I/O, no JupyterHub import."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Protocol


class IdleLimits(Protocol):
    """A group's idle limits, in seconds (``None``: none);
    :class:`mig_spawner.core.policy.GroupPolicy` has them."""

    @property
    def server_idle_timeout(self) -> float | None: ...
    @property
    def server_idle_timeout_when_waited(self) -> float | None: ...
    @property
    def server_idle_timeout_when_unwaited(self) -> float | None: ...


def idle_limit(limits: IdleLimits, waited: bool) -> float | None:
    """The idle limit that applies now: ``server_idle_timeout_when_waited`` while
    someone waits for the server's size, else ``server_idle_timeout_when_unwaited``;
    either falls back to ``server_idle_timeout``."""
    pressured = (limits.server_idle_timeout_when_waited if waited
                 else limits.server_idle_timeout_when_unwaited)
    return limits.server_idle_timeout if pressured is None else pressured


def idle_deadline(
    now: datetime, active_at: datetime, limit: float, warn_before: float | None,
    warned: datetime | None,
) -> datetime:
    """When an idle server is stopped: ``limit`` after it was last active; where it
    is warned (``warn_before`` set) never before a warning with that time. A pending
    idle warning's deadline (``warned``) holds: a shorter limit since, such as someone
    starting to wait, does not bring it forward. Without one the stop is at least
    ``warn_before`` away, so the warning comes first."""
    due = active_at + timedelta(seconds=limit)
    if warn_before is None:
        return due
    if warned is not None:
        return max(due, warned)
    return max(due, now + timedelta(seconds=warn_before))
