"""The claim decision (policy, then allocator) on a real ledger and a simulated host.

No hub: these pin down which refusal a user hears first and what a grant records.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from mig_spawner.config import MIGPolicyConfig, load_config_files
from mig_spawner.core.refusal import Refused
from mig_spawner.gpu import connect
from mig_spawner.ledger import LeaseRequest
from mig_spawner.spawner.decide import free_now, make_decide
from mig_spawner.spawner.progress import ProgressLog
from tests.mocking import mig_device

GROUPS = Path(__file__).resolve().parents[1] / "jupyterhub_config.d" / "20-groups.py"
# Two 1g.18gb and one 2g.35gb on GPU 0; a 3g.71gb on GPU 1.
SIM = "h200x1:layout=1g.18gb*2,2g.35gb+h200x1:layout=3g.71gb"


@pytest.fixture(scope="module")
def policies():
    return MIGPolicyConfig(config=load_config_files(GROUPS)).build()


@pytest.fixture(scope="module")
def inventory():
    with connect(simulate=SIM) as adapter:
        return adapter.inventory()


def claim(ledger, policies, inventory, user, groups, offer, mode="pool", server=""):
    mine = policies.for_user(groups)
    decide = make_decide(mine, mine.offer(offer), inventory, mode, "pack")
    return ledger.leases.claim(LeaseRequest(user, server), decide)


def test_pool_grant_records_the_instance_group_and_session_end(ledger, policies, inventory):
    lease = claim(ledger, policies, inventory, "ana", ["analysts"], "small")
    device = mig_device(inventory, lease.mig_uuid)
    assert device.profile == lease.profile == "1g.18gb"
    assert (lease.gi_id, lease.ci_id, lease.start) == (device.gi_id, device.ci_id, device.start)
    assert lease.group == "analysts"
    # analysts have max_session_age "8h"
    assert lease.expires_at - lease.claimed_at == timedelta(hours=8)


def test_quota_is_told_before_availability(ledger, policies, inventory):
    claim(ledger, policies, inventory, "ana", ["analysts"], "medium")
    # ana's second server: the only 2g.35gb is taken, but what stops her is her limit.
    with pytest.raises(Refused) as e:
        claim(ledger, policies, inventory, "ana", ["analysts"], "medium", server="two")
    assert e.value.reason == "user_limit"
    assert "you already hold 1 of 1 slices" in e.value.message
    # bob is under his limit, so he hears that none is free, and what is.
    with pytest.raises(Refused) as e:
        claim(ledger, policies, inventory, "bob", ["analysts"], "medium")
    assert e.value.reason == "none_free"
    assert "free now: 1g.18gb: 2" in e.value.message


def test_slice_classes_follow_the_gpu_model(ledger, policies, inventory):
    lease = claim(ledger, policies, inventory, "mia", ["ml-team"], "large")
    assert lease.profile == "3g.71gb" and lease.gpu_index == 1


def test_dynamic_mode_reserves_a_placement_then_free_counts_drop(ledger, policies):
    with connect(simulate="h200x1") as adapter:
        empty = adapter.inventory()
    before = free_now(empty, [], "dynamic")["h200"]["3g.71gb"]
    lease = claim(ledger, policies, empty, "mia", ["ml-team"], "large", mode="dynamic")
    assert lease.mig_uuid is None and lease.size == 4  # created by the spawner next
    after = free_now(empty, ledger.leases.active(), "dynamic")["h200"]["3g.71gb"]
    assert (before, after) == (2, 1)


async def test_progress_is_replayed_to_late_readers_and_ends_with_the_start():
    log = ProgressLog()
    log.add(10, "Reserving a Small slice")

    async def read():
        return [e["message"] async for e in log.follow()]

    early = asyncio.ensure_future(read())
    await asyncio.sleep(0)  # one turn of the loop: the reader starts before the next add
    log.add(70, "Starting your server")
    late = asyncio.ensure_future(read())
    await asyncio.sleep(0)  # one turn of the loop: the late reader starts
    log.finish()
    expected = ["Reserving a Small slice", "Starting your server"]
    assert await asyncio.wait_for(early, 1) == expected
    assert await asyncio.wait_for(late, 1) == expected
