"""The wait list's order rule against a brute-force model, and its documented example."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import (
    StarvationGuard,
    Waiter,
    first_served,
    group_shares,
    order,
    positions,
)

T0 = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
GROUPS = {"research": (5, 4), "teaching": (0, 6), "staff": (0, None)}  # priority, quota
OUTCOMES = ("fits", "none_free", "user_limit")


def precedes(a: Waiter, b: Waiter, shares: dict[str, float]) -> bool:
    """The rule written out pairwise, independently of ``order``'s sort key."""
    if a.priority != b.priority:
        return a.priority > b.priority
    if shares.get(a.group, 0.0) != shares.get(b.group, 0.0):
        return shares.get(a.group, 0.0) < shares.get(b.group, 0.0)
    return (a.joined_at, a.id) < (b.joined_at, b.id)


waiter_specs = st.lists(
    st.tuples(
        st.sampled_from(sorted(GROUPS)),
        st.sampled_from(["small", "large"]),
        st.integers(0, 40),  # minutes after T0
        st.sampled_from(OUTCOMES),
        st.integers(0, 4),  # bypassed
        st.sampled_from(["ana", "ben", "cy", "dee"]),
    ),
    max_size=9,
)
held_counts = st.dictionaries(st.sampled_from(sorted(GROUPS)), st.integers(0, 6))


def build(specs: list) -> tuple[list[Waiter], dict[int, str]]:
    waiters, outcome = [], {}
    for n, (group, offer, minute, result, bypassed, user) in enumerate(specs):
        waiters.append(
            Waiter(n, user, f"s{n}", group, GROUPS[group][0], offer,
                   T0 + timedelta(minutes=minute), bypassed)
        )
        outcome[n] = result
    return waiters, outcome


def serve_from(outcome: dict[int, str]):
    def serve(waiter: Waiter) -> str:
        if outcome[waiter.id] == "fits":
            return f"slice for {waiter.id}"
        raise Refused(Reason(outcome[waiter.id]), "no")

    return serve


@settings(max_examples=400, deadline=None)
@given(waiter_specs, held_counts, st.booleans())
def test_first_served_matches_the_brute_force_model(specs, held, guarded) -> None:
    waiters, outcome = build(specs)
    shares = group_shares(held, {g: q for g, (_, q) in GROUPS.items()}, capacity=14)
    guard = StarvationGuard(max_bypasses=3, max_age=30 * 60) if guarded else None
    now = T0 + timedelta(minutes=45)
    grant = first_served(waiters, serve_from(outcome), shares=shares, now=now, guard=guard)

    def blocking(w: Waiter) -> bool:
        return outcome[w.id] == "none_free" and guard is not None and guard.blocks(w, now)

    fitting = [w for w in waiters if outcome[w.id] == "fits"]
    # Model: served = a fitting waiter that no fitting or blocking waiter precedes.
    ahead_kinds = [x for x in waiters if outcome[x.id] == "fits" or blocking(x)]
    model = [w for w in fitting if not any(precedes(x, w, shares) for x in ahead_kinds)]
    if grant is None:
        assert model == []
        return
    assert [grant.waiter] == model
    assert grant.result == f"slice for {grant.waiter.id}"
    expected_passed = {
        x.id for x in waiters if outcome[x.id] == "none_free" and precedes(x, grant.waiter, shares)
    }
    assert {w.id for w in grant.passed_over} == expected_passed
    assert all(outcome[w.id] != "user_limit" for w in grant.passed_over)


@settings(max_examples=200, deadline=None)
@given(waiter_specs, held_counts, st.sets(st.sampled_from(["ana", "ben", "cy", "dee"])))
def test_positions_count_who_is_ahead_in_the_same_line(specs, held, skipped) -> None:
    waiters, _ = build(specs)
    shares = group_shares(held, {g: q for g, (_, q) in GROUPS.items()}, capacity=14)
    places = positions(waiters, shares, skipped)
    for w in waiters:
        ahead = [
            x for x in waiters
            if x.offer == w.offer and x.user not in skipped and precedes(x, w, shares)
        ]
        assert places[w.id] == len(ahead) + 1


def test_the_documented_example() -> None:
    # docs/policies.md, "Waiting": the same example, step by step.
    quotas = {"research": 4, "teaching": 6, "staff": None}
    ada = Waiter(1, "ada", "", "teaching", 0, "small", T0)
    bob = Waiter(2, "bob", "", "staff", 0, "small", T0 + timedelta(minutes=1))
    cyd = Waiter(3, "cyd", "", "research", 5, "small", T0 + timedelta(minutes=2))
    dan = Waiter(4, "dan", "", "teaching", 0, "large", T0 + timedelta(minutes=3))
    held = {"research": 4, "teaching": 3, "staff": 1}
    shares = group_shares(held, quotas, capacity=14)
    assert shares == {"research": 1.0, "teaching": 0.5, "staff": pytest.approx(1 / 14)}
    assert [w.user for w in order([ada, bob, cyd, dan], shares)] == ["cyd", "bob", "ada", "dan"]
    assert positions([ada, bob, cyd, dan], shares) == {3: 1, 2: 2, 1: 3, 4: 1}
    # cyd's research group is at its quota: skipped, blocks nobody; a small slice goes to bob.
    fits_small = {1: "fits", 2: "fits", 3: "group_quota", 4: "none_free"}
    grant = first_served([ada, bob, cyd, dan], serve_from(fits_small), shares=shares, now=T0)
    assert grant is not None and grant.waiter is bob
    # Dynamic mode: dan (large) was passed over 3 times; now he blocks the small line
    # until a large slice fits.
    dan3 = Waiter(4, "dan", "", "teaching", 0, "large", T0 - timedelta(minutes=1), bypassed=3)
    shares = group_shares(held, quotas, capacity=14)
    blocked = first_served(
        [ada, dan3], serve_from({1: "fits", 4: "none_free"}), shares=shares,
        now=T0 + timedelta(minutes=5), guard=StarvationGuard(max_bypasses=3, max_age=None),
    )
    assert blocked is None


def test_a_starving_waiter_blocks_by_age_too() -> None:
    old = Waiter(1, "ann", "", "g", 0, "large", T0)
    young = Waiter(2, "bea", "", "g", 0, "small", T0 + timedelta(minutes=1))
    serve = serve_from({1: "none_free", 2: "fits"})
    guard = StarvationGuard(max_bypasses=99, max_age=600)
    early = first_served([old, young], serve, shares={}, now=T0 + timedelta(minutes=5), guard=guard)
    assert early is not None and early.waiter is young and early.passed_over == (old,)
    late = first_served([old, young], serve, shares={}, now=T0 + timedelta(minutes=10), guard=guard)
    assert late is None


def test_quota_zero_puts_a_group_last() -> None:
    assert group_shares({"x": 0}, {"x": 0, "y": None}, 0) == {"x": float("inf"), "y": 0.0}
