"""The holder of a Kubernetes lease is its pod, by name and UID: before the slice service
releases an orphan lease, and before a restarted hub drops a stale one, the pod is
checked through the Kubernetes API (the stand-in): a live pod is deleted first, a gone
or recreated one is not touched, and an API that cannot be read keeps the slice."""

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
from tests.support.kube_objects import pod
from tests.support.spawners import a100_node, created, held, kube_spawner

POLICY = MIGPolicyConfig(group_policies={"analysts": {"allowed": ["1g.10gb"]}}).build()
POD = "jupyterhub/jupyter-ana"
UID = "uid-pod-jupyterhub-jupyter-ana"


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


def kube_lease(ledger: Ledger, uid: str | None = UID) -> str:
    """The lease of ana's pod, active with the pod's UID as its holder (as the spawner
    records it once the pod runs)."""
    lease = ledger.claim(LeaseRequest("ana"), lambda view: Grant(
        group="analysts", profile="1g.10gb", compute_slices=1, mode="kube", pod=POD))
    ledger.activate(lease.id, node="gpu-a1", pod_uid=uid)
    return lease.id


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
    kube.pods = [pod("jupyter-ana", "gpu-a1", {"nvidia.com/mig-1g.10gb": "1"})]
    lease_id = kube_lease(ledger)
    sweeper, released = await repair(hub, ledger)
    assert [x.id for x in released] == [lease_id]
    assert kube.pods == []
    # Deleted by UID only: a pod recreated under the name meanwhile would be refused.
    ((_, name, options),) = kube.deletes
    assert name == "jupyter-ana" and options["preconditions"] == {"uid": UID}
    assert sweeper.metrics.holders_stopped._value.get() == 1


async def test_orphan_whose_pod_is_gone_or_recreated_is_released_and_the_new_pod_kept(
    kube, hub, ledger
):
    newer = pod("jupyter-ana", "gpu-a1", {"nvidia.com/mig-1g.10gb": "1"})
    newer["metadata"]["uid"] = "uid-of-a-later-pod"
    kube.pods = [newer]
    recreated = kube_lease(ledger)
    _, released = await repair(hub, ledger)
    assert [x.id for x in released] == [recreated]
    assert kube.pods == [newer] and kube.deletes == []

    kube.pods = []
    gone = kube_lease(ledger)
    _, released = await repair(hub, ledger)
    assert [x.id for x in released] == [gone]


async def test_orphan_whose_pod_cannot_be_read_keeps_its_slice_and_is_counted(
    kube, hub, ledger
):
    kube.pods = [pod("jupyter-ana", "gpu-a1", {"nvidia.com/mig-1g.10gb": "1"})]
    kube.fail_with = (503, "etcd is unavailable")
    lease_id = kube_lease(ledger)
    sweeper, released = await repair(hub, ledger)
    assert released == [] and ledger.get(lease_id).held
    assert sweeper.metrics.holders_unknown._value.get() == 1
    assert len(kube.pods) == 1


async def test_a_restarted_hub_deletes_the_lost_pod_before_it_drops_the_stale_lease(
    kube, ledger_url
):
    """The hub died after the pod started but before it saved the server's state: the
    next start of that server finds the lease, deletes the old pod (by its recorded UID)
    and only then releases the lease and starts anew."""
    kube.nodes = [a100_node("gpu-a1")]
    lost = kube_spawner(kube, ledger_url)
    await lost.start()
    (lease,) = held(ledger_url)
    assert lease.holder_pod_uid == created(kube, lost.pod_name)["metadata"]["uid"]

    again = kube_spawner(kube, ledger_url)  # no saved state
    await again.start()
    assert kube.deletes[0][2]["preconditions"] == {"uid": lease.holder_pod_uid}
    with Ledger.open(ledger_url) as led:
        assert led.get(lease.id).release_code == "stale"
    await again.stop()


async def test_a_restarted_hub_keeps_a_stale_lease_whose_pod_it_cannot_check(
    kube, ledger_url
):
    kube.nodes = [a100_node("gpu-a1")]
    lost = kube_spawner(kube, ledger_url)
    await lost.start()
    (lease,) = held(ledger_url)
    held_back = RELEASES_HELD_BACK.labels(why="holder_unknown")._value.get()

    kube.fail_with = (503, "etcd is unavailable")
    again = kube_spawner(kube, ledger_url)
    try:
        with pytest.raises(SpawnException, match="not given back yet"):
            await again.start()
    finally:
        for retry in list(release._RETRIES.values()):
            retry.cancel()
    assert [x.id for x in held(ledger_url)] == [lease.id]
    assert RELEASES_HELD_BACK.labels(why="holder_unknown")._value.get() == held_back + 1
    assert len(kube.pods) == 1
