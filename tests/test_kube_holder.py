"""The holder of a Kubernetes lease is its pod, by name and UID: before the slice service
releases an orphan lease, and before a restarted hub drops a stale one, the pod is
checked through the real Kubernetes API: a live pod is deleted first, a gone or
recreated one (the API server gives it a new, random UID) is not touched, and an API
that cannot be read keeps the slice."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from jupyterhub.spawner import SpawnException

from mig_spawner import release
from mig_spawner.config import MIGPolicyConfig
from mig_spawner.hub.client import HubClient
from mig_spawner.kube.pods import connect_api
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper
from mig_spawner.spawner.metrics import RELEASES_HELD_BACK
from tests.support.hub_standin import StandinState
from tests.support.kube_gpus import Gpu, Gpus
from tests.support.spawners import created, held
from tests.support.spawners import kube_spawner as make

#: An A100 80GB cut 3g.40gb + 2x 1g.10gb, mixed strategy.
A100 = Gpus((Gpu("a100-80gb", {"3g.40gb": 1, "1g.10gb": 2}),))

POLICY = MIGPolicyConfig(group_policies={"analysts": {"allowed": ["1g.10gb"]}}).build()


@pytest.fixture
async def hub(serve_hub):
    """A hub that runs no servers: every held lease is an orphan."""
    return serve_hub(StandinState.build(0))


@pytest.fixture
def ledger(tmp_path):
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    with Ledger.open(f"sqlite:///{tmp_path}/kube-ledger.sqlite", clock=lambda: an_hour_ago
                     ) as led:
        yield led


def kube_lease(ledger: Ledger, kube, uid: str | None) -> str:
    """The lease of ana's pod, active with the pod's UID as its holder (as the spawner
    records it once the pod runs)."""
    lease = ledger.leases.claim(LeaseRequest("ana"), lambda view: Grant(
        group="analysts", profile="1g.10gb", compute_slices=1, mode="kube",
        pod=f"{kube.ns}/jupyter-ana"))
    ledger.leases.activate(lease.id, node=kube.node_name("a1"), pod_uid=uid)
    return lease.id


async def ana_pod(kube) -> dict:
    """ana's pod, running on the test's node (its UID is the API server's)."""
    if not await kube.admin.find(f"/api/v1/nodes/{kube.node_name('a1')}"):
        await kube.add_node("a1", A100)
    return await kube.run_pod("jupyter-ana", "a1", {"nvidia.com/mig-1g.10gb": "1"})


def deletes(kube) -> list[dict]:
    """The DeleteOptions of every pod deletion the hub's side sent."""
    import json

    return [json.loads(r.body or b"{}") for r in kube.tap.requests
            if r.method == "DELETE" and "/pods/" in r.path]


async def repair(hub: str, ledger: Ledger) -> tuple[Sweeper, list]:
    apis = []

    async def connect():
        apis.append(await connect_api())
        return apis[-1]

    client = HubClient(f"{hub}/hub/api", "t", retries=1, backoff_base=0.01)
    sweeper = Sweeper(client, POLICY, ServiceMetrics(), ledger=ledger, orphan_grace=0,
                      probe_servers=False, holder_grace=0, connect_kube=connect)
    report = await sweeper.sweep()
    for api in apis:
        await api.api_client.close()
    assert report.complete
    return sweeper, report.orphans_released


async def test_orphan_whose_pod_runs_is_released_only_after_the_pod_is_deleted(
    kube, hub, ledger
):
    uid = (await ana_pod(kube))["metadata"]["uid"]
    lease_id = kube_lease(ledger, kube, uid)
    sweeper, released = await repair(hub, ledger)
    assert [x.id for x in released] == [lease_id]
    assert await kube.pods() == []
    # Deleted by UID only: a pod recreated under the name meanwhile would be refused.
    (options,) = deletes(kube)
    assert options["preconditions"] == {"uid": uid}
    assert sweeper.metrics.holders_stopped._value.get() == 1


async def test_orphan_whose_pod_is_gone_or_recreated_is_released_and_the_new_pod_kept(
    kube, hub, ledger
):
    first = await ana_pod(kube)
    await kube.admin.delete(f"/api/v1/namespaces/{kube.ns}/pods/jupyter-ana",
                               {"gracePeriodSeconds": 0})
    await kube.admin.watch_object(f"/api/v1/namespaces/{kube.ns}/pods/jupyter-ana",
                              lambda p: p is None)
    newer = await ana_pod(kube)  # the same name: the API server gives a new UID
    assert newer["metadata"]["uid"] != first["metadata"]["uid"]
    recreated = kube_lease(ledger, kube, first["metadata"]["uid"])
    _, released = await repair(hub, ledger)
    assert [x.id for x in released] == [recreated]
    assert [p["metadata"]["uid"] for p in await kube.pods()] == [newer["metadata"]["uid"]]
    assert all(o.get("preconditions") == {"uid": first["metadata"]["uid"]}
               for o in deletes(kube))

    await kube.admin.delete(f"/api/v1/namespaces/{kube.ns}/pods/jupyter-ana",
                               {"gracePeriodSeconds": 0})
    await kube.admin.watch_object(f"/api/v1/namespaces/{kube.ns}/pods/jupyter-ana",
                              lambda p: p is None)
    gone = kube_lease(ledger, kube, newer["metadata"]["uid"])
    _, released = await repair(hub, ledger)
    assert [x.id for x in released] == [gone]


async def test_orphan_whose_pod_cannot_be_read_keeps_its_slice_and_is_counted(
    kube, hub, ledger
):
    uid = (await ana_pod(kube))["metadata"]["uid"]
    kube.tap.fail(503, "etcd is unavailable")
    lease_id = kube_lease(ledger, kube, uid)
    sweeper, released = await repair(hub, ledger)
    assert released == [] and ledger.leases.get(lease_id).held
    assert sweeper.metrics.holders_unknown._value.get() == 1
    kube.tap.heal()
    assert len(await kube.pods()) == 1


async def test_a_restarted_hub_deletes_the_lost_pod_before_it_drops_the_stale_lease(
    kube, ledger_url
):
    """The hub died after the pod started but before it saved the server's state: the
    next start of that server finds the lease, deletes the old pod (by its recorded UID)
    and only then releases the lease and starts anew."""
    await kube.add_node("a1", A100)
    lost = make(kube, ledger_url)
    await lost.start()
    (lease,) = held(ledger_url)
    assert lease.holder_pod_uid == (await created(kube, lost.pod_name))["metadata"]["uid"]

    again = make(kube, ledger_url)  # no saved state
    await again.start()
    assert deletes(kube)[0]["preconditions"] == {"uid": lease.holder_pod_uid}
    assert (await created(kube, again.pod_name))["metadata"]["uid"] != lease.holder_pod_uid
    with Ledger.open(ledger_url) as led:
        assert led.leases.get(lease.id).release_code == "stale"
    await again.stop()


async def test_a_restarted_hub_keeps_a_stale_lease_whose_pod_it_cannot_check(
    kube, ledger_url
):
    await kube.add_node("a1", A100)
    lost = make(kube, ledger_url)
    await lost.start()
    (lease,) = held(ledger_url)
    held_back = RELEASES_HELD_BACK.labels(why="holder_unknown")._value.get()

    kube.tap.fail(503, "etcd is unavailable")
    again = make(kube, ledger_url)
    try:
        with pytest.raises(SpawnException, match="not given back yet"):
            await again.start()
    finally:
        for retry in list(release._RETRIES.values()):
            retry.cancel()
    assert [x.id for x in held(ledger_url)] == [lease.id]
    assert RELEASES_HELD_BACK.labels(why="holder_unknown")._value.get() == held_back + 1
    kube.tap.heal()
    assert len(await kube.pods()) == 1
