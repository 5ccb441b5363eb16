"""The test cluster's GPU side, run by the cluster's supervisor (tests/support/kube_cluster.py).

What NVIDIA's GPU Operator and DRA driver do on a real GPU node, for the fake nodes:

* **GPU Feature Discovery and the device plugin**: a node's ``nvidia.com/*`` labels and
  its ``nvidia.com/mig-*`` / ``nvidia.com/gpu`` allocatable, from the GPUs of its
  annotation (tests/support/kube_gpus.py), updated whenever they change;
* **the DRA driver** (``gpu.nvidia.com``): the node's ResourceSlices, owned by the
  Node (the garbage collector removes them with it), republished with a new pool
  generation when the GPUs change;
* **MIG Manager**: a changed ``nvidia.com/mig.config`` label sets
  ``nvidia.com/mig.config.state=pending``, then re-cuts the GPUs to that config of
  mig-parted config of the ``gpu-operator`` ConfigMaps and sets ``success``; or
  ``failed`` when the config is unknown, does not fit, or a pod still holds a GPU of
  the node (MIG Manager cannot re-cut a GPU in use);
* **a kubelet** for :data:`~tests.support.kube_cluster.PROCESS_NODE`: each pod bound to
  it runs as local processes (its containers' command and args, with the environment
  of the pod spec and the device it was given: ``NVIDIA_VISIBLE_DEVICES`` names the
  device plugin's device, or the device its ResourceClaim was allocated), on a
  loopback address of its own as the pod IP; the pod is marked Running and ready, and
  a deleted pod's processes get SIGTERM, SIGKILL after the grace period, and the pod
  is then removed, as the kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.kube_gpus import (
    DEVICE_CLASSES,
    DRIVER,
    GPUS_ANNOTATION,
    Gpu,
    Gpus,
    apply_mig_parted,
    counters_apart,
    device_plugin_devices,
    device_plugin_view,
    dra_device_uuids,
    gpu_node,
    resource_slices,
)
from tests.support.kube_rest import ApiError, Kube

MIG_CONFIG = "nvidia.com/mig.config"
MIG_STATE = "nvidia.com/mig.config.state"
APPLIED = "mig-spawner.test/mig-config-applied"
#: How long MIG Manager takes to re-cut a node (an annotation on the node overrides it).
RECUT_SECONDS = "mig-spawner.test/mig-manager-seconds"
DONE_PHASES = ("Succeeded", "Failed")
#: The label of the ConfigMaps MIG Manager reads its configs from.
MIG_PARTED_LABEL = "mig-spawner.test/mig-parted"
NODES = "/api/v1/nodes"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def process_node_gpus() -> Gpus:
    """The process node's GPUs: an A100 80GB cut 3g.40gb + 2x 1g.10gb for the device
    plugin (mixed strategy), and an H200 with two 1g.18gb and a 3g.71gb for the DRA
    driver."""
    return Gpus((Gpu("a100-80gb", {"3g.40gb": 1, "1g.10gb": 2}, "device-plugin"),
                 Gpu("h200", {"1g.18gb": 2, "3g.71gb": 1}, "dra")))


class Agents:
    """Every agent, on one event loop; :meth:`check` raises when one of them died."""

    def __init__(self, info: Any, folder: Path) -> None:
        self.info = info
        self.folder = folder
        self.kube: Kube | None = None
        self.tasks: list[asyncio.Task] = []
        self.kubelet: ProcessKubelet | None = None

    async def start(self) -> None:
        from tests.support.kube_cluster import PROCESS_NODE

        self.kube = kube = Kube(self.info.credentials())
        await kube.apply({"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": "gpu-operator"}})
        for device_class in DEVICE_CLASSES:
            await kube.apply(device_class)
        node = gpu_node(PROCESS_NODE, process_node_gpus(), kwok=False,
                        taints=[{"key": "nvidia.com/gpu", "value": "present",
                                 "effect": "NoSchedule"}])
        node["status"]["conditions"] = [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "kubelet is posting ready status", "lastHeartbeatTime": _now(),
            "lastTransitionTime": _now()}]
        node["status"]["addresses"] = [{"type": "InternalIP", "address": "127.0.0.1"}]
        await kube.apply(node)
        gpu_side = GpuSide(kube, counters_apart(self.info.version))
        self.kubelet = ProcessKubelet(kube, PROCESS_NODE, self.folder / "pods")
        self.tasks = [asyncio.create_task(gpu_side.run(), name="gpu-side"),
                      asyncio.create_task(self.kubelet.run(), name="kubelet"),
                      asyncio.create_task(self.kubelet.heartbeat(), name="heartbeat")]
        await gpu_side.ready.wait()

    def check(self) -> None:
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"agent {task.get_name()} died") from task.exception()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.kubelet is not None:
            self.kubelet.kill_all()
        if self.kube is not None:
            await self.kube.close()


async def watch_forever(kube: Kube, path: str, handle: Any, ready: asyncio.Event | None = None,
                        **params: Any) -> None:
    """List ``path``, hand each item to ``handle(type, obj)``, then follow its watch;
    list again when the watch expires (410), as a client must."""
    while True:
        page = await kube.get(path, **params)
        version = page["metadata"]["resourceVersion"]
        for item in page.get("items") or []:
            await handle("ADDED", item)
        if ready is not None:
            ready.set()
        try:
            while True:
                async for event in kube.watch(path, resource_version=version, timeout=240,
                                              bookmarks=True, **params):
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise ApiError(obj.get("code", 500), obj)
                    version = obj.get("metadata", {}).get("resourceVersion", version)
                    if event.get("type") != "BOOKMARK":
                        await handle(event["type"], obj)
        except ApiError as e:
            if e.status != 410:
                raise


class GpuSide:
    """GFD + device plugin, the DRA driver and MIG Manager for every annotated node."""

    def __init__(self, kube: Kube, split_counters: bool = True) -> None:
        self.kube = kube
        self.split_counters = split_counters
        self.ready = asyncio.Event()
        self.recuts: dict[str, asyncio.Task] = {}
        self.published: dict[str, list[dict]] = {}

    async def run(self) -> None:
        await watch_forever(self.kube, NODES, self.handle, self.ready)

    async def handle(self, kind: str, node: dict) -> None:
        """One node's change; what the API refuses (a test's node it cannot take, a
        node deleted meanwhile) is logged, and the agent goes on for the others."""
        try:
            await self._handle(kind, node)
        except ApiError as e:
            print(f"gpu agent: node {node['metadata'].get('name')}: {e}", file=sys.stderr,
                  flush=True)

    async def _handle(self, kind: str, node: dict) -> None:
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations") or {}
        if kind == "DELETED" or GPUS_ANNOTATION not in annotations:
            self.published.pop(name, None)
            return
        labels = node["metadata"].get("labels") or {}
        wanted = labels.get(MIG_CONFIG)
        applied = annotations.get(APPLIED)
        if wanted and applied is None and labels.get(MIG_STATE) in (None, "success"):
            # Made with this config in place: nothing to re-cut.
            await self.kube.patch(f"{NODES}/{name}", {"metadata": {"annotations": {
                APPLIED: wanted}}})
            return
        if wanted and wanted != applied and name not in self.recuts:
            self.recuts[name] = asyncio.create_task(self.recut(name, wanted))
        await self.publish(node)

    async def publish(self, node: dict) -> None:
        """Labels, allocatable and ResourceSlices as the node's GPUs are now."""
        name = node["metadata"]["name"]
        gpus = Gpus.parse(node["metadata"]["annotations"][GPUS_ANNOTATION])
        labels, resources = device_plugin_view(gpus)
        current = node["metadata"].get("labels") or {}
        stale = {k: None for k in current if k.startswith("nvidia.com/mig-")
                 and k.endswith(".count") and k not in labels}
        if any(current.get(k) != v for k, v in labels.items()) or stale:
            await self.kube.patch(f"{NODES}/{name}", {"metadata": {"labels": {**labels,
                                                                              **stale}}})
        status = node.get("status") or {}
        capacity = device_plugin_view(gpus, capacity=True)[1]
        change = {}
        for field, wanted in (("allocatable", resources), ("capacity", capacity)):
            now = status.get(field) or {}
            gpu_keys = {k for k in now if k.startswith("nvidia.com/")}
            if {k: now[k] for k in gpu_keys} != wanted:
                change[field] = {**{k: None for k in gpu_keys}, **wanted}
        if change and any(g.api == "device-plugin" for g in gpus.gpus):
            await self.kube.patch(f"{NODES}/{name}/status", {"status": change})
        await self.publish_slices(node, gpus)

    async def publish_slices(self, node: dict, gpus: Gpus) -> None:
        name = node["metadata"]["name"]
        owner = {"apiVersion": "v1", "kind": "Node", "name": name,
                 "uid": node["metadata"]["uid"]}
        old = await self.kube.items(SLICES, fieldSelector=f"spec.nodeName={name}")
        mine = [s for s in old if s["spec"]["driver"] == DRIVER]
        generation = max((s["spec"]["pool"]["generation"] for s in mine), default=0)
        wanted = resource_slices(name, gpus, generation or 1,
                                 split_counters=self.split_counters)
        if [s["spec"] for s in wanted] == self.published.get(name):
            return
        if mine:
            wanted = resource_slices(name, gpus, generation + 1,
                                     split_counters=self.split_counters)
        for s in wanted:
            s["metadata"]["ownerReferences"] = [owner]
            await self.kube.apply(s)
        for s in mine:
            if s["metadata"]["name"] not in {w["metadata"]["name"] for w in wanted}:
                await self.kube.delete(f"{SLICES}/{s['metadata']['name']}")
        self.published[name] = [s["spec"] for s in resource_slices(
            name, gpus, wanted[0]["spec"]["pool"]["generation"] if wanted else 1,
            split_counters=self.split_counters)]

    async def recut(self, name: str, config: str) -> None:
        try:
            await self._recut(name, config)
        finally:
            self.recuts.pop(name, None)

    async def _recut(self, name: str, config: str) -> None:
        node = await self.kube.patch(f"{NODES}/{name}", {"metadata": {"labels": {
            MIG_STATE: "pending"}}})
        annotations = node["metadata"].get("annotations") or {}
        await asyncio.sleep(float(annotations.get(RECUT_SECONDS, "0.3")))
        node = await self.kube.find(f"{NODES}/{name}")
        if node is None or (node["metadata"].get("labels") or {}).get(MIG_CONFIG) != config:
            return  # relabelled meanwhile: the newer config's turn
        gpus = Gpus.parse(node["metadata"]["annotations"][GPUS_ANNOTATION])
        state = "failed"
        relaid = None
        if not await self.busy(name):
            configs = await self.mig_configs()
            if config in configs:
                with contextlib.suppress(ValueError):
                    relaid = apply_mig_parted(gpus, configs[config])
        if relaid is not None:
            node = await self.kube.patch(f"{NODES}/{name}", {"metadata": {"annotations": {
                GPUS_ANNOTATION: relaid.to_json(), APPLIED: config}}})
            await self.publish(node)
            state = "success"
        await self.kube.patch(f"{NODES}/{name}", {"metadata": {
            "labels": {MIG_STATE: state}, "annotations": {APPLIED: config}}})

    async def mig_configs(self) -> dict[str, Any]:
        """mig-parted's configs by name, from the gpu-operator ConfigMaps labelled
        :data:`MIG_PARTED_LABEL` (each test brings its own; a real MIG Manager reads
        the one ConfigMap it is given)."""
        configs: dict[str, Any] = {}
        for cm in await self.kube.items("/api/v1/namespaces/gpu-operator/configmaps",
                                        labelSelector=MIG_PARTED_LABEL):
            text = (cm.get("data") or {}).get("config.yaml") or "{}"
            configs.update((yaml.safe_load(text) or {}).get("mig-configs") or {})
        return configs

    async def busy(self, name: str) -> bool:
        """Whether a pod on the node still holds one of its GPUs."""
        pods = await self.kube.items("/api/v1/pods", fieldSelector=f"spec.nodeName={name}")
        for pod in pods:
            if (pod.get("status") or {}).get("phase") in DONE_PHASES:
                continue
            spec = pod["spec"]
            if spec.get("resourceClaims"):
                return True
            for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
                limits = (c.get("resources") or {}).get("limits") or {}
                if any(k.startswith("nvidia.com/") for k in limits):
                    return True
        return False


class ProcessKubelet:
    """Runs the pods bound to one node as local processes (see the module doc)."""

    def __init__(self, kube: Kube, node: str, workdir: Path) -> None:
        self.kube = kube
        self.node = node
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}  # pod uid -> its process
        self.ips: dict[str, str] = {}
        self.devices: dict[str, list[str]] = {}  # pod uid -> device plugin devices
        self.stopping: set[str] = set()
        self.count = 0
        self.tasks: set[asyncio.Task] = set()  # kept: the loop holds tasks weakly

    def _task(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        await watch_forever(self.kube, "/api/v1/pods", self.handle,
                            fieldSelector=f"spec.nodeName={self.node}")

    async def heartbeat(self) -> None:
        """Renew the node's Lease as the kubelet does: the node lifecycle controller
        taints a node whose lease runs out (unreachable) and evicts its pods."""
        while True:
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            await self.kube.apply({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                         "renewTime": now}})
            await asyncio.sleep(10)

    async def handle(self, kind: str, pod: dict) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        if kind == "DELETED":
            await asyncio.to_thread(self._stop, uid, 0)
            return
        if meta.get("deletionTimestamp"):
            if uid not in self.stopping:
                self.stopping.add(uid)
                self._task(self._terminate(pod))
            return
        phase = (pod.get("status") or {}).get("phase")
        if uid in self.procs or phase in DONE_PHASES or phase == "Running":
            return
        await self._start(pod)

    def _env(self, pod: dict, container: dict, ip: str) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": self.node,
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                  "status.podIP": ip, "status.hostIP": "127.0.0.1"}
        env: dict[str, str] = {}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
            elif ref := (e.get("valueFrom") or {}).get("fieldRef"):
                env[e["name"]] = fields.get(ref.get("fieldPath", ""), "")
        # The pod's own network namespace: a server told to listen on every address
        # listens on the pod IP.
        for key in ("JUPYTERHUB_SERVICE_URL",):
            if key in env:
                env[key] = env[key].replace("://0.0.0.0:", f"://{ip}:")
        return env

    async def _devices(self, pod: dict) -> list[str]:
        """The devices the pod was given: device plugin devices for its extended
        resources (the first free ones of the node), else those its claims were
        allocated (the DRA driver prepares them)."""
        node = await self.kube.get(f"{NODES}/{self.node}")
        gpus = Gpus.parse(node["metadata"]["annotations"][GPUS_ANNOTATION])
        given: list[str] = []
        taken = {d for devices in self.devices.values() for d in devices}
        plugin = device_plugin_devices(self.node, gpus)
        for c in pod["spec"]["containers"]:
            limits = (c.get("resources") or {}).get("limits") or {}
            for resource, amount in limits.items():
                free = [d for d in plugin.get(resource, []) if d not in taken]
                given += free[: int(amount)]
                taken |= set(free[: int(amount)])
        names = dra_device_uuids(self.node, gpus)
        namespace = pod["metadata"]["namespace"]
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            claim = await self.kube.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/"
                                        f"resourceclaims/{status['resourceClaimName']}")
            results = (((claim.get("status") or {}).get("allocation") or {})
                       .get("devices") or {}).get("results") or []
            given += [names[r["device"]] for r in results if r["device"] in names]
        return given

    async def _start(self, pod: dict) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        self.count += 1
        ip = f"127.{1 + self.count // 250 % 250}.{self.count % 250 + 1}.{1 + os.getpid() % 250}"
        devices = await self._devices(pod)
        self.devices[uid] = devices
        home = self.workdir / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
        home.mkdir(parents=True, exist_ok=True)
        container = pod["spec"]["containers"][0]
        env = self._env(pod, container, ip)
        env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
                   NVIDIA_VISIBLE_DEVICES=",".join(devices) or "void")
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        argv = [a.replace("0.0.0.0", ip) for a in argv]
        with (home / "container.log").open("ab") as log:
            from tests.support.kube_cluster import die_with_parent

            proc = subprocess.Popen(argv, env=env, cwd=home, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=lambda: (os.setsid(), die_with_parent()))
        self.procs[uid] = proc
        self.ips[uid] = ip
        now = _now()
        conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                      for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady",
                                "Ready", "PodScheduled")]
        statuses = [{"name": c["name"], "ready": True, "started": True, "restartCount": 0,
                     "image": c.get("image", ""), "imageID": f"{c.get('image', '')}@sha256:"
                     + "0" * 64, "containerID": f"process://{proc.pid}",
                     "state": {"running": {"startedAt": now}}}
                    for c in pod["spec"]["containers"]]
        with contextlib.suppress(ApiError):
            await self.kube.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                            "startTime": now, "conditions": conditions,
                            "containerStatuses": statuses}}, kind="strategic")
        self._task(self._follow(pod, proc))

    async def _follow(self, pod: dict, proc: subprocess.Popen) -> None:
        """A container that exits on its own ends the pod (no restarts here)."""
        code = await asyncio.to_thread(proc.wait)
        meta = pod["metadata"]
        if meta["uid"] in self.stopping or self.procs.get(meta["uid"]) is not proc:
            return
        self.procs.pop(meta["uid"], None)
        self.devices.pop(meta["uid"], None)
        now = _now()
        with contextlib.suppress(ApiError):
            await self.kube.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": {"phase": "Succeeded" if code == 0 else "Failed",
                            "containerStatuses": [{
                                "name": c["name"], "ready": False, "started": False,
                                "restartCount": 0, "image": c.get("image", ""),
                                "imageID": "", "state": {"terminated": {
                                    "exitCode": code if code >= 0 else 128 - code,
                                    "reason": "Completed" if code == 0 else "Error",
                                    "startedAt": now, "finishedAt": now}}}
                                for c in pod["spec"]["containers"]]}}, kind="strategic")

    def _stop(self, uid: str, grace: float) -> None:
        proc = self.procs.pop(uid, None)
        self.devices.pop(uid, None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(max(grace, 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    async def _terminate(self, pod: dict) -> None:
        """SIGTERM, SIGKILL after the grace period, then the pod goes (the kubelet's
        final delete, by UID)."""
        meta = pod["metadata"]
        grace = float(meta.get("deletionGracePeriodSeconds") or 0)
        await asyncio.to_thread(self._stop, meta["uid"], grace)
        with contextlib.suppress(ApiError):
            await self.kube.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        self.stopping.discard(meta["uid"])

    def kill_all(self) -> None:
        for uid in list(self.procs):
            proc = self.procs.pop(uid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
