"""The rules the ledger's stores run in their transactions, in-process and pure: what
"Keep my server" does (core/keep.py) and who may join the wait list
(core/waitlist/join.py). The stores' own tests (test_ledger.py, test_ledger_waitlist.py)
check that the answers are written in the same transaction as the read."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from mig_spawner.core.keep import KEEP_RESOLUTION, KeepOutcome, answer_keep
from mig_spawner.core.lifecycle import StopRule, WarningEvent, WarningState
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import Waiter, check_join

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
HOUR = 3600.0


@dataclass(frozen=True)
class Warned:
    """What Keep reads of a lease."""

    warning: StopRule | None = None
    warning_deadline: datetime | None = NOW + timedelta(minutes=10)
    expires_at: datetime | None = NOW + timedelta(minutes=10)
    extensions: int | None = None
    kept_at: datetime | None = None
    warning_state: WarningState | None = WarningState.PENDING


# (case, lease, extend_by, max_extensions, refused before, outcome, event, words)
KEEPS = [
    ("an idle warning: activity", Warned(StopRule.SERVER_IDLE), HOUR, 1, False,
     KeepOutcome.KEPT, WarningEvent.KEPT, "counts as in use"),
    ("no warning: activity, no event", Warned(None, warning_state=None), HOUR, 1, False,
     KeepOutcome.KEPT, None, "counts as in use"),
    ("max session age: extended", Warned(StopRule.MAX_SESSION_AGE), HOUR, 1, False,
     KeepOutcome.EXTENDED, WarningEvent.EXTENDED, "now stops at 13:10 UTC"),
    ("max session age, none left", Warned(StopRule.MAX_SESSION_AGE, extensions=1), HOUR, 1,
     False, KeepOutcome.REFUSED, WarningEvent.REFUSED, "already extended 1 time"),
    ("max session age, none allowed", Warned(StopRule.MAX_SESSION_AGE), None, 3, False,
     KeepOutcome.REFUSED, WarningEvent.REFUSED, "cannot be extended"),
    ("refused again: no second event", Warned(StopRule.MAX_SESSION_AGE, extensions=1), HOUR,
     1, True, KeepOutcome.REFUSED, None, "already extended"),
    ("a spent budget", Warned(StopRule.BUDGET), HOUR, 3, False, KeepOutcome.REFUSED,
     WarningEvent.REFUSED, "ask an admin for more hours"),
    ("a GPU being re-cut", Warned(StopRule.DRAIN), HOUR, 3, False, KeepOutcome.REFUSED,
     WarningEvent.REFUSED, "re-cutting the GPU"),
    ("a stop carried out", Warned(StopRule.SERVER_IDLE,
                                  warning_state=WarningState.CARRIED_OUT), HOUR, 3, False,
     KeepOutcome.GONE, None, "being stopped"),
]


@pytest.mark.parametrize(("case", "lease", "extend_by", "most", "refused", "outcome", "event",
                          "words"), KEEPS, ids=[k[0] for k in KEEPS])
def test_what_keep_answers(case, lease, extend_by, most, refused, outcome, event, words):
    answer = answer_keep(lease, NOW, extend_by=extend_by, max_extensions=most,
                         refused_before=refused)
    assert (answer.outcome, answer.event) == (outcome, event)
    assert words in answer.message or words in answer.detail
    assert "http" not in answer.message
    assert answer.ends_warning is (event in (WarningEvent.KEPT, WarningEvent.EXTENDED))
    if outcome is KeepOutcome.EXTENDED:
        assert answer.changes["expires_at"] == lease.expires_at + timedelta(hours=1)
        assert answer.changes["extensions"] == 1 and answer.changes["warning"] is None
    if outcome in (KeepOutcome.REFUSED, KeepOutcome.GONE):
        assert answer.changes == {}  # nothing on the lease moves


def test_keep_pressed_again_and_again_counts_once_per_resolution():
    kept = Warned(None, warning_state=WarningState.KEPT, kept_at=NOW)
    soon = NOW + timedelta(seconds=KEEP_RESOLUTION - 1)
    assert answer_keep(kept, soon, extend_by=HOUR, max_extensions=1,
                       refused_before=False).changes == {}
    later = NOW + timedelta(seconds=KEEP_RESOLUTION)
    assert answer_keep(kept, later, extend_by=HOUR, max_extensions=1,
                       refused_before=False).changes["kept_at"] == later


def waiter(entry_id: int, user: str, server: str = "") -> Waiter:
    return Waiter(entry_id, user, server, "analysts", 0, "small", NOW)


def test_a_server_may_join_once_up_to_the_users_limit_and_not_while_it_holds_a_slice():
    line = [waiter(1, "ana", "a"), waiter(2, "bob")]
    # Joining again resumes the entry it has (a restarted hub).
    assert check_join("ana", "a", line, max_waiting=1, holds_slice=False) == line[0]
    assert check_join("ana", "b", line, max_waiting=2, holds_slice=False) is None
    with pytest.raises(Refused) as limit:
        check_join("ana", "b", line, max_waiting=1, holds_slice=False)
    assert limit.value.reason is Reason.USER_LIMIT
    with pytest.raises(Refused) as held:
        check_join("cy", "", line, max_waiting=1, holds_slice=True)
    assert held.value.reason is Reason.PREVIOUS_LEASE
