"""mig-spawner report: usage figures, the replay through the allocator, and layout advice."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.dates import num2date

from mig_spawner.cli.main import main
from mig_spawner.core.catalog import model
from mig_spawner.ledger import (
    Grant,
    Lease,
    LeaseRequest,
    Ledger,
    LedgerUnavailable,
    RefusalRecord,
)
from mig_spawner.report.advise import advise, candidate_layouts, count_refusals
from mig_spawner.report.demand import Request, held_steps, peak_concurrency, requests_of, usage
from mig_spawner.report.plots import concurrency_figure, demand_figure
from mig_spawner.report.replay import (
    GpuLayout,
    LayoutError,
    layout_inventory,
    replay_dynamic,
    replay_pool,
)
from tests.mocking import Clock

DAY = datetime(2026, 12, 1, tzinfo=UTC)
SMALL, BIG = "1g.18gb", "3g.71gb"


def at(hour: float) -> datetime:
    return DAY + timedelta(hours=hour)


def lease(user: str, group: str, profile: str, start: float, end: float | None,
          last_activity: float | None = None) -> Lease:
    """A ledger record as ``ledger.leases.history()`` returns it (hours from DAY)."""
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
    assert sorted(d.profile for d in inventory.mig_devices) == [SMALL, SMALL, "2g.35gb", BIG]
    ids = [d.gi_id for d in inventory.mig_devices]
    assert len(set(ids)) == len(ids)  # unique; no placement formula is assumed
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
    advice = advise(small_only(), requests, min_requests=1)
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
    advice = advise(small_only(1), requests_of(leases, [], at(17)), min_requests=1)
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
                ledger.leases.release(ids[user], "stopped")
                continue
            size = model("h200").profile(profile).placement_size
            decision = Grant(group=group, profile=profile, compute_slices=size,
                                mode="dynamic", host="gpu1", gpu_uuid=f"GPU-{gpu}",
                                gpu_index=gpu, start=start, size=size)
            ids[user] = ledger.leases.claim(LeaseRequest(user), lambda view, d=decision: d).id
            ledger.leases.activate(ids[user], mig_uuid=f"MIG-{user}", gi_id=1, ci_id=0)


def test_report_command_table_advice_yaml_and_plots(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    record_history(url)
    config, plots = tmp_path / "mig-config.yaml", tmp_path / "plots"
    status = main(["report", "--ledger-url", url, "--since", "2026-12-01T00:00",
                   "--until", "2026-12-02T00:00", "--simulate", "h200x2:layout=1g.18gb*7",
                   "--advise", "--min-requests", "1", "--write-config", str(config),
                   "--plots", str(plots)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert re.search(r"3g\.71gb +- +research", out) and re.search(r"1g\.18gb +- +analysts", out)
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
        ledger.refusals.record(LeaseRequest("r3"), offer=BIG, profile=BIG, reason="none_free",
                              group="research", host="gpu1", message="no 3g.71gb free")
        clock.now = at(10.5)
        ledger.refusals.record(LeaseRequest("a3", "second"), offer="small",
                              reason="user_limit", group="analysts", message="limit")
        kept = ledger.refusals.between(at(10.4))
        assert [(r.user, r.server_name, r.offer, r.reason) for r in kept] == [
            ("a3", "second", "small", "user_limit")]
        assert [r.at for r in ledger.refusals.between(until=at(10.3))] == [at(10.25)]
    assert main(["report", "--ledger-url", url, "--since", "2026-12-01",
                 "--until", "2026-12-02", "--json"]) == 0
    rows = {(r["profile"], r["group"]): r for r in json.loads(capsys.readouterr().out)["usage"]}
    assert rows[(BIG, "research")]["refused_capacity"] == 1
    assert rows[(BIG, "research")]["requests"] == 4
    # The class "small" is no profile: its refusal (before a slice was chosen) has a row
    # of its own, named in the class column, with no profile.
    assert "small" not in {profile for profile, _ in rows}
    assert rows[("", "analysts")]["classes"] == ["small"]
    assert rows[("", "analysts")]["refused_policy"] == 1


def test_the_report_keeps_classes_and_profiles_in_their_own_columns(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    record_history(url)
    clock = Clock(at(10.5))
    with Ledger.open(url, clock=clock) as ledger:
        # A class refused before a slice was chosen, and one refused with its profile known.
        ledger.refusals.record(LeaseRequest("a3"), offer="small", reason="user_limit",
                              group="analysts", message="limit")
        ledger.refusals.record(LeaseRequest("a4"), offer="small", profile=SMALL,
                              reason="none_free", group="analysts", message="none free")
    assert main(["report", "--ledger-url", url, "--since", "2026-12-01",
                 "--until", "2026-12-02"]) == 0
    table = capsys.readouterr().out.splitlines()
    header = table[2].split()
    assert header[:3] == ["PROFILE", "CLASS", "GROUP"]
    cells = {tuple(line.split()[:3]): line.split() for line in table[3:] if line.strip()
             and "analysts" in line}
    assert set(cells) == {(SMALL, "small", "analysts"), ("-", "small", "analysts")}
    requests = header.index("REQUESTS")
    assert cells[(SMALL, "small", "analysts")][requests] == "4"  # 3 granted, 1 refused
    assert cells[("-", "small", "analysts")][requests] == "1"


# --- reading only -------------------------------------------------------------------------

def test_report_opens_the_ledger_read_only(tmp_path, capsys):
    path = tmp_path / "ledger.sqlite"
    record_history(f"sqlite:///{path}")
    before = path.read_bytes()
    for url in (f"sqlite:///{path}", f"sqlite:///file:{path}?uri=true"):
        with Ledger.open_existing(url) as ledger:
            assert len(ledger.leases.history()) == 6
            with pytest.raises(LedgerUnavailable, match="readonly"):
                ledger.refusals.record(LeaseRequest("x"), offer=BIG, reason="none_free")
    assert main(["report", "--ledger-url", f"sqlite:///{path}", "--since", "2026-12-01",
                 "--until", "2026-12-02"]) == 0
    assert path.read_bytes() == before


def test_report_on_a_missing_ledger_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "nothing-here.sqlite"
    assert main(["report", "--ledger-url", f"sqlite:///{missing}"]) == 1
    err = capsys.readouterr().err
    assert f"there is no ledger at {missing}" in err
    assert "--ledger-url" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.postgres
def test_report_refuses_a_database_without_the_ledger_and_creates_no_table(postgres_url,
                                                                            capsys):
    from sqlalchemy import create_engine, inspect

    assert main(["report", "--ledger-url", postgres_url]) == 1
    assert "has no ledger tables" in capsys.readouterr().err
    engine = create_engine(postgres_url)
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_report_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out
    assert "--min-requests" in out and "never creates it" in out


def test_report_min_requests_default_is_the_advices():
    from mig_spawner.cli.report import DEFAULT_MIN_REQUESTS
    from mig_spawner.report.advise import MIN_REQUESTS

    assert DEFAULT_MIN_REQUESTS == MIN_REQUESTS


# --- advice worth following -----------------------------------------------------------------

def claim_all(url: str, plan: list[tuple[str, str, str, float, float | None, str | None]]
              ) -> None:
    """Record ``plan`` (user, group, profile, from, to or None = still held, GPU UUID or
    None) in the ledger at the hours given; a lease without a GPU UUID takes no slot."""
    clock = Clock(at(-1))
    events = sorted([(p[3], 1, n) for n, p in enumerate(plan)]
                    + [(p[4], 0, n) for n, p in enumerate(plan) if p[4] is not None])
    ids = {}
    with Ledger.open(url, clock=clock) as ledger:
        for hour, claiming, n in events:
            user, group, profile, _, _, gpu_uuid = plan[n]
            clock.now = at(hour)
            if not claiming:
                ledger.leases.release(ids[n], "stopped")
                continue
            shape = model("h200").profile(profile)
            size = shape.placement_size
            decision = Grant(group=group, profile=profile,
                                compute_slices=shape.compute_slices,
                                mode="dynamic" if gpu_uuid else "kube",
                                host="gpu1" if gpu_uuid else None, gpu_uuid=gpu_uuid,
                                gpu_index=0 if gpu_uuid else None,
                                start=0 if gpu_uuid else None, size=size if gpu_uuid else None)
            ids[n] = ledger.leases.claim(LeaseRequest(user, str(n)), lambda view, d=decision: d).id


def test_advice_on_five_requests_says_the_sample_is_too_small(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    claim_all(url, [(f"r{n}", "research", BIG, 9 + n, 10 + n, None) for n in range(5)])
    config = tmp_path / "advised.yaml"
    status = main(["report", "--ledger-url", url, "--since", "2026-11-30", "--until",
                   "2026-12-02", "--simulate", "h200x1:layout=1g.18gb*7", "--advise",
                   "--write-config", str(config)])
    captured = capsys.readouterr()
    assert status == 1  # nothing to write
    assert "sample: 5 requests over 1 day" in captured.out
    assert "no advice: the sample is too small" in captured.out
    assert "at least 50 requests (--min-requests)" in captured.out
    assert "->" not in captured.out and "mig-parted" not in captured.out
    assert not config.exists()
    assert main(["report", "--ledger-url", url, "--since", "2026-11-30", "--until",
                 "2026-12-02", "--simulate", "h200x1:layout=1g.18gb*7", "--advise",
                 "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)["advice"]
    assert advice["sample"] == {"requests": 5, "days": 1, "min_requests": 50,
                                "too_small": True}
    assert advice["changed_gpus"] == []


def contested_days(days: int) -> list[Request]:
    """Every day three pairs of 3g.71gb sessions overlap (one of each pair finds the only
    3g.71gb held) and ml-team uses its 1g.35gb once."""
    found = []
    for day in range(days):
        base = 24 * day
        for shift, start in enumerate((8, 11, 14)):
            for n in range(2):
                found.append(Request(at(base + start), at(base + start + 2.5), BIG,
                                     "research", f"r{shift}{n}", True))
        found.append(Request(at(base + 10), at(base + 11), "1g.35gb", "ml-team", "m", True))
    return sorted(found, key=lambda q: (q.arrive, q.user))


def test_advice_keeps_a_profile_a_group_still_asks_for():
    current = (GpuLayout(0, "h200", {BIG: 1, "1g.35gb": 2}),)
    requests = contested_days(10)
    # Trading both 1g.35gb for a second 3g.71gb would refuse 10 fewer requests (30 3g
    # refusals avoided, ml-team's 10 refused), but ml-team would lose its only size.
    two_big = (GpuLayout(0, "h200", {BIG: 2}),)
    assert count_refusals(two_big, requests) < count_refusals(current, requests)
    advice = advise(current, requests, allowed_by={"1g.35gb": ["ml-team"]})
    assert advice.sample.requests == 70 and not advice.too_small
    assert sum(d.profile == "1g.35gb" for d in layout_inventory(advice.proposed).mig_devices)
    assert advice.dropped == {}
    assert advice.summary().startswith("keep the current layout")


def test_advice_ranges_come_from_resampled_days_and_are_seeded():
    requests = contested_days(10)
    current = (GpuLayout(0, "h200", {SMALL: 7}),)
    advice = advise(current, requests)
    assert advice.sample.days == 10
    ranges = advice.ranges
    assert ranges.before.low <= advice.before.refused <= ranges.before.high
    assert ranges.after.low <= advice.after.refused <= ranges.after.high
    assert ranges.gain.low <= advice.fewer_refusals <= ranges.gain.high
    assert advise(current, requests).ranges == ranges  # same seed, same figures
    # Uneven days give a range of more than one value.
    uneven = [q for q in requests if q.arrive.day % 3 or q.profile != BIG]
    spread = advise(current, uneven).ranges.before
    assert spread.low < spread.high


def test_advice_names_who_loses_a_dropped_profile_and_which_gpu_to_drain(tmp_path, capsys):
    from mig_spawner.gpu import connect

    spec = "h200x1:layout=3g.71gb,1g.35gb*2"
    adapter = connect(simulate=spec)
    try:
        gpu_uuid = adapter.inventory().gpus[0].uuid
    finally:
        adapter.close()
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    # 60 requests for 3g.71gb over 10 days, in overlapping pairs; nobody asks for
    # 1g.35gb. One 3g.71gb lease on the GPU is still held.
    plan = [(q.user, q.group, q.profile, (q.arrive - DAY).total_seconds() / 3600,
             (q.leave - DAY).total_seconds() / 3600, None)
            for q in contested_days(10) if q.profile == BIG]
    plan.append(("now", "research", BIG, 24 * 10, None, gpu_uuid))
    claim_all(url, plan)
    (tmp_path / "20-groups.py").write_text(
        "c.MIGPolicyConfig.group_policies = {\n"
        "    'research': {'allowed': ['3g.71gb']},\n"
        "    'ml-team': {'allowed': ['1g.35gb', '3g.71gb']},\n"
        "}\n")
    status = main(["report", "--ledger-url", url, "--since", "2026-11-30", "--until",
                   "2026-12-12", "--simulate", spec, "--advise", "--config-dir",
                   str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "sample: 61 requests over 10 days" in out
    assert "-> 2x 3g.71gb  (changes; drain first: 1 lease held)" in out
    assert ("the proposal has no 1g.35gb any more (nobody asked for it in the window; "
            "groups allowed it: ml-team)") in out
    assert "GPU 0 changes but has 1 lease holding slices on it: drain it" in out
    assert "refused now:      30 of 61  (range " in out


# --- plots that match the ledger ----------------------------------------------------------

def test_held_steps_count_a_held_slice_to_the_right_edge():
    leases = [lease("ann", "a", SMALL, 9, 9.25), lease("bo", "a", SMALL, 9.1, None)]
    times, counts = held_steps(leases, at(8), at(10))[SMALL]
    assert times[0] == at(8) and times[-1] == at(10)
    assert counts == [0, 1, 2, 1, 1]  # bo still holds his slice at the window's end
    assert max(counts) == usage(leases, [], at(8), at(10))[0].peak_concurrent


def test_concurrency_plot_shows_minutes_of_use_up_to_now():
    # Twenty minutes of use in a 30-day window, one slice still held "now".
    now = at(9 + 20 / 60)
    leases = [lease("ann", "a", SMALL, 9, 9 + 5 / 60), lease("bo", "a", SMALL, 9 + 2 / 60, None)]
    fig = concurrency_figure(leases, now - timedelta(days=30), now, {SMALL: 7})
    ax = fig.axes[0]
    start, end = (num2date(x) for x in ax.get_xlim())
    assert end == now
    assert at(9) - timedelta(minutes=2) < start <= at(9)  # the window adapts to the data
    line = ax.get_lines()[0]
    assert list(line.get_ydata())[-1] == 1  # held to the right edge
    assert "2026-12-01 08:59 .. 09:20 UTC" in ax.get_title()


def test_demand_plot_is_titled_with_its_window():
    rows = usage([lease("ann", "a", SMALL, 9, 10)], [], at(0), at(48))
    assert "2026-12-01 00:00 .. 2026-12-03 00:00 UTC" in demand_figure(
        rows, at(0), at(48)).axes[0].get_title()


def test_report_shows_waits_and_abandoned_waits_per_offer_and_group(tmp_path, capsys):
    from mig_spawner.ledger import WaitRequest

    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    clock = Clock(at(9))
    decision = Grant(group="analysts", profile=SMALL, compute_slices=1, mode="pool",
                        host="gpu1", gpu_uuid="GPU-0", gpu_index=0, start=0, size=1,
                        mig_uuid="MIG-0")
    with Ledger.open(url, clock=clock) as ledger:
        entries = [ledger.waits.join(WaitRequest(u, "", "analysts", 0, "small", 3600))
                   for u in ("a0", "a1", "a2")]
        ledger.waits.join(WaitRequest("r0", "", "research", 0, BIG, 3600))
        clock.now = at(9.2)
        done = ledger.waits.grant(lambda e, v: decision, quotas={}, capacity=7, limit=1)
        assert [e.user for e in done.granted] == ["a0"]
        ledger.waits.cancel(entries[1].id, "cancelled by the user")
        ledger.waits.cancel(entries[2].id, "the hub restarted", state="abandoned")
    assert main(["report", "--ledger-url", url, "--since", "2026-12-01",
                 "--until", "2026-12-02"]) == 0
    out = capsys.readouterr().out
    assert "Wait list" in out and "ABANDONED" in out
    assert main(["report", "--ledger-url", url, "--since", "2026-12-01",
                 "--until", "2026-12-02", "--json"]) == 0
    rows = {(w["offer"], w["group"]): w for w in json.loads(capsys.readouterr().out)["waits"]}
    small = rows[("small", "analysts")]
    assert (small["waits"], small["granted"], small["cancelled"], small["abandoned"]) == (
        3, 1, 1, 1)
    assert small["median_minutes"] == pytest.approx(12)
    assert rows[(BIG, "research")]["waiting"] == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), max_size=30))
def test_peak_concurrency_is_the_most_intervals_open_at_one_moment(spans):
    """Against the definition: walk every start and end in time order, an end at t
    before a start at t, and keep the most open at once."""
    base = datetime(2026, 1, 1, tzinfo=UTC)
    intervals = [(base + timedelta(hours=a), base + timedelta(hours=a + d)) for a, d in spans]
    events = sorted((moment, step) for start, end in intervals
                    for moment, step in ((start, 1), (end, -1)))
    walked = [sum(step for _, step in events[:n + 1]) for n in range(len(events))]
    assert peak_concurrency(iter(intervals)) == max([0, *walked])
