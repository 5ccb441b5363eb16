"""Allocator: pool and dynamic decisions, strategies and refusal messages."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from mig_spawner.core.allocator import (
    Occupancy,
    Placement,
    PoolGrant,
    SliceIndex,
    pick_dynamic,
    pick_pool,
)
from mig_spawner.core.allocator.tables import table
from mig_spawner.core.catalog import CatalogError, model
from mig_spawner.core.inventory import Inventory
from mig_spawner.core.refusal import Refused
from tests.mocking import make_gpu, make_inventory


def granted(result: object) -> Placement:
    assert isinstance(result, Placement), result
    return result


# --- pool mode ------------------------------------------------------------------------

POOL_LAYOUT = (("1g.18gb", 0), ("1g.18gb", 1), ("2g.35gb", 2), ("3g.71gb", 4))


def test_pool_pack_fills_the_busiest_gpu_and_spread_the_idlest() -> None:
    inv = make_inventory(make_gpu(0, layout=POOL_LAYOUT), make_gpu(1, layout=POOL_LAYOUT))
    held = {"MIG-1-4-3g.71gb"}
    pack = pick_pool(inv, held, "1g.18gb", "pack")
    spread = pick_pool(inv, held, "1g.18gb", "spread")
    assert isinstance(pack, PoolGrant) and isinstance(spread, PoolGrant)
    assert (pack.device.gpu_index, pack.device.start) == (1, 0)
    assert (spread.device.gpu_index, spread.device.start) == (0, 0)
    assert pack.placement == Placement(1, "GPU-0001", "1g.18gb", 0, 1)


def test_pool_ties_go_to_lowest_gpu_then_lowest_start() -> None:
    inv = make_inventory(make_gpu(0, layout=POOL_LAYOUT), make_gpu(1, layout=POOL_LAYOUT))
    grant = pick_pool(inv, {"MIG-0-0-1g.18gb", "MIG-1-0-1g.18gb"}, "1g.18gb")
    assert isinstance(grant, PoolGrant)
    assert grant.uuid == "MIG-0-1-1g.18gb"


def test_pool_skips_leased_and_busy_devices_and_says_so() -> None:
    inv = make_inventory(make_gpu(0, layout=POOL_LAYOUT, busy_starts=[2]),
                         make_gpu(1, layout=POOL_LAYOUT))
    refusal = pick_pool(inv, {"MIG-1-2-2g.35gb"}, "2g.35gb")
    assert isinstance(refusal, Refused)
    assert refusal.reason == "none_free"
    assert refusal.message == (
        "no 2g.35gb free on 2 GPUs (2 exist: 1 leased, 1 running processes that no lease "
        "accounts for); free now: 1g.18gb: 4, 3g.71gb: 2"
    )
    assert refusal.free == {"1g.18gb": 4, "3g.71gb": 2}


def test_pool_refusal_when_no_instance_of_the_profile_was_made() -> None:
    inv = make_inventory(make_gpu(0, layout=POOL_LAYOUT))
    refusal = pick_pool(inv, set(), "7g.141gb")
    assert isinstance(refusal, Refused) and refusal.reason == "none_free"
    assert "no 7g.141gb instance exists on the 1 GPU with MIG on" in refusal.message
    assert "nvidia-smi mig -cgi 7g.141gb -C" in refusal.message


def test_pool_wanted_per_model_on_a_mixed_host() -> None:
    inv = make_inventory(make_gpu(0, "h100", [("2g.20gb", 0)]), make_gpu(1, layout=POOL_LAYOUT))
    wanted = {"h100": "2g.20gb", "h200": "2g.35gb"}
    first = pick_pool(inv, set(), wanted, "spread")
    assert isinstance(first, PoolGrant) and first.device.profile == "2g.20gb"
    second = pick_pool(inv, {first.uuid}, wanted)
    assert isinstance(second, PoolGrant) and second.device.profile == "2g.35gb"
    refusal = pick_pool(inv, {first.uuid, second.uuid}, wanted)
    assert isinstance(refusal, Refused)
    assert refusal.message.startswith(
        "no 2g.20gb (H100 80GB) or 2g.35gb (H200 141GB) free on 2 GPUs")


def test_no_gpu_for_profile_names_what_the_host_has() -> None:
    inv = make_inventory(make_gpu(0, "h100", [("1g.10gb", 0)]))
    for refusal in (pick_pool(inv, set(), "2g.35gb"), pick_dynamic(inv, (), "2g.35gb")):
        assert isinstance(refusal, Refused) and refusal.reason == "no_gpu_for_profile"
        assert refusal.message.startswith(
            "no GPU here offers 2g.35gb; this host has 1 x H100 80GB; free now: 1g.10gb:")


def test_mig_disabled_tells_the_admin_what_to_run() -> None:
    inv = make_inventory(make_gpu(0, mig=(False, False)), make_gpu(1, mig=(False, True)))
    for refusal in (pick_pool(inv, set(), "1g.18gb"), pick_dynamic(inv, (), "1g.18gb")):
        assert isinstance(refusal, Refused) and refusal.reason == "mig_disabled"
        assert refusal.message == (
            "cannot give 1g.18gb: MIG mode is off on GPU 0; an admin enables it with "
            "'nvidia-smi -i 0 -mig 1' (root, GPU idle); GPU 1 has a MIG mode change waiting "
            "for a GPU reset ('nvidia-smi -i 1 -r' when idle); nothing else is free either"
        )


def test_bad_requests_raise_clear_errors() -> None:
    inv = make_inventory(make_gpu(0))
    with pytest.raises(ValueError, match="strategy must be 'pack' or 'spread', not 'best'"):
        pick_pool(inv, set(), "1g.18gb", "best")  # type: ignore[arg-type]
    with pytest.raises(CatalogError, match="not a MIG profile of any GPU model"):
        pick_dynamic(inv, (), "5g.99gb")
    with pytest.raises(CatalogError, match=r"valid profiles: 1g\.10gb"):
        pick_dynamic(inv, (), {"h100": "2g.35gb"})
    with pytest.raises(ValueError, match="demand weights must be numbers >= 0"):
        pick_dynamic(inv, (), "1g.18gb", demand={"1g.18gb": -1})


# --- dynamic mode ---------------------------------------------------------------------


def run_requests(inv: Inventory, names: Iterable[str], **kw: object) -> list[Placement]:
    """Ask for each profile in turn, keeping earlier grants as reservations."""
    reserved: list[Placement] = []
    for name in names:
        reserved.append(granted(pick_dynamic(inv, reserved, name, **kw)))  # type: ignore[arg-type]
    return reserved


def test_dynamic_keeps_room_where_the_driver_order_fragments() -> None:
    # Created without placements, 1g,1g,2g,3g fails on the 3g (the driver's order,
    # docs/mig-facts.md).
    inv = make_inventory(make_gpu(0, "h100"))
    got = run_requests(inv, ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"])
    assert [(p.start, p.size) for p in got] == [(0, 1), (1, 1), (2, 2), (4, 4)]
    m = model("h100")
    driver = [m.driver_starts(m.profile(n))[0] for n in ("1g.10gb", "2g.20gb")]
    assert driver == [6, 4]  # 1g at 6 and 2g at 4 would leave no 4-slice block


def test_dynamic_1g_double_memory_takes_the_slices_only_big_profiles_share() -> None:
    inv = make_inventory(make_gpu(0))
    assert granted(pick_dynamic(inv, (), "1g.35gb")).start == 6


def test_dynamic_counts_existing_instances_and_reservations_once() -> None:
    inv = make_inventory(make_gpu(0, layout=[("3g.71gb", 4)]))
    same = Placement(0, "GPU-0000", "3g.71gb", 4, 4)  # the claim whose instance now exists
    gone = Placement(9, "GPU-gone", "7g.141gb", 0, 8)  # a claim on a GPU no longer there
    assert granted(pick_dynamic(inv, [same, gone], "3g.71gb")).start == 0
    assert Occupancy.of(inv, [same]).free_counts()["3g.71gb"] == 1


def test_dynamic_pack_prefers_a_used_gpu_and_spread_an_empty_one() -> None:
    inv = make_inventory(make_gpu(0), make_gpu(1, layout=[("3g.71gb", 0)]))
    assert granted(pick_dynamic(inv, (), "1g.18gb", "pack")).gpu_index == 1
    assert granted(pick_dynamic(inv, (), "1g.18gb", "spread")).gpu_index == 0


def test_dynamic_only_one_media_instance_per_gpu() -> None:
    inv = make_inventory(make_gpu(0, layout=[("1g.18gb+me", 0)]),
                         make_gpu(1, layout=[("1g.18gb+me", 0)]), make_gpu(2, mig=(False, False)))
    refusal = pick_dynamic(inv, (), "1g.18gb+me")
    assert isinstance(refusal, Refused) and refusal.reason == "no_capacity"
    assert refusal.message.startswith(
        "no room for a new 1g.18gb+me on 2 GPUs (the one +me (media extensions) instance per "
        "GPU is taken on 2 GPUs); 1 more GPU with MIG off or pending; free now: 1g.18gb: 12,")


def test_dynamic_refusal_lists_what_can_still_be_created() -> None:
    inv = make_inventory(make_gpu(0, layout=[("3g.71gb", 0), ("2g.35gb", 4), ("1g.18gb", 6)]))
    refusal = pick_dynamic(inv, (), "2g.35gb")
    assert isinstance(refusal, Refused) and refusal.reason == "no_capacity"
    assert refusal.message == (
        "no room for a new 2g.35gb on 1 GPU (not enough free aligned memory slices on 1 GPU); "
        "nothing else is free either"
    )
    # Slices 6-7 free: 1g fits only at 6 (no 1g starts at 7), 1g double memory at 6.
    inv = make_inventory(make_gpu(0, layout=[("4g.71gb", 0), ("2g.35gb", 4)]))
    refusal = pick_dynamic(inv, (), "3g.71gb")
    assert isinstance(refusal, Refused)
    assert refusal.message.endswith("free now: 1g.18gb: 1, 1g.18gb+me: 1, 1g.35gb: 1")


def test_dynamic_media_rule_spans_profiles_on_a30() -> None:
    inv = make_inventory(make_gpu(0, "a30", [("1g.6gb+me", 3)]))
    refusal = pick_dynamic(inv, (), "2g.12gb+me")
    assert isinstance(refusal, Refused)
    assert "(the one +me (media extensions) instance per GPU is taken on 1 GPU)" in refusal.message
    assert granted(pick_dynamic(inv, (), "2g.12gb")).start == 0


def test_demand_steers_small_slices_away_from_blocks_in_demand() -> None:
    inv = make_inventory(make_gpu(0, "h100"))
    assert granted(pick_dynamic(inv, (), "1g.10gb")).start == 0
    # When 4g (only at start 0) is what people ask for, keep slices 0-3 free for it.
    demand = {"1g.10gb": 30, "2g.20gb": 20, "4g.40gb": 30, "7g.80gb": 10}
    assert granted(pick_dynamic(inv, (), "1g.10gb", demand=demand)).start >= 4


def test_free_counts_pool_and_dynamic() -> None:
    inv = make_inventory(make_gpu(0, layout=POOL_LAYOUT, busy_starts=[1]))
    index = SliceIndex(inv)
    index.hold("a lease", mig_uuid="MIG-0-4-3g.71gb")
    assert index.free_pool() == {"h200": {"1g.18gb": 1, "2g.35gb": 1}}
    dyn = Occupancy.of(inv).free_counts()
    assert dyn["1g.18gb"] == 0 and dyn["7g.141gb"] == 0
    assert Occupancy.of(make_inventory(make_gpu(0, "a30"))).free_counts() == {
        "1g.6gb": 4, "1g.6gb+me": 1, "2g.12gb": 2, "2g.12gb+me": 1, "4g.24gb": 1}


def test_occupancy_place_and_release_round_trip() -> None:
    inv = make_inventory(make_gpu(0), make_gpu(1, "a30"))
    occ = Occupancy.of(inv)
    p = granted(occ.pick_dynamic("2g.12gb+me"))
    placed = occ.place(p)
    assert placed != occ and placed.gpus[1].media_used
    a30 = placed.gpus[1]
    assert {p.name: c for p, c in zip(table("a30").profiles, a30.counts, strict=True) if c} == {
        "2g.12gb+me": 1
    }
    assert placed.release(p) == occ
    with pytest.raises(ValueError, match="no GPU GPU-x"):
        occ.place(Placement(5, "GPU-x", "1g.18gb", 0, 1))
