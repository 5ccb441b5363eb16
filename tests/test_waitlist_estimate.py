"""Wait estimates: ranges from hold-time history, and "no estimate yet" without it."""

from __future__ import annotations

import pytest

from mig_spawner.core.policy import GroupPolicy
from mig_spawner.core.waitlist import (
    MIN_HISTORY,
    Estimate,
    Holder,
    HoldLimits,
    estimate_wait,
    history_for,
)

MIN = 60.0
# Past holds of one profile: 10 to 50 minutes.
HISTORY = [m * MIN for m in (10, 20, 20, 30, 30, 40, 50)]


def test_no_history_no_estimate() -> None:
    assert estimate_wait(1, [Holder(age=0)], HISTORY[: MIN_HISTORY - 1]) is None
    assert estimate_wait(1, [], HISTORY) is None
    # Without a session limit the group's limits bound no hold either.
    assert estimate_wait(1, [Holder(age=0)], [], limits=HoldLimits(idle=600)) is None


def test_before_history_exists_the_groups_limits_give_the_range_marked_as_such() -> None:
    # Idle limit 1 h, session limit 8 h (the shipped analysts' ratio); one holder 2 h in.
    limits = HoldLimits(idle=3600, session=8 * 3600)
    est = estimate_wait(1, [Holder(age=2 * 3600)], HISTORY[:2], limits=limits)
    assert est is not None and est.from_limits
    assert (est.low, est.high) == (0, 6 * 3600)  # idle limit already past; 6 h to 8 h
    assert est.said("usually") == "0-6 h by the limits in force (too few past sessions yet)"
    # Second in line: after that release, a fresh hold of 1 h to 8 h.
    second = estimate_wait(2, [Holder(age=2 * 3600)], [], limits=limits)
    assert second is not None and (second.low, second.high) == (3600, 14 * 3600)
    # A holder's own end (max_session_age already set on its lease) still caps it.
    capped = estimate_wait(1, [Holder(age=0, ends_within=1800)], [], limits=limits)
    assert capped is not None and capped.high == 1800
    # A holder's own idle limit, counted from its last activity, bounds it too: a
    # 1-day session left idle under a 5-minute limit while others wait goes within 5
    # minutes, not "0-24 h" (the demo said so of holders idle for minutes).
    demo = HoldLimits(idle=300, session=24 * 3600)
    idle = estimate_wait(1, [Holder(age=600, ends_within=24 * 3600 - 600, idle_within=180)],
                         [], limits=demo)
    assert idle is not None and (idle.low, idle.high) == (0, 180)
    assert idle.said("estimated") == "0-3 min by the limits in force (too few past sessions yet)"
    # Third in line: after the two holders' releases, the first waiter's fresh hold of
    # 5 min to 1 day.
    third = estimate_wait(3, [Holder(age=600, idle_within=180), Holder(age=60, idle_within=240)],
                          [], limits=demo)
    assert third is not None and (third.low, third.high) == (300, 180 + 24 * 3600)
    # Once history exists, it decides and says "usually".
    known = estimate_wait(1, [Holder(age=5 * MIN)], HISTORY, limits=limits)
    assert known is not None and not known.from_limits
    assert known.said("usually") == f"usually {known.text}"


def test_a_groups_limits_are_its_idle_limit_while_others_wait_and_its_session_age() -> None:
    group = GroupPolicy("analysts", server_idle_timeout=3600, max_session_age=8 * 3600)
    assert HoldLimits.of(group) == HoldLimits(3600, 8 * 3600)
    waited = GroupPolicy("analysts", server_idle_timeout=3600,
                         server_idle_timeout_when_waited=900, max_session_age=8 * 3600)
    assert HoldLimits.of(waited) == HoldLimits(900, 8 * 3600)
    assert HoldLimits.of(None) is None


def test_first_in_line_waits_for_the_earliest_release() -> None:
    # Two holders, 5 and 25 minutes in: the young one is judged by all holds, the older
    # one only by holds that lasted longer than 25 minutes.
    est = estimate_wait(1, [Holder(age=5 * MIN), Holder(age=25 * MIN)], HISTORY)
    assert est is not None
    assert 0 <= est.low <= est.high <= 20 * MIN
    assert est.text == f"{int(est.low // MIN)}-{int(-(-est.high // MIN))} min"


def test_later_in_line_waits_longer_and_limits_cap_the_wait() -> None:
    holders = [Holder(age=5 * MIN), Holder(age=25 * MIN)]
    waits = [estimate_wait(n, holders, HISTORY) for n in (1, 2, 3, 4)]
    assert all(w is not None for w in waits)
    lows = [w.low for w in waits if w]
    highs = [w.high for w in waits if w]
    assert lows == sorted(lows) and highs == sorted(highs)
    assert highs[3] > highs[0]
    # A holder that max_session_age ends in 2 minutes is released by then.
    capped = estimate_wait(1, [Holder(age=5 * MIN, ends_within=2 * MIN)], HISTORY)
    assert capped is not None and capped.high <= 2 * MIN


def test_a_holder_older_than_every_past_hold() -> None:
    est = estimate_wait(1, [Holder(age=3 * 3600)], HISTORY)
    assert est is not None and est.low == 0 and est.high == 30 * MIN


@pytest.mark.parametrize(
    ("low", "high", "text"),
    [(0, 30, "under 1 min"), (300, 900, "5-15 min"), (300, 330, "5-6 min"),
     (3600, 4 * 3600, "1-4 h")],
)
def test_estimate_text(low: float, high: float, text: str) -> None:
    assert Estimate(low, high).text == text


def test_position_starts_at_one() -> None:
    with pytest.raises(ValueError, match="starts at 1"):
        estimate_wait(0, [Holder(0)], HISTORY)


def test_history_is_the_groups_own_once_it_has_enough() -> None:
    holds = [("1g.18gb", "a", 60.0)] * 4 + [("1g.18gb", "b", 600.0), ("2g.35gb", "a", 9.0)]
    assert history_for(holds, "1g.18gb", "a") == [60.0] * 4 + [600.0]
    holds.append(("1g.18gb", "a", 60.0))
    assert history_for(holds, "1g.18gb", "a") == [60.0] * 5
    assert history_for(holds, "3g.71gb", "a") == []
