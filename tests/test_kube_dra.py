"""MIG through DRA: free slices from ResourceSlices less allocated ResourceClaims, a pod
that carries a claim from a template per GPU model and profile, and what a claim no
device can satisfy looks like, against the stand-in API and its CEL-evaluating
scheduler."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from jupyterhub.spawner import SpawnException
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api, ResourceV1Api

from mig_spawner.cli.doctor import Status, check_kube_resource_api
from mig_spawner.kube import ClusterAvailability
from mig_spawner.kube.dra import claim_template, dra_slices, served_by
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.support.kube_dra import mig_device, resource_slice
from tests.support.kube_objects import node, pod, run_check_command, write_kubeconfig
from tests.support.spawners import held, kube_spawner


def h200_node(name: str = "gpu-h1") -> dict:
    """A DRA node: no nvidia.com/* in allocatable, no GFD labels needed."""
    return node(name)


def h200_slice(name: str = "gpu-h1", small: int = 2) -> dict:
    return resource_slice(name, [mig_device(0, "1g.18gb", start) for start in range(small)]
                          + [mig_device(1, "3g.71gb", 0)])


def allocated_claim(device: str, pod_name: str, node_name: str = "gpu-h1") -> dict:
    return {"metadata": {"name": f"{pod_name}-mig-abcde", "namespace": "batch"},
            "status": {"allocation": {"devices": {"results": [{
                "request": "mig", "driver": "gpu.nvidia.com", "pool": node_name,
                "device": device}]}},
                "reservedFor": [{"resource": "pods", "name": pod_name, "uid": "u"}]}}


def test_free_slices_are_resource_slice_devices_less_allocated_claims():
    slices = dra_slices([h200_node()], [h200_slice(small=3)],
                        [allocated_claim("gpu-0-mig-1g18gb-1", "train")])
    assert slices.free() == {"h200": {"1g.18gb": 2, "3g.71gb": 1}}
    assert slices.counted_pods == {"batch/train"}
    # Nothing of it is in node allocatable, which the device-plugin count reads.
    assert dra_slices([h200_node(), node("cpu-1")], [], []).free() == {}


def test_dynamic_mig_counts_what_the_gpus_counters_leave():
    """Partitionable devices (dynamic MIG): every placement is a device consuming memory
    slices of its GPU's counter set; with a 1g placed, one 2g no longer fits."""
    def placement(profile: str, start: int, size: int) -> dict:
        device = mig_device(0, profile, start)
        device["consumesCounters"] = [{"counterSet": "gpu-0-counter-set", "counters": {
            f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)}}]
        return device

    shared = [{"name": "gpu-0-counter-set", "counters": {
        f"memory-slice-{i}": {"value": "1"} for i in range(4)}}]
    devices = [placement("1g.18gb", s, 1) for s in range(4)] + [
        placement("2g.35gb", s, 2) for s in (0, 2)]
    rs = resource_slice("gpu-h1", devices, shared_counters=shared)
    assert dra_slices([h200_node()], [rs], []).free() == {"h200": {"1g.18gb": 4,
                                                                   "2g.35gb": 2}}
    taken = allocated_claim("gpu-0-mig-1g18gb-0", "p")
    assert dra_slices([h200_node()], [rs], [taken]).free() == {"h200": {"1g.18gb": 3,
                                                                        "2g.35gb": 1}}


def test_the_cluster_says_whether_it_serves_mig_through_dra_or_the_device_plugin():
    plugin = node("gpu-a1", {"nvidia.com/gpu.product": "NVIDIA-H200"},
                  {"nvidia.com/mig-1g.18gb": "7"})
    assert served_by([h200_node()], [h200_slice()]) == "dra"
    assert served_by([plugin], []) == "device-plugin"
    assert served_by([node("cpu-1")], []) == "none"


@pytest.fixture
async def dra(kube):
    """The stand-in (the documented RBAC, DRA rules included) with one H200 node whose
    MIG devices the DRA driver publishes."""
    server = kube
    server.nodes = [h200_node()]
    server.dra.slices = [h200_slice()]
    return server


async def test_availability_reads_resource_slices_and_claims_through_the_api(dra):
    dra.dra.claims = [allocated_claim("gpu-0-mig-1g18gb-0", "train")]
    async with ApiClient(Configuration(host=dra.url)) as client:
        reader = ClusterAvailability(CoreV1Api(client), resource_api=ResourceV1Api(client))
        assert (await reader.slices()).free() == {"h200": {"1g.18gb": 1, "3g.71gb": 1}}


async def test_a_dra_spawn_carries_a_claim_that_the_scheduler_allocates(dra, tmp_path):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    s = kube_spawner(dra, ledger_url, profile="small", mig_resource_api="dra")
    assert "2 free now" in await s.render_options_form()
    await s.start()
    spec = next(p for p in dra.pods if p["metadata"]["name"] == s.pod_name)["spec"]
    assert spec["resourceClaims"] == [{"name": "mig",
                                       "resourceClaimTemplateName": "mig-h200-1g-18gb"}]
    notebook = spec["containers"][0]
    assert notebook["resources"]["claims"] == [{"name": "mig"}]
    assert not any(k.startswith("nvidia.com/") for k in notebook["resources"].get(
        "limits") or {})
    (template,) = dra.dra.templates
    assert template["spec"] == claim_template("h200", "1g.18gb", "jupyterhub")["spec"]
    (claim,) = dra.dra.claims
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert (result["pool"], result["device"]) == ("gpu-h1", "gpu-0-mig-1g18gb-0")
    (lease,) = held(ledger_url)
    assert (lease.profile, lease.node) == ("1g.18gb", "gpu-h1")
    KubeMIGSpawner._readers.clear()
    assert "1 free now" in await kube_spawner(dra, ledger_url, name="ben", mig_resource_api="dra"
                                              ).render_options_form()
    await s.stop()
    assert dra.dra.claims == [] and held(ledger_url) == []


async def test_a_size_no_device_has_is_refused_in_words(dra, tmp_path):
    ledger_url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    s = kube_spawner(dra, ledger_url, profile="large", mig_resource_api="dra")
    with pytest.raises(SpawnException) as info:
        await s.start()
    assert info.value.jupyterhub_message.startswith(
        "No schedulable GPU node of the cluster offers 'Large' now.")
    assert dra.pods == [] and held(ledger_url) == []


async def test_a_claim_no_device_satisfies_leaves_the_pod_pending_saying_so(dra):
    """The scheduler evaluates the claim's CEL selector: no device has the profile."""
    dra.dra.templates = [claim_template("h200", "2g.35gb", "jupyterhub")]
    body = pod("jupyter-ana", None)
    del body["status"], body["metadata"]["uid"], body["metadata"]["resourceVersion"]
    body["spec"]["resourceClaims"] = [{"name": "mig",
                                       "resourceClaimTemplateName": "mig-h200-2g-35gb"}]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "mig"}]}
    async with ApiClient(Configuration(host=dra.url)) as client:
        await CoreV1Api(client).create_namespaced_pod("jupyterhub", body)
    await asyncio.sleep(0)
    created = dra.pods[0]
    assert created["status"]["phase"] == "Pending"
    assert created["status"]["conditions"][0]["message"].startswith(
        "0/1 nodes are available: 1 cannot allocate all claims.")
    assert [c["status"] for c in dra.dra.claims] == [{}]


async def test_the_check_command_names_dra_and_counts_its_slices(dra, tmp_path):
    code, out, err = await run_check_command(dra, tmp_path)
    assert out.startswith("MIG through: DRA (driver gpu.nvidia.com, DeviceClass "
                          'mig.nvidia.com): c.KubeMIGSpawner.mig_resource_api = "dra"')
    assert code == 2  # read as device-plugin: no node offers slices
    assert "the cluster serves MIG through dra, but --resource-api is device-plugin" in err
    code, out, _ = await run_check_command(dra, tmp_path, "--resource-api", "dra")
    assert code == 0
    assert "free on h200: 1g.18gb: 2, 3g.71gb: 1" in out


def test_doctor_names_how_the_cluster_serves_mig_against_the_setting():
    assert check_kube_resource_api("dra", "dra").status is Status.PASS
    mismatch = check_kube_resource_api("dra", "device-plugin")
    assert (mismatch.status, mismatch.fix) == (
        Status.FAIL, 'c.KubeMIGSpawner.mig_resource_api = "dra"')
    assert "no DRA driver publishes any" in check_kube_resource_api("none", "dra").detail


async def test_doctor_kube_reads_the_cluster(dra, tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "40-kube.py").write_text(
        'c.KubeMIGSpawner.mig_resource_api = "dra"\n')
    env = {**os.environ, "KUBECONFIG": write_kubeconfig(tmp_path / "kubeconfig", dra.url)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from mig_spawner.cli.main import main; "
        "sys.exit(main(sys.argv[1:]))", "doctor", "--kube", "-f", str(tmp_path / "conf"),
        stdout=asyncio.subprocess.PIPE, env=env)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    assert "[PASS] Kubernetes MIG devices  served by NVIDIA's DRA driver" in out.decode()
