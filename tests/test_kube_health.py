"""A size the cluster reports unhealthy: NVIDIA's device plugin leaves an unhealthy
GPU's devices out of ``allocatable`` (the kubelet keeps them in ``capacity``), and its
DRA driver taints them ``NoSchedule`` or takes them out of its ResourceSlice while GPU
Feature Discovery still counts them. The form says why the size is unavailable, a
claim is refused in the same words, and the scheduler places nothing there. The
arithmetic in-process; the rest against the real control plane
(tests/support/kube_cluster.py), the fault injected as the GPU agents' annotation."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime

import pytest
from jupyterhub.spawner import SpawnException
from traitlets.config import Config

from mig_spawner.core.catalog import model
from mig_spawner.core.policy import build_policy
from mig_spawner.kube.cluster import ClusterSlices, NodeSlices, cluster_slices
from mig_spawner.kube.dra import claim_template, dra_slices
from mig_spawner.observe.slice_state import slice_map
from mig_spawner.observe.slicemap import _LOADER, human_seconds, nodes_json, slicemap_json
from mig_spawner.observe.source import NO_GPUS
from mig_spawner.service.app import SliceServiceApp
from mig_spawner.spawner.form import build_choices
from mig_spawner.spawner.kube_decide import CLUSTER_UNHEALTHY
from tests.support.kube_fixture import run_check_command, run_doctor
from tests.support.kube_gpus import GPUS_ANNOTATION, Gpu, Gpus, gpu_node, resource_slices
from tests.support.spawners import held
from tests.support.spawners import kube_spawner as make

#: Two A100 80GB, mixed strategy: the large slices on GPU 0, the small ones on GPU 1.
A100 = (Gpu("a100-80gb", {"3g.40gb": 2}), Gpu("a100-80gb", {"1g.10gb": 7}))
#: Two H200 for the DRA driver: the small slices on GPU 0, a 3g.71gb on GPU 1.
H200 = (Gpu("h200", {"1g.18gb": 2}, "dra"), Gpu("h200", {"3g.71gb": 1}, "dra"))


def faulty(gpus: tuple[Gpu, ...], fault: str) -> Gpus:
    """The GPUs with GPU 0 failing its health checks as ``fault`` says."""
    first, *rest = gpus
    return Gpus((Gpu(first.model, first.layout, first.api, fault), *rest))


def ready(node: dict) -> dict:
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return node


# --- the arithmetic, on the API's objects ---------------------------------------------


def test_capacity_above_allocatable_is_what_the_cluster_reports_unhealthy():
    node = ready(gpu_node("a1", faulty(A100, "unhealthy")))
    assert node["status"]["capacity"]["nvidia.com/mig-3g.40gb"] == "2"
    slices = cluster_slices([node], [])
    assert slices.free() == {"a100-80gb": {"3g.40gb": 0, "1g.10gb": 7}}
    assert slices.unhealthy() == {"a100-80gb": {"3g.40gb": 2}}
    # A node with nothing missing, or whose capacity is not given, reports nothing.
    assert cluster_slices([ready(gpu_node("a2", Gpus(A100)))], []).unhealthy() == {}
    del node["status"]["capacity"]
    assert cluster_slices([node], []).unhealthy() == {}


@pytest.mark.parametrize("fault", ["tainted", "unhealthy"])
def test_a_tainted_or_withdrawn_dra_device_is_unhealthy(fault):
    gpus = faulty(H200, fault)
    node = ready(gpu_node("h1", gpus))
    slices = dra_slices([node], resource_slices("h1", gpus), [])
    assert slices.free() == {"h200": {"1g.18gb": 0, "3g.71gb": 1}}
    assert slices.unhealthy() == {"h200": {"1g.18gb": 2}}


def test_the_form_says_why_a_size_of_an_unhealthy_model_is_unavailable():
    policy = build_policy(None, None, {"a": {"allowed": ["1g.10gb", "3g.40gb"]}}
                          ).for_user(["a"])

    def choices(**kw):
        return build_choices(policy, [model("a100-80gb")],
                             {"a100-80gb": {"1g.10gb": 0, "3g.40gb": 1}}, lambda o, c: None,
                             scope="in the cluster",
                             unhealthy={"a100-80gb": CLUSTER_UNHEALTHY}, **kw)

    small, large = choices()
    assert (small.unavailable, large.unavailable) == (CLUSTER_UNHEALTHY, None)
    # Waiting is offered (the device plugin reports a device healthy again), saying why.
    small, _ = choices(waits={"1g.10gb": "1 waiting"})
    assert small.available and small.wait.startswith(
        f"Unavailable: {CLUSTER_UNHEALTHY} \u2014 join the wait list")


def map_of(cluster: ClusterSlices | str | None) -> dict:
    """``slices.json`` of a service with no GPUs of its own, and ``cluster``'s nodes."""
    return slicemap_json(slice_map(NO_GPUS, [], datetime.now(UTC)), cluster)


def test_the_map_names_each_nodes_unhealthy_slices_and_why():
    plugin = NodeSlices("a1", "a100-80gb", "NVIDIA-A100-SXM4-80GB", "mixed",
                        {"3g.40gb": 0, "1g.10gb": 7}, {"1g.10gb": 1},
                        unhealthy={"3g.40gb": 2})
    dra = NodeSlices("h1", "h200", "NVIDIA H200", "dra", {"1g.18gb": 0, "3g.71gb": 1}, {},
                     unhealthy={"1g.18gb": 2})
    healthy = NodeSlices("a2", "a100-80gb", "NVIDIA-A100-SXM4-80GB", "mixed",
                         {"1g.10gb": 7}, {})
    nodes = {n["name"]: n for n in map_of(ClusterSlices((plugin, dra, healthy)))["nodes"]}
    assert nodes["a1"]["profiles"] == [
        {"profile": "1g.10gb", "slices": 7, "free": 6, "unhealthy": 0},
        {"profile": "3g.40gb", "slices": 0, "free": 0, "unhealthy": 2}]
    assert nodes["a1"]["unhealthy"] == (
        "3g.40gb: 2: the device plugin left them out of allocatable (capacity has them)")
    assert nodes["h1"]["unhealthy"] == (
        "1g.18gb: 2: the DRA driver tainted them or took them out of its ResourceSlice")
    assert nodes["a2"]["unhealthy"] is None
    # A cluster that cannot be read is said in words; a local hub's map has no nodes.
    assert map_of("cannot read the cluster's GPU nodes now")["nodes_error"]
    assert "nodes" not in map_of(None)


# --- against the real control plane -------------------------------------------------------


async def report(kube, short: str, gpus: Gpus) -> None:
    """The node's GPU agents see ``gpus`` now (a GPU failed its health checks) and
    republish; returns once the API server has what they publish."""
    await kube.admin.patch(f"/api/v1/nodes/{kube.node_name(short)}", {"metadata": {
        "annotations": {GPUS_ANNOTATION: gpus.to_json()}}})


def says_unhealthy(form: str) -> bool:
    """The form says a size is unavailable because the cluster reports it unhealthy."""
    return f"Unavailable: {CLUSTER_UNHEALTHY}</li>" in form


async def form_after_fault(s) -> str:
    s.availability.invalidate()
    return await s.render_options_form()


async def test_allocatable_lowered_by_the_device_plugin_shows_the_size_unhealthy(
        kube, ledger_url):
    await kube.add_node("a1", Gpus(A100))
    s = make(kube, ledger_url, profile="large")
    assert "2 free now" in await s.render_options_form()
    await report(kube, "a1", faulty(A100, "unhealthy"))
    await kube.admin.watch_object(f"/api/v1/nodes/{kube.node_name('a1')}", lambda n: n[
        "status"]["allocatable"].get("nvidia.com/mig-3g.40gb") == "0")
    form = await form_after_fault(s)
    assert says_unhealthy(form)
    assert "7 free now" in form  # GPU 1's small slices are still offered
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.status_code == 503
    assert CLUSTER_UNHEALTHY in info.value.jupyterhub_message
    assert await kube.pods() == [] and held(ledger_url) == []
    # The scheduler does not place a pod on the unhealthy devices either.
    await kube.run_pod("batch", "a1", {"nvidia.com/mig-3g.40gb": "1"}, running=False)
    pod = await kube.admin.watch_object(f"/api/v1/namespaces/{kube.ns}/pods/batch", lambda p: any(
        c.get("reason") == "Unschedulable" for c in p["status"].get("conditions") or []))
    assert not pod["spec"].get("nodeName")
    # The admin's view of the cluster says which node and how many.
    _, out, _ = await run_check_command(kube.kubeconfig(), "--node-selector", kube.selector)
    assert re.search(rf"{kube.node_name('a1')}\s+reported unhealthy: 3g\.40gb: 2\n", out), out


@pytest.mark.parametrize("fault", ["tainted", "unhealthy"])
async def test_a_dra_device_tainted_or_taken_out_shows_the_size_unhealthy(
        kube, ledger_url, fault):
    await kube.add_node("h1", Gpus(H200))
    s = make(kube, ledger_url, profile="small", mig_resource_api="dra")
    assert "2 free now" in await s.render_options_form()
    before = {d["name"] for rs in await kube.slices("h1") for d in rs["spec"]["devices"]}
    await report(kube, "h1", faulty(H200, fault))

    def republished(rs: dict | None) -> bool:
        """GPU 0's devices tainted, or gone (a new pool generation)."""
        devices = (rs or {}).get("spec", {}).get("devices") or []
        if fault == "tainted":
            return any(d.get("taints") for d in devices)
        return bool(devices) and {d["name"] for d in devices} != before

    await kube.admin.watch_object(
        f"/apis/resource.k8s.io/v1/resourceslices/{kube.node_name('h1')}-gpu.nvidia.com",
        republished)
    form = await form_after_fault(s)
    assert says_unhealthy(form)
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert CLUSTER_UNHEALTHY in info.value.jupyterhub_message
    assert await kube.pods() == [] and held(ledger_url) == []
    # kube-scheduler allocates no tainted (or withdrawn) device to a claim.
    await kube.admin.create(claim_template("h200", "1g.18gb", kube.ns))
    await kube.run_pod("batch", "h1", running=False, resourceClaims=[
        {"name": "mig", "resourceClaimTemplateName": "mig-h200-1g-18gb"}])
    pod = await kube.admin.watch_object(f"/api/v1/namespaces/{kube.ns}/pods/batch", lambda p: any(
        c.get("reason") == "Unschedulable" for c in p["status"].get("conditions") or []))
    assert "cannot allocate all claims" in str(pod["status"]["conditions"])
    # doctor --kube names the node, how many, and what the driver did.
    _, checks = await run_doctor(kube, kube.kubeconfig(), mig_resource_api="dra")
    node = checks[f"node {kube.node_name('h1')}"]
    assert (node["status"], node["detail"]) == ("warn", (
        "the cluster reports slices unhealthy (1g.18gb: 2): the DRA driver tainted them "
        "or took them out of its ResourceSlice"))


def test_the_table_view_lists_the_nodes_too():
    """The map's plain-HTML table (no JavaScript) has the same nodes section, and says
    when the cluster cannot be read; a local hub's has none."""
    plugin = NodeSlices("a1", "a100-80gb", "NVIDIA-A100-SXM4-80GB", "mixed",
                        {"3g.40gb": 0, "1g.10gb": 7}, {"1g.10gb": 1},
                        unhealthy={"3g.40gb": 2})
    view = slice_map(NO_GPUS, [], datetime.now(UTC))

    def table(cluster: ClusterSlices | str | None) -> str:
        return _LOADER.load("slicetable.html").generate(
            view=view, refresh=5, human=human_seconds, user=None, map_url="../slices",
            nodes=None if cluster is None else nodes_json(cluster)).decode()

    page = table(ClusterSlices((plugin,)))
    assert "Kubernetes GPU nodes" in page
    assert ("a1: the cluster reports unhealthy 3g.40gb: 2: the device plugin left them "
            "out of allocatable (capacity has them)") in page
    assert page.count('<tr class="faulty">') == 2  # the 3g.40gb row and the node's note
    assert "cannot read the cluster" in table("cannot read the cluster's GPU nodes now")
    assert "Kubernetes GPU nodes" not in table(None)


async def test_the_slice_services_map_shows_a_nodes_unhealthy_slices(kube, ledger_url):
    """The slice service of a Kubernetes hub reads the nodes as the hub's config says,
    and its map JSON names the node's slices the device plugin reports unhealthy."""
    await kube.add_node("a1", faulty(A100, "unhealthy"))
    await kube.admin.watch_object(f"/api/v1/nodes/{kube.node_name('a1')}", lambda n: n[
        "status"]["allocatable"].get("nvidia.com/mig-3g.40gb") == "0")
    app = SliceServiceApp(config=Config({
        "JupyterHub": {"spawner_class": "mig-kube"},
        "KubeMIGSpawner": kube.spawner_config(), "MIGSettings": {"ledger_url": ledger_url}}))
    try:
        read = app.cluster_nodes()
        assert read is not None
        (node,) = map_of(await read())["nodes"]
        # One client for the map and the orphan checks, closed when the service stops.
        api = await app.connect_kube()
        assert await asyncio.gather(app.connect_kube(), app.connect_kube()) == [api, api]
    finally:
        await app.close_kube()
    assert api.api_client.rest_client.pool_manager.closed
    assert node["name"] == kube.node_name("a1")
    assert node["unhealthy"] == ("3g.40gb: 2: the device plugin left them out of "
                                 "allocatable (capacity has them)")
    assert {"profile": "3g.40gb", "slices": 0, "free": 0, "unhealthy": 2} in node["profiles"]
    # A local hub's service reads no cluster.
    assert SliceServiceApp(config=Config({"MIGSettings": {"ledger_url": ledger_url}})
                           ).cluster_nodes() is None
