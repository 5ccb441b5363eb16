"""One pass of the wait list (``next_grants``) against today's rule: the grant step
(``first_served`` on the held leases, the passed-over waiters counted once more) called
once per free slice until nobody more is served, as a loop of one-grant passes did.

The fleet is modelled as slices per offer shared by every waiter (pool mode), or a
room where a large request needs room that small ones fill (dynamic mode, with the
starvation guard); users have a per-user limit and groups quotas, so every kind of
refusal (does not fit; skipped) occurs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import (
    StarvationGuard,
    Waiter,
    first_served,
    group_shares,
    next_grants,
)

T0 = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)
GROUPS = {"research": (5, 3), "teaching": (0, 4), "staff": (0, None)}  # priority, quota
QUOTAS = {g: q for g, (_, q) in GROUPS.items()}
SIZE = {"small": 1, "large": 4}


@dataclass(frozen=True)
class Held:
    user: str
    group: str
    offer: str


def fleet_serve(room: int, per_offer: dict[str, int] | None, per_user: int):
    """``serve(waiter, held)`` on a fleet of ``room`` compute slices (dynamic: any size
    fits while room is left) or of fixed slices per offer (pool)."""

    def serve(waiter: Waiter, held: Sequence[Held]) -> str:
        if sum(1 for h in held if h.user == waiter.user) >= per_user:
            raise Refused(Reason.USER_LIMIT, "at the limit")
        quota = QUOTAS[waiter.group]
        if quota is not None and sum(1 for h in held if h.group == waiter.group) >= quota:
            raise Refused(Reason.GROUP_QUOTA, "at the quota")
        if per_offer is not None:
            if sum(1 for h in held if h.offer == waiter.offer) >= per_offer[waiter.offer]:
                raise Refused(Reason.NONE_FREE, "none free")
        elif sum(SIZE[h.offer] for h in held) + SIZE[waiter.offer] > room:
            raise Refused(Reason.NO_CAPACITY, "no room")
        return f"{waiter.offer} for {waiter.id}"

    return serve


def take(waiter: Waiter, _grant: str) -> Held:
    return Held(waiter.user, waiter.group, waiter.offer)


def todays_rule(waiters, held, serve, *, capacity, now, guard):
    """The grant step as the ledger ran it, once per call, until it grants nothing."""
    line, holding, grants = list(waiters), list(held), []
    while True:
        shares = group_shares(Counter(h.group for h in holding), QUOTAS, capacity)
        view = tuple(holding)
        served = first_served(line, lambda w, view=view: serve(w, view), shares=shares, now=now,
                              guard=guard)
        if served is None:
            return grants
        grants.append((served.waiter.id, served.result,
                       tuple(w.id for w in served.passed_over)))
        holding.append(take(served.waiter, served.result))
        bump = {w.id for w in served.passed_over}
        line = [replace(w, bypassed=w.bypassed + (w.id in bump)) for w in line
                if w.id != served.waiter.id]


waiter_specs = st.lists(
    st.tuples(
        st.sampled_from(sorted(GROUPS)),
        st.sampled_from(sorted(SIZE)),
        st.integers(0, 40),  # minutes after T0
        st.integers(0, 3),  # bypassed so far
        st.sampled_from(["ana", "ben", "cy", "dee", "eve"]),
    ),
    max_size=10,
)
held_specs = st.lists(
    st.tuples(st.sampled_from(["ana", "ben", "zed"]), st.sampled_from(sorted(GROUPS)),
              st.sampled_from(sorted(SIZE))),
    max_size=5,
)


@settings(max_examples=500, deadline=None)
@given(waiter_specs, held_specs, st.booleans(), st.integers(2, 12), st.integers(1, 2),
       st.integers(1, 3))
def test_one_pass_grants_what_the_rule_grants_slice_by_slice(
    specs, held_specs, dynamic, room, per_user, max_bypasses
) -> None:
    waiters = [Waiter(n, user, f"s{n}", group, GROUPS[group][0], offer,
                      T0 + timedelta(minutes=minute), bypassed)
               for n, (group, offer, minute, bypassed, user) in enumerate(specs)]
    held = [Held(*h) for h in held_specs]
    per_offer = None if dynamic else {"small": room, "large": room // 4}
    serve = fleet_serve(room, per_offer, per_user)
    guard = StarvationGuard(max_bypasses, max_age=30 * 60) if dynamic else None
    now = T0 + timedelta(minutes=45)

    grants = next_grants(waiters, held, serve, take, quotas=QUOTAS, capacity=room, now=now,
                         guard=guard)

    expected = todays_rule(waiters, held, serve, capacity=room, now=now, guard=guard)
    assert [(g.waiter.id, g.result, tuple(w.id for w in g.passed_over))
            for g in grants] == expected
    # A limit stops the pass early and changes nothing before it.
    if grants:
        first = next_grants(waiters, held, serve, take, quotas=QUOTAS, capacity=room,
                            now=now, guard=guard, limit=1)
        assert [g.waiter.id for g in first] == [grants[0].waiter.id]


def test_a_waiter_passed_over_in_a_pass_counts_for_the_next_grant_of_that_pass() -> None:
    """A large request that does not fit, two small ones behind it that do: with one
    bypass allowed, the pass serves the first small one and then holds the room for
    the large one (dynamic mode's guard), as two grant steps in a row did."""
    ana = Waiter(0, "ana", "", "staff", 0, "large", T0, 0)
    ben = Waiter(1, "ben", "", "staff", 0, "small", T0 + timedelta(minutes=1), 0)
    cy = Waiter(2, "cy", "", "staff", 0, "small", T0 + timedelta(minutes=2), 0)
    grants = next_grants([ana, ben, cy], [], fleet_serve(3, None, 1), take, quotas=QUOTAS,
                         capacity=3, now=T0 + timedelta(minutes=5),
                         guard=StarvationGuard(max_bypasses=1))
    assert [(g.waiter.user, [w.user for w in g.passed_over]) for g in grants] == [
        ("ben", ["ana"])]
