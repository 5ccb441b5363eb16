"""The idle rules judged by what people do, the wait list's pressure and the warning
before a stop, in-process (:mod:`mig_spawner.service.cull_rules` is pure).

Times are the shipped defaults' (jupyterhub_config.d/20-groups.py, "analysts"): what a
user meets. The old warning bug escaped because tests set ``warn_before`` far below the
limit while the demo did not.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mig_spawner.config import MIGPolicyConfig, load_config_files
from mig_spawner.core.idle import idle_limit
from mig_spawner.core.lifecycle import StopRule
from mig_spawner.core.policy import GroupPolicy
from mig_spawner.hub.models import HubServer, Kernel, PeopleActivity, ServerStatus
from mig_spawner.ledger.records import Lease
from mig_spawner.service.cull_rules import (
    HUB_DATA_ONLY,
    UNREACHABLE,
    Probe,
    activity_to_record,
    decide_server,
    needs_probe,
    warnings_due,
)
from tests.mocking import warned_of

REPO = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
MIN = 60.0


def shipped(group: str = "analysts") -> GroupPolicy:
    config = load_config_files(REPO / "jupyterhub_config.d" / "20-groups.py")
    return MIGPolicyConfig(config=config).build().group(group)


ANALYSTS = shipped()
UNWAITED = replace(ANALYSTS, server_idle_timeout=idle_limit(ANALYSTS, waited=False))
WAITED = replace(ANALYSTS, server_idle_timeout=idle_limit(ANALYSTS, waited=True))
LIMIT = UNWAITED.server_idle_timeout
WARN = ANALYSTS.warn_before


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def server(started_ago: float = 2 * 3600, hub_active_ago: float = 5) -> HubServer:
    # The hub's last_activity moves with every request the proxy forwards: an open tab
    # keeps it a few seconds old.
    return HubServer("ana", "", "/user/ana/", None, True, None, ago(started_ago),
                     ago(hub_active_ago))


def lease(**kw) -> Lease:
    fields = dict(id="L1", user="ana", server_name="", group="analysts", profile="1g.18gb",
                  compute_slices=1, mode="pool", state="active", claimed_at=ago(2 * 3600),
                  started_at=ago(2 * 3600), expires_at=NOW + timedelta(hours=6))
    return Lease(**{**fields, **kw})


def look(interaction_ago: float | None, page_seen_ago: float | None = 10,
         terminal_ago: float | None = None, kernels: tuple[Kernel, ...] = ()) -> Probe:
    """What a look inside finds: the page's reports, and a status that an open tab's
    polling keeps fresh."""
    people = PeopleActivity(
        page_seen=None if page_seen_ago is None else ago(page_seen_ago),
        interaction=None if interaction_ago is None else ago(interaction_ago),
        terminal=None if terminal_ago is None else ago(terminal_ago),
    )
    return Probe(kernels=kernels, status=ServerStatus(ago(2 * 3600), ago(5), 1, 1),
                 people=people)


def warned(rule_deadline: tuple[StopRule, datetime] | None, srv, limits, probe, held):
    due = [(w.rule, w.deadline) for w in warnings_due(NOW, srv, limits, probe, held)]
    assert due == ([] if rule_deadline is None else [rule_deadline])


def test_the_shipped_defaults_warn_well_before_each_limit():
    assert WARN < WAITED.server_idle_timeout < ANALYSTS.server_idle_timeout <= LIMIT


def test_a_fresh_server_in_use_is_never_warned():
    # The demo's bug: warned "stops in about 9m" 10 s after the start, with a cell running.
    fresh = server(started_ago=10)
    busy = look(interaction_ago=2, kernels=(Kernel("k", "python3", "busy", ago(1), 1),))
    held = lease(claimed_at=ago(10), started_at=ago(10))
    for limits in (UNWAITED, WAITED):
        warned(None, fresh, limits, busy, held)
        warned(None, fresh, limits, None, held)
        assert decide_server(NOW, fresh, "analysts", limits, busy, held) is None


def test_a_server_started_from_the_wait_list_is_not_warned_in_its_first_minutes():
    """The hub's ``started`` is when the spawn began: a waiter's, before their wait. The
    report: a waiter was warned as her server started, and stopped 2 min later. Her
    server counts from its own start (its lease's): warned only once its idle stop
    truly falls within ``warn_before``."""
    waited = WAITED.server_idle_timeout
    srv = server(started_ago=waited + 60, hub_active_ago=waited + 60)
    opened = look(interaction_ago=None, page_seen_ago=5)  # her page open, not yet touched
    for probe in (opened, None):
        held = lease(claimed_at=ago(waited + 60), started_at=ago(30))
        warned(None, srv, WAITED, probe, held)
        assert decide_server(NOW, srv, "analysts", WAITED, probe, held) is None
    # Her own idle stop comes near: warned then, with the time it falls at.
    later = lease(claimed_at=ago(waited + 60), started_at=ago(waited - WARN))
    warned((StopRule.SERVER_IDLE, NOW + timedelta(seconds=WARN)), srv, WAITED, opened, later)


def test_an_open_untouched_tab_does_not_keep_the_server():
    # Its polling keeps the hub's and the status's activity seconds old; nobody typed
    # for the whole limit: warned (with warn_before to go, though the sweep came 30 s
    # late), then stopped at the warned time.
    srv, idle = server(), look(interaction_ago=LIMIT - WARN + 30)
    due = NOW + timedelta(seconds=WARN)
    warned((StopRule.SERVER_IDLE, due), srv, UNWAITED, idle, lease())
    warned(None, srv, UNWAITED, look(interaction_ago=LIMIT - WARN - 30), lease())
    after = NOW + timedelta(seconds=WARN)
    stop = decide_server(after, srv, "analysts", UNWAITED, look(LIMIT + 30),
                         warned_of(lease(), StopRule.SERVER_IDLE, due))
    assert stop is not None and stop.rule is StopRule.SERVER_IDLE


@pytest.mark.parametrize(
    ("case", "probe", "limits"),
    [
        ("typing in the page", look(interaction_ago=60), UNWAITED),
        ("a terminal in use", look(interaction_ago=LIMIT, terminal_ago=60), UNWAITED),
        ("a cell that printed a minute ago",
         look(LIMIT, kernels=(Kernel("k", "python3", "idle", ago(60), 1),)), UNWAITED),
        ("a cell running for hours",
         look(LIMIT, kernels=(Kernel("k", "python3", "busy", ago(3 * 3600), 1),)), UNWAITED),
        ("no page ever reported (VS Code, API clients): any request counts",
         look(None, page_seen_ago=None), UNWAITED),
        ("a server without mig-spawner's extension: any request counts",
         Probe(status=ServerStatus(ago(7200), ago(5), 1, 0)), UNWAITED),
        ("the group lets open tabs count", look(LIMIT), replace(UNWAITED, open_tab_counts=True)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_what_keeps_a_server_in_use(case, probe, limits):
    warned(None, server(), limits, probe, lease())
    assert decide_server(NOW, server(), "analysts", limits, probe,
                         warned_of(lease(), StopRule.SERVER_IDLE, ago(1))) is None


def test_keep_withdraws_the_warning_until_the_next_deadline_comes_near():
    srv, idle = server(), look(interaction_ago=LIMIT - 60)
    kept = lease(kept_at=NOW)
    warned(None, srv, UNWAITED, idle, kept)
    soon = NOW + timedelta(seconds=LIMIT - WARN - 1)
    assert warnings_due(soon, srv, UNWAITED, idle, kept) == []
    later = NOW + timedelta(seconds=LIMIT - WARN)
    [warning] = warnings_due(later, srv, UNWAITED, idle, kept)
    assert warning.deadline == NOW + timedelta(seconds=LIMIT)


def test_someone_waiting_shortens_the_limit_but_only_after_a_warning():
    srv, idle = server(), look(interaction_ago=WAITED.server_idle_timeout + 60)
    # Nobody waits: the longer limit, nothing due yet.
    warned(None, srv, UNWAITED, idle, lease())
    # Someone starts waiting: idle past the shorter limit already, but warned first,
    # with warn_before to save their work.
    due = NOW + timedelta(seconds=WARN)
    warned((StopRule.SERVER_IDLE, due), srv, WAITED, idle, lease())
    assert decide_server(NOW, srv, "analysts", WAITED, idle, lease()) is None
    pending = warned_of(lease(), StopRule.SERVER_IDLE, due)
    just_before = due - timedelta(seconds=1)
    assert decide_server(just_before, srv, "analysts", WAITED, idle, pending) is None
    stop = decide_server(due, srv, "analysts", WAITED, idle, pending)
    assert stop is not None and stop.rule is StopRule.SERVER_IDLE
    # The waiter gave up: the longer limit is far off again, the warning is withdrawn.
    warned(None, srv, UNWAITED, idle, pending)


def test_a_warning_whose_stop_did_not_come_is_withdrawn():
    overdue = warned_of(lease(), StopRule.SERVER_IDLE, ago(120))
    warned(None, server(), UNWAITED, UNREACHABLE, overdue)
    assert decide_server(NOW, server(), "analysts", UNWAITED, UNREACHABLE, overdue) is None


def test_without_looking_the_service_trusts_only_what_it_recorded():
    # The hub says "active 5 s ago" (the tab's polling); the lease says a look found
    # activity LIMIT ago: a look is due, and until then nothing is stopped unannounced.
    recorded = lease(last_activity_at=ago(LIMIT))
    assert needs_probe(NOW, server(), UNWAITED, recorded, None)
    fresh = lease(last_activity_at=ago(60))
    assert not needs_probe(NOW, server(), replace(UNWAITED, kernel_idle_timeout=None), fresh,
                           None)
    # A service that never looks (probe_servers off) judges by the hub, as before.
    assert decide_server(NOW, server(), "analysts", UNWAITED, HUB_DATA_ONLY, recorded) is None


def test_what_is_recorded_is_what_people_did_not_the_tabs_polling():
    srv = server()
    assert activity_to_record(NOW, srv, UNWAITED, look(interaction_ago=600), None, 60) == ago(600)
    assert activity_to_record(NOW, srv, UNWAITED, None, None, 60) is None
    assert activity_to_record(NOW, srv, UNWAITED, HUB_DATA_ONLY, None, 60) == ago(5)
