"""What reading the cluster's free MIG slices costs the hub, on a big synthetic cluster.

Cluster: 200 GPU nodes (8x H200, 7 slices each, mixed strategy; half of them single
strategy), 50 CPU nodes, 4,000 pods (2,600 holding a slice, 700 finished), on the real
control plane the tests use (tests/support/kube_cluster.py: kube-apiserver and etcd
built from upstream; KWOK runs the pods), read through a counting tap.

Rows, each measured in the same run:
  * compute: cluster_slices() on the JSON already in memory;
  * read (raw JSON): ClusterAvailability's uncached read, as the hub does it
    (_preload_content=False, paged);
  * baseline (models): the same two paged lists through kubernetes_asyncio's default
    deserialization into V1Node/V1Pod objects, without any counting;
  * form renders: 20 spawn-form reads through the 10 s cache vs with ttl=0.

Most of a read is the API server serving 3,300 pods in 500-item pages (the same for
the hub and the baseline); the machine's load moves the absolute numbers. Setting the
cluster up (creating the objects) takes a minute or two and is not measured.

Run: .venv/bin/python -m benchmarks.kube_availability [--runs 5] (from the repository
root: it starts the test cluster from ``tests.support``)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

from mig_spawner.kube import ClusterAvailability, cluster_slices
from mig_spawner.kube.availability import NOT_TERMINATED, PAGE_SIZE
from tests.support import kube_cluster
from tests.support.kube_fixture import nodes_usable
from tests.support.kube_objects import gpu_labels, node, pod
from tests.support.kube_rest import ApiError, Kube
from tests.support.kube_tap import Tap

GPU_NODES, CPU_NODES, GPU_PODS, CPU_PODS, DONE_PODS = 200, 50, 2600, 700, 700
NAMESPACE = "bench-availability"
RENDERS = 20


def cluster() -> tuple[list[dict], list[dict]]:
    nodes = []
    for i in range(GPU_NODES):
        if i % 2:
            labels = gpu_labels("NVIDIA-H200-MIG-1g.18gb", "single")
            nodes.append(node(f"bench-gpu-{i}", labels, {"nvidia.com/gpu": "56"}))
        else:
            labels = gpu_labels("NVIDIA-H200", "mixed")
            nodes.append(node(f"bench-gpu-{i}", labels, {"nvidia.com/mig-1g.18gb": "56"}))
    nodes += [node(f"bench-cpu-{i}", {"pool": "cpu"}) for i in range(CPU_NODES)]
    for n in nodes:
        n["metadata"]["labels"]["bench"] = "availability"
        n["metadata"]["annotations"] = {"kwok.x-k8s.io/node": "fake"}
    pods = []
    for i in range(GPU_PODS):
        n = i % GPU_NODES
        resource = "nvidia.com/gpu" if n % 2 else "nvidia.com/mig-1g.18gb"
        pods.append(pod(f"gpu-{i}", f"bench-gpu-{n}", {resource: "1", "cpu": "2"},
                        namespace=NAMESPACE))
    pods += [pod(f"web-{i}", f"bench-cpu-{i % CPU_NODES}", {"cpu": "1"}, namespace=NAMESPACE)
             for i in range(CPU_PODS)]
    pods += [pod(f"job-{i}", f"bench-gpu-{i % GPU_NODES}", {"nvidia.com/gpu": "1"},
                 phase="Succeeded", namespace=NAMESPACE) for i in range(DONE_PODS)]
    return nodes, pods


def bare(obj: dict, kind: str) -> dict:
    """A builder's object as a client creates it: no server-set fields."""
    meta = {k: v for k, v in obj["metadata"].items()
            if k not in ("uid", "resourceVersion", "creationTimestamp")}
    return {"apiVersion": "v1", "kind": kind, **obj, "metadata": meta}


async def populate(kube: Kube, nodes: list[dict], pods: list[dict]) -> None:
    """Create the nodes and pods (20 requests at a time); finished pods are marked so."""
    await kube.apply({"apiVersion": "v1", "kind": "Namespace",
                      "metadata": {"name": NAMESPACE}})
    await kube.watch_object(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default",
                     lambda sa: sa is not None)
    gate = asyncio.Semaphore(20)

    async def create(obj: dict, kind: str) -> None:
        async with gate:
            body = bare(obj, kind)
            if kind == "Pod":
                body.pop("status", None)
            try:
                await kube.create(body)
            except ApiError as e:
                if e.status != 409:
                    raise
            if kind == "Pod" and obj["status"]["phase"] == "Succeeded":
                path = f"/api/v1/namespaces/{NAMESPACE}/pods/{obj['metadata']['name']}"
                await kube.patch(f"{path}/status", {"status": {"phase": "Succeeded"}})

    await asyncio.gather(*(create(n, "Node") for n in nodes))
    await nodes_usable(kube, "bench=availability", len(nodes))
    await asyncio.gather(*(create(p, "Pod") for p in pods))


async def median_ms(fn: Callable[[], Awaitable[object]], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def main(runs: int) -> None:
    nodes, pods = cluster()
    run = f"bench-availability-{os.getpid()}"
    info = kube_cluster.acquire(run)
    tap = Tap(info.server, info.ca)
    tap.start()
    async with Kube(info.credentials()) as admin:
        await populate(admin, nodes, pods)
    configuration = Configuration(host=tap.url)
    configuration.api_key = {"BearerToken": info.admin_token}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    async with ApiClient(configuration) as client:
        api = CoreV1Api(client)
        selector = "bench=availability"

        async def compute() -> object:
            return cluster_slices(nodes, [p for p in pods if p["status"]["phase"] == "Running"])

        async def raw_read() -> object:
            return await ClusterAvailability(api, ttl=0, node_selector=selector).slices()

        async def paged_models(method: Callable[..., Awaitable], **kwargs: object) -> list:
            items, token = [], None
            while True:
                page = await method(limit=PAGE_SIZE, _continue=token, **kwargs)
                items += page.items
                token = page.metadata._continue
                if not token:
                    return items

        async def model_read() -> object:
            return await asyncio.gather(
                paged_models(api.list_node, label_selector=selector),
                paged_models(api.list_pod_for_all_namespaces, field_selector=NOT_TERMINATED),
            )

        result = await raw_read()
        # KWOK may let a node's lease lapse on a busy machine (then it is tainted
        # unreachable and left out): the read is measured all the same.
        assert len(result.nodes) >= GPU_NODES * 0.9, result.skipped[:3]

        t_compute = await median_ms(compute, runs)
        t_raw = await median_ms(raw_read, runs)
        t_models = await median_ms(model_read, runs)

        def lists() -> int:
            return (tap.count("GET", "/api/v1/nodes", watch=False)
                    + tap.count("GET", "/api/v1/pods", watch=False))

        async def renders(ttl: float) -> tuple[float, int]:
            reader = ClusterAvailability(api, ttl=ttl, node_selector=selector)
            before = lists()
            start = time.perf_counter()
            for _ in range(RENDERS):
                await reader.slices()
            return (time.perf_counter() - start) * 1000, lists() - before

        t_cached, hits_cached = await renders(10.0)
        t_uncached, hits_uncached = await renders(0.0)
    tap.stop()
    kube_cluster.release(run)

    print(f"cluster: {GPU_NODES} GPU + {CPU_NODES} CPU nodes, "
          f"{GPU_PODS + CPU_PODS + DONE_PODS} pods; median of {runs} runs")
    print(f"{'what':<44} {'ms':>10} {'vs baseline':>12}")
    print(f"{'compute free slices (JSON in memory)':<44} {t_compute:>10.1f} "
          f"{t_compute / t_models:>11.2f}x")
    print(f"{'read nodes+pods, raw JSON (the hub)':<44} {t_raw:>10.1f} {t_raw / t_models:>11.2f}x")
    print(f"{'baseline: read as kubernetes_asyncio models':<44} {t_models:>10.1f} {1:>11.2f}x")
    print(f"{f'{RENDERS} form renders, 10 s cache':<44} {t_cached:>10.1f}   "
          f"API requests: {hits_cached}")
    print(f"{f'{RENDERS} form renders, no cache (ttl=0)':<44} {t_uncached:>10.1f}   "
          f"API requests: {hits_uncached}")
    print(f"cache speed-up for a burst of renders: {t_uncached / t_cached:.0f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    asyncio.run(main(parser.parse_args().runs))
