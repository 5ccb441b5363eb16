"""GPU-hour budgets (mig_spawner.core.budget, the policy keys, the claim's check).

The retry time is checked against a brute-force scan, second by second, of the same
coverage rule: with no running servers it is exactly the first second a spawn is
covered (and a second earlier it is not), over rolling windows, several past leases,
whole GPUs (7 compute slices) and extra hours; with running servers it is never later
than the first second the spawn is covered when they run on and stop at any time.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mig_spawner.core import budget
from mig_spawner.core.budget import Extra, Span
from mig_spawner.core.policy import GroupPolicy, PolicyError, build_policy
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.ledger import LeaseRequest, Ledger
from tests.support.start_check import POLICY_WRONG
from tests.support.start_check import refusal as start_refusal

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)  # a Thursday, on a whole second
H = 3600.0


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def group(budget_s: float | None = None, user_s: float | None = None, window: float = 100.0,
          hold: float = 5.0) -> GroupPolicy:
    return GroupPolicy("team", allowed=("1g.18gb",), budget=budget_s, user_budget=user_s,
                       budget_window=window, budget_min_hold=hold)


def first_covered(g: GroupPolicy, user: str, compute: int, spans, extras, start: datetime,
                  horizon: float) -> datetime | None:
    """The first whole second from ``start`` at which the spawn is covered, by scanning."""
    for second in range(int(horizon) + 1):
        t = start + timedelta(seconds=second)
        if budget.covered(g, user, compute, spans, extras, t):
            return t
    return None


# Spans: (user, compute slices, start offset, length), offsets in seconds before NOW with
# microseconds, so that rounding to whole seconds is exercised.
_span = st.tuples(
    st.sampled_from(["ana", "ben"]),
    st.sampled_from([1, 2, 3, 4, 7]),  # 7: a whole H200
    st.floats(min_value=0, max_value=250, allow_nan=False).map(lambda x: round(x, 6)),
    st.floats(min_value=0.5, max_value=120, allow_nan=False).map(lambda x: round(x, 6)),
)
_extra = st.tuples(st.sampled_from([None, "ana"]),
                   st.floats(min_value=1, max_value=400, allow_nan=False),
                   st.floats(min_value=0, max_value=150, allow_nan=False))


def past_spans(raw, running: bool = False) -> list[Span]:
    spans = []
    for user, compute, ago, length in raw:
        start = at(-ago - length)
        end = None if running else start + timedelta(seconds=length)
        spans.append(Span("team", user, compute, start, end))
    return spans


@settings(max_examples=150, deadline=None)
@given(
    raw=st.lists(_span, max_size=6),
    extras_raw=st.lists(_extra, max_size=2),
    budget_s=st.one_of(st.none(), st.floats(min_value=50, max_value=900)),
    user_s=st.one_of(st.none(), st.floats(min_value=50, max_value=900)),
    window=st.sampled_from([60.0, 100.0, 240.0]),
    compute=st.sampled_from([1, 3, 7]),
)
def test_with_nothing_running_the_retry_time_is_exact(raw, extras_raw, budget_s, user_s, window,
                                                      compute):
    g = group(budget_s, user_s, window)
    spans = past_spans(raw)
    extras = [Extra("team", who, amount, at(-ago)) for who, amount, ago in extras_raw]
    retry = budget.retry_at(g, "ana", compute, spans, extras, NOW)
    # Every span and extra has left the window 2 windows from now: scanning that far
    # finds the first covered second, or none ever comes.
    assert retry == first_covered(g, "ana", compute, spans, extras, NOW, 2 * window + 2)
    if retry is not None:
        assert budget.covered(g, "ana", compute, spans, extras, retry)
        if retry > NOW:
            earlier = retry - timedelta(seconds=1)
            assert not budget.covered(g, "ana", compute, spans, extras, earlier)
            refusal = budget.refusal(g, "ana", compute, spans, extras, NOW)
            assert refusal is not None and refusal.retry_at == retry


@settings(max_examples=100, deadline=None)
@given(
    done=st.lists(_span, max_size=4),
    running=st.lists(_span, min_size=1, max_size=3),
    budget_s=st.floats(min_value=50, max_value=900),
    hold=st.sampled_from([0.0, 5.0, 20.0]),
    runs_on=st.floats(min_value=0, max_value=150),
    compute=st.sampled_from([1, 7]),
)
def test_with_servers_running_the_retry_time_is_never_late(done, running, budget_s, hold,
                                                           runs_on, compute):
    g = group(budget_s, None, 100.0, hold)
    live = past_spans(running, running=True)
    spans = past_spans(done) + live
    retry = budget.retry_at(g, "ana", compute, spans, [], NOW)
    # The running servers run on for ``runs_on`` seconds, but at least their minimum
    # hold (one stopped sooner frees the budget sooner: its release wakes the wait
    # list), then stop; until then each is charged its minimum hold at least.
    stops = {id(s): max(at(runs_on), s.start + timedelta(seconds=hold)) for s in live}

    def truly(t: datetime) -> list[Span]:
        return [s if s.end is not None or t < stops[id(s)] else replace(s, end=stops[id(s)])
                for s in spans]

    true_time = next((t for t in (at(k) for k in range(int(2 * 100 + runs_on + hold) + 3))
                      if budget.covered(g, "ana", compute, truly(t), [], t)), None)
    if true_time is not None:
        assert retry is not None and retry <= true_time


# Spawns: (second from NOW, user, compute slices, share of the minimum hold it runs).
# Few seconds to pick from: several spawns fall on the same second, as spawns at once do.
_spawn = st.tuples(st.integers(min_value=0, max_value=40), st.sampled_from(["ana", "ben"]),
                   st.sampled_from([1, 2, 7]), st.floats(min_value=0, max_value=1))


@settings(max_examples=200, deadline=None)
@given(
    done=st.lists(_span, max_size=4),
    spawns=st.lists(_spawn, min_size=1, max_size=10),
    budget_s=st.floats(min_value=20, max_value=300),
    user_s=st.one_of(st.none(), st.floats(min_value=20, max_value=300)),
    hold=st.sampled_from([5.0, 10.0, 30.0]),
    window=st.sampled_from([60.0, 100.0]),
)
def test_spawns_at_once_never_spend_past_the_budget(done, spawns, budget_s, user_s, hold,
                                                   window):
    """Spawns granted one after another as the serialised claims grant them (several in
    the same second), each server running at most its minimum hold: scanned second by
    second, no budget ever holds more than it has (or than the past leases alone held
    before: spawns add nothing to a spent budget). A refusal says when to retry."""
    g = group(budget_s, user_s, window, hold)
    past = past_spans(done)
    spans = list(past)
    for second, user, compute, share in sorted(spawns, key=lambda s: s[0]):
        now = at(second)
        # What the claim's transaction reads: released servers, and the running ones.
        seen = [s if s.end is None or s.end <= now else replace(s, end=None) for s in spans]
        if budget.covered(g, user, compute, seen, [], now):
            spans.append(Span("team", user, compute, now,
                              now + timedelta(seconds=round(share * hold, 6))))
        else:
            refused = budget.refusal(g, user, compute, seen, [], now)
            assert refused is not None and refused.reason is Reason.BUDGET_SPENT
            assert refused.retry_at is None or refused.retry_at > now
    for second in range(-10, int(40 + hold + 2)):
        t = at(second)
        for user in ("ana", "ben"):
            before = budget.standings(g, user, past, [], t)  # what the spawns found
            for standing, earlier in zip(budget.standings(g, user, spans, [], t), before,
                                         strict=True):
                assert standing.used <= max(standing.amount, earlier.used) + 1e-6, (
                    second, standing)


def test_a_whole_gpu_burns_seven_times_as_fast_and_monday_leaves_the_window():
    week = group(budget_s=40 * H, window=7 * 86400.0, hold=1800.0)
    monday = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
    # A whole H200 (7 compute slices) held Monday 09:00-14:00: 35 of the 40 hours.
    spans = [Span("team", "ana", 7, monday, monday + timedelta(hours=5))]
    thursday = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    assert budget.covered(week, "ana", 1, spans, [], thursday)  # 5h left pays 0.5h
    refusal = budget.refusal(week, "ana", 7, spans, [], thursday)  # needs 3.5h: 5h left
    assert refusal is None
    spans.append(Span("team", "ben", 3, thursday - timedelta(hours=1), thursday))
    refusal = budget.refusal(week, "ana", 7, spans, [], thursday)  # 2h left, needs 3.5h
    assert refusal is not None and refusal.reason is Reason.BUDGET_SPENT
    # Monday's whole-GPU hours leave the window from next Monday 09:00 at 7 an hour:
    # 1.5h more are free 1.5/7 h later, rounded up to the second.
    assert refusal.retry_at == monday + timedelta(days=7, seconds=math.ceil(1.5 * H / 7))
    assert "Retry at Monday 09:13 UTC, when the hours used on Monday leave the window" \
        in refusal.sentence, refusal.sentence
    assert "running" not in refusal.sentence


def test_running_servers_are_named_and_an_admin_grant_helps_at_once():
    g = group(budget_s=100.0, window=100.0, hold=10.0)
    spans = [Span("team", "ben", 1, at(-95), None)]
    refusal = budget.refusal(g, "ana", 1, spans, [], NOW)
    assert refusal is not None and "assumes your group's running servers stop now" in \
        refusal.sentence
    assert budget.refusal(g, "ana", 1, spans, [Extra("team", None, 20.0, NOW)], NOW) is None
    # A grant to another member's own budget does not raise the group's.
    assert budget.refusal(g, "ana", 1, spans, [Extra("team", "ben", 20.0, NOW)], NOW)


def test_a_member_budget_stops_one_member_and_not_the_others():
    g = group(budget_s=1000.0, user_s=50.0, window=100.0, hold=10.0)
    spans = [Span("team", "ana", 1, at(-50), at(-5))]
    assert not budget.covered(g, "ana", 1, spans, [], NOW)
    assert budget.covered(g, "ben", 1, spans, [], NOW)
    assert budget.refusal(g, "ana", 1, spans, [], NOW).message.startswith("your own")


def test_a_running_server_runs_out_when_the_budget_is_spent():
    g = group(budget_s=100.0, window=1000.0)
    spans = [Span("team", "ana", 2, at(-30), None)]  # 60 used, 40 left, burns 2 a second
    assert budget.exhausted_at(g, "ana", spans, [], NOW) == at(20)
    assert budget.exhausted_at(g, "ana", [replace(spans[0], end=NOW)], [], NOW) is None
    share = budget.standings(g, "ana", spans, [], NOW)[0].share_used
    assert share == pytest.approx(0.6)


def test_many_members_run_out_each_at_their_own_time_from_one_reading():
    """The slice map and the sweep ask when each running member's budgets run out from
    one :class:`~mig_spawner.core.budget.Exhaustion` (the group's budget worked out
    once): each answer is the member's own, the earlier of the group's and theirs."""
    g = group(budget_s=400.0, user_s=100.0, window=1000.0)
    spans = [Span("team", "ana", 1, at(-90), None),   # 90 of her 100: out in 10 s
             Span("team", "ben", 2, at(-20), None),   # 40 of his 100: out in 30 s
             Span("team", "cy", 1, at(-10), None),    # 10 of 100, but the group's
             Span("team", "dan", 1, at(-200), at(-140)),  # 60 held, then stopped
             Span("other", "ana", 3, at(-50), None)]  # another group: not counted
    extras = [Extra("team", "ben", 20.0, at(-5))]     # ben's own 20 more: 40 s
    # The group: 90 + 40 + 10 + 60 = 200 of 400, burning 4 a second: out in 50 s.
    each = budget.Exhaustion(spans, extras, NOW)
    assert {u: each.at(g, u) for u in ("ana", "ben", "cy", "dan")} == {
        "ana": at(10), "ben": at(40), "cy": at(50), "dan": at(50)}
    for user in ("ana", "ben", "cy", "dan"):
        assert each.at(g, user) == budget.exhausted_at(g, user, spans, extras, NOW)


# --- the policy keys ---------------------------------------------------------------------


def test_budget_keys_are_read_with_their_defaults():
    policies = build_policy(None, None, {"team": {
        "allowed": ["1g.18gb", "7g.141gb"], "budget": "40h", "user_budget": "10h"}})
    team = policies.group("team")
    assert (team.budget, team.user_budget, team.budget_window, team.budget_min_hold,
            team.budget_action, team.budget_warn_share) == (
        40 * H, 10 * H, 7 * 86400.0, 1800.0, "stop", 0.8)
    assert policies.budget_horizon == 7 * 86400.0
    assert build_policy(None, None, {"t": {"allowed": ["1g.18gb"]}}).budget_horizon is None


@pytest.mark.parametrize(("spec", "words"), [
    ({"budget": "40x"}, ["budget", "40x", "compute-slice-hours"]),
    ({"budget": "40h", "budget_window": "never"}, ["budget_window", "positive"]),
    ({"budget": "40h", "budget_action": "stopp"}, ["budget_action", "'stop'"]),
    ({"budget": "40h", "budget_warn_share": 1.5}, ["budget_warn_share", "1.5"]),
    ({"budget": "10h", "user_budget": "20h"}, ["user_budget", "more than the group's"]),
    ({"budget": "40h", "budget_min_hold": "8d"}, ["budget_min_hold", "budget_window"]),
    ({"budget": "2h", "budget_min_hold": "30m"}, ["'7g.141gb'", "cannot be paid for"]),
    ({"budgett": "2h"}, ["budgett", "did you mean 'budget'"]),
], ids=["bad-hours", "no-window", "action", "share", "member-above-group", "hold-too-long",
        "whole-gpu-unaffordable", "misspelt"])
def test_budget_mistakes_name_the_key(spec, words):
    with pytest.raises(PolicyError) as refused:
        build_policy(None, None, {"team": {"allowed": ["1g.18gb", "7g.141gb"], **spec}})
    for word in words:
        assert word in str(refused.value), str(refused.value)


# --- the claim's check, on a real ledger --------------------------------------------------


class Clock:
    """The ledger's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def world(tmp_path):
    from mig_spawner.gpu import connect

    with connect(simulate="h200x1:layout=1g.18gb*7+h200x1:layout=7g.141gb") as adapter:
        inventory = adapter.inventory()
    clock = Clock()
    policies = build_policy(None, None, {
        # 100 compute-slice-seconds per 100 s; 10 s minimum hold.
        "team": {"allowed": ["1g.18gb", "7g.141gb"], "max_slices_per_user": 2,
                 "budget": 100, "budget_window": 100, "budget_min_hold": 10},
        "spare": {"allowed": ["1g.18gb"]},
    })
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    ledger = Ledger.open(url, clock=clock)
    ledger.usage.budget_horizon = policies.budget_horizon
    yield ledger, policies, inventory, clock, url
    ledger.close()


def claim_as(world, user, offer, groups=("team",), server=""):
    from mig_spawner.spawner.decide import make_decide

    ledger, policies, inventory, _, _ = world
    mine = policies.for_user(list(groups))
    return ledger.leases.claim(LeaseRequest(user, server),
                        make_decide(mine, mine.offer(offer), inventory, "pool", "pack"))


def test_a_claim_is_refused_until_the_retry_time_and_succeeds_then(world, tmp_path):
    ledger, policies, _, clock, url = world
    whole = claim_as(world, "ana", "7g.141gb")  # 7 compute slices
    clock.now = at(12)
    ledger.leases.release(whole.id, "stopped")  # 84 of 100 used: 16 left, a 1g needs 10
    claim_as(world, "ben", "1g.18gb", server="a")  # covered
    with pytest.raises(Refused) as refused:
        claim_as(world, "ben", "7g.141gb", server="b")  # needs 70
    assert refused.value.reason is Reason.BUDGET_SPENT
    assert "assumes your group's running servers stop now" in refused.value.message
    # Durable: a ledger opened again (a restarted hub) counts the same hours.
    again = Ledger.open(url, clock=clock)
    again.usage.budget_horizon = policies.budget_horizon
    held = again.leases.active_for_server("ben", "a")
    again.leases.release(held.id, "stopped")
    again.close()
    with pytest.raises(Refused) as refused:
        claim_as(world, "ben", "7g.141gb", server="b")
    retry = refused.value.retry_at
    assert retry is not None and "Retry at" in refused.value.message
    clock.now = retry - timedelta(seconds=1)
    with pytest.raises(Refused):
        claim_as(world, "ben", "7g.141gb", server="b")
    clock.now = retry
    assert claim_as(world, "ben", "7g.141gb", server="b").profile == "7g.141gb"


def test_a_spent_group_passes_the_lease_to_another_group_and_extra_hours_help(world):
    ledger, _, _, clock, _ = world
    whole = claim_as(world, "ana", "7g.141gb")
    clock.now = at(14)
    ledger.leases.release(whole.id, "stopped")  # 98 used
    with pytest.raises(Refused):
        claim_as(world, "ana", "1g.18gb")
    # A member of a second group without a budget is charged there instead.
    assert claim_as(world, "ana", "1g.18gb", groups=("team", "spare")).group == "spare"
    ledger.usage.grant_hours("team", None, 20.0, by="admin", note="deadline")
    assert claim_as(world, "ben", "1g.18gb").group == "team"


# --- the admin's view: usage per group and member, extra hours --------------------------


def admin_world(tmp_path, team: str, held: tuple[float, float]) -> tuple[str, str]:
    """A hub config folder whose group 'team' has the policy ``team`` (its keys, as
    Python source), and a ledger where ana held a whole GPU from ``held[0]`` to
    ``held[1]`` seconds ago; returns the ledger's URL and the folder."""
    from mig_spawner.spawner.decide import make_decide

    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    config = tmp_path / "jupyterhub_config.d"
    config.mkdir()
    (config / "20-groups.py").write_text(
        "c = get_config()  # noqa: F821\n"
        f"c.MIGPolicyConfig.group_policies = {{'team': {{{team}}}}}\n")
    now = datetime.now(UTC)
    clock = Clock()
    clock.now = now - timedelta(seconds=held[0])
    with connect_sim() as inventory, Ledger.open(url, clock=clock) as ledger:
        mine = build_policy(None, None, {"team": {"allowed": ["7g.141gb"]}}).for_user(["team"])
        whole = ledger.leases.claim(LeaseRequest("ana"), make_decide(
            mine, mine.offer("7g.141gb"), inventory, "pool", "pack"))
        clock.now = now - timedelta(seconds=held[1])
        ledger.leases.release(whole.id, "stopped")
    return url, str(config)


def test_an_admin_sees_usage_per_group_and_member_and_grants_hours(tmp_path, capsys):
    from mig_spawner.cli.main import main

    # 2h of a whole GPU: 14 compute-slice-hours.
    url, config = admin_world(tmp_path, "'allowed': ['1g.18gb', '7g.141gb'], 'budget': '40h', "
                                        "'user_budget': '30h'", (3 * H, H))
    assert main(["budget", "-f", config, "--ledger-url", url, "grant", "team", "10h",
                 "--note", "deadline"]) == 0
    assert "granted 10 compute-slice-hours to the budget of group 'team'" in \
        capsys.readouterr().out
    assert main(["budget", "-f", config, "--ledger-url", url, "--json"]) == 0
    rows = {(r["group"], r["user"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows[("team", "")]["used_hours"] == pytest.approx(14)
    assert rows[("team", "")]["left_hours"] == pytest.approx(40 + 10 - 14)
    assert rows[("team", "ana")]["left_hours"] == pytest.approx(30 - 14)
    assert main(["budget", "-f", config, "--ledger-url", url, "grant", "nobody",
                 "1h"]) == 2
    assert "group 'nobody' has no budget" in capsys.readouterr().err
    assert main(["report", "-f", config, "--ledger-url", url]) == 0
    assert "GPU budgets (compute-slice-hours" in capsys.readouterr().out
    # The report's JSON has them too, as the budget command gives them.
    assert main(["report", "-f", config, "--ledger-url", url, "--json"]) == 0
    budgets = {(r["group"], r["user"]): r for r in json.loads(capsys.readouterr().out)["budgets"]}
    assert budgets == rows


def connect_sim():
    """A context giving the inventory of one H200 laid out as one whole-GPU instance."""
    from contextlib import contextmanager

    from mig_spawner.gpu import connect

    @contextmanager
    def inventory():
        with connect(simulate="h200x1:layout=7g.141gb") as adapter:
            yield adapter.inventory()

    return inventory()


def test_the_form_shows_the_budget_left_beside_each_size_and_when_a_spent_one_can_start():
    from mig_spawner.core.catalog import model
    from mig_spawner.spawner import form

    policies = build_policy(None, None, {"team": {
        "allowed": ["1g.18gb", "7g.141gb"], "budget": "40h", "budget_min_hold": "30m"}})
    mine = policies.for_user(["team"])
    team = policies.group("team")
    spans = [Span("team", "ana", 7, NOW - timedelta(hours=5), NOW - timedelta(hours=1))]

    def quota(offer, compute):
        refused = budget.refusal(team, "ana", compute, spans, [], NOW)
        return None if refused is None else refused.sentence

    def line(offer, compute):
        return budget.form_line(team, "ana", compute, spans, [], NOW)

    choices = {c.key: c for c in form.build_choices(
        mine, [model("h200")], {"h200": {"1g.18gb": 3, "7g.141gb": 1}}, quota,
        budget_line=line)}
    small, whole = choices["1g.18gb"], choices["7g.141gb"]
    assert small.available and small.budget == (
        "12 of 40 compute-slice-hours left in your group's budget in the last 7 days (1.7 "
        "whole-GPU hours): this size uses 1 an hour, so about 12h")
    assert "this size uses 7 an hour, so about 1h 42m" in whole.budget
    assert whole.available  # 12 left pays the 3.5 a whole GPU needs for 30 minutes
    html = form.render_form(list(choices.values()))
    assert "Budget: 12 of 40 compute-slice-hours left" in html


@pytest.mark.parametrize(("spec", "words"), [
    ("'budget': '40 hours a week'", ["group 'analysts'", "budget", "40 hours a week"]),
    ("'budget': '40h', 'budget_action': 'kill'", ["budget_action", "'refuse_new'"]),
])
def test_a_budget_mistake_stops_the_hub_with_the_key_named(tmp_path, monkeypatch, spec, words):
    monkeypatch.chdir(tmp_path)  # where the hub would make its database
    message = start_refusal(tmp_path, "c.MIGPolicyConfig.group_policies = "
                                     f"{{'analysts': {{'allowed': ['1g.18gb'], {spec}}}}}")
    assert POLICY_WRONG in message
    for word in words:
        assert word in message, message


def test_a_waiter_whose_budget_is_spent_is_passed_over_not_served_first(world):
    """Fair order: ana waits first, but her group's budget is spent; bo of a group
    with hours left gets the released slice, and ana is served once hers come back."""
    from mig_spawner.ledger import WaitRequest
    from mig_spawner.spawner.decide import make_decide

    ledger, policies, inventory, clock, _ = world
    whole = claim_as(world, "cy", "7g.141gb")
    fillers = [claim_as(world, f"u{i}", "1g.18gb", groups=("spare",)) for i in range(7)]
    clock.now = at(14)
    ledger.leases.release(whole.id, "stopped")  # team: 98 of 100 used; the 7g is free again
    for user, group in (("ana", "team"), ("bo", "spare")):
        ledger.waits.join(WaitRequest(user, "", group, 0, "1g.18gb", None))

    def decide(entry, view):
        mine = policies.for_user([entry.group])
        return make_decide(mine, mine.offer(entry.offer), inventory, "pool", "pack")(view)

    def grant():
        return [e.user for e in ledger.waits.grant(decide, quotas={}, capacity=8).granted]

    ledger.leases.release(fillers[0].id, "stopped")
    assert grant() == ["bo"]  # ana, first in line, could not start anyway
    ledger.leases.release(fillers[1].id, "stopped")
    assert grant() == []
    spans = budget.spans_of([], ledger.leases.history())
    clock.now = budget.retry_at(policies.group("team"), "ana", 1, spans, [], clock.now)
    assert grant() == ["ana"]


def test_the_slice_map_shows_each_group_budgets_use(world):
    from mig_spawner.observe.slice_state import slice_map

    ledger, policies, inventory, clock, _ = world
    whole = claim_as(world, "ana", "7g.141gb")
    clock.now = at(10)
    ledger.leases.release(whole.id, "stopped")
    claim_as(world, "ben", "1g.18gb")
    clock.now = at(20)  # 70 + 10 compute-slice-seconds used of 100
    view = slice_map(inventory, ledger.leases.active(), clock.now, policies,
                     budgets=ledger.usage.budget(at(-100)))
    rows = {g.name: g for g in view.groups}
    assert rows["team"].budget_used_hours * 3600 == pytest.approx(80)
    assert rows["team"].budget_hours * 3600 == pytest.approx(100)
    assert rows["team"].budget_text == "1.3 of 1.7 compute-slice-minutes"
    assert rows["spare"].budget_hours is None and rows["spare"].budget_text is None


def test_extra_hours_that_expire_before_the_hours_free_up_are_not_counted_on():
    # 98 of 100 used from 99 s to 1 s ago; 5 extra given 95 s ago leave the window in 5 s.
    g = group(budget_s=100.0, window=100.0, hold=12.0)
    spans = [Span("team", "ana", 1, at(-99), at(-1))]
    extras = [Extra("team", None, 5.0, at(-95))]
    # Without the expiry the spawn would be covered 6 s from now; with it, 11 s.
    assert budget.retry_at(g, "ana", 1, spans, extras, NOW) == at(11)
    assert not budget.covered(g, "ana", 1, spans, extras, at(10))


# --- small budgets: minutes or seconds where hours would round to 0 ----------------------


def test_a_small_budget_is_said_in_minutes_and_seconds_not_as_0_hours():
    g = group(budget_s=120.0, window=600.0, hold=30.0)  # "2m" per "10m", 30 s minimum hold
    spans = [Span("team", "ana", 1, at(-120), at(-20))]  # 100 s used: 20 left
    refused = budget.refusal(g, "ben", 1, spans, [], NOW)
    assert refused.message == (
        "the GPU budget of group 'team' has 20 compute-slice-seconds left of 2 "
        "compute-slice-minutes per 10m; this size needs 30 compute-slice-seconds (30s of 1 "
        "compute slice)")
    assert budget.form_line(g, "ben", 1, spans, [], NOW).startswith(
        "20 compute-slice-seconds of 2 compute-slice-minutes left in your group's budget "
        "in the last 10 minutes (2.9 whole-GPU seconds)")
    # A server started now keeps its minimum hold aside, and the message says so.
    running = [*spans, Span("team", "ana", 1, at(-2), None)]
    g = group(budget_s=120.0, window=600.0, hold=10.0)
    assert budget.refusal(g, "ben", 2, running, [], NOW).message == (
        "the GPU budget of group 'team' has 10 compute-slice-seconds left of 2 "
        "compute-slice-minutes per 10m (after 8 compute-slice-seconds set aside for the "
        "servers started less than 10s ago); this size needs 20 (10s of 2 compute slices)")


def test_the_budget_command_says_a_small_budget_in_minutes_and_seconds(tmp_path, capsys):
    from mig_spawner.cli.main import main

    # 15 s of 7 compute slices: 105 s.
    url, config = admin_world(tmp_path, "'allowed': ['7g.141gb'], 'budget': '2m', "
                                        "'budget_window': '10m', 'budget_min_hold': '10s'",
                              (60, 45))
    assert main(["budget", "-f", config, "--ledger-url", url, "grant", "team", "30s"]) == 0
    assert "granted 30 compute-slice-seconds to the budget of group 'team'" in \
        capsys.readouterr().out
    assert main(["budget", "-f", config, "--ledger-url", url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("GPU budgets (compute-slice-hours, or minutes (m) and seconds")
    # Used 1.75 minutes of 2, 30 s extra: 45 s left (not "0.0" hours each).
    assert table[2].split() == ["team", "(all)", "10m", "1.8m", "2m", "30s", "45s"]
