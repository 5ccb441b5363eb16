"""The Kubernetes claim decision: quota from the ledger's view, capacity from the cluster."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Refused
from mig_spawner.kube import cluster_slices
from mig_spawner.ledger import Lease, LeaseRequest, LedgerView
from mig_spawner.spawner.kube_decide import (
    ClaimTarget,
    free_by_model,
    in_flight,
    make_kube_decide,
)
from tests.support.kube_objects import gpu_labels, node, pod

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)

POLICY = build_policy(
    offers={},
    classes={"small": {"profiles": {"a100-80gb": "1g.10gb", "h200": "1g.18gb"}}},
    groups={"analysts": {"allowed": ["small", "3g.71gb"], "max_slices_per_user": 2,
                         "quota_slices": 3, "max_session_age": "8h"}},
)
ANALYST = POLICY.for_user(["analysts"])


def h200(name: str, n18: int = 1, n71: int = 1) -> dict:
    return node(name, gpu_labels("NVIDIA-H200", "mixed"),
                {"nvidia.com/mig-1g.18gb": str(n18), "nvidia.com/mig-3g.71gb": str(n71)})


def lease(user: str, profile: str, pod_ref: str | None, group: str = "analysts") -> Lease:
    return Lease(id=f"l-{user}-{profile}", user=user, server_name="", group=group,
                 profile=profile, compute_slices=int(profile[0]), mode="kube",
                 state="claimed", claimed_at=NOW, pod=pod_ref)


def view(user: str, *leases: Lease) -> LedgerView:
    return LedgerView(request=LeaseRequest(user), leases=tuple(leases), now=NOW)


def test_grant_records_pod_group_expiry_and_target():
    slices = cluster_slices([h200("h1")], [])
    choice = ClaimTarget()
    decision = make_kube_decide(ANALYST, POLICY.offer("3g.71gb"), slices,
                                "jupyterhub/jupyter-ana", choice)(view("ana"))
    assert (decision.mode, decision.profile, decision.compute_slices) == ("kube", "3g.71gb", 3)
    assert (decision.pod, decision.node, decision.group) == (
        "jupyterhub/jupyter-ana", None, "analysts")
    assert decision.expires_at == datetime(2026, 12, 2, 18, 0, tzinfo=UTC)
    assert choice.target.nodes == ("h1",)


def test_a_lease_whose_pod_the_snapshot_does_not_show_yet_takes_its_slice():
    """Ben claimed the last 3g.71gb a moment ago; his pod is not in the cluster snapshot
    yet. Ana must not get the same slice."""
    slices = cluster_slices([h200("h1")], [])
    bens = lease("ben", "3g.71gb", "jupyterhub/jupyter-ben")
    assert in_flight([bens], slices) == {"3g.71gb": 1}
    assert free_by_model(slices, [bens]) == {"h200": {"1g.18gb": 1, "3g.71gb": 0}}
    decide = make_kube_decide(ANALYST, POLICY.offer("3g.71gb"), slices, "jupyterhub/a",
                              ClaimTarget())
    with pytest.raises(Refused) as info:
        decide(view("ana", bens))
    assert info.value.reason == "none_free"
    assert "1 being started" in info.value.message


def test_a_lease_whose_pod_runs_is_counted_once():
    pods = [pod("jupyter-ben", "h1", {"nvidia.com/mig-1g.18gb": "1"})]
    slices = cluster_slices([h200("h1", n18=2)], pods)
    bens = lease("ben", "1g.18gb", "jupyterhub/jupyter-ben")
    assert in_flight([bens], slices) == {}
    assert free_by_model(slices, [bens])["h200"]["1g.18gb"] == 1
    decision = make_kube_decide(ANALYST, POLICY.offer("small"), slices, "jupyterhub/a",
                                ClaimTarget())(view("ana", bens))
    assert decision.profile == "1g.18gb"


def test_quota_refusal_comes_before_capacity():
    slices = cluster_slices([h200("h1", n18=0, n71=0)], [])
    mine = [lease("ana", "1g.18gb", "ns/a1"), lease("ana", "3g.71gb", "ns/a2")]
    decide = make_kube_decide(ANALYST, POLICY.offer("small"), slices, "ns/a3", ClaimTarget())
    with pytest.raises(Refused) as info:
        decide(view("ana", *mine))
    assert info.value.reason == "user_limit"


def test_no_node_for_the_offer_names_the_nodes_left_out():
    reconfiguring = node("h9", gpu_labels("NVIDIA-H200", "mixed", state="pending"),
                         {"nvidia.com/mig-3g.71gb": "2"})
    slices = cluster_slices([reconfiguring], [])
    decide = make_kube_decide(ANALYST, POLICY.offer("3g.71gb"), slices, "ns/a", ClaimTarget())
    with pytest.raises(Refused) as info:
        decide(view("ana"))
    assert info.value.reason == "no_gpu_for_profile"
    assert "h9: MIG Manager is applying a layout" in info.value.message
