"""A class starts at once on Kubernetes: KubeMIGSpawner against plain KubeSpawner.

The cluster is the tests' real control plane (tests/support/kube_cluster.py:
kube-apiserver, etcd, kube-scheduler and kube-controller-manager built from upstream,
KWOK running the pods): N fake nodes with 8 H200 each, every GPU cut into seven
1g.18gb (56 slices a node). S servers are started at once (start() until the pod
runs; no notebook process), first by plain KubeSpawner with a ``profile_list`` whose
one profile asks for the same slice (``nvidia.com/mig-1g.18gb: 1`` and the GPU
toleration), then by KubeMIGSpawner (form policy, quota, lease, free-slice check),
each burst stopped and cleaned before the next. The same again with DRA: the nodes'
MIG devices are published as NVIDIA's DRA driver publishes them, plain KubeSpawner's
pods carry a claim from a ResourceClaimTemplate, KubeMIGSpawner's its own.

Printed per burst: time from the burst's start to each pod running (p50, p95), API
requests per start (counted by a tap in front of the API server: everything the
spawners and their reflectors sent), and the API server's CPU seconds (from /proc);
then KubeMIGSpawner's ratios to plain KubeSpawner (goal: at most 1.2 on time and
requests).

Run: .venv/bin/python -m benchmarks.kube_burst [--nodes 100] [--starts 500]
(from the repository root; a few minutes; builds the cluster first if needed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio.config import kube_config
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from mig_spawner.kube.dra import claim_template
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.mocking import Hub, OrmSpawner, User
from tests.support import kube_cluster
from tests.support.kube_fixture import nodes_usable
from tests.support.kube_gpus import Gpu, Gpus, gpu_node, resource_slices
from tests.support.kube_rest import Kube
from tests.support.kube_tap import Tap

TOLERATE_GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
H200 = Gpus(tuple(Gpu("h200", {"1g.18gb": 7}) for _ in range(8)))
H200_DRA = Gpus(tuple(Gpu("h200", {"1g.18gb": 7}, "dra") for _ in range(8)))


HEADER = f"{'burst':<28} {'p50 s':>7} {'p95 s':>7} {'req/start':>10} {'apiserver CPU s':>16}"


@dataclass
class Burst:
    name: str
    times: list[float]
    requests: int
    cpu: float

    def p(self, q: float) -> float:
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def line(self, starts: int) -> str:
        return (f"{self.name:<28} {self.p(0.5):>7.2f} {self.p(0.95):>7.2f} "
                f"{self.requests / starts:>10.2f} {self.cpu:>16.1f}")


def apiserver_cpu(folder: str) -> float:
    """CPU seconds the run's kube-apiserver has used (user + system)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"kube-apiserver" in cmdline.split(b"\0")[0] and folder.encode() in cmdline:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    raise RuntimeError("no kube-apiserver of this cluster")


async def setup(admin: Kube, nodes: int) -> None:
    """The bench's nodes (KWOK's, labelled for their pool) and namespaces."""
    gate = asyncio.Semaphore(20)

    async def one(name: str, gpus: Gpus, pool: str) -> None:
        async with gate:
            await admin.apply(gpu_node(name, gpus, agents=False, labels={"bench": pool},
                                       taints=[{"key": "nvidia.com/gpu", "value": "present",
                                                "effect": "NoSchedule"}]))
            for rs in resource_slices(name, gpus):
                await admin.apply(rs)

    await asyncio.gather(*(one(f"bench-dp-{i}", H200, "dp") for i in range(nodes)),
                         *(one(f"bench-dra-{i}", H200_DRA, "dra") for i in range(nodes)))
    for ns in ("bench-plain-dp", "bench-mig-dp", "bench-plain-dra", "bench-mig-dra"):
        await admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        await admin.watch_object(f"/api/v1/namespaces/{ns}/serviceaccounts/default",
                          lambda sa: sa is not None)
    await admin.apply(claim_template("h200", "1g.18gb", "bench-plain-dra"))
    for pool in ("dp", "dra"):
        await nodes_usable(admin, f"bench={pool}", nodes)


def plain_config(url: str, pool: str) -> Config:
    """Plain KubeSpawner with a profile_list whose profile asks for the same slice."""
    c = Config()
    c.KubeSpawner.namespace = f"bench-plain-{pool}"
    c.KubeSpawner.k8s_api_host = url
    c.KubeSpawner.events_enabled = False
    c.KubeSpawner.start_timeout = 600
    # A burst on two cores answers slower than KubeSpawner's 3 s per request (both
    # spawners get the same).
    c.KubeSpawner.k8s_api_request_timeout = 60
    c.KubeSpawner.k8s_api_request_retry_timeout = 600
    override = {"tolerations": [TOLERATE_GPU], "node_selector": {"bench": pool}}
    if pool == "dp":
        override["extra_resource_limits"] = {"nvidia.com/mig-1g.18gb": "1"}
        override["extra_resource_guarantees"] = {"nvidia.com/mig-1g.18gb": "1"}
    else:
        override["extra_pod_config"] = {"resourceClaims": [
            {"name": "mig", "resourceClaimTemplateName": "mig-h200-1g-18gb"}]}
        override["extra_container_config"] = {"resources": {"claims": [{"name": "mig"}]}}
    c.KubeSpawner.profile_list = [{"display_name": "Small", "slug": "small",
                                   "kubespawner_override": override}]
    return c


def mig_config(url: str, pool: str, ledger: str) -> Config:
    c = Config()
    c.MIGPolicyConfig.slice_classes = {"small": {"display_name": "Small",
                                                 "profiles": {"h200": "1g.18gb"}}}
    c.MIGPolicyConfig.group_policies = {"class": {"allowed": ["small"],
                                                  "max_slices_per_user": 1}}
    c.MIGSettings.ledger_url = ledger
    s = c.KubeMIGSpawner
    s.namespace = f"bench-mig-{pool}"
    s.k8s_api_host = url
    s.events_enabled = False
    s.start_timeout = 600
    s.k8s_api_request_timeout = 60
    s.k8s_api_request_retry_timeout = 600
    s.mig_tolerations = [TOLERATE_GPU]
    s.mig_node_selector = {"bench": pool}
    s.mig_node_label_selector = f"bench={pool}"
    s.mig_resource_api = "device-plugin" if pool == "dp" else "dra"
    return c


async def burst(name: str, spawners: list, tap: Tap, folder: str,
                admin: Kube, namespace: str) -> Burst:
    tap.reset()
    cpu = apiserver_cpu(folder)
    start = time.perf_counter()
    times: list[float] = []

    async def one(s) -> None:
        await s.start()
        times.append(time.perf_counter() - start)

    results = await asyncio.gather(*(one(s) for s in spawners), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise RuntimeError(f"{name}: {len(failures)} starts failed, e.g. {failures[0]!r}")
    result = Burst(name, times, len(tap.requests), apiserver_cpu(folder) - cpu)
    print(result.line(len(spawners)), flush=True)
    # Stop all (a stop that gives up waiting is fine: the pods go anyway), and wait
    # until the namespace is empty (claims too) before the next burst.
    await asyncio.gather(*(s.stop(now=True) for s in spawners), return_exceptions=True)
    while await admin.items(f"/api/v1/namespaces/{namespace}/pods") or await admin.items(
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"):
        await asyncio.sleep(0.5)
    return result


async def main(nodes: int, starts: int, pools: tuple[str, ...]) -> None:
    run = f"bench-burst-{os.getpid()}"
    info = kube_cluster.acquire(run)
    tap = Tap(info.server, info.ca)
    tap.start()
    workdir = Path(tempfile.mkdtemp(prefix="kube-burst-"))
    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = info.kubeconfig(workdir / "kubeconfig",
                                                               server=tap.url)
    results: list[Burst] = []
    try:
        async with Kube(info.credentials()) as admin:
            t = time.perf_counter()
            await setup(admin, nodes)
            print(f"cluster: {nodes} + {nodes} KWOK nodes x 8 H200 x 7 1g.18gb "
                  f"(set up in {time.perf_counter() - t:.0f} s); {starts} starts at once")
            print(HEADER, flush=True)
            for pool in pools:
                plain = []
                for i in range(starts):
                    s = KubeSpawner(config=plain_config(tap.url, pool), user=User(f"u{i:03d}", []),
                                    hub=Hub(), orm_spawner=OrmSpawner(""), _mock=True)
                    s.user_options = {"profile": "small"}
                    s.api_token = "token"
                    plain.append(s)
                results.append(await burst(f"plain KubeSpawner ({pool})", plain, tap,
                                           info.folder, admin, f"bench-plain-{pool}"))
                ledger = f"sqlite:///{workdir / f'ledger-{pool}.sqlite'}"
                mig = []
                for i in range(starts):
                    s = KubeMIGSpawner(config=mig_config(tap.url, pool, ledger),
                                       user=User(f"u{i:03d}", ["class"]), hub=Hub(),
                                       orm_spawner=OrmSpawner(""), _mock=True)
                    s.user_options = {"profile": "small"}
                    s.api_token = "token"
                    mig.append(s)
                results.append(await burst(f"KubeMIGSpawner ({pool})", mig, tap,
                                           info.folder, admin, f"bench-mig-{pool}"))
                for reflector in list(KubeSpawner.reflectors.values()):
                    await reflector.stop()
                KubeSpawner.reflectors.clear()
                KubeMIGSpawner._readers.clear()
                load_config.cache_clear()
    finally:
        tap.stop()
        kube_cluster.release(run)
    for i in range(0, len(results) - 1, 2):
        plain, mig = results[i], results[i + 1]
        print(f"{mig.name} / plain: time p50 {mig.p(0.5) / plain.p(0.5):.2f}x, "
              f"p95 {mig.p(0.95) / plain.p(0.95):.2f}x, requests "
              f"{mig.requests / plain.requests:.2f}x, API server CPU "
              f"{mig.cpu / max(plain.cpu, 0.01):.2f}x (goal: at most 1.2x on time and "
              "requests)")
    if results:
        print(f"{statistics.mean([b.cpu for b in results]):.1f} s API server CPU per burst "
              "on average")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--starts", type=int, default=500)
    parser.add_argument("--only", choices=["dp", "dra"],
                        help="only the device plugin's bursts, or only DRA's")
    args = parser.parse_args()
    asyncio.run(main(args.nodes, args.starts, (args.only,) if args.only else ("dp", "dra")))
