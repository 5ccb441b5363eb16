"""Free MIG slices of a cluster, read through kubernetes_asyncio from a stand-in API server."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

from mig_spawner.kube import ClusterAvailability, ClusterReadError, cluster_slices, pod_requests
from tests.mocking import Seconds, h200_single
from tests.support.kube_objects import gpu_labels, node, pod, run_check_command

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE_GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def a100_mixed(name: str, **kw) -> dict:
    """An A100 80GB node, two GPUs each cut into 3g.40gb + 2x 1g.10gb (mixed strategy)."""
    return node(
        name,
        gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", config="all-balanced",
                   counts={"1g.10gb": 4, "3g.40gb": 2}),
        {"nvidia.com/mig-1g.10gb": "4", "nvidia.com/mig-3g.40gb": "2"},
        **kw,
    )


def h200_mixed(name: str, **kw) -> dict:
    return node(
        name,
        gpu_labels("NVIDIA-H200", "mixed", config="all-balanced"),
        {"nvidia.com/mig-1g.18gb": "2", "nvidia.com/mig-3g.71gb": "1"},
        **kw,
    )


def cpu_node(name: str) -> dict:
    return node(name, {"node.kubernetes.io/instance-type": "c6i.8xlarge"})


@pytest.fixture
async def standin(kube_standin):
    return kube_standin


@pytest.fixture
async def api(standin):
    """kubernetes_asyncio's CoreV1Api talking to the stand-in (KubeSpawner uses this
    client class; its k8s_api_host sets the same Configuration.host)."""
    config = Configuration(host=standin.url)
    async with ApiClient(config) as client:
        yield CoreV1Api(client)


# --- the arithmetic, straight from API JSON ------------------------------------------


def test_free_is_allocatable_minus_requests_of_pods_still_running():
    nodes = [a100_mixed("a100-1"), h200_single("h200-1"), cpu_node("cpu-1")]
    pods = [
        pod("jupyter-ana", "a100-1", {"nvidia.com/mig-1g.10gb": "1"}),
        pod("jupyter-ben", "a100-1", {"nvidia.com/mig-3g.40gb": "1"}, phase="Pending"),
        pod("train-done", "a100-1", {"nvidia.com/mig-3g.40gb": "1"}, phase="Succeeded"),
        pod("train-crash", "a100-1", {"nvidia.com/mig-1g.10gb": "1"}, phase="Failed"),
        pod("jupyter-cy", "h200-1", {"nvidia.com/gpu": "1", "cpu": "2"}),
        pod("unscheduled", None, {"nvidia.com/gpu": "1"}, phase="Pending"),
        pod("web", "cpu-1", {"cpu": "1"}),
    ]
    slices = cluster_slices(nodes, pods)
    assert slices.free() == {
        "a100-80gb": {"1g.10gb": 3, "3g.40gb": 1},
        "h200": {"1g.18gb": 55},
    }
    assert [(t.nodes, t.free) for t in slices.targets({"h200": "1g.18gb"})] == [
        (("h200-1",), 55)
    ]
    assert [n.name for n in slices.nodes] == ["a100-1", "h200-1"]
    assert slices.skipped == ()  # a CPU node is not a GPU node left out
    assert "jupyterhub/train-done" not in slices.counted_pods
    assert "jupyterhub/jupyter-ben" in slices.counted_pods


def test_limits_only_requests_count_like_requests():
    slices = cluster_slices(
        [h200_mixed("h1")],
        [pod("p", "h1", {"nvidia.com/mig-3g.71gb": "1"}, limits_only=True)],
    )
    assert slices.free()["h200"] == {"1g.18gb": 2, "3g.71gb": 0}


def test_init_containers_count_by_kubernetes_rules():
    one = {"requests": {"nvidia.com/mig-1g.18gb": "1"}, "limits": {"nvidia.com/mig-1g.18gb": "1"}}
    two = {"requests": {"nvidia.com/mig-1g.18gb": "2"}, "limits": {"nvidia.com/mig-1g.18gb": "2"}}
    # An init container runs before the main one: the pod needs the larger of the two.
    plain = pod("p", "h1", {"nvidia.com/mig-1g.18gb": "1"},
                init_containers=[{"name": "warmup", "resources": two}])
    assert pod_requests(plain) == {"nvidia.com/mig-1g.18gb": 2}
    # A sidecar (restartPolicy Always) keeps running next to the main container.
    sidecar = pod("q", "h1", {"nvidia.com/mig-1g.18gb": "1"},
                  init_containers=[{"name": "proxy", "restartPolicy": "Always",
                                    "resources": one}])
    assert pod_requests(sidecar) == {"nvidia.com/mig-1g.18gb": 2}


@pytest.mark.parametrize(
    "bad_node, reason",
    [
        (a100_mixed("n", unschedulable=True), "cordoned"),
        (a100_mixed("n", ready=False), "not Ready"),
        (node("n", gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", state="pending"),
              {"nvidia.com/mig-1g.10gb": "7"}), "mig.config.state=pending"),
        (node("n", gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", state="rebooting"),
              {"nvidia.com/mig-1g.10gb": "7"}), "rebooting"),
        (a100_mixed("n", taints=[GPU_TAINT]), "nvidia.com/gpu=present:NoSchedule"),
        (node("n", gpu_labels("Tesla-T4", "none"), {"nvidia.com/gpu": "1"}), "not a MIG GPU"),
        (node("n", gpu_labels("NVIDIA-H200", "single"), {"nvidia.com/gpu": "8"}),
         "names no MIG profile"),
        (node("n", gpu_labels("NVIDIA-H200", "mixed"), {"nvidia.com/mig-1g.10gb": "7"}),
         "not H200 141GB profiles"),
        (node("n", gpu_labels("NVIDIA-H200-MIG-1g.18gb-SHARED", "single"),
              {"nvidia.com/gpu": "28"}), "shares each slice between pods"),
        (node("n", {**gpu_labels("NVIDIA-H200", "mixed"), "nvidia.com/mig-1g.18gb.replicas": "4"},
              {"nvidia.com/mig-1g.18gb": "28"}), "nvidia.com/mig-1g.18gb.replicas=4"),
    ],
)
def test_nodes_that_cannot_take_a_slice_now_are_not_offered(bad_node, reason):
    slices = cluster_slices([bad_node], [])
    assert slices.nodes == ()
    assert len(slices.skipped) == 1
    assert reason in slices.skipped[0].reason


def test_tolerated_taint_keeps_the_node():
    slices = cluster_slices([a100_mixed("n", taints=[GPU_TAINT])], [], tolerations=[TOLERATE_GPU])
    assert slices.free() == {"a100-80gb": {"1g.10gb": 4, "3g.40gb": 2}}


def test_missing_strategy_label_is_inferred_and_config_can_force_it():
    labels = gpu_labels("NVIDIA-H200-MIG-2g.35gb", "mixed")
    del labels["nvidia.com/mig.strategy"]
    single = node("s", labels, {"nvidia.com/gpu": "3"})
    assert cluster_slices([single], []).free() == {"h200": {"2g.35gb": 3}}
    assert cluster_slices([single], [], strategy="mixed").skipped[0].reason.startswith("no nvidia")


def test_mixed_fleet_maps_a_slice_class_to_each_model():
    slices = cluster_slices(
        [a100_mixed("a1"), h200_mixed("h1"), h200_single("h2")],
        [pod("x", "h1", {"nvidia.com/mig-1g.18gb": "1"})],
    )
    small = {"a100-80gb": "1g.10gb", "h200": "1g.18gb"}
    assert sum(t.free for t in slices.targets(small)) == 4 + 1 + 56
    assert sum(t.free for t in slices.targets({"h200": "3g.71gb"})) == 1
    assert slices.model_keys() == ("a100-80gb", "h200")


# --- through the real client and HTTP ------------------------------------------------


async def test_reads_nodes_and_pods_through_the_api(standin, api):
    standin.nodes = [a100_mixed("a100-1"), h200_single("h200-1")]
    standin.pods = [
        pod("jupyter-ana", "a100-1", {"nvidia.com/mig-3g.40gb": "1"}),
        pod("old-job", "h200-1", {"nvidia.com/gpu": "4"}, namespace="batch", phase="Succeeded"),
        pod("jupyter-ben", "h200-1", {"nvidia.com/gpu": "1"}, namespace="other"),
    ]
    slices = await ClusterAvailability(api).slices()
    assert slices.free() == {"a100-80gb": {"1g.10gb": 4, "3g.40gb": 1}, "h200": {"1g.18gb": 55}}
    # Terminated pods are filtered by the API server, all namespaces are read.
    pod_reads = [q for path, q in standin.requests if path == "/api/v1/pods"]
    assert pod_reads[0]["fieldSelector"] == [b"status.phase!=Succeeded,status.phase!=Failed"]


async def test_node_with_pending_reconfiguration_is_not_offered(standin, api):
    standin.nodes = [
        a100_mixed("a100-1"),
        node("a100-2", gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", config="all-1g.10gb",
                                  state="pending"),
             {"nvidia.com/mig-1g.10gb": "14"}),
    ]
    slices = await ClusterAvailability(api).slices()
    assert [(t.nodes, t.free) for t in slices.targets({"a100-80gb": "1g.10gb"})] == [
        (("a100-1",), 4)
    ]
    assert [s.name for s in slices.skipped] == ["a100-2"]


async def test_cache_serves_renders_within_ttl_and_rereads_after(standin, api):
    standin.nodes = [h200_mixed("h1")]
    clock = Seconds()
    availability = ClusterAvailability(api, ttl=10, clock=clock)
    first = await availability.slices()
    assert standin.list_hits() == 2  # one Node list, one Pod list
    # 30 users open the spawn form at once, then more within the TTL: no more reads.
    await asyncio.gather(*(availability.slices() for _ in range(30)))
    clock.now += 9.5
    assert (await availability.slices()) is first
    assert standin.list_hits() == 2
    standin.pods = [pod("p", "h1", {"nvidia.com/mig-3g.71gb": "1"})]
    clock.now += 1
    assert (await availability.slices()).free()["h200"]["3g.71gb"] == 0
    assert standin.list_hits() == 4


async def test_concurrent_first_reads_share_one_request(standin, api):
    standin.nodes = [h200_mixed("h1")]
    availability = ClusterAvailability(api, ttl=10)
    results = await asyncio.gather(*(availability.slices() for _ in range(20)))
    assert all(r is results[0] for r in results)
    assert standin.list_hits() == 2


async def test_max_age_zero_forces_a_fresh_read(standin, api):
    standin.nodes = [h200_mixed("h1")]
    availability = ClusterAvailability(api, ttl=60)
    await availability.slices()
    await availability.slices(max_age=0)
    assert standin.list_hits() == 4


async def test_large_lists_are_read_page_by_page(standin, api, monkeypatch):
    monkeypatch.setattr("mig_spawner.kube.availability.PAGE_SIZE", 2)
    standin.nodes = [h200_mixed(f"h{i}") for i in range(5)]
    standin.pods = [pod(f"p{i}", f"h{i}", {"nvidia.com/mig-1g.18gb": "1"}) for i in range(5)]
    slices = await ClusterAvailability(api).slices()
    assert slices.free()["h200"] == {"1g.18gb": 5, "3g.71gb": 5}
    assert standin.hits["/api/v1/nodes"] == 3


async def test_forbidden_list_says_which_rbac_is_missing(standin, api):
    standin.fail_with = (403, 'nodes is forbidden: User "system:serviceaccount:jhub:hub" '
                              'cannot list resource "nodes" in API group "" at the cluster scope')
    with pytest.raises(ClusterReadError) as info:
        await ClusterAvailability(api).slices()
    assert "HTTP 403" in str(info.value)
    assert "cannot list resource" in str(info.value)
    assert "ClusterRole" in info.value.hint


async def test_unreachable_api_is_a_clear_error():
    async with ApiClient(Configuration(host="http://127.0.0.1:9")) as client:
        with pytest.raises(ClusterReadError, match="cannot list"):
            await ClusterAvailability(CoreV1Api(client)).slices()


# --- the admin's check: python -m mig_spawner.kube -----------------------------------


async def test_check_command_prints_free_slices_and_left_out_nodes(standin, tmp_path):
    standin.nodes = [
        a100_mixed("a100-1"),
        node("a100-2", gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", state="failed"),
             {"nvidia.com/mig-1g.10gb": "7"}),
    ]
    standin.pods = [pod("jupyter-ana", "a100-1", {"nvidia.com/mig-1g.10gb": "1"})]
    code, out, _ = await run_check_command(standin, tmp_path)
    assert code == 0
    assert "a100-1                   a100-80gb  mixed    1g.10gb          3    4" in out
    assert "a100-2                   not offered: MIG Manager is applying a layout " \
        "(nvidia.com/mig.config.state=failed)" in out
    code, out, _ = await run_check_command(standin, tmp_path, "--json")
    assert json.loads(out)["free"] == {"a100-80gb": {"1g.10gb": 3, "3g.40gb": 2}}


async def test_check_command_explains_missing_rbac(standin, tmp_path):
    standin.fail_with = (403, 'pods is forbidden: User "system:serviceaccount:jhub:hub" '
                              'cannot list resource "pods" in API group "" at the cluster scope')
    code, _, err = await run_check_command(standin, tmp_path)
    assert code == 1
    assert "HTTP 403" in err
    assert "hint: the hub's service account needs a ClusterRole" in err


async def test_standin_objects_are_valid_api_objects(standin, api):
    """The stand-in's JSON deserializes into kubernetes_asyncio's V1Node and V1Pod, whose
    required fields are checked: what the tests count is what a cluster would send."""
    standin.nodes = [a100_mixed("a1", taints=[GPU_TAINT]), h200_single("h1"), cpu_node("c1")]
    standin.pods = [pod("p", "a1", {"nvidia.com/mig-1g.10gb": "1"},
                        init_containers=[{"name": "init", "image": "busybox"}])]
    nodes = await api.list_node()
    pods = await api.list_pod_for_all_namespaces()
    assert [n.metadata.name for n in nodes.items] == ["a1", "h1", "c1"]
    assert nodes.items[0].status.allocatable["nvidia.com/mig-3g.40gb"] == "2"
    assert pods.items[0].spec.containers[0].resources.limits == {"nvidia.com/mig-1g.10gb": "1"}
