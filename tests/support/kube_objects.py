"""Kubernetes API objects as a cluster with NVIDIA's GPU Operator shows them.

Builders for Nodes (GFD labels, device plugin allocatable) and Pods in the API's JSON,
for the tests that compute on API JSON in-process (the arithmetic of free slices, the
claim decision); tests/test_kube_availability.py checks that the real API server stores
them as built. Nodes on the test cluster come from tests/support/kube_gpus.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CREATED = "2026-12-01T09:00:00Z"


def node(
    name: str,
    labels: Mapping[str, str] | None = None,
    allocatable: Mapping[str, str] | None = None,
    *,
    ready: bool = True,
    unschedulable: bool = False,
    taints: Iterable[Mapping[str, str]] = (),
) -> dict[str, Any]:
    """A Node as ``kubectl get node -o json`` shows it (the fields that matter here)."""
    resources = {"cpu": "64", "memory": "527975388Ki", "pods": "110", **(allocatable or {})}
    spec: dict[str, Any] = {"podCIDR": "10.244.1.0/24"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-node-{name}",
            "resourceVersion": "1001",
            "creationTimestamp": CREATED,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "Unknown",
                    "lastHeartbeatTime": CREATED,
                    "lastTransitionTime": CREATED,
                    "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                    "message": "kubelet is posting ready status" if ready
                    else "Kubelet stopped posting node status.",
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": f"boot-{name}",
                "containerRuntimeVersion": "containerd://1.7.22",
                "kernelVersion": "6.1.0-27-amd64",
                "kubeProxyVersion": "v1.31.2",
                "kubeletVersion": "v1.31.2",
                "machineID": f"machine-{name}",
                "operatingSystem": "linux",
                "osImage": "Ubuntu 22.04.5 LTS",
                "systemUUID": f"uuid-{name}",
            },
        },
    }


def gpu_labels(
    product: str, strategy: str, *, config: str = "", state: str | None = "success",
    counts: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """GFD and MIG Manager labels of a MIG node."""
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": strategy,
    }
    if config:
        labels["nvidia.com/mig.config"] = config
    if state is not None:
        labels["nvidia.com/mig.config.state"] = state
    for profile, count in (counts or {}).items():
        labels[f"nvidia.com/mig-{profile}.count"] = str(count)
    return labels


def pod(
    name: str,
    node_name: str | None,
    requests: Mapping[str, str] | None = None,
    *,
    namespace: str = "jupyterhub",
    phase: str = "Running",
    init_containers: Iterable[Mapping[str, Any]] = (),
    limits_only: bool = False,
) -> dict[str, Any]:
    """A Pod whose one container asks for ``requests`` (and the same limits)."""
    asks = dict(requests or {})
    resources = {"limits": asks} if limits_only else {"requests": asks, "limits": asks}
    spec: dict[str, Any] = {
        "containers": [
            {"name": "notebook", "image": "quay.io/jupyter/base-notebook:latest",
             "resources": resources if asks else {}}
        ],
        "restartPolicy": "OnFailure",
        "schedulerName": "default-scheduler",
    }
    if init_containers:
        spec["initContainers"] = [dict(c) for c in init_containers]
    if node_name:
        spec["nodeName"] = node_name
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-pod-{namespace}-{name}",
            "resourceVersion": "2002",
            "creationTimestamp": CREATED,
            "labels": {"app": "jupyterhub", "component": "singleuser-server"},
        },
        "spec": spec,
        "status": {"phase": phase, "qosClass": "Burstable"},
    }
