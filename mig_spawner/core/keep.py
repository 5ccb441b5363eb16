"""What "Keep my server" does: the rule, pure.

The user answers a warning before a stop (docs/culling.md, "Warnings"). Against an idle
stop a Keep counts as activity; against max session age it moves the session's end by
the group's ``extend_by`` while fewer than ``max_extensions`` were granted; a spent
budget and a GPU being re-cut cannot be put off. :func:`answer_keep` decides on the
lease as the ledger read it under its lock, and says what to write; the ledger's
warnings store writes it in that same transaction. No I/O, no JupyterHub import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

from .durations import format_duration
from .lifecycle import StopRule, WarningEvent, WarningState

#: Seconds within which another "Keep my server" with no warning pending writes nothing:
#: a user pressing it again and again is one activity, not a row per press.
KEEP_RESOLUTION = 60.0


class KeepOutcome(StrEnum):
    """What a Keep did. The values are the ``outcome`` label of the hub's metric."""

    #: Counts as activity (an idle warning, or none pending).
    KEPT = "kept"
    #: Max session age moved on by ``extend_by``.
    EXTENDED = "extended"
    #: Nothing moves this stop (no extension left, a spent budget, a re-cut GPU).
    REFUSED = "refused"
    #: The server is not running any more.
    GONE = "gone"


class Warned(Protocol):
    """What Keep reads of a lease."""

    @property
    def warning(self) -> StopRule | None: ...
    @property
    def warning_deadline(self) -> datetime | None: ...
    @property
    def expires_at(self) -> datetime | None: ...
    @property
    def extensions(self) -> int | None: ...
    @property
    def kept_at(self) -> datetime | None: ...
    @property
    def warning_state(self) -> WarningState | None: ...


@dataclass(frozen=True)
class KeepAnswer:
    """The answer to one Keep: ``outcome`` and the user's ``message`` (plain words, no
    URLs or hosts); the lease's fields to write (``changes``, none when empty), and the
    ``event`` to record with its ``detail`` (``None``: none, so that pressing again and
    again is one row per change of state). ``rule``: the stop it answered (an idle
    stop when no warning is pending)."""

    outcome: KeepOutcome
    message: str
    rule: StopRule
    changes: Mapping[str, Any] = field(default_factory=dict)
    event: WarningEvent | None = None
    detail: str = ""

    @property
    def ends_warning(self) -> bool:
        """Whether it answers a pending warning for good (kept or extended)."""
        return self.event in (WarningEvent.KEPT, WarningEvent.EXTENDED)


def answer_keep(lease: Warned, now: datetime, *, extend_by: float | None, max_extensions: int,
                refused_before: bool) -> KeepAnswer:
    """The answer to a Keep of ``lease`` at ``now``, under its group's ``extend_by`` and
    ``max_extensions``. ``refused_before``: the lease's latest event already refuses
    its pending warning (no second refusal is recorded)."""
    rule = StopRule(lease.warning or StopRule.SERVER_IDLE)
    if lease.warning_state is WarningState.CARRIED_OUT:
        # The service has asked the hub to stop it: nothing puts that off now.
        return KeepAnswer(KeepOutcome.GONE, "This server is being stopped.", rule)
    if rule is StopRule.BUDGET:
        # Hours are not activity: a spent budget stops the server whatever the user
        # does; only an admin's extra hours move it.
        why = "A GPU budget cannot be extended with Keep"
        at = f", at {lease.warning_deadline:%H:%M} UTC" if lease.warning_deadline else ""
        return _refused(rule, why, f"{why}: the server stops when the budget is spent{at}. "
                        "Save your work, or ask an admin for more hours.", refused_before)
    if rule is StopRule.GPU_FAULT:
        # The GPU itself is faulty (docs/health.md): no answer makes it sound again.
        why = "The GPU of this slice reported a hardware fault"
        at = f" at {lease.warning_deadline:%H:%M} UTC" if lease.warning_deadline else \
            " when it ends"
        return _refused(rule, why, f"{why}: the server stops{at}. Save your work.",
                        refused_before)
    if rule is StopRule.DRAIN and lease.warning_deadline is not None:
        # The GPU is re-cut (docs/layout.md): no answer moves that stop.
        why = "An admin is re-cutting the GPU of this slice"
        return _refused(rule, why, f"{why}: the server stops at "
                        f"{lease.warning_deadline:%H:%M} UTC. Save your work.", refused_before)
    kept = KeepAnswer(KeepOutcome.KEPT, "Kept: your server counts as in use from now.", rule)
    if rule is not StopRule.MAX_SESSION_AGE or lease.expires_at is None:
        if lease.warning is None and lease.kept_at is not None and (
                (now - lease.kept_at).total_seconds() < KEEP_RESOLUTION):
            return kept  # pressed again: already counted
        return KeepAnswer(
            kept.outcome, kept.message, rule,
            {"kept_at": now, "warning": None, "warning_deadline": None},
            WarningEvent.KEPT if lease.warning is not None else None, "counts as activity")
    used = lease.extensions or 0
    if not extend_by or used >= max_extensions:
        why = (
            "Your group's sessions cannot be extended"
            if not extend_by or max_extensions == 0
            else f"This session was already extended {used} "
            f"time{'s' if used != 1 else ''}, the most your group allows"
        )
        return _refused(rule, why, f"{why}: the server stops at {lease.expires_at:%H:%M} UTC. "
                        "Save your work.", refused_before)
    expires = lease.expires_at + timedelta(seconds=extend_by)
    return KeepAnswer(
        KeepOutcome.EXTENDED,
        f"Extended by {format_duration(extend_by)}: your server now stops at "
        f"{expires:%H:%M} UTC.", rule,
        {"expires_at": expires, "extensions": used + 1, "kept_at": now, "warning": None,
         "warning_deadline": None},
        WarningEvent.EXTENDED,
        f"expires_at {expires.isoformat()} ({used + 1} of {max_extensions})")


def keep_can_help(lease: Warned, now: datetime, *, extend_by: float | None,
                  max_extensions: int) -> bool:
    """Whether a Keep now would put off the stop ``lease``'s warning names (kept or
    extended, not refused): the pages offer "Keep my server" only then."""
    answer = answer_keep(lease, now, extend_by=extend_by, max_extensions=max_extensions,
                         refused_before=True)
    return answer.outcome in (KeepOutcome.KEPT, KeepOutcome.EXTENDED)


def _refused(rule: StopRule, why: str, message: str, refused_before: bool) -> KeepAnswer:
    return KeepAnswer(KeepOutcome.REFUSED, message, rule,
                      event=None if refused_before else WarningEvent.REFUSED, detail=why)
