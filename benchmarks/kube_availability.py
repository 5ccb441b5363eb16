"""What reading the cluster's free MIG slices costs the hub, on a big synthetic cluster.

Cluster: 200 GPU nodes (8x H200, 7 slices each, mixed strategy; half of them single
strategy), 50 CPU nodes, 12,000 pods (8,000 holding a slice, 2,000 finished), served
over HTTP by the test stand-in of the Kubernetes API (tests/support/kube_standin.py).

Rows, each measured in the same run:
  * compute: cluster_slices() on the JSON already in memory;
  * read (raw JSON): ClusterAvailability's uncached read, as the hub does it
    (_preload_content=False, paged);
  * baseline (models): the same two paged lists through kubernetes_asyncio's default
    deserialization into V1Node/V1Pod objects, without any counting;
  * form renders: 20 spawn-form reads through the 10 s cache vs with ttl=0.

Most of a read is the stand-in serving 10,000 pods in 500-item pages (the same for
the hub and the baseline); the machine's load moves the absolute numbers.

Run: .venv/bin/python -m benchmarks.kube_availability [--runs 5] (from the repository
root: it imports the stand-in from ``tests.support``)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

from mig_spawner.kube import ClusterAvailability, cluster_slices
from mig_spawner.kube.availability import NOT_TERMINATED, PAGE_SIZE
from tests.support.kube_objects import gpu_labels, node, pod
from tests.support.kube_standin import KubeStandin

GPU_NODES, CPU_NODES, GPU_PODS, CPU_PODS, DONE_PODS = 200, 50, 8000, 2000, 2000
RENDERS = 20


def cluster() -> tuple[list[dict], list[dict]]:
    nodes = []
    for i in range(GPU_NODES):
        if i % 2:
            labels = gpu_labels("NVIDIA-H200-MIG-1g.18gb", "single")
            nodes.append(node(f"gpu-{i}", labels, {"nvidia.com/gpu": "56"}))
        else:
            labels = gpu_labels("NVIDIA-H200", "mixed")
            nodes.append(node(f"gpu-{i}", labels, {"nvidia.com/mig-1g.18gb": "56"}))
    nodes += [node(f"cpu-{i}", {"pool": "cpu"}) for i in range(CPU_NODES)]
    pods = []
    for i in range(GPU_PODS):
        n = i % GPU_NODES
        resource = "nvidia.com/gpu" if n % 2 else "nvidia.com/mig-1g.18gb"
        pods.append(pod(f"gpu-{i}", f"gpu-{n}", {resource: "1", "cpu": "2"}))
    pods += [pod(f"web-{i}", f"cpu-{i % CPU_NODES}", {"cpu": "1"}) for i in range(CPU_PODS)]
    pods += [pod(f"job-{i}", f"gpu-{i % GPU_NODES}", {"nvidia.com/gpu": "1"}, phase="Succeeded")
             for i in range(DONE_PODS)]
    return nodes, pods


async def median_ms(fn: Callable[[], Awaitable[object]], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def main(runs: int) -> None:
    nodes, pods = cluster()
    standin = KubeStandin(nodes, pods)
    standin.start()
    async with ApiClient(Configuration(host=standin.url)) as client:
        api = CoreV1Api(client)

        async def compute() -> object:
            return cluster_slices(nodes, [p for p in pods if p["status"]["phase"] == "Running"])

        async def raw_read() -> object:
            return await ClusterAvailability(api, ttl=0).slices()

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
                paged_models(api.list_node),
                paged_models(api.list_pod_for_all_namespaces, field_selector=NOT_TERMINATED),
            )

        result = await raw_read()
        assert result.free()["h200"]["1g.18gb"] == GPU_NODES * 56 - GPU_PODS

        t_compute = await median_ms(compute, runs)
        t_raw = await median_ms(raw_read, runs)
        t_models = await median_ms(model_read, runs)

        async def renders(ttl: float) -> tuple[float, int]:
            reader = ClusterAvailability(api, ttl=ttl)
            before = standin.list_hits()
            start = time.perf_counter()
            for _ in range(RENDERS):
                await reader.slices()
            return (time.perf_counter() - start) * 1000, standin.list_hits() - before

        t_cached, hits_cached = await renders(10.0)
        t_uncached, hits_uncached = await renders(0.0)
    standin.stop()

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
