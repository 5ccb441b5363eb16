"""The stand-in Kubernetes API behaves like the API server where the hub would notice:
graceful deletion, a scheduler that says why a pod waits and tries again, admission,
RBAC from the documented Roles, and watches that expire. Each through
kubernetes_asyncio, the client KubeSpawner and mig-spawner use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from mig_spawner.kube import ClusterAvailability
from tests.support.kube_admission import documented_roles
from tests.support.kube_objects import gpu_labels, node, pod
from tests.support.polling import until_async

DOC = Path(__file__).resolve().parents[1] / "docs" / "kubernetes.md"
MIG = "nvidia.com/mig-1g.18gb"


def h200(name: str = "gpu-h1", slices: int = 1, allocatable: dict | None = None,
         **kw) -> dict:
    return node(name, gpu_labels("NVIDIA-H200", "mixed"),
                {MIG: str(slices), **(allocatable or {})}, **kw)


def new_pod(name: str, requests: dict[str, str] | None = None, **kw) -> dict:
    """A pod as a client POSTs it: no node, no status."""
    body = pod(name, None, requests, **kw)
    del body["status"], body["metadata"]["uid"], body["metadata"]["resourceVersion"]
    return body


@pytest.fixture
async def api(kube_standin):
    async with ApiClient(Configuration(host=kube_standin.url)) as client:
        yield CoreV1Api(client)


async def read(api: CoreV1Api, name: str) -> dict | None:
    response = await api.read_namespaced_pod(name, "jupyterhub", _preload_content=False)
    return None if response.status == 404 else json.loads(await response.read())


def error(e: ApiException) -> dict:
    return json.loads(e.body)


async def test_a_deleted_pod_terminates_holding_its_slice_and_the_next_one_gets_it(
    kube_standin, api
):
    """Deletion with a grace period: the pod stays (deletionTimestamp, phase Running)
    and keeps its device until its containers stop; the waiting pod is then scheduled."""
    kube_standin.nodes = [h200()]
    kube_standin.shutdown_seconds = 0.3
    await api.create_namespaced_pod("jupyterhub", new_pod("first", {MIG: "1"}))
    await api.delete_namespaced_pod("first", "jupyterhub", grace_period_seconds=30)
    terminating = await read(api, "first")
    assert terminating["metadata"]["deletionTimestamp"]
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 30
    assert terminating["status"]["phase"] == "Running"
    free = await ClusterAvailability(api, ttl=0).slices()
    assert free.free() == {"h200": {"1g.18gb": 0}}  # the device is not free yet

    await api.create_namespaced_pod("jupyterhub", new_pod("second", {MIG: "1"}))
    assert (await read(api, "second"))["status"]["phase"] == "Pending"
    await until_async(lambda: _gone(api, "first"), 10, "the first pod gone",
                      show=lambda: kube_standin.pods)
    await until_async(lambda: _running(api, "second"), 10, "the second pod running",
                      show=lambda: kube_standin.pods)
    assert (await read(api, "second"))["spec"]["nodeName"] == "gpu-h1"


async def _gone(api: CoreV1Api, name: str) -> bool:
    return await read(api, name) is None


async def _running(api: CoreV1Api, name: str) -> bool:
    return (await read(api, name))["status"]["phase"] == "Running"


@pytest.mark.parametrize(("allocatable", "asks", "why"), [
    ({}, {MIG: "1"}, "1 Insufficient nvidia.com/mig-1g.18gb"),
    ({"cpu": "2"}, {"cpu": "2500m"}, "1 Insufficient cpu"),
    ({"memory": "8Gi"}, {"memory": "9Gi"}, "1 Insufficient memory"),
    ({"pods": "1"}, {}, "1 Too many pods"),
])
async def test_the_scheduler_says_why_a_pod_waits(kube_standin, api, allocatable, asks, why):
    kube_standin.nodes = [h200(allocatable=allocatable)]
    kube_standin.pods = [pod("batch", "gpu-h1", {MIG: "1"}, namespace="batch")]
    await api.create_namespaced_pod("jupyterhub", new_pod("waiting", asks))
    waiting = await read(api, "waiting")
    assert waiting["status"]["phase"] == "Pending"
    assert "nodeName" not in waiting["spec"]
    (event,) = (await api.list_namespaced_event(
        "jupyterhub", field_selector="involvedObject.name=waiting")).items
    assert (event.type, event.reason) == ("Warning", "FailedScheduling")
    assert event.message.startswith(f"0/1 nodes are available: {why}. preemption: ")


async def test_selectors_and_taints_are_named_per_node(kube_standin, api):
    kube_standin.nodes = [
        h200("gpu-a", taints=[{"key": "nvidia.com/gpu", "value": "present",
                               "effect": "NoSchedule"}]),
        h200("gpu-b", unschedulable=True),
        h200("gpu-c"),
    ]
    body = new_pod("picky", {MIG: "1"})
    body["spec"]["nodeSelector"] = {"pool": "gpu"}
    await api.create_namespaced_pod("jupyterhub", body)
    message = (await read(api, "picky"))["status"]["conditions"][0]["message"]
    assert message == (
        "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
        "1 node(s) had untolerated taint {nvidia.com/gpu: present}, "
        "1 node(s) were unschedulable. preemption: 0/3 nodes are available: "
        "3 Preemption is not helpful for scheduling."
    )


def _label(body: dict, value: str) -> None:
    body["metadata"]["labels"]["hub.jupyter.org/username"] = value


def _selector(body: dict, value: str) -> None:
    body["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": value}


def _resources(requests: dict, limits: dict):
    def change(body: dict, _: str) -> None:
        body["spec"]["containers"][0]["resources"] = {"requests": requests, "limits": limits}
    return change


def _no_image_list(body: dict, _: str) -> None:
    body["spec"]["containers"] = "notebook"


MAX_Q = "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation-Edition-MIG-1g.24gb"


@pytest.mark.parametrize(("change", "value", "words"), [
    (_label, "a" * 64, 'metadata.labels: Invalid value: "' + "a" * 64
     + '": must be no more than 63 characters'),
    (_label, "-ana", "a valid label must be an empty string or consist of"),
    (_selector, MAX_Q, f'spec.nodeSelector: Invalid value: "{MAX_Q}": must be no more '
     "than 63 characters"),
    (_resources({}, {"nvidia.com/mig-1g.10gb+me": "1"}), "",
     "spec.containers[0].resources.limits[nvidia.com/mig-1g.10gb+me]: Invalid value: "
     '"nvidia.com/mig-1g.10gb+me": name part must consist of alphanumeric characters'),
    (_resources({MIG: "1"}, {MIG: "2"}), "",
     f'spec.containers[0].resources.requests[{MIG}]: Invalid value: "1": must be equal '
     f"to {MIG} limit of 2"),
    (_resources({MIG: "1"}, {}), "", "Limit must be set for non overcommitable resources"),
    (_resources({}, {MIG: "500m"}), "", 'Invalid value: "500m": must be an integer'),
    (_no_image_list, "", "spec.containers: 'notebook' is not of type 'array'"),
])
async def test_admission_refuses_what_the_api_server_refuses(kube_standin, api, change,
                                                             value, words):
    kube_standin.nodes = [h200()]
    body = new_pod("jupyter-ana")
    change(body, value)
    with pytest.raises(ApiException) as info:
        await api.create_namespaced_pod("jupyterhub", body)
    assert info.value.status == 422
    status = error(info.value)
    assert (status["reason"], status["code"]) == ("Invalid", 422)
    assert status["message"].startswith('Pod "jupyter-ana" is invalid: ')
    assert words in status["message"]
    assert kube_standin.pods == []


async def test_rbac_is_the_documented_roles_and_a_missing_verb_is_the_real_403(
    kube_standin, api
):
    kube_standin.rbac = documented_roles(DOC)
    kube_standin.nodes = [h200()]
    # What the hub does, allowed: list nodes and all pods, run pods in its namespace.
    await api.list_node()
    await api.list_pod_for_all_namespaces()
    await api.create_namespaced_pod("jupyterhub", new_pod("jupyter-ana"))
    await api.delete_namespaced_pod("jupyter-ana", "jupyterhub")
    # What it was not given.
    with pytest.raises(ApiException) as info:
        await api.create_namespaced_pod("batch", new_pod("sneaky"))
    assert info.value.status == 403
    assert error(info.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods is forbidden: User "system:serviceaccount:jhub:hub" cannot create '
                   'resource "pods" in API group "" in the namespace "batch"',
        "reason": "Forbidden", "details": {"group": "", "kind": "pods"}, "code": 403,
    }
    with pytest.raises(ApiException) as info:
        await api.list_namespaced_event("batch")
    assert 'cannot list resource "events" in API group "" in the namespace "batch"' in (
        error(info.value)["message"])


async def test_an_expired_watch_gets_410_gone_and_a_fresh_list_works(kube_standin, api):
    kube_standin.nodes = [h200()]
    listed = await api.list_namespaced_pod("jupyterhub", _preload_content=False)
    version = json.loads(await listed.read())["metadata"]["resourceVersion"]
    await api.create_namespaced_pod("jupyterhub", new_pod("jupyter-ana"))
    kube_standin.expire_watches()
    stream = watch.Watch().stream(api.list_namespaced_pod, "jupyterhub",
                                  resource_version=version, timeout_seconds=2)
    with pytest.raises(ApiException) as info:
        async with stream:
            async for _ in stream:
                pass
    assert info.value.status == 410
    # The relist path: a fresh list has what happened meanwhile.
    names = [p.metadata.name for p in (await api.list_namespaced_pod("jupyterhub")).items]
    assert names == ["jupyter-ana"]
