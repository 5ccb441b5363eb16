"""A layout change on Kubernetes, against the real API server and the test cluster's
MIG Manager (tests/support/kube_agents.py: label -> ``nvidia.com/mig.config.state``
pending -> success or failed, and the node's advertised MIG resources re-cut). The plan
holds the node from new pods, waits for the pod that holds a slice there, sets the
label, waits for MIG Manager and releases the hold; a failure is reported.
docs/layout.md, "Kubernetes"."""

from __future__ import annotations

from datetime import timedelta

import pytest
from kubernetes_asyncio.config import kube_config

from mig_spawner.core.layout import PlanState
from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.kube.cluster import cluster_slices
from mig_spawner.kube.pods import connect_api
from mig_spawner.layout import KubeLayout, begin_kube
from mig_spawner.ledger import Grant, LeaseRequest, Ledger, LedgerView
from mig_spawner.spawner.kube_decide import ClaimTarget, make_kube_decide
from tests.support.kube_gpus import Gpu, Gpus, mig_parted_config
from tests.support.polling import until_async
from tests.support.spawners import kube_spawner as make

HOUR = 3600.0
POLICY = build_policy(None, None, {"a": {"allowed": ["1g.10gb"], "max_slices_per_user": 9}})
#: An A100 80GB cut 3g.40gb + 2x 1g.10gb.
A100 = Gpus((Gpu("a100-80gb", {"3g.40gb": 1, "1g.10gb": 2}),))


@pytest.fixture
async def cluster(kube, tmp_path, monkeypatch):
    """Two A100 nodes of this test; the hub's account may do what the documented
    ClusterRoles allow, no more (a label the docs do not grant: 403); MIG Manager knows
    the config ``<namespace>-all-1g.10gb``."""
    await kube.grant(("kubernetes.md", "layout.md"))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", kube.kubeconfig())
    for short in ("a1", "a2"):
        await kube.add_node(short, A100, mig_config="all-balanced")
    await kube.admin.create(mig_parted_config(kube.ns, {f"{kube.ns}-all-1g.10gb": [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}]}))
    kube.cluster_objects.append(f"/api/v1/namespaces/gpu-operator/configmaps/{kube.ns}")
    apis = []

    async def api():
        if not apis:
            apis.append(await connect_api())
        return apis[0]

    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        yield kube, ledger, api
    for a in apis:
        await a.api_client.close()


async def snapshot(kube):
    """The cluster's slices as the hub reads them: this test's nodes, all pods."""
    nodes = await kube.admin.items("/api/v1/nodes", labelSelector=kube.selector)
    return cluster_slices(nodes, await kube.admin.items("/api/v1/pods"))


async def claim(ledger: Ledger, kube, name: str):
    slices = await snapshot(kube)
    choice = ClaimTarget()
    decide = make_kube_decide(POLICY.for_user(["a"]), POLICY.offer("1g.10gb"), slices,
                              f"{kube.ns}/{name}", choice)
    return ledger.leases.claim(LeaseRequest(name), decide), choice.target


async def settle(layout: KubeLayout, state: PlanState) -> list:
    """The layout's passes, stepped (as the service's sweep steps it) until its last GPU
    reaches ``state``."""
    passes = []

    async def reached() -> bool:
        passes.append(await layout.step())
        return bool(passes[-1].gpus) and passes[-1].gpus[-1].state is state

    await until_async(reached, 120, f"the change {state}",
                      show=lambda: [g for p in passes for g in p.gpus][-3:], every=0.05)
    return passes


async def test_the_node_is_held_drained_labelled_and_re_cut_by_mig_manager(cluster):
    kube, ledger, api = cluster
    a1, a2 = kube.node_name("a1"), kube.node_name("a2")
    config = f"{kube.ns}-all-1g.10gb"
    # ana's pod runs on a1 with a slice; her lease records the node.
    lease = ledger.leases.claim(LeaseRequest("ana"), lambda view: Grant(
        group="a", profile="1g.10gb", compute_slices=1, mode="kube",
        pod=f"{kube.ns}/jupyter-ana", expires_at=view.now + timedelta(hours=8)))
    ledger.leases.activate(lease.id, node=a1, pod=f"{kube.ns}/jupyter-ana")
    await kube.run_pod("jupyter-ana", "a1", {"nvidia.com/mig-1g.10gb": "1"})
    begin_kube(ledger, a1, config)
    # From now on no new pod goes to a1, though it has a 1g.10gb free.
    got, target = await claim(ledger, kube, "bob")
    assert target.nodes == (a2,)
    layout = KubeLayout(ledger, api, lambda group: HOUR)
    first = await layout.step()
    assert first.gpus[0].state is PlanState.DRAINING and first.gpus[0].warned == [lease.id]
    assert "waits for 1 pod" in first.gpus[0].why
    # Not labelled while the pod holds a slice.
    labels = (await kube.node("a1"))["metadata"]["labels"]
    assert labels["nvidia.com/mig.config"] == "all-balanced"
    assert labels["nvidia.com/mig.config.state"] == "success"
    # ana's server ends (its pod goes, its lease is given back).
    await kube.admin.delete(f"/api/v1/namespaces/{kube.ns}/pods/jupyter-ana",
                            {"gracePeriodSeconds": 0})
    await kube.admin.watch_object(f"/api/v1/namespaces/{kube.ns}/pods/jupyter-ana",
                           lambda p: p is None)
    ledger.leases.release(lease.id, "stopped")
    await settle(layout, PlanState.DONE)
    node = await kube.node("a1")
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/mig.config"] == config
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert node["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] == "7"
    assert "nvidia.com/mig-3g.40gb" not in node["status"]["allocatable"]
    assert ledger.holds.held() == {}
    # The re-cut node serves again, with its new layout.
    slices = await snapshot(kube)
    assert {n.name: dict(n.allocatable) for n in slices.nodes}[a1] == {"1g.10gb": 7}
    assert got.mode == "kube"


async def test_mig_manager_failing_fails_the_change_and_ends_the_hold(cluster):
    kube, ledger, api = cluster
    begin_kube(ledger, kube.node_name("a2"), "no-such-config")
    # The hold: a spawn is told the node is being re-cut when only it would fit.
    await kube.run_pod("jupyter-x", "a1", {"nvidia.com/mig-1g.10gb": "2"})
    slices = await snapshot(kube)
    decide = make_kube_decide(POLICY.for_user(["a"]), POLICY.offer("1g.10gb"), slices,
                              f"{kube.ns}/jupyter-y", ClaimTarget())
    with pytest.raises(Refused) as refused:
        decide(LedgerView(LeaseRequest("y"), (), ledger._tx.now(), holds=ledger.holds.held()))
    assert refused.value.reason is Reason.GPU_RECUT
    passes = await settle(KubeLayout(ledger, api, lambda group: HOUR), PlanState.FAILED)
    assert "mig.config.state=failed" in passes[-1].gpus[0].why
    [failed] = ledger.holds.changes(open_only=False)
    assert failed.state is PlanState.FAILED and ledger.holds.held() == {}


async def test_the_form_tells_a_held_node_apart_from_a_free_one(cluster, ledger_url):
    """A node held for a re-cut but not labelled yet is not counted free on the form:
    its sizes say why they are unavailable, as a claim would (Reason.GPU_RECUT)."""
    kube, _, _ = cluster
    # a2's 3g.40gb is taken: only the held a1 has a 'large' left.
    other = await kube.namespace(f"{kube.ns}-x")
    await kube.run_pod("other", "a2", {"nvidia.com/mig-3g.40gb": "1"}, namespace=other)
    with Ledger.open(ledger_url) as ledger:
        begin_kube(ledger, kube.node_name("a1"), f"{kube.ns}-all-1g.10gb")
    form = await make(kube, ledger_url).render_options_form()
    assert "2 free now" in form and "4 free now" not in form  # small: a2's only
    assert "not free for a while: an admin is re-cutting its GPU" in form  # large
    assert "1 free now" not in form
