"""Claims in passes (issue 36, item 3): the claims that arrive together are decided in
one transaction, each seeing the ones before it as held; and a class start's concurrent
spawns in one process share their reads of the GPUs, get distinct slices, and those
beyond the fleet are refused, not given a slice twice."""

from __future__ import annotations

import asyncio

from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import LeaseRequest, Ledger, ServerHasLease
from mig_spawner.spawner import waiting
from mig_spawner.spawner.runtime import SpawnerRuntime
from tests.support.grants import first_free
from tests.support.spawners import make_spawner, mig_config


def refuse(view):
    raise Refused(Reason.GROUP_QUOTA, "over quota")


def test_a_pass_claims_each_in_turn_seeing_the_ones_before_it(backend_url):
    with Ledger.open(backend_url) as ledger:
        ledger.leases.claim(LeaseRequest("held"), first_free)
        made = ledger.leases.claim_many([
            (LeaseRequest("ann"), first_free), (LeaseRequest("bob"), refuse),
            (LeaseRequest("cy"), first_free), (LeaseRequest("ann"), first_free),
            (LeaseRequest("held"), first_free)])
        ann, bob, cy, ann_again, held_again = made
        assert isinstance(bob, Refused) and bob.reason is Reason.GROUP_QUOTA
        assert isinstance(ann_again, ServerHasLease) and ann_again.lease.id == ann.id
        assert isinstance(held_again, ServerHasLease)
        # Each grant saw the earlier ones held: three leases, three different slices.
        held = ledger.leases.active()
        assert {x.id for x in held} >= {ann.id, cy.id}
        assert len({(x.gpu_uuid, x.start) for x in held}) == len(held) == 3


async def test_concurrent_spawns_share_gpu_reads_and_never_share_a_slice(tmp_path,
                                                                         monkeypatch):
    sim, state = "h200x2:layout=1g.18gb*7", tmp_path / "sim.json"
    SimulatedHost.from_spec(sim, state)
    config = mig_config(f"sqlite:///{tmp_path}/ledger.sqlite", sim=sim, sim_state=state,
                        policies={"burst": {"allowed": ["1g.18gb"]}})
    reads = []
    inventory_here = SpawnerRuntime.inventory_here
    monkeypatch.setattr(SpawnerRuntime, "inventory_here",
                        lambda self: reads.append(1) or inventory_here(self))
    spawners = [make_spawner(config, f"u{i:02d}", ["burst"], profile="1g.18gb")
                for i in range(20)]

    async def claim(spawner):
        offer, mine = spawner._validate(spawner.user_options)
        return (await waiting.claim(spawner, offer, mine)).lease

    got = await asyncio.gather(*(claim(s) for s in spawners), return_exceptions=True)
    leases = [x for x in got if not isinstance(x, BaseException)]
    refused = [x for x in got if isinstance(x, BaseException)]
    assert len(leases) == 14  # every slice of the two GPUs, each once
    assert len({x.mig_uuid for x in leases}) == 14
    assert all(isinstance(e, Refused) and e.reason is Reason.NONE_FREE for e in refused)
    # The 20 claims came together: a few reads of the GPUs, not one each.
    assert len(reads) <= 3, len(reads)
