"""Whole GPUs (MIG off) beside MIG slices: the offer, the claim, quotas, the holder
rule, and the ledger's guarantee that a whole GPU and a slice of it are never both
granted. In-process, on a real ledger and simulated GPUs (docs/policies.md, "Whole
GPUs"; docs/architecture.md, "Kinds")."""

from __future__ import annotations

import asyncio
import os
import threading
from datetime import UTC, datetime

import pytest
from traitlets.config import Config

from mig_spawner import holder
from mig_spawner.cli.status import render_text
from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.catalog import model
from mig_spawner.core.kinds import Kind
from mig_spawner.core.policy import PolicyError, build_policy
from mig_spawner.core.refusal import Refused
from mig_spawner.device_cgroup import SliceCgroups
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.hub.client import HubClient
from mig_spawner.kinds import Confinement, kind_of
from mig_spawner.ledger import DoubleGrant, LeaseRequest, Ledger, ReleaseCode
from mig_spawner.ledger import transactions as ledger_transactions
from mig_spawner.observe.slice_state import slice_map
from mig_spawner.release import GiveBack, HolderProbes, LocalProcesses, Releaser
from mig_spawner.report.demand import requests_of
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper
from mig_spawner.spawner.decide import free_now, make_decide
from mig_spawner.spawner.startup import policy_warnings
from tests.mocking import make_gpu, make_inventory
from tests.support.system_deps import missing

# GPU 0: seven 1g.18gb instances; GPU 1 and 2: MIG off.
MIXED = "h200x1:layout=1g.18gb*7+h200x1:mig=off+rtx-pro-6000x1:mig=off"
CLASSES = {"small": {"profiles": {"h200": "1g.18gb", "rtx-pro-6000": "1g.24gb"}}}


def policies(**group):
    settings = {"allowed": ["small", "gpu"], "max_slices_per_user": 2, **group}
    return build_policy({"gpu": {"display_name": "Whole GPU"}}, CLASSES, {"ml": settings})


@pytest.fixture(scope="module")
def inventory():
    with connect(simulate=MIXED) as adapter:
        return adapter.inventory()


def claim(ledger, inventory, user, offer, mode="pool", server="", **group):
    mine = policies(**group).for_user(["ml"])
    return ledger.leases.claim(LeaseRequest(user, server),
                        make_decide(mine, mine.offer(offer), inventory, mode, "pack"))


def test_the_policy_offers_a_whole_gpu_by_its_own_name():
    built = policies()
    offer = built.offer("GPU")
    assert (offer.key, offer.whole, offer.display_name) == ("gpu", True, "Whole GPU")
    assert offer.profile_for("h200") == "gpu"
    # A pool layout needs MIG instances only: the whole GPU is none.
    assert "gpu" not in built.profile_names()
    with pytest.raises(PolicyError, match="class 'gpu': a class name must not"):
        build_policy({}, {"gpu": {"profiles": {"h200": "7g.141gb"}}}, {})
    with pytest.raises(PolicyError, match="a whole GPU is the offer 'gpu'"):
        build_policy({}, {"big": {"profiles": {"h200": "gpu"}}}, {})


@pytest.mark.parametrize("mode", ["pool", "dynamic"])
def test_a_mixed_host_offers_slices_and_whole_gpus(inventory, mode):
    free = free_now(inventory, [], mode)
    assert free["h200"]["gpu"] == 1 and free["rtx-pro-6000"] == {"gpu": 1}
    assert free["h200"]["1g.18gb"] == (7 if mode == "pool" else 0)


def test_a_whole_gpu_lease_covers_every_memory_slice_and_points_cuda_at_the_gpu(
        ledger, inventory):
    lease = claim(ledger, inventory, "ana", "gpu")
    gpu = inventory.gpus[1]
    assert (lease.mode, lease.profile, lease.gpu_uuid, lease.mig_uuid) == (
        Kind.GPU, "gpu", gpu.uuid, None)
    assert (lease.compute_slices, lease.start, lease.size) == (7, 0, 8)
    env = kind_of(lease).environment(lease)
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
    assert env["MIG_SPAWNER_LEASE_ID"] == lease.id
    # A process whose CUDA_VISIBLE_DEVICES names the GPU holds it, whatever lease it names.
    assert holder.names_slice({"CUDA_VISIBLE_DEVICES": gpu.uuid,
                               "MIG_SPAWNER_LEASE_ID": "another"}, lease)
    assert free_now(inventory, ledger.leases.active(), "pool")["h200"]["gpu"] == 0
    # The RTX PRO 6000 is the other whole GPU: 4 compute slices, its 12 memory slices.
    other = claim(ledger, inventory, "bob", "gpu")
    assert (other.gpu_index, other.compute_slices, other.size) == (2, 4, 12)
    with pytest.raises(Refused, match="no whole GPU free") as refused:
        claim(ledger, inventory, "cy", "gpu")
    assert refused.value.reason == "none_free"
    # The slices of the MIG GPU stay free.
    assert claim(ledger, inventory, "cy", "small").profile == "1g.18gb"


def test_quotas_count_a_whole_gpu_as_one_server_and_as_its_compute_slices(ledger, inventory):
    assert model("h200").whole.compute_slices == 7
    assert model("rtx-pro-6000").whole.compute_slices == 4
    claim(ledger, inventory, "ana", "gpu", quota_compute_slices=8)
    claim(ledger, inventory, "bob", "small", quota_compute_slices=8)
    with pytest.raises(Refused) as refused:  # 7 + 1 of 8 compute slices are held
        claim(ledger, inventory, "cy", "small", quota_compute_slices=8)
    assert refused.value.reason == "group_quota"
    # Counted in servers, the whole GPU is one: a quota of 3 still has room for one.
    assert claim(ledger, inventory, "cy", "small", quota_slices=3).profile == "1g.18gb"


def test_a_whole_gpu_and_a_slice_of_it_exclude_each_other(tmp_path):
    # The same GPU, as a claim saw it before and after a plan turned MIG on (or off):
    # each decision reads the other's lease in the ledger and refuses.
    off = make_inventory(make_gpu(0, mig=(False, False)))
    on = make_inventory(make_gpu(0))
    mine = policies().for_user(["ml"])
    for first, second, why in ((("small", on), ("gpu", off), "every GPU with MIG off is in use"),
                               (("gpu", off), ("small", on), "1g.18gb")):
        with Ledger.open(f"sqlite:///{tmp_path / f'{first[0]}.sqlite'}") as ledger:
            ledger.leases.claim(LeaseRequest("ana"),
                         make_decide(mine, mine.offer(first[0]), first[1], "dynamic", "pack"))
            with pytest.raises(Refused, match=why):
                ledger.leases.claim(LeaseRequest("bob"), make_decide(
                    mine, mine.offer(second[0]), second[1], "dynamic", "pack"))


def _racers(ledger: Ledger, rounds: int) -> list[tuple[str, object]]:
    """Whole-GPU and slice claims on one GPU, at once from 8 threads; each claimer reads
    the GPU in the MIG mode it had for it (off for the whole GPU, on for a slice)."""
    off = make_inventory(make_gpu(0, mig=(False, False)))
    on = make_inventory(make_gpu(0))
    mine = policies(max_slices_per_user=8).for_user(["ml"])
    outcomes: list[tuple[str, object]] = []
    barrier = threading.Barrier(8)

    def race(n: int) -> None:
        offer, inventory = ("gpu", off) if n % 2 else ("small", on)
        barrier.wait(timeout=60)
        for i in range(rounds):
            try:
                lease = ledger.leases.claim(LeaseRequest(f"u{n}-{i}"), make_decide(
                    mine, mine.offer(offer), inventory, "dynamic", "pack"))
            except Refused:
                outcomes.append((offer, None))
            except Exception as e:  # a DoubleGrant or anything else fails the test
                outcomes.append((offer, repr(e)))
            else:
                outcomes.append((offer, lease))

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return outcomes


def test_racing_whole_gpu_and_slice_claims_never_share_a_gpu(backend_url):
    with Ledger.open(backend_url) as ledger:
        outcomes = _racers(ledger, 3)
        granted = [(offer, got) for offer, got in outcomes if got is not None
                   and not isinstance(got, str)]
        errors = [got for _, got in outcomes if isinstance(got, str)]
        assert errors == []
        kinds = {lease.mode for lease in ledger.leases.active()}
        assert kinds in ({"gpu"}, {"dynamic"}), f"both kinds granted on one GPU: {granted}"
        whole = [lease for lease in ledger.leases.active() if lease.mode == "gpu"]
        assert len(whole) <= 1
        assert len(ledger.leases.active()) == len(granted)


@pytest.mark.postgres
def test_the_keys_refuse_a_whole_gpu_over_a_slice_without_the_lock(postgres_url, monkeypatch):
    # Take the claim lock away and let a slice claim commit between the whole-GPU
    # claim's read and its write: the memory-slice keys alone refuse it.
    monkeypatch.setattr(ledger_transactions, "lock_claims", lambda connection: None)
    off = make_inventory(make_gpu(0, mig=(False, False)))
    on = make_inventory(make_gpu(0))
    mine = policies().for_user(["ml"])
    with Ledger.open(postgres_url) as ours, Ledger(postgres_url) as theirs:
        whole = make_decide(mine, mine.offer("gpu"), off, "dynamic", "pack")

        def interleaved(view):
            theirs.leases.claim(LeaseRequest("bob"),
                         make_decide(mine, mine.offer("small"), on, "dynamic", "pack"))
            return whole(view)  # a view from before bob's slice

        with pytest.raises(DoubleGrant):
            ours.leases.claim(LeaseRequest("ana"), interleaved)
        assert [lease.mode for lease in ours.leases.active()] == ["dynamic"]


async def test_every_release_path_undoes_the_servers_confinement(tmp_path, inventory):
    """The slice service's orphan release (no spawner involved) removes the server's
    device cgroup and gives its capability nodes back, as a stop by the spawner does."""
    if os.geteuid() != 0:
        missing("capability nodes are given back by root (chown)")
    cgroups = SliceCgroups(hierarchy=tmp_path / "devices")
    caps = tmp_path / "nvidia-caps"
    caps.mkdir()
    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger, \
            connect(simulate=MIXED) as gpus:
        lease = claim(ledger, inventory, "ana", "small")
        cgroups.path(lease.id).mkdir(parents=True)  # as the spawner's start made it
        rules = kind_of(lease).device_rules(lease, inventory.gpus[0].minor, "/dev")
        nodes = [caps / os.path.basename(r.path) for r in rules if "caps" in r.path]
        for node in nodes:
            node.write_text("")
            os.chown(node, 65534, 65534)  # the server's user had them
        releaser = Releaser(lambda: ledger, lambda: gpus,
                            HolderProbes(local=LocalProcesses(asyncio.to_thread, lambda: gpus)),
                            run=asyncio.to_thread, grace=0.5,
                            confinement=Confinement(cgroups, caps))
        outcome = await releaser.release(lease, ReleaseCode.ORPHAN, "test")
        assert outcome.result is GiveBack.RELEASED
        assert not cgroups.path(lease.id).exists()
        assert [(n.stat().st_uid, n.stat().st_mode & 0o777) for n in nodes] == [(0, 0o400)] * 2


@pytest.fixture
def busy_gpu(tmp_path, ledger):
    """A whole-GPU lease of ana's, the adapter, and the simulated host it reads (whose
    UUIDs are its own: a host kept in a file never shares them with another)."""
    state = tmp_path / "sim.json"
    with connect(simulate=MIXED, state_file=state) as gpus:
        lease = claim(ledger, gpus.inventory(), "ana", "gpu")
        yield lease, gpus, SimulatedHost.open(state)


async def test_a_process_nvml_lists_on_a_whole_gpu_holds_it(ledger, busy_gpu):
    """A PID the GPU lists (say, a job whose environment does not name the lease) keeps
    the lease held: no release path calls the GPU free under it."""
    lease, gpus, host = busy_gpu
    host.set_processes(lease.gpu_uuid, [(4242, 1000)])
    local = LocalProcesses(asyncio.to_thread, lambda: gpus, cgroup_members=None)
    found = await local.check(lease)
    assert (found.state, found.on_device) == (holder.UNKNOWN, (4242,))
    releaser = Releaser(lambda: ledger, lambda: gpus, HolderProbes(local=local),
                        run=asyncio.to_thread, grace=0.5)
    outcome = await releaser.release(lease, ReleaseCode.ORPHAN, "test")
    assert outcome.result is GiveBack.HELD and "4242" in (outcome.why or "")
    assert [held.id for held in ledger.leases.active()] == [lease.id]


async def test_the_service_samples_the_work_on_a_whole_gpu(ledger, busy_gpu):
    """A background job on a whole GPU is GPU work (not idle) and its memory is sampled
    for right-sizing, as a slice's is."""
    lease, gpus, host = busy_gpu
    host.set_processes(lease.gpu_uuid, [(4242, 9000)])
    sweeper = Sweeper(HubClient("http://127.0.0.1:1/hub/api", "t"), MIGPolicyConfig().build(),
                      ServiceMetrics(), ledger=ledger, gpus=gpus)
    now = datetime.now(UTC)
    (seen,) = await sweeper._gpu_activity(now, ledger.leases.active())
    assert (seen.gpu_active_at, seen.peak_memory_mib) == (now, 9000)
    (sample,) = ledger.usage.samples([lease.id])[lease.id]
    assert (sample.memory_used_mib, sample.processes) == (9000, 1)
    assert sample.memory_total_mib == gpus.inventory().gpus[1].memory_total_mib


def test_the_map_and_status_show_whole_gpus_beside_slices(ledger, inventory):
    lease = claim(ledger, inventory, "ana", "gpu")
    view = slice_map(inventory, ledger.leases.active(), datetime.now(UTC))
    whole = {gpu.index: [(r.profile, r.start, r.size, r.state, r.user) for r in gpu.slices]
             for gpu in view.gpus if not gpu.mig_enabled}
    assert whole == {1: [("gpu", 0, 8, "leased", "ana")], 2: [("gpu", 0, 12, "free", None)]}
    assert view.lost == () and view.count("orphan") == 0
    assert [r.state for r in view.gpus[0].slices] == ["free"] * 7
    assert lease.id in {r.lease_id for r in view.slices}
    text = render_text(inventory)
    assert "MIG off\n  whole GPU, 140.4 GiB: offered as 'gpu'" in text


def test_a_server_confined_to_a_whole_gpu_may_open_that_gpu_and_no_slice(ledger, inventory):
    lease = claim(ledger, inventory, "ana", "gpu")
    rules = kind_of(lease).device_rules(lease, inventory.gpus[1].minor, "/dev")
    assert [r.path for r in rules] == ["/dev/nvidiactl", "/dev/nvidia-uvm",
                                       "/dev/nvidia-uvm-tools", "/dev/nvidia1"]
    assert {r.access for r in rules} == {"rw"}


def test_the_start_up_check_warns_of_a_whole_gpu_offered_where_every_gpu_has_mig_on(
        inventory):
    all_mig = make_inventory(make_gpu(0))
    built = policies()
    (warning,) = [w for w in policy_warnings(Config(), built, all_mig) if "'gpu'" in w]
    assert warning.startswith("ml may pick 'gpu' (a whole GPU) but no GPU on this host has "
                              "MIG off")
    assert not [w for w in policy_warnings(Config(), built, inventory) if "'gpu'" in w]


def test_layout_advice_replays_slices_only(ledger, inventory):
    """A whole GPU is no MIG instance: ``report --advise`` replays the slices."""
    claim(ledger, inventory, "ana", "gpu")
    claim(ledger, inventory, "bob", "small")
    requests = requests_of(ledger.leases.active(), [], datetime.now(UTC))
    assert [q.profile for q in requests] == ["1g.18gb"]
