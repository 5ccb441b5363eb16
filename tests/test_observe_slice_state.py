"""The slice map join: inventory (simulated GPU) + ledger leases + policy -> one row per slice."""

from __future__ import annotations

from datetime import timedelta

import pytest

from mig_spawner.core.policy import GroupPolicy
from mig_spawner.hub.models import HubServer, Kernel
from mig_spawner.ledger import Grant, LeaseRequest
from mig_spawner.observe.slice_state import activity_resolution, slice_map
from mig_spawner.service.cull_rules import Probe, activity_to_record
from tests.mocking import T0
from tests.support.observe_world import World, make_world


@pytest.fixture
def world(tmp_path):
    w = make_world(tmp_path)
    yield w
    w.close()


def snapshot(world: World, **kwargs):
    return slice_map(world.inventory(), world.ledger.leases.active(), world.clock.now, world.policy,
                     **kwargs)


def test_nothing_leased_every_slice_is_free(world):
    view = snapshot(world)
    assert [g.index for g in view.gpus] == [0, 1]
    assert view.count("free") == 8
    first = view.gpus[0]
    assert first.memory_slices == 8
    # 1g at 0 and 1, 2g at 2-3, 3g at 4-7: every memory slice is in an instance.
    assert first.free_memory_slices == ()
    assert [(r.profile, r.start) for r in first.slices] == [
        ("1g.18gb", 0), ("1g.18gb", 1), ("2g.35gb", 2), ("3g.71gb", 4)]


def test_leased_slice_names_holder_group_age_and_idle_time(world):
    device = world.device(0, "3g.71gb")
    world.lease("ada", "research", device, server="big", expires_in=timedelta(hours=8))
    world.clock.advance(minutes=5)
    world.ledger.usage.touch(world.leases["ada"].id, world.clock.now)
    world.clock.advance(minutes=3)
    row = next(r for r in snapshot(world).slices if r.mig_uuid == device.uuid)
    assert row.state == "leased"
    assert (row.user, row.server_name, row.group, row.server) == (
        "ada", "big", "research", "ada/big")
    assert row.age_seconds == pytest.approx(8 * 60)
    assert row.idle_seconds == pytest.approx(3 * 60)
    # The lease's deadline, the one the slice service stops the server at.
    assert row.session_left_seconds == pytest.approx(8 * 3600 - 8 * 60)
    assert row.idle_limit_seconds is None


def test_slice_without_activity_for_idle_after_is_idle(world):
    world.lease("bob", "analysts", world.device(1, "1g.18gb"))
    world.clock.advance(minutes=20)
    rows = [r for r in snapshot(world, idle_after=600).slices if r.user == "bob"]
    assert [r.state for r in rows] == ["idle"]
    assert rows[0].idle_limit_seconds == pytest.approx(1800)
    # Activity makes it leased again.
    world.ledger.usage.touch(world.leases["bob"].id, world.clock.now)
    assert [r.state for r in snapshot(world, idle_after=600).slices if r.user == "bob"] == [
        "leased"]


@pytest.mark.parametrize("idle_after", [30.0, 120.0, 900.0])
def test_a_busy_servers_tile_stays_leased_sweep_after_sweep(world, idle_after):
    # The demo's ratios: the map's idle limit is the kernel limit, swept 8 times as often
    # (2 min and 15 s); with a short kernel limit (30 s) a minute's write resolution
    # drew the busy slice idle for half of each minute.
    sweep = idle_after / 8
    lease = world.lease("bob", "analysts", world.device(1, "1g.18gb"))
    server = HubServer("bob", "", "/user/bob/", None, True, None, world.clock.now, None)
    busy = Probe(kernels=(Kernel("k", "python3", "busy", world.clock.now, 1),))
    states = []
    for _ in range(40):
        world.clock.advance(seconds=sweep)
        recorded = world.ledger.leases.get(lease.id).last_activity_at
        active = activity_to_record(world.clock.now, server, GroupPolicy("analysts"), busy,
                                    recorded,
                                    activity_resolution(idle_after))
        if active is not None:
            world.ledger.usage.touch(lease.id, active)
        states += [r.state for r in snapshot(world, idle_after=idle_after).slices
                   if r.user == "bob"]
    assert set(states) == {"leased"}


def test_processes_without_a_lease_make_an_orphan_and_memory_is_reported(world):
    device = world.device(0, "2g.35gb")
    world.sim.set_processes(device.uuid, [(4242, 2048), (4343, 1024)])
    row = next(r for r in snapshot(world).slices if r.mig_uuid == device.uuid)
    assert row.state == "orphan"
    assert "4242" in row.note and "no lease" in row.note
    assert row.processes == 2
    assert row.memory_used_mib == 3072


def test_active_lease_whose_instance_is_gone_is_an_orphan(world):
    device = world.device(1, "2g.35gb")
    world.lease("cy", "analysts", device)
    world.adapter.destroy_instance(1, device.gi_id)
    view = snapshot(world)
    row = next(r for r in view.slices if r.user == "cy")
    assert row.state == "orphan"
    assert "gone" in row.note
    assert (row.gpu_index, row.start, row.size) == (1, 2, 2)


def test_dynamic_claim_before_its_instance_exists_is_leased(tmp_path):
    world = make_world(tmp_path, "h200x1")  # MIG on, no instances
    try:
        gpu0 = world.inventory().gpus[0]
        decision = Grant(group="research", profile="3g.71gb", compute_slices=3,
                            mode="dynamic", host=world.inventory().host, gpu_uuid=gpu0.uuid,
                            gpu_index=0, start=4, size=4)
        world.ledger.leases.claim(LeaseRequest("dee"), lambda view: decision)
        view = snapshot(world)
        (row,) = view.slices
        assert (row.state, row.user, row.mig_uuid) == ("leased", "dee", None)
        assert "being created" in row.note
        assert view.gpus[0].free_memory_slices == (0, 1, 2, 3)
    finally:
        world.close()


def test_group_rows_count_hub_wide_leases_against_quotas(world):
    world.lease("ada", "research", world.device(0, "3g.71gb"))
    world.lease("eve", "research", world.device(1, "1g.18gb"))
    world.lease("bob", "analysts", world.device(0, "1g.18gb"))
    groups = {g.name: g for g in snapshot(world).groups}
    assert (groups["research"].slices, groups["research"].quota_slices) == (2, 2)
    assert groups["research"].compute_slices == 4
    assert (groups["analysts"].slices, groups["analysts"].quota_slices) == (1, 4)
    assert groups["analysts"].configured


def test_leases_of_other_hosts_count_for_groups_but_not_as_slices(world):
    decision = Grant(group="analysts", profile="1g.18gb", compute_slices=1, mode="pool",
                        host="other-host", gpu_uuid="GPU-elsewhere", gpu_index=0, start=0,
                        size=1, mig_uuid="MIG-elsewhere")
    world.ledger.leases.claim(LeaseRequest("far"), lambda view: decision)
    view = snapshot(world)
    assert all(r.user != "far" for r in view.slices)
    assert next(g for g in view.groups if g.name == "analysts").slices == 1


def test_naive_time_and_bad_idle_after_are_refused(world):
    with pytest.raises(ValueError, match="timezone-aware"):
        slice_map(world.inventory(), [], T0.replace(tzinfo=None))
    with pytest.raises(ValueError, match="idle_after"):
        slice_map(world.inventory(), [], T0, idle_after=0)


def test_released_leases_free_their_slice(world):
    lease = world.lease("ada", "research", world.device(0, "3g.71gb"))
    world.clock.advance(hours=1)
    world.ledger.leases.release(lease.id, "stopped")
    view = slice_map(world.inventory(), world.ledger.leases.history(),
                     world.clock.now + timedelta(1))
    assert view.count("free") == 8


def test_lease_on_a_gpu_the_host_no_longer_shows_is_a_lost_orphan(world):
    decision = Grant(group="research", profile="3g.71gb", compute_slices=3, mode="pool",
                        host=world.inventory().host, gpu_uuid="GPU-fell-off-the-bus",
                        gpu_index=5, start=0, size=4, mig_uuid="MIG-gone")
    world.ledger.leases.claim(LeaseRequest("fay"), lambda view: decision)
    view = snapshot(world)
    (row,) = view.lost
    assert (row.state, row.user, row.gpu_index) == ("orphan", "fay", 5)
    assert "not on this host" in row.note and "Xid" in row.note
    assert row in view.slices and view.count("orphan") == 1


def test_the_map_lists_who_waits_for_what_and_since_when(world):
    from mig_spawner.ledger import WaitRequest
    from mig_spawner.observe.slicemap import slicemap_json

    world.ledger.waits.join(WaitRequest("bob", "gpu", "analysts", 0, "small", 600))
    world.clock.advance(seconds=90)
    view = slice_map(world.inventory(), world.ledger.leases.active(), world.clock.now, world.policy,
                     waits=world.ledger.waits.waiting())
    (row,) = view.waiting
    assert (row.user, row.server_name, row.offer, row.group) == ("bob", "gpu", "small",
                                                                 "analysts")
    assert row.waited_seconds == 90
    assert slicemap_json(view)["waiting"][0]["since"] == row.since.isoformat()


def test_the_map_says_what_comes_next_for_each_server(world):
    """Per server, the limit in force and why (here: someone waits for ana's size, nobody
    for bob's), the soonest stop if nobody uses it from now on (bob's GPU is re-cut: its
    drain comes before its idle limit), and each pending warning with its time and
    whether Keep can put it off. Before, the map showed the plain limit ("idle 3m of
    10m") while the 5 min waited one applied, and no warning at all."""
    from mig_spawner.core.lifecycle import StopRule
    from mig_spawner.core.policy import build_policy
    from mig_spawner.ledger import WaitRequest
    from mig_spawner.observe.slicemap import slicemap_json

    policy = build_policy(offers=None, classes=None, groups={"analysts": {
        "allowed": ["1g.18gb", "2g.35gb"], "server_idle_timeout": "30m",
        "server_idle_timeout_when_unwaited": "40m", "server_idle_timeout_when_waited": "25m",
        "max_session_age": "8h"}})  # no extend_by: a session is never extended
    ana = world.lease("ana", "analysts", world.device(1, "1g.18gb"),
                      expires_in=timedelta(hours=8))
    bob = world.lease("bob", "analysts", world.device(1, "2g.35gb"))
    world.ledger.waits.join(WaitRequest("cy", "", "analysts", 0, "1g.18gb", 600))
    world.clock.advance(minutes=20)
    now = world.clock.now
    world.ledger.warnings.warn(ana.id, StopRule.SERVER_IDLE, now + timedelta(minutes=10), "idle")
    world.ledger.warnings.warn(bob.id, StopRule.DRAIN, now + timedelta(minutes=15), "re-cut")
    view = slice_map(world.inventory(), world.ledger.leases.active(), now, policy,
                     waits=world.ledger.waits.waiting())
    rows = {r.user: r for r in view.slices if r.user}
    a, b = rows["ana"], rows["bob"]
    assert (a.idle_limit_seconds, a.idle_limit_waited) == (25 * 60, True)
    assert (a.next_stop, a.next_stop_in_seconds) == (StopRule.SERVER_IDLE, 10 * 60)
    assert a.next_text == "server_idle in 10m (idle 25m: someone waits for its size)"
    assert a.warnings_text == "warned: server_idle in 10m (Keep possible)"
    assert (b.idle_limit_seconds, b.idle_limit_waited) == (40 * 60, False)
    assert (b.next_stop, b.next_stop_in_seconds) == (StopRule.DRAIN, 15 * 60)
    assert b.warnings_text == "warned: drain in 15m (no Keep)"
    shown = {r["user"]: r for g in slicemap_json(view)["gpus"] for r in g["slices"]
             if r["user"]}
    assert shown["bob"]["next_text"].startswith("drain in 15m")
    assert list(shown["bob"]["warnings"]) == [{"rule": "drain", "stops_in_seconds": 900.0,
                                         "keep": False}]
    # A session at its end with no extension left: warned, and no Keep to offer.
    world.ledger.warnings.warn(ana.id, StopRule.MAX_SESSION_AGE, now + timedelta(minutes=5),
                               "age")
    view = slice_map(world.inventory(), world.ledger.leases.active(), now, policy)
    [a] = [r for r in view.slices if r.user == "ana"]
    assert [(w.rule, w.keep) for w in a.warnings] == [
        (StopRule.MAX_SESSION_AGE, False), (StopRule.SERVER_IDLE, True)]
