"""``mig-spawner doctor --kube`` against the real cluster, as the hub's account: what it
reads (nodes, their MIG slices or DRA devices, the strategy, the DeviceClass) and the
hub's RBAC, asked of the API server (SelfSubjectAccessReview)."""

from __future__ import annotations

from tests.support.kube_fixture import run_doctor
from tests.support.kube_gpus import Gpu, Gpus, gpu_labels_of

A100 = Gpus((Gpu("a100-80gb", {"3g.40gb": 1, "1g.10gb": 2}),))
H200_DRA = Gpus((Gpu("h200", {"1g.18gb": 2}, "dra"),))



async def test_doctor_reads_nodes_slices_strategy_and_rbac(kube):
    await kube.add_node("a1", A100)
    await kube.add_node("a2", None, labels={**gpu_labels_of(A100),
                                            "nvidia.com/mig.config.state": "pending"},
                        allocatable={"nvidia.com/mig-1g.10gb": "7"})
    await kube.run_pod("batch", "a1", {"nvidia.com/mig-1g.10gb": "1"})
    code, checks = await run_doctor(kube, kube.kubeconfig())
    assert code == 0, [c for c in checks.values() if c["status"] == "fail"]
    assert checks["Kubernetes API"]["detail"].startswith(kube.info.version)
    assert checks["Kubernetes MIG devices"]["status"] == "pass"
    nodes = checks["GPU nodes"]
    assert nodes["status"] == "pass"
    assert (f"1 offer MIG slices (free/all): {kube.node_name('a1')} (a100-80gb, mixed): "
            "1g.10gb 1/2, 3g.40gb 1/1") == nodes["detail"]
    left_out = checks[f"node {kube.node_name('a2')}"]
    assert (left_out["status"], left_out["detail"]) == (
        "warn", "not offered: MIG Manager is applying a layout "
                "(nvidia.com/mig.config.state=pending)")
    assert checks["MIG strategy"]["detail"] == (
        "nodes hand out slices as mixed (read from each node)")
    assert checks["hub RBAC"]["status"] == "pass"
    assert "DeviceClass mig.nvidia.com" not in checks


async def test_doctor_checks_dra_devices_and_the_device_class(kube):
    await kube.add_node("h1", H200_DRA)
    code, checks = await run_doctor(kube, kube.kubeconfig(), mig_resource_api="dra")
    assert code == 0, [c for c in checks.values() if c["status"] == "fail"]
    assert checks["Kubernetes MIG devices"]["detail"].startswith(
        "served by NVIDIA's DRA driver")
    assert checks["DeviceClass mig.nvidia.com"]["status"] == "pass"
    assert checks["GPU nodes"]["detail"].endswith("(h200, dra): 1g.18gb 2/2")
    assert checks["hub RBAC"]["status"] == "pass"
    # Read as the device plugin's, the same cluster has no slices, and doctor says so.
    code, checks = await run_doctor(kube, kube.kubeconfig())
    assert code == 1
    assert checks["Kubernetes MIG devices"]["fix"] == 'c.KubeMIGSpawner.mig_resource_api = "dra"'


async def test_doctor_names_each_permission_the_hub_lacks(kube):
    await kube.add_node("a1", A100)
    kubeconfig, _ = await kube.account("partial", drop={"hub": {"delete", "watch"}})
    code, checks = await run_doctor(kube, kubeconfig)
    assert code == 1
    rbac = checks["hub RBAC"]
    assert rbac["status"] == "fail"
    assert rbac["detail"] == (
        f"the hub's account may not: watch pods in namespace {kube.ns} (to follow servers); "
        f"delete pods in namespace {kube.ns} (to stop servers); "
        f"watch events in namespace {kube.ns} (to show why a pod waits)")
    assert "docs/kubernetes.md" in rbac["fix"]
