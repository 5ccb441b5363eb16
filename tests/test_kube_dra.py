"""MIG through DRA: free slices from ResourceSlices less allocated ResourceClaims, a pod
that carries a claim from a template per GPU model and profile, and what a claim no
device can satisfy looks like. Against the real API server and kube-scheduler's DRA
allocator (its CEL), with ResourceSlices in the format of NVIDIA's DRA driver."""

from __future__ import annotations

import asyncio

import pytest
from jupyterhub.spawner import SpawnException
from kubernetes_asyncio.client import CoreV1Api, ResourceV1Api

from mig_spawner.cli.doctor import Status, check_kube_resource_api
from mig_spawner.kube import ClusterAvailability
from mig_spawner.kube.dra import claim_template, dra_slices, served_by
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.support.kube_fixture import run_check_command
from tests.support.kube_gpus import Gpu, Gpus, counters_apart, gpu_node, resource_slices
from tests.support.kube_rest import ApiError
from tests.support.spawners import held
from tests.support.spawners import kube_spawner as make

#: Two H200s for NVIDIA's DRA driver: two 1g.18gb on one, a 3g.71gb on the other.
H200 = Gpus((Gpu("h200", {"1g.18gb": 2}, "dra"), Gpu("h200", {"3g.71gb": 1}, "dra")))
DYNAMIC = Gpus((Gpu("h200", "dynamic", "dra"),))


def ready(node: dict) -> dict:
    """The node as KWOK leaves it: Ready."""
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return node


def allocated_claim(device: str, pod_name: str, pool: str) -> dict:
    return {"metadata": {"name": f"{pod_name}-mig-abcde", "namespace": "batch"},
            "status": {"allocation": {"devices": {"results": [{
                "request": "mig", "driver": "gpu.nvidia.com", "pool": pool,
                "device": device}]}},
                "reservedFor": [{"resource": "pods", "name": pod_name, "uid": "u"}]}}


# --- the arithmetic, on the driver's objects ----------------------------------------


def test_free_slices_are_resource_slice_devices_less_allocated_claims():
    gpus = Gpus((Gpu("h200", {"1g.18gb": 3}, "dra"), Gpu("h200", {"3g.71gb": 1}, "dra")))
    node = ready(gpu_node("gpu-h1", gpus))
    taken = allocated_claim("gpu-0-mig-1g18gb-19-1", "train", "gpu-h1")
    slices = dra_slices([node], resource_slices("gpu-h1", gpus), [taken])
    assert slices.free() == {"h200": {"1g.18gb": 2, "3g.71gb": 1}}
    assert slices.counted_pods == {"batch/train"}
    # Nothing of it is in node allocatable, which the device-plugin count reads.
    assert dra_slices([node, ready(gpu_node("cpu-1"))], [], []).free() == {}


def test_dynamic_mig_counts_what_the_gpus_counters_leave():
    """Partitionable devices (dynamic MIG): every placement is a device consuming
    counters of its GPU's counter set, published in a ResourceSlice of its own; with a
    1g placed, one 7g no longer fits and one fewer 4g-sized memory range is left."""
    node = ready(gpu_node("gpu-h1", DYNAMIC))
    published = resource_slices("gpu-h1", DYNAMIC)
    assert [bool(s["spec"].get("sharedCounters")) for s in published] == [False, True]
    free = dra_slices([node], published, []).free()["h200"]
    assert (free["1g.18gb"], free["3g.71gb"], free["7g.141gb"]) == (7, 2, 1)
    taken = allocated_claim("gpu-0-mig-1g18gb-19-0", "p", "gpu-h1")
    free = dra_slices([node], published, [taken]).free()["h200"]
    assert (free["1g.18gb"], free["3g.71gb"], free["7g.141gb"]) == (6, 1, 0)


def test_the_cluster_says_whether_it_serves_mig_through_dra_or_the_device_plugin():
    plugin = Gpus((Gpu("h200", {"1g.18gb": 7}),))
    assert served_by([gpu_node("gpu-h1", H200)], resource_slices("gpu-h1", H200)) == "dra"
    assert served_by([gpu_node("gpu-a1", plugin)], []) == "device-plugin"
    assert served_by([gpu_node("cpu-1")], []) == "none"


def test_doctor_names_how_the_cluster_serves_mig_against_the_setting():
    assert check_kube_resource_api("dra", "dra").status is Status.PASS
    mismatch = check_kube_resource_api("dra", "device-plugin")
    assert (mismatch.status, mismatch.fix) == (
        Status.FAIL, 'c.KubeMIGSpawner.mig_resource_api = "dra"')
    assert "no DRA driver publishes any" in check_kube_resource_api("none", "dra").detail


# --- on the cluster ------------------------------------------------------------------


@pytest.fixture
async def dra(kube):
    """This test's share of the cluster with one node whose two H200s NVIDIA's DRA
    driver publishes (no nvidia.com/* in its allocatable)."""
    await kube.add_node("h1", H200)
    return kube


async def template_selecting(kube, name: str, expression: str) -> None:
    """A ResourceClaimTemplate ``name`` like the hub's, selecting by ``expression``."""
    template = claim_template("h200", "1g.18gb", kube.ns)
    template["metadata"]["name"] = name
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {
        "expression": expression}}]
    await kube.admin.create(template)


async def claim_pod(kube, name: str, template: str, namespace: str | None = None,
                    running: bool = True) -> dict:
    """Someone else's pod on the test's node, with a claim from ``template``."""
    return await kube.run_pod(name, "h1", namespace=namespace, running=running,
                              resourceClaims=[{"name": "mig",
                                               "resourceClaimTemplateName": template}])


async def test_availability_reads_resource_slices_and_claims_through_the_api(dra):
    await dra.admin.create(claim_template("h200", "1g.18gb", dra.ns))
    await claim_pod(dra, "train", "mig-h200-1g-18gb")
    async with dra.client() as client:
        reader = ClusterAvailability(CoreV1Api(client), resource_api=ResourceV1Api(client),
                                     node_selector=dra.selector)
        slices = await reader.slices()
    assert slices.free() == {"h200": {"1g.18gb": 1, "3g.71gb": 1}}
    assert f"{dra.ns}/train" in slices.counted_pods


async def test_dynamic_mig_through_the_api_and_the_scheduler(kube):
    """The driver's counters in their own ResourceSlice (1.35+ refuses them beside
    devices, 1.34 apart); the scheduler allocates a placement and the counts follow."""
    await kube.add_node("h1", DYNAMIC)
    assert len(await kube.slices("h1")) == (2 if counters_apart(kube.info.version)
                                               else 1)
    await kube.admin.create(claim_template("h200", "3g.71gb", kube.ns))
    await claim_pod(kube, "train", "mig-h200-3g-71gb")
    async with kube.client() as client:
        reader = ClusterAvailability(CoreV1Api(client), resource_api=ResourceV1Api(client),
                                     node_selector=kube.selector)
        free = (await reader.slices()).free()["h200"]
    # The scheduler took the first placement that fits (0 or 4): three or four 1g
    # placements are left in the other half.
    assert (free["3g.71gb"], free["7g.141gb"]) == (1, 0) and free["1g.18gb"] in (3, 4)


async def test_a_dra_spawn_carries_a_claim_that_the_scheduler_allocates(dra, tmp_path):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    s = make(dra, ledger_url, profile="small", mig_resource_api="dra")
    assert "2 free now" in await s.render_options_form()
    await s.start()
    pod = await dra.pod(s.pod_name)
    spec = pod["spec"]
    assert spec["resourceClaims"] == [{"name": "mig",
                                       "resourceClaimTemplateName": "mig-h200-1g-18gb"}]
    notebook = spec["containers"][0]
    assert notebook["resources"]["claims"] == [{"name": "mig"}]
    assert not any(k.startswith("nvidia.com/") for k in notebook["resources"].get(
        "limits") or {})
    template = await dra.admin.get(f"/apis/resource.k8s.io/v1/namespaces/{dra.ns}/"
                                   "resourceclaimtemplates/mig-h200-1g-18gb")
    assert template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] == (
        claim_template("h200", "1g.18gb", dra.ns)["spec"]["spec"]["devices"]["requests"][0][
            "exactly"]["selectors"])
    # The claim the controller made from the template: the pod's name, the claim's
    # and a random suffix.
    (claim,) = await dra.claims()
    assert claim["metadata"]["name"].startswith(f"{s.pod_name}-mig-")
    assert claim["metadata"]["name"] != f"{s.pod_name}-mig"
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert (result["pool"], result["device"]) == (dra.node_name("h1"),
                                                   "gpu-0-mig-1g18gb-19-0")
    (lease,) = held(ledger_url)
    assert (lease.profile, lease.node) == ("1g.18gb", dra.node_name("h1"))
    KubeMIGSpawner._readers.clear()
    assert "1 free now" in await make(dra, ledger_url, name="ben", mig_resource_api="dra"
                                      ).render_options_form()
    await s.stop()
    # The claim is removed after the pod, by the garbage collector: stop waits for it.
    assert await dra.claims() == [] and held(ledger_url) == []


async def test_a_start_right_after_a_stop_gets_the_device_the_claim_held(kube, tmp_path):
    """One 3g.71gb: the claim of the stopped pod goes after the pod (asynchronously);
    stop returns only then, so the next start's claim gets the device at once."""
    await kube.add_node("h1", Gpus((Gpu("h200", {"3g.71gb": 1}, "dra"),)))
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    s = make(kube, ledger_url, profile="large", mig_resource_api="dra",
             allowed=("small", "large", "3g.71gb"))
    s.user_options = {"profile": "3g.71gb"}
    await s.start()
    await s.stop()
    assert await kube.claims() == []
    again = make(kube, ledger_url, name="ben", mig_resource_api="dra",
                 allowed=("small", "large", "3g.71gb"))
    again.user_options = {"profile": "3g.71gb"}
    await asyncio.wait_for(again.start(), 30)
    assert (await kube.pod(again.pod_name))["status"]["phase"] == "Running"
    await again.stop()


async def test_stop_waits_for_the_claim_to_go_before_the_lease_is_released(dra, tmp_path):
    """A claim outlives its pod until the garbage collector and whoever holds a
    finalizer on it (a DRA driver still unpreparing) let it go; its device is allocated
    until then. Stop, and with it the release, waits for the claim (before: it
    returned once the pod was gone, and the lease was given back while the device was
    still taken)."""
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    s = make(dra, ledger_url, profile="small", mig_resource_api="dra")
    await s.start()
    (claim,) = await dra.claims()
    path = (f"/apis/resource.k8s.io/v1/namespaces/{dra.ns}/resourceclaims/"
            f"{claim['metadata']['name']}")
    ours = "mig-spawner.test/unprepare"
    # A JSON patch adds ours alone (a merge patch would send the list as read).
    patch = ([{"op": "add", "path": "/metadata/finalizers/-", "value": ours}]
             if claim["metadata"].get("finalizers")
             else [{"op": "add", "path": "/metadata/finalizers", "value": [ours]}])
    await dra.admin.patch(path, patch, kind="json")
    stopping = asyncio.ensure_future(s.stop())
    await dra.admin.watch_object(f"/api/v1/namespaces/{dra.ns}/pods/{s.pod_name}",
                          lambda p: p is None)
    deleted = await dra.admin.watch_object(path, lambda c: c is None or c["metadata"].get(
        "deletionTimestamp"))
    assert deleted is not None  # the garbage collector marked it; the finalizer holds it
    assert not stopping.done() and len(held(ledger_url)) == 1
    await drop_finalizer(dra.admin, path, ours)
    await asyncio.wait_for(stopping, 60)
    assert await dra.claims() == [] and held(ledger_url) == []


async def drop_finalizer(admin, path: str, finalizer: str) -> None:
    """Remove ``finalizer`` alone, as its driver would: a JSON patch that tests it is
    still where it was read, read again when the controllers moved the list (a merge
    patch of the list as read would put back one they removed meanwhile, which the API
    server refuses on an object being deleted)."""
    while True:
        finalizers = (await admin.get(path))["metadata"].get("finalizers", [])
        at = f"/metadata/finalizers/{finalizers.index(finalizer)}"
        try:
            await admin.patch(path, [{"op": "test", "path": at, "value": finalizer},
                                     {"op": "remove", "path": at}], kind="json")
            return
        except ApiError as e:
            if e.status not in (409, 422):
                raise


async def test_a_size_no_device_has_is_refused_in_words(dra, tmp_path):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    s = make(dra, ledger_url, profile="large", mig_resource_api="dra")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.jupyterhub_message.startswith(
        "No schedulable GPU node of the cluster offers 'Large' now.")
    assert await dra.pods() == [] and held(ledger_url) == []


async def test_a_claim_no_device_satisfies_leaves_the_pod_pending_saying_so(dra):
    """kube-scheduler evaluates the claim's CEL selector: no device has the profile."""
    await dra.admin.create(claim_template("h200", "2g.35gb", dra.ns))
    await claim_pod(dra, "jupyter-ana", "mig-h200-2g-35gb", running=False)
    path = f"/api/v1/namespaces/{dra.ns}/pods/jupyter-ana"
    pod = await dra.admin.watch_object(path, lambda p: any(
        c.get("reason") == "Unschedulable" for c in p["status"].get("conditions") or []))
    assert pod["status"]["phase"] == "Pending"
    (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "cannot allocate all claims" in condition["message"]
    (claim,) = await dra.claims()
    assert not claim.get("status", {}).get("allocation")


async def test_the_selector_skips_a_device_without_an_attribute_where_cel_would_abort(
        kube):
    """A MIG device of an older driver has no productName. kube-scheduler's CEL fails a
    claim whose selector reads a missing attribute ("no such key"), and the whole
    allocation with it; the hub's selector checks first, so the claim gets the other
    device."""
    await kube.add_node("h1", None, agents=False)
    name = kube.node_name("h1")
    (published,) = resource_slices(name, Gpus((Gpu("h200", {"1g.18gb": 2}, "dra"),)))
    del published["spec"]["devices"][0]["attributes"]["productName"]
    published["metadata"]["name"] = f"{name}-old-driver"
    await kube.admin.create(published)
    await template_selecting(
        kube, "unguarded", "device.attributes['gpu.nvidia.com'].profile == '1g.18gb' && "
        "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H200'")
    await kube.admin.create(claim_template("h200", "1g.18gb", kube.ns))
    failing = await claim_pod(kube, "unguarded", "unguarded", running=False)
    guarded = await claim_pod(kube, "guarded", "mig-h200-1g-18gb")
    assert guarded["spec"]["nodeName"] == name
    pod = await kube.admin.watch_object(
        f"/api/v1/namespaces/{kube.ns}/pods/{failing['metadata']['name']}",
        lambda p: any(c["type"] == "PodScheduled" and c["status"] == "False"
                      for c in p["status"].get("conditions") or []))
    (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    # Not "no device matches": the scheduler gives up on the claim.
    assert condition["reason"] == "SchedulerError"
    assert "CEL runtime error: no such key: productName" in condition["message"]


async def test_the_api_refuses_what_the_old_stand_in_took(kube):
    """Counters beside devices in one ResourceSlice (1.35+; apart on 1.34), device names
    with dots, and a version attribute that is no semantic version are refused by the
    API server; the driver's own format passes."""
    name = kube.node_name("h1")
    await kube.add_node("h1", None, agents=False)
    devices, counters = resource_slices(name, DYNAMIC)
    (both,) = resource_slices(name, DYNAMIC, split_counters=False)
    both["metadata"]["name"] = f"{name}-both"
    if counters_apart(kube.info.version):
        with pytest.raises(ApiError, match="only one of `sharedCounters` or `devices`"):
            await kube.admin.create(both)
    else:  # 1.34 wants them together: apart, the devices' counter set is unknown
        with pytest.raises(ApiError, match="must reference a counterSet defined in the "
                                           "ResourceSlice sharedCounters"):
            await kube.admin.create(devices)
        devices, counters = both, None
    (static,) = resource_slices(name, Gpus((Gpu("h200", {"1g.18gb": 1}, "dra"),)))
    dotted = {**static, "metadata": {"name": f"{name}-dots"}, "spec": {
        **static["spec"], "devices": [{**static["spec"]["devices"][0],
                                       "name": "gpu-0-mig-1g.18gb-0"}]}}
    with pytest.raises(ApiError, match=r"gpu-0-mig-1g\.18gb-0"):
        await kube.admin.create(dotted)
    device = static["spec"]["devices"][0]
    unversioned = {**static, "metadata": {"name": f"{name}-version"}, "spec": {
        **static["spec"], "devices": [{**device, "attributes": {
            **device["attributes"], "driverVersion": {"version": "580.82.07"}}}]}}
    with pytest.raises(ApiError, match="driverVersion"):
        await kube.admin.create(unversioned)
    for ok in (devices, counters):
        if ok is not None:
            await kube.admin.create(ok)


async def test_a_claim_can_select_on_a_device_capacity(dra):
    """``device.capacity`` is there for CEL, by domain, as quantities."""
    await template_selecting(dra, "big", "device.capacity['gpu.nvidia.com'].memory"
                             ".compareTo(quantity('60Gi')) >= 0")
    await claim_pod(dra, "big", "big")
    (claim,) = await dra.claims()
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == (
        "gpu-1-mig-3g71gb-9-0")


async def test_the_check_command_names_dra_and_counts_its_slices(dra, tmp_path):
    kubeconfig = dra.kubeconfig()
    code, out, err = await run_check_command(kubeconfig, "--node-selector", dra.selector)
    assert out.startswith("MIG through: DRA (driver gpu.nvidia.com, DeviceClass "
                          'mig.nvidia.com): c.KubeMIGSpawner.mig_resource_api = "dra"')
    assert code == 2  # read as device-plugin: no node offers slices
    assert "the cluster serves MIG through dra, but --resource-api is device-plugin" in err
    code, out, _ = await run_check_command(kubeconfig, "--resource-api", "dra",
                                           "--node-selector", dra.selector)
    assert code == 0
    assert "free on h200: 1g.18gb: 2, 3g.71gb: 1" in out
