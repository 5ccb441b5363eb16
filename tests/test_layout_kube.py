"""A layout change on Kubernetes, against the API stand-in that models NVIDIA's MIG
Manager (label -> ``nvidia.com/mig.config.state`` pending -> success or failed, and the
node's advertised MIG resources re-cut). The plan holds the node from new pods, waits
for the pod that holds a slice there, sets the label, waits for MIG Manager and
releases the hold; a failure is reported. docs/layout.md, "Kubernetes"."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

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
from tests.support.kube_admission import documented_roles
from tests.support.kube_objects import gpu_labels, node, pod, write_kubeconfig
from tests.support.spawners import a100_node, kube_spawner

HOUR = 3600.0
DOCS = Path(__file__).resolve().parents[1] / "docs"
POLICY = build_policy(None, None, {"a": {"allowed": ["1g.10gb"], "max_slices_per_user": 9}})


def a100(name: str) -> dict:
    return node(name, gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", config="all-balanced"),
                {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": "1"})


@pytest.fixture
async def cluster(kube_standin, tmp_path, monkeypatch):
    kube_standin.nodes = [a100("gpu-a1"), a100("gpu-a2")]
    # What the documented ClusterRoles allow, no more (a label the docs do not grant: 403).
    kube_standin.rbac = [*documented_roles(DOCS / "kubernetes.md"),
                         *documented_roles(DOCS / "layout.md")]
    kube_standin.mig_configs = {"all-1g.10gb": {"1g.10gb": 7}}
    path = write_kubeconfig(tmp_path / "kubeconfig", kube_standin.url)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", path)
    apis = []

    async def api():
        if not apis:
            apis.append(await connect_api())
        return apis[0]

    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        yield kube_standin, ledger, api
    for a in apis:
        await a.api_client.close()


def claim(ledger: Ledger, standin, name: str):
    slices = cluster_slices(standin.nodes, standin.pods)
    choice = ClaimTarget()
    decide = make_kube_decide(POLICY.for_user(["a"]), POLICY.offer("1g.10gb"), slices,
                              f"jhub/{name}", choice)
    return ledger.claim(LeaseRequest(name), decide), choice.target


async def settle(layout: KubeLayout, until: PlanState, rounds: int = 40) -> list:
    passes = []
    for _ in range(rounds):
        passes.append(await layout.step())
        if passes[-1].gpus and passes[-1].gpus[-1].state is until:
            return passes
        await asyncio.sleep(0.05)
    raise AssertionError(f"not {until}: {[g for p in passes for g in p.gpus][-3:]}")


async def test_the_node_is_held_drained_labelled_and_re_cut_by_mig_manager(cluster):
    standin, ledger, api = cluster
    # ana's pod runs on gpu-a1 with a slice; her lease records the node.
    lease = ledger.claim(LeaseRequest("ana"), lambda view: Grant(
        group="a", profile="1g.10gb", compute_slices=1, mode="kube", pod="jhub/jupyter-ana",
        expires_at=view.now + timedelta(hours=8)))
    ledger.activate(lease.id, node="gpu-a1", pod="jhub/jupyter-ana")
    standin.pods = [pod("jupyter-ana", "gpu-a1", {"nvidia.com/mig-1g.10gb": "1"},
                        namespace="jhub")]
    begin_kube(ledger, "gpu-a1", "all-1g.10gb")
    # From now on no new pod goes to gpu-a1, though it has a 1g.10gb free.
    got, target = claim(ledger, standin, "bob")
    assert target.nodes == ("gpu-a2",)
    layout = KubeLayout(ledger, api, lambda group: HOUR)
    first = await layout.step()
    assert first.gpus[0].state is PlanState.DRAINING and first.gpus[0].warned == [lease.id]
    assert "waits for 1 pod" in first.gpus[0].why
    assert standin.mig_manager_runs == []  # not labelled while the pod holds a slice
    assert standin.find_node("gpu-a1")["metadata"]["labels"]["nvidia.com/mig.config"] == (
        "all-balanced")
    # ana's server ends (its pod goes, its lease is given back).
    standin.pods = []
    ledger.release(lease.id, "stopped")
    await settle(layout, PlanState.DONE)
    labels = standin.find_node("gpu-a1")["metadata"]["labels"]
    assert labels["nvidia.com/mig.config"] == "all-1g.10gb"
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert standin.mig_manager_runs == [("gpu-a1", "all-1g.10gb")]
    assert standin.find_node("gpu-a1")["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] == "7"
    assert ledger.holds() == {}
    # The re-cut node serves again, with its new layout.
    slices = cluster_slices(standin.nodes, standin.pods)
    assert {n.name: dict(n.allocatable) for n in slices.nodes}["gpu-a1"] == {"1g.10gb": 7}
    assert got.mode == "kube"


async def test_mig_manager_failing_fails_the_change_and_ends_the_hold(cluster):
    standin, ledger, api = cluster
    begin_kube(ledger, "gpu-a2", "no-such-config")
    # The hold: a spawn is told the node is being re-cut when only it would fit.
    standin.pods = [pod("jupyter-x", "gpu-a1", {"nvidia.com/mig-1g.10gb": "2"},
                        namespace="jhub")]
    slices = cluster_slices(standin.nodes, standin.pods)
    decide = make_kube_decide(POLICY.for_user(["a"]), POLICY.offer("1g.10gb"), slices,
                              "jhub/jupyter-y", ClaimTarget())
    with pytest.raises(Refused) as refused:
        decide(LedgerView(LeaseRequest("y"), (), ledger._now(), holds=ledger.holds()))
    assert refused.value.reason is Reason.GPU_RECUT
    passes = await settle(KubeLayout(ledger, api, lambda group: HOUR), PlanState.FAILED)
    assert "mig.config.state=failed" in passes[-1].gpus[0].why
    [failed] = ledger.layout_changes(open_only=False)
    assert failed.state is PlanState.FAILED and ledger.holds() == {}


async def test_the_form_tells_a_held_node_apart_from_a_free_one(kube, ledger_url):
    """A node held for a re-cut but not labelled yet is not counted free on the form:
    its sizes say why they are unavailable, as a claim would (Reason.GPU_RECUT)."""
    kube.nodes = [a100_node("gpu-a1"), a100_node("gpu-a2")]
    # gpu-a2's 3g.40gb is taken: only the held gpu-a1 has a 'large' left.
    kube.pods = [pod("other", "gpu-a2", {"nvidia.com/mig-3g.40gb": "1"}, namespace="x")]
    with Ledger.open(ledger_url) as ledger:
        begin_kube(ledger, "gpu-a1", "all-1g.10gb")
    form = await kube_spawner(kube, ledger_url).render_options_form()
    assert "2 free now" in form and "4 free now" not in form  # small: gpu-a2's only
    assert "not free for a while: an admin is re-cutting its GPU" in form  # large
    assert "1 free now" not in form
