"""Free MIG slices of a cluster: the arithmetic on API JSON, and the reads through
kubernetes_asyncio from the real API server (tests/support/kube_cluster.py), with its
paging, selectors, expiring continue tokens and RBAC."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

from mig_spawner.kube import ClusterAvailability, ClusterReadError, cluster_slices, pod_requests
from tests.mocking import Seconds, h200_single
from tests.support.kube_fixture import run_check_command
from tests.support.kube_gpus import Gpu, Gpus
from tests.support.kube_objects import gpu_labels, node, pod
from tests.support.kube_rest import ApiError
from tests.support.polling import until

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
async def api(kube):
    """kubernetes_asyncio's CoreV1Api as the hub's account, through the tap (KubeSpawner
    uses this client class)."""
    async with kube.client() as client:
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


# --- through the real client and the API server ---------------------------------------

A100 = Gpus((Gpu("a100-80gb", {"3g.40gb": 2, "1g.10gb": 1}),
             Gpu("a100-80gb", {"1g.10gb": 3})))
H200 = Gpus((Gpu("h200", {"3g.71gb": 1, "1g.18gb": 2}),))


async def test_reads_nodes_and_pods_through_the_api(kube, api):
    await kube.add_node("a1", A100)
    await kube.add_node("h1", Gpus((Gpu("h200", {"1g.18gb": 7}),), strategy="single"))
    other = await kube.namespace(f"{kube.ns}-other")
    await kube.run_pod("jupyter-ana", "a1", {"nvidia.com/mig-3g.40gb": "1"})
    await kube.run_pod("jupyter-ben", "h1", {"nvidia.com/gpu": "1"}, namespace=other)
    done = await kube.run_pod("old-job", "h1", {"nvidia.com/gpu": "4"}, namespace=other)
    await kube.admin.patch(f"/api/v1/namespaces/{other}/pods/old-job/status",
                           {"status": {"phase": "Succeeded"}})
    kube.tap.reset()
    slices = await ClusterAvailability(api, node_selector=kube.selector).slices()
    assert slices.free() == {"a100-80gb": {"1g.10gb": 4, "3g.40gb": 1}, "h200": {"1g.18gb": 6}}
    assert f"{other}/{done['metadata']['name']}" not in slices.counted_pods
    # Terminated pods are filtered by the API server, all namespaces are read.
    (pod_read,) = kube.tap.matching("GET", "/api/v1/pods")
    assert pod_read.query["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed"


async def test_the_api_defaults_a_limit_as_the_request_and_it_is_counted_once(kube, api):
    """A pod that gives only a limit: the API server sets the request to it (and adds
    its default tolerations, token volume and restart policy)."""
    await kube.add_node("h1", H200)
    pod_obj = await kube.run_pod("p", "h1", {"nvidia.com/mig-3g.71gb": "1"})
    resources = pod_obj["spec"]["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"] == {"nvidia.com/mig-3g.71gb": "1"}
    assert {t["key"] for t in pod_obj["spec"]["tolerations"]} >= {
        "node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
    assert pod_obj["spec"]["restartPolicy"] == "Always"
    assert any(v["name"].startswith("kube-api-access-") for v in pod_obj["spec"]["volumes"])
    slices = await ClusterAvailability(api, node_selector=kube.selector).slices()
    assert slices.free()["h200"] == {"1g.18gb": 2, "3g.71gb": 0}


async def test_a_set_based_selector_reads_only_the_nodes_it_names(kube, api):
    await kube.add_node("h1", H200, labels={"pool": "notebooks"})
    await kube.add_node("h2", H200, labels={"pool": "batch"})
    await kube.add_node("h3", H200)
    selector = f"{kube.selector},pool in (notebooks, teaching),pool notin (batch)"
    slices = await ClusterAvailability(api, node_selector=selector).slices()
    assert [n.name for n in slices.nodes] == [kube.node_name("h1")]
    nodes = await ClusterAvailability(api, node_selector=f"{kube.selector},!pool").slices()
    assert [n.name for n in nodes.nodes] == [kube.node_name("h3")]


async def test_node_with_pending_reconfiguration_is_not_offered(kube, api):
    await kube.add_node("a1", A100)
    await kube.add_node("a2", None, labels={
        **gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed", config="all-1g.10gb",
                     state="pending")}, allocatable={"nvidia.com/mig-1g.10gb": "14"})
    slices = await ClusterAvailability(api, node_selector=kube.selector).slices()
    assert [(t.nodes, t.free) for t in slices.targets({"a100-80gb": "1g.10gb"})] == [
        ((kube.node_name("a1"),), 4)
    ]
    assert [s.name for s in slices.skipped] == [kube.node_name("a2")]


async def test_cache_serves_renders_within_ttl_and_rereads_after(kube, api):
    await kube.add_node("h1", H200)
    clock = Seconds()
    availability = ClusterAvailability(api, ttl=10, clock=clock, node_selector=kube.selector)
    kube.tap.reset()
    first = await availability.slices()
    assert kube.tap.count("GET", "/api/v1/nodes") + kube.tap.count("GET", "/api/v1/pods") == 2
    # 30 users open the spawn form at once, then more within the TTL: no more reads.
    await asyncio.gather(*(availability.slices() for _ in range(30)))
    clock.now += 9.5
    assert (await availability.slices()) is first
    assert kube.tap.count("GET", "/api/v1/nodes") + kube.tap.count("GET", "/api/v1/pods") == 2
    await kube.run_pod("p", "h1", {"nvidia.com/mig-3g.71gb": "1"})
    clock.now += 1
    assert (await availability.slices()).free()["h200"]["3g.71gb"] == 0
    assert kube.tap.count("GET", "/api/v1/nodes") + kube.tap.count("GET", "/api/v1/pods") == 4


async def test_concurrent_first_reads_share_one_request(kube, api):
    await kube.add_node("h1", H200)
    availability = ClusterAvailability(api, ttl=10, node_selector=kube.selector)
    kube.tap.reset()
    results = await asyncio.gather(*(availability.slices() for _ in range(20)))
    assert all(r is results[0] for r in results)
    assert kube.tap.count("GET", "/api/v1/nodes") + kube.tap.count("GET", "/api/v1/pods") == 2


async def test_max_age_zero_forces_a_fresh_read(kube, api):
    await kube.add_node("h1", H200)
    availability = ClusterAvailability(api, ttl=60, node_selector=kube.selector)
    kube.tap.reset()
    await availability.slices()
    await availability.slices(max_age=0)
    assert kube.tap.count("GET", "/api/v1/nodes") + kube.tap.count("GET", "/api/v1/pods") == 4


async def test_large_lists_are_read_page_by_page(kube, api, monkeypatch):
    monkeypatch.setattr("mig_spawner.kube.availability.PAGE_SIZE", 2)
    for i in range(5):
        await kube.add_node(f"h{i}", H200)
    kube.tap.reset()
    slices = await ClusterAvailability(api, node_selector=kube.selector).slices()
    assert slices.free()["h200"] == {"1g.18gb": 10, "3g.71gb": 5}
    assert kube.tap.count("GET", "/api/v1/nodes") == 3


async def test_an_expired_continue_token_starts_the_list_again(kube, api, monkeypatch):
    """Between two pages etcd is compacted past the version the continue token names (as
    the API server does every 5 minutes): once the API server's cache has let that
    version go, it answers 410 Expired, and the reader lists again, whole, as
    client-go's pager does (before: the read failed)."""
    monkeypatch.setattr("mig_spawner.kube.availability.PAGE_SIZE", 1)
    for i in range(3):
        await kube.add_node(f"h{i}", H200)
    admin = kube.info.credentials()

    def expire_the_token(seen) -> None:
        token = seen.query.get("continue")
        if seen.path != "/api/v1/nodes" or not token or kube.tap.matching("GET", "x"):
            return
        kube.compact()
        kube.tap.requests.append(type(seen)("GET", "x", {}))  # once
        # The API server's cache follows compactions every 15 s: until then it still
        # serves the page. Wait until the token is refused.
        until(lambda: continue_status(admin, seen.path_qs) == 410, 60,
              "the continue token refused", every=0.1)

    kube.tap.hooks.append(expire_the_token)
    kube.tap.reset()
    slices = await ClusterAvailability(api, node_selector=kube.selector).slices()
    assert slices.free()["h200"] == {"1g.18gb": 6, "3g.71gb": 3}
    statuses = [r.status for r in kube.tap.matching("GET", "/api/v1/nodes")]
    assert statuses == [200, 410, 200], statuses
    assert "limit" not in kube.tap.matching("GET", "/api/v1/nodes")[-1].query


def continue_status(credentials, path_qs: str) -> int:
    """The API server's answer to a list request, as the admin."""
    import ssl
    import urllib.error
    import urllib.request

    request = urllib.request.Request(credentials.server + path_qs,
                                     headers={"Authorization": f"Bearer {credentials.token}"})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(
                cafile=credentials.ca), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def test_forbidden_list_says_which_rbac_is_missing(kube):
    kubeconfig, _ = await kube.account("no-list", drop={"mig-spawner-gpu-capacity": {"list"}})
    async with kube.client(kubeconfig) as client:
        with pytest.raises(ClusterReadError) as info:
            await ClusterAvailability(CoreV1Api(client)).slices()
    assert "HTTP 403" in str(info.value)
    assert (f'User "system:serviceaccount:{kube.ns}:no-list" cannot list resource'
            in str(info.value))
    assert "ClusterRole" in info.value.hint


async def test_unreachable_api_is_a_clear_error():
    async with ApiClient(Configuration(host="http://127.0.0.1:9")) as client:
        with pytest.raises(ClusterReadError, match="cannot list"):
            await ClusterAvailability(CoreV1Api(client)).slices()


# --- the admin's check: python -m mig_spawner.kube -----------------------------------


async def test_check_command_prints_free_slices_and_left_out_nodes(kube):
    await kube.add_node("a1", A100)
    await kube.add_node("a2", None, labels=gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed",
                                                      state="failed"),
                        allocatable={"nvidia.com/mig-1g.10gb": "7"})
    await kube.run_pod("jupyter-ana", "a1", {"nvidia.com/mig-1g.10gb": "1"})
    kubeconfig = kube.kubeconfig()
    code, out, _ = await run_check_command(kubeconfig, "--node-selector", kube.selector)
    assert code == 0
    a1, a2 = kube.node_name("a1"), kube.node_name("a2")
    assert re.search(rf"{a1}\s+a100-80gb\s+mixed\s+1g\.10gb\s+3\s+4\n", out), out
    assert re.search(rf"{a2}\s+not offered: MIG Manager is applying a layout "
                     r"\(nvidia\.com/mig\.config\.state=failed\)", out), out
    code, out, _ = await run_check_command(kubeconfig, "--json", "--node-selector",
                                           kube.selector)
    assert json.loads(out)["free"] == {"a100-80gb": {"1g.10gb": 3, "3g.40gb": 2}}


async def test_check_command_explains_missing_rbac(kube):
    kubeconfig, _ = await kube.account("no-pods", drop={"mig-spawner-gpu-capacity": {"list"}})
    code, _, err = await run_check_command(kubeconfig)
    assert code == 1
    assert "HTTP 403" in err
    assert "hint: the hub's service account needs a ClusterRole" in err


async def test_builders_are_what_the_api_stores(kube):
    """The JSON the arithmetic above is fed (tests/support/kube_objects.py) is what the
    real API server stores and serves, in the fields the count reads."""
    built = node(kube.node_name("x1"), {**gpu_labels("NVIDIA-A100-SXM4-80GB", "mixed"),
                                        "mig-spawner.test/owner": kube.ns},
                 {"nvidia.com/mig-1g.10gb": "2"}, taints=[GPU_TAINT], unschedulable=True)
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        del built["metadata"][key]
    stored = await kube.admin.create({"apiVersion": "v1", "kind": "Node", **built})
    for part in ("labels",):
        assert stored["metadata"][part] == built["metadata"][part]
    # The API server adds the not-ready taint to a new node; the built ones stay.
    assert [t for t in stored["spec"]["taints"] if t["key"] == "nvidia.com/gpu"] == built[
        "spec"]["taints"]
    assert stored["status"]["allocatable"] == built["status"]["allocatable"]
    assert cluster_slices([stored], []).skipped[0].reason == cluster_slices(
        [built], []).skipped[0].reason


async def test_the_label_selector_check_agrees_with_the_api_server(kube):
    """KubeMIGSpawner.mig_node_label_selector is refused at start-up when the API server
    would refuse it (check_label_selector); each selector here is asked of the real one:
    the check and the API server take and refuse the same, set-based ones too."""
    from mig_spawner.kube import KubeConfigError, check_label_selector

    selectors = ["pool=gpu", "pool==gpu,zone!=a", "pool in (a, b)", "pool notin (a)",
                 "!pool", "pool", "pool in (a,b),!zone", "pool=", "pool in ()",
                 "pool in (a", "a b", "-pool=x", "pool=a b", "nvidia.com/gpu.present=true"]
    for selector in selectors:
        try:
            check_label_selector(selector)
            checked = True
        except KubeConfigError:
            checked = False
        try:
            await kube.admin.get("/api/v1/nodes", labelSelector=selector, limit=1)
            served = True
        except ApiError as e:
            assert e.status == 400, e
            served = False
        assert checked == served, (selector, checked, served)
