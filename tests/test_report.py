"""mig-spawner report: usage figures, the replay through the allocator, and layout advice."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import Clock

from mig_spawner.cli.main import main
from mig_spawner.core.catalog import model
from mig_spawner.ledger import Decision, Lease, LeaseRequest, Ledger, RefusalRecord
from mig_spawner.report.advise import advise, candidate_layouts, count_refusals
from mig_spawner.report.demand import Request, requests_of, usage
from mig_spawner.report.replay import (
    GpuLayout,
    LayoutError,
    layout_inventory,
    replay_dynamic,
    replay_pool,
)

DAY = datetime(2026, 12, 1, tzinfo=UTC)
SMALL, BIG = "1g.18gb", "3g.71gb"


def at(hour: float) -> datetime:
    return DAY + timedelta(hours=hour)


def lease(user: str, group: str, profile: str, start: float, end: float | None,
          last_activity: float | None = None) -> Lease:
    """A ledger record as ``Ledger.history()`` returns it (hours from DAY)."""
    return Lease(
        id=f"{user}-{start}", user=user, server_name="", group=group, profile=profile,
        compute_slices=model("h200").profile(profile).compute_slices, mode="pool",
        state="released" if end is not None else "active", claimed_at=at(start),
        started_at=at(start), last_activity_at=at(last_activity if last_activity else start),
        released_at=None if end is None else at(end),
    )


def small_only(gpus: int = 2) -> tuple[GpuLayout, ...]:
    return tuple(GpuLayout(i, "h200", {SMALL: 7}) for i in range(gpus))


# --- usage figures -----------------------------------------------------------------------

def test_usage_per_profile_and_group():
    leases = [
        lease("ann", "analysts", SMALL, 9, 11, last_activity=10),   # 1 h idle tail of 2 h
        lease("bo", "analysts", SMALL, 10, 12, last_activity=12),   # busy to the end
        lease("cy", "research", BIG, 9, None, last_activity=9),     # still held at 17:00
    ]
    refusals = [
        RefusalRecord(at(10.5), "dee", "", BIG, "none_free", BIG, "research"),
        RefusalRecord(at(11), "eve", "", SMALL, "group_quota", SMALL, "analysts"),
    ]
    rows = {(r.profile, r.group): r for r in usage(leases, refusals, at(8), at(17))}
    small = rows[(SMALL, "analysts")]
    assert (small.requests, small.granted, small.refused_capacity, small.refused_policy) == (
        3, 2, 0, 1)
    assert small.hold_hours == pytest.approx(4)
    assert small.median_hold_minutes == pytest.approx(120)
    assert small.idle_share == pytest.approx(1 / 4)
    assert small.peak_concurrent == 2
    big = rows[(BIG, "research")]
    assert (big.requests, big.granted, big.refused_capacity) == (2, 1, 1)
    assert big.hold_hours == pytest.approx(8)  # clipped to the window's end
    assert big.median_hold_minutes is None  # none ended
    assert big.idle_share == pytest.approx(1.0)


def test_usage_clips_to_the_window_and_refuses_an_empty_one():
    rows = usage([lease("ann", "a", SMALL, 6, 10)], [], at(8), at(17), by_group=False)
    assert rows[0].group == "*" and rows[0].hold_hours == pytest.approx(2)
    with pytest.raises(ValueError, match="empty"):
        usage([], [], at(9), at(9))


def test_refused_requests_get_the_median_hold_of_their_profile():
    leases = [lease("a", "g", BIG, 9, 10), lease("b", "g", BIG, 9, 12)]
    refusals = [RefusalRecord(at(13), "c", "", BIG, "no_capacity", BIG),
                RefusalRecord(at(13), "d", "", BIG, "user_limit", BIG)]  # policy: not replayed
    requests = requests_of(leases, refusals, at(17))
    assert [(q.user, q.granted) for q in requests] == [("a", True), ("b", True), ("c", False)]
    assert requests[-1].leave - requests[-1].arrive == timedelta(hours=2)  # median of 1h, 3h


# --- replay through the allocator --------------------------------------------------------

def test_layout_inventory_lays_instances_where_nvidia_allows():
    inventory = layout_inventory((GpuLayout(0, "h200", {BIG: 1, "2g.35gb": 1, SMALL: 2}),))
    h200 = model("h200")
    covered = [s for d in inventory.mig_devices for s in range(d.start, d.start + d.size)]
    assert sorted(covered) == list(range(8))  # no overlap, every memory slice used
    for d in inventory.mig_devices:
        assert d.start in h200.profile(d.profile).placement_starts
        assert d.gi_id == h200.gi_id(d.start, d.size)
    assert sorted(d.profile for d in inventory.mig_devices) == [SMALL, SMALL, "2g.35gb", BIG]
    with pytest.raises(LayoutError, match="cannot hold"):
        layout_inventory((GpuLayout(0, "h200", {BIG: 3}),))


def test_replay_refuses_when_every_slice_of_the_profile_is_held():
    inventory = layout_inventory((GpuLayout(0, "h200", {BIG: 1, SMALL: 4}),))
    requests = [
        Request(at(9), at(12), BIG, "g", "a", True),
        Request(at(10), at(11), BIG, "g", "b", True),   # the only 3g is held: refused
        Request(at(12), at(13), BIG, "g", "c", True),   # freed at 12: granted
        Request(at(9), at(10), "2g.35gb", "g", "d", True),  # no such instance: refused
    ]
    result = replay_pool(inventory, requests)
    assert (result.served, result.refused) == (2, 2)
    assert result.refused_by_profile == {BIG: 1, "2g.35gb": 1}
    # Dynamic mode on one empty H200 creates what is asked when it fits.
    assert replay_dynamic(["h200"], requests).refused == 0


@settings(max_examples=25, deadline=None)
@given(
    # 3g at most once with up to four 1g: always a valid H200 layout.
    counts=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 4)), min_size=1, max_size=2),
    spans=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6), st.booleans()),
                   max_size=25),
)
def test_fast_count_agrees_with_the_allocator_replay(counts, spans):
    fleet = tuple(GpuLayout(i, "h200", {BIG: big, SMALL: small})
                  for i, (big, small) in enumerate(counts))
    requests = [Request(at(s), at(s + d), BIG if b else SMALL, "g", f"u{n}", True)
                for n, (s, d, b) in enumerate(spans)]
    assert count_refusals(fleet, requests) == replay_pool(layout_inventory(fleet),
                                                          requests).refused


# --- advice -------------------------------------------------------------------------------

def mismatched_history() -> tuple[list[Lease], list[RefusalRecord]]:
    """A week of small slices used, and big ones asked for and refused, on 2x 7x 1g."""
    leases, refusals = [], []
    for day in range(5):
        base = 24 * day
        for n in range(4):
            leases.append(lease(f"a{n}", "analysts", SMALL, base + 9 + n, base + 15 + n))
        for n, (start, hours) in enumerate([(9, 4), (10, 3), (11, 5)]):
            refusals.append(RefusalRecord(at(base + start), f"r{n}", "", BIG,
                                          "no_gpu_for_profile", BIG, "research"))
            # The same researchers got a big slice elsewhere in the past: hold times known.
            if day == 0:
                leases.append(lease(f"r{n}", "research", BIG, -48 + start, -48 + start + hours))
    return leases, refusals


def test_advice_on_a_mismatched_layout_lowers_refusals_and_says_by_how_much():
    leases, refusals = mismatched_history()
    requests = requests_of(leases, refusals, at(24 * 5))
    advice = advise(small_only(), requests)
    assert advice.before.refused >= 15  # every big request of the week
    assert advice.after.refused == 0
    assert advice.fewer_refusals == advice.before.refused
    # The proposal must really exist on an H200 and keep room for the 4 small users.
    proposed = layout_inventory(advice.proposed)
    assert sum(d.profile == BIG for d in proposed.mig_devices) >= 3
    assert sum(d.profile == SMALL for d in proposed.mig_devices) >= 4
    text = advice.summary()
    assert f"instead of {advice.before.refused}" in text and "fewer (100% fewer)" in text


def test_advice_keeps_a_layout_that_already_fits():
    leases = [lease(f"a{n}", "g", SMALL, 9, 12) for n in range(5)]
    advice = advise(small_only(1), requests_of(leases, [], at(17)))
    assert advice.changed == () and advice.after.refused == advice.before.refused == 0
    assert advice.summary().startswith("keep the current layout")


def test_candidate_layouts_are_maximal_and_valid():
    layouts = candidate_layouts("h200", frozenset({SMALL, BIG}))
    described = sorted(layout.describe() for layout in layouts)
    assert described == ["2x 3g.71gb", "3g.71gb + 4x 1g.18gb", "7x 1g.18gb"]


# --- the command ----------------------------------------------------------------------------

def record_history(url: str) -> None:
    """Dynamic-mode history on two H200: three 3g and three 1g used at once."""
    clock = Clock(at(8))
    plan = [  # (user, group, profile, gpu, start, from, to)
        ("r0", "research", BIG, 0, 0, 9, 12), ("r1", "research", BIG, 0, 4, 9.5, 13),
        ("r2", "research", BIG, 1, 0, 10, 11),
        ("a0", "analysts", SMALL, 1, 4, 9, 17), ("a1", "analysts", SMALL, 1, 5, 9, 16),
        ("a2", "analysts", SMALL, 1, 6, 10, 14),
    ]
    events = sorted([(f, 1, p) for p in plan for f in [p[5]]]
                    + [(p[6], 0, p) for p in plan], key=lambda e: (e[0], e[1]))
    ids = {}
    with Ledger.open(url, clock=clock) as ledger:
        for hour, claiming, (user, group, profile, gpu, start, _, _) in events:
            clock.now = at(hour)
            if not claiming:
                ledger.release(ids[user], "stopped")
                continue
            size = model("h200").profile(profile).placement_size
            decision = Decision(group=group, profile=profile, compute_slices=size,
                                mode="dynamic", host="gpu1", gpu_uuid=f"GPU-{gpu}",
                                gpu_index=gpu, start=start, size=size)
            ids[user] = ledger.claim(LeaseRequest(user), lambda view, d=decision: d).id
            ledger.activate(ids[user], mig_uuid=f"MIG-{user}", gi_id=1, ci_id=0)


def test_report_command_table_advice_yaml_and_plots(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    record_history(url)
    config, plots = tmp_path / "mig-config.yaml", tmp_path / "plots"
    status = main(["report", "--ledger-url", url, "--since", "2026-12-01T00:00",
                   "--until", "2026-12-02T00:00", "--simulate", "h200x2:layout=1g.18gb*7",
                   "--advise", "--write-config", str(config), "--plots", str(plots)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "3g.71gb  research" in out and "1g.18gb  analysts" in out
    assert "refused now:      3 of 6" in out
    assert "refused proposed: 0 of 6" in out
    assert "3 fewer (100% fewer)" in out
    written = yaml.safe_load(config.read_text())
    assert written["version"] == "v1"
    advised = written["mig-configs"]["mig-spawner-advised"]
    assert sum(e["mig-devices"].get(BIG, 0) * (2 if e["devices"] == "all" else len(e["devices"]))
               for e in advised) >= 3
    assert written["mig-configs"]["mig-spawner-current"] == [
        {"devices": "all", "mig-enabled": True, "mig-devices": {SMALL: 7}}]
    for name in ("concurrency.png", "demand.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_command_json(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    record_history(url)
    assert main(["report", "--ledger-url", url, "--since", "2026-12-01", "--until",
                 "2026-12-02", "--json", "--no-groups"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_profile = {row["profile"]: row for row in data["usage"]}
    assert by_profile[BIG]["peak_concurrent"] == 3
    assert by_profile[SMALL]["hold_hours"] == pytest.approx(8 + 7 + 4)


def test_report_command_says_what_is_wrong(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    assert main(["report", "--ledger-url", url, "--since", "last tuesday"]) == 2
    assert "neither a date" in capsys.readouterr().err
    assert main(["report", "--ledger-url", url, "--write-config", "x.yaml"]) == 2
    assert "--write-config needs --advise" in capsys.readouterr().err
    assert main(["report", "--ledger-url", url, "--since", "2026-12-02",
                 "--until", "2026-12-01"]) == 2
    assert "must be before" in capsys.readouterr().err


def test_ledger_keeps_refusals_and_the_report_counts_them(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    record_history(url)
    clock = Clock(at(10.25))
    with Ledger.open(url, clock=clock) as ledger:
        ledger.record_refusal(LeaseRequest("r3"), offer=BIG, profile=BIG, reason="none_free",
                              group="research", host="gpu1", message="no 3g.71gb free")
        clock.now = at(10.5)
        ledger.record_refusal(LeaseRequest("a3", "second"), offer="small",
                              reason="user_limit", group="analysts", message="limit")
        kept = ledger.refusals(at(10.4))
        assert [(r.user, r.server_name, r.offer, r.reason) for r in kept] == [
            ("a3", "second", "small", "user_limit")]
        assert [r.at for r in ledger.refusals(until=at(10.3))] == [at(10.25)]
    assert main(["report", "--ledger-url", url, "--since", "2026-12-01",
                 "--until", "2026-12-02", "--json"]) == 0
    rows = {(r["profile"], r["group"]): r for r in json.loads(capsys.readouterr().out)["usage"]}
    assert rows[(BIG, "research")]["refused_capacity"] == 1
    assert rows[(BIG, "research")]["requests"] == 4
    assert rows[("small", "analysts")]["refused_policy"] == 1
