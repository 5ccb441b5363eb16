"""Fake GPU nodes as NVIDIA's GPU Operator and DRA driver present them to the API.

A test node carries its GPUs in one annotation (:data:`GPUS_ANNOTATION`, JSON written
by :func:`gpu_node`): per GPU the catalog model, its MIG layout (``{"1g.18gb": 7}``,
``"off"`` for MIG disabled, ``"dynamic"`` for dynamic MIG) and who hands it out
(``device-plugin`` or ``dra``). From that the cluster's agents (tests/support/
kube_agents.py) publish what the real components would: GPU Feature Discovery's
labels and the device plugin's ``nvidia.com/mig-*`` allocatable (mixed or single
strategy), or NVIDIA's DRA driver ResourceSlices (driver ``gpu.nvidia.com``, its
device names ``gpu-<minor>-mig-<profile without dots>-<profile ID>-<placement>``, its
attributes and capacities; dynamic MIG as every placement consuming counters of its
GPU's counter set, which 1.35+ requires in a ResourceSlice of its own and 1.34 beside
the devices). MIG Manager
changes the layouts on a ``nvidia.com/mig.config`` label.

Pure functions: these are what the agents compute and what tests compare against.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_spawner.core.catalog import GpuModel, Profile, model

GPUS_ANNOTATION = "mig-spawner.test/gpus"
#: The label every test puts on its own nodes, with its namespace as value.
OWNER_LABEL = "mig-spawner.test/owner"
DRIVER = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
GPU_CLASS = "gpu.nvidia.com"
DRIVER_VERSION = "580.82.7"
CUDA_VERSION = "13.0.0"
#: The taint the DRA driver puts on the devices of a GPU whose health checks failed.
HEALTH_TAINT = {"key": f"{DRIVER}/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
CAPABILITY = {"Hopper": "9.0.0", "Ampere": "8.0.0", "Blackwell": "10.0.0"}

#: The DeviceClasses NVIDIA's DRA driver's chart installs.
DEVICE_CLASSES = [
    {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
     "metadata": {"name": MIG_CLASS},
     "spec": {"selectors": [{"cel": {"expression": (
         f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'mig'")}}]}},
    {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
     "metadata": {"name": GPU_CLASS},
     "spec": {"selectors": [{"cel": {"expression": (
         f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'")}}]}},
]


@dataclass(frozen=True)
class Gpu:
    """One GPU of a node: model key, layout and how it is handed out."""

    model: str = "h200"
    layout: Mapping[str, int] | str = "off"  # {"1g.18gb": 7}, "off" or "dynamic"
    api: str = "device-plugin"  # or "dra"
    #: The GPU's health checks failed (an Xid, ECC errors): "" healthy; "unhealthy":
    #: the device plugin reports its devices unhealthy (the kubelet keeps them in
    #: capacity, not in allocatable) and the DRA driver takes them out of its
    #: ResourceSlice; "tainted": the DRA driver taints them NoSchedule instead.
    fault: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "layout": self.layout if isinstance(self.layout, str)
                else dict(self.layout), "api": self.api,
                **({"fault": self.fault} if self.fault else {})}

    @property
    def catalog(self) -> GpuModel:
        return model(self.model)


@dataclass(frozen=True)
class Gpus:
    """A node's GPUs and the device plugin's strategy."""

    gpus: tuple[Gpu, ...]
    strategy: str = "mixed"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"strategy": self.strategy, "gpus": [g.to_json() for g in self.gpus],
                           **self.extra})

    @classmethod
    def parse(cls, text: str) -> Gpus:
        raw = json.loads(text)
        return cls(tuple(Gpu(g["model"], g["layout"], g.get("api", "device-plugin"),
                             g.get("fault", "")) for g in raw["gpus"]),
                   raw.get("strategy", "mixed"),
                   {k: v for k, v in raw.items() if k not in ("strategy", "gpus")})

    def relaid(self, layouts: list[Mapping[str, int] | str]) -> Gpus:
        """The same GPUs with new layouts (MIG Manager's work), one per GPU."""
        return Gpus(tuple(Gpu(g.model, lay, g.api, g.fault) for g, lay in zip(self.gpus, layouts,
                                                                       strict=True)),
                    self.strategy, self.extra)


def placements(gpu_model: GpuModel, layout: Mapping[str, int]) -> list[tuple[Profile, int]]:
    """Where MIG Manager would put a layout's instances: the largest first, each at the
    first free placement start its profile allows."""
    used: set[int] = set()
    out: list[tuple[Profile, int]] = []
    wanted = sorted(((gpu_model.profile(name), n) for name, n in layout.items()),
                    key=lambda pn: -pn[0].memory_slices)
    for profile, count in wanted:
        for _ in range(count):
            start = next((s for s in profile.placement_starts
                          if not used & set(range(s, s + profile.placement_size))), None)
            if start is None:
                raise ValueError(f"{dict(layout)} does not fit a {gpu_model.display_name}")
            used |= set(range(start, start + profile.placement_size))
            out.append((profile, start))
    return sorted(out, key=lambda ps: ps[1])


def product_label(gpu_model: GpuModel) -> str:
    """GFD's ``nvidia.com/gpu.product`` for the model: its first product name, dashed."""
    return gpu_model.product_names[0].replace(" ", "-")


def device_uuid(node: str, minor: int, profile: str = "", start: int = 0) -> str:
    """A stable UUID for a GPU (``GPU-...``) or one of its MIG devices (``MIG-...``)."""
    key = f"{node}/{minor}/{profile}/{start}"
    value = uuid.uuid5(uuid.NAMESPACE_URL, key)
    return f"MIG-{value}" if profile else f"GPU-{value}"


def device_name(minor: int, profile: Profile, start: int) -> str:
    """NVIDIA's DRA driver's canonical MIG device name."""
    return f"gpu-{minor}-mig-{profile.name.replace('.', '')}-{profile.profile_id}-{start}"


# --- the device plugin and GFD ------------------------------------------------------------


def device_plugin_view(gpus: Gpus, *, capacity: bool = False
                       ) -> tuple[dict[str, str], dict[str, str]]:
    """GFD's labels and the device plugin's extended resources for the node's
    device-plugin GPUs: allocatable, the healthy devices (``capacity``: every device,
    as the kubelet counts them). GFD counts every MIG device NVML lists, the DRA
    driver's too (``nvidia.com/mig-<profile>.count``); its other labels describe the
    device plugin's GPUs (empty when the node has none)."""
    counted: dict[str, int] = {}
    for g in gpus.gpus:
        if g.api == "dra" and isinstance(g.layout, Mapping):
            for name, n in g.layout.items():
                counted[name] = counted.get(name, 0) + n
    mine = [g for g in gpus.gpus if g.api == "device-plugin"]
    if not mine:
        return {f"nvidia.com/mig-{p}.count": str(n) for p, n in counted.items()}, {}
    first = mine[0].catalog
    labels = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(len(mine)),
              "nvidia.com/gpu.product": product_label(first),
              "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": gpus.strategy,
              "nvidia.com/gpu.memory": str(first.memory_mib)}
    counts: dict[str, int] = {}
    healthy: dict[str, int] = {}
    whole = healthy_whole = 0
    for g in mine:
        ok = capacity or not g.fault
        if isinstance(g.layout, str):
            whole += g.layout == "off"
            healthy_whole += g.layout == "off" and ok
            continue
        for name, n in g.layout.items():
            counts[name] = counts.get(name, 0) + n
            healthy[name] = healthy.get(name, 0) + n * ok
    resources: dict[str, str] = {}
    if gpus.strategy == "single":
        (profile,) = counts or {"": 0}
        if profile:
            labels["nvidia.com/gpu.product"] = f"{product_label(first)}-MIG-{profile}"
        resources["nvidia.com/gpu"] = str(healthy.get(profile, healthy_whole))
    else:
        resources.update({f"nvidia.com/mig-{p}": str(healthy[p]) for p in counts})
        if whole:
            resources["nvidia.com/gpu"] = str(healthy_whole)
    for p, n in counts.items():
        counted[p] = counted.get(p, 0) + n
    labels.update({f"nvidia.com/mig-{p}.count": str(n) for p, n in counted.items()})
    return labels, resources


def gpu_labels_of(gpus: Gpus) -> dict[str, str]:
    """GFD's labels for the GPUs (for a node no agent describes)."""
    return device_plugin_view(gpus)[0]


def device_plugin_devices(node: str, gpus: Gpus) -> dict[str, list[str]]:
    """The device plugin's devices per extended resource (their UUIDs), in order: what
    the kubelet hands out, one per request."""
    out: dict[str, list[str]] = {}
    for minor, g in enumerate(gpus.gpus):
        if g.api != "device-plugin" or g.fault:
            continue  # the kubelet hands out healthy devices only
        if g.layout == "off":
            out.setdefault("nvidia.com/gpu", []).append(device_uuid(node, minor))
        elif isinstance(g.layout, Mapping):
            for profile, start in placements(g.catalog, g.layout):
                resource = ("nvidia.com/gpu" if gpus.strategy == "single"
                            else f"nvidia.com/mig-{profile.name}")
                out.setdefault(resource, []).append(device_uuid(node, minor, profile.name,
                                                                start))
    return out


# --- NVIDIA's DRA driver --------------------------------------------------------------


def _attributes(g: Gpu, node: str, minor: int) -> dict[str, Any]:
    m = g.catalog
    return {
        "productName": {"string": m.product_names[0]},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": m.architecture},
        "cudaComputeCapability": {"version": CAPABILITY.get(m.architecture, "9.0.0")},
        "driverVersion": {"version": DRIVER_VERSION},
        "cudaDriverVersion": {"version": CUDA_VERSION},
        "parentUUID": {"string": device_uuid(node, minor)},
    }


def _capacities(p: Profile) -> dict[str, dict[str, str]]:
    return {"multiprocessors": {"value": str(p.sm_count)},
            "copyEngines": {"value": str(p.copy_engines)},
            "decoders": {"value": str(p.decoders)}, "encoders": {"value": str(p.encoders)},
            "jpegEngines": {"value": str(p.jpeg)}, "ofaEngines": {"value": str(p.ofa)},
            "memory": {"value": str(p.memory_mib * 2**20)}}


def _counter_names(capacities: Mapping[str, Any]) -> dict[str, Any]:
    """The driver derives counter names from capacity names (camelCase to dashes)."""
    import re

    return {re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", k).lower(): v for k, v in capacities.items()}


def mig_device(node: str, minor: int, g: Gpu, profile: Profile, start: int,
               *, dynamic: bool = False) -> dict[str, Any]:
    """One MIG device of the driver's ResourceSlice."""
    attributes = {"type": {"string": "mig"}, "profile": {"string": profile.name},
                  **_attributes(g, node, minor)}
    if not dynamic:
        attributes["uuid"] = {"string": device_uuid(node, minor, profile.name, start)}
    device: dict[str, Any] = {"name": device_name(minor, profile, start),
                              "attributes": attributes, "capacity": _capacities(profile)}
    if dynamic:
        counters = _counter_names(_capacities(profile))
        counters.update({f"memory-slice-{i}": {"value": "1"}
                         for i in range(start, start + profile.placement_size)})
        device["consumesCounters"] = [{"counterSet": f"gpu-{minor}-counter-set",
                                       "counters": counters}]
    return device


def _full(g: Gpu) -> Profile:
    return max(g.catalog.profiles, key=lambda p: (p.compute_slices, p.memory_slices))


def resource_slices(node: str, gpus: Gpus, generation: int = 1, *,
                    split_counters: bool = True) -> list[dict[str, Any]]:
    """The driver's ResourceSlices for the node's ``dra`` GPUs: the devices, and for
    dynamic MIG the GPUs' counter sets, in a second slice (``split_counters``: as
    Kubernetes 1.35+ requires) or beside the devices (as 1.34 requires; empty list:
    none)."""
    devices: list[dict[str, Any]] = []
    counter_sets: list[dict[str, Any]] = []
    for minor, g in enumerate(gpus.gpus):
        if g.api != "dra" or g.fault == "unhealthy":
            continue  # the driver leaves an unhealthy GPU's devices out
        mark = len(devices)
        if g.layout == "off":
            devices.append({"name": f"gpu-{minor}", "attributes": {
                "type": {"string": "gpu"}, "uuid": {"string": device_uuid(node, minor)},
                **_attributes(g, node, minor)},
                "capacity": {"memory": {"value": str(g.catalog.memory_mib * 2**20)}}})
        elif g.layout == "dynamic":
            full = _full(g)
            total = _counter_names(_capacities(full))
            total.update({f"memory-slice-{i}": {"value": "1"}
                          for i in range(g.catalog.memory_slices)})
            counter_sets.append({"name": f"gpu-{minor}-counter-set", "counters": total})
            for profile in g.catalog.profiles:
                if profile.variant:
                    continue
                for start in profile.placement_starts:
                    devices.append(mig_device(node, minor, g, profile, start, dynamic=True))
        else:
            devices += [mig_device(node, minor, g, p, s)
                        for p, s in placements(g.catalog, g.layout)]
        if g.fault == "tainted":
            for device in devices[mark:]:
                device["taints"] = [dict(HEALTH_TAINT)]
    if not devices:
        return []
    count = 2 if counter_sets and split_counters else 1
    pool = {"name": node, "generation": generation, "resourceSliceCount": count}
    out = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": pool, "devices": devices}}]
    if counter_sets and not split_counters:
        out[0]["spec"]["sharedCounters"] = counter_sets
    elif counter_sets:
        out.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": f"{node}-{DRIVER}-counters"},
                    "spec": {"driver": DRIVER, "nodeName": node, "pool": pool,
                             "sharedCounters": counter_sets}})
    return out


def dra_device_uuids(node: str, gpus: Gpus) -> dict[str, str]:
    """Device name -> the UUID the driver prepares for it (a dynamic MIG device's is
    made when it is prepared: the same stable one here)."""
    out: dict[str, str] = {}
    for minor, g in enumerate(gpus.gpus):
        if g.api != "dra":
            continue
        if g.layout == "off":
            out[f"gpu-{minor}"] = device_uuid(node, minor)
            continue
        if g.layout == "dynamic":
            pairs = [(p, s) for p in g.catalog.profiles if not p.variant
                     for s in p.placement_starts]
        else:
            pairs = placements(g.catalog, g.layout)
        for p, s in pairs:
            out[device_name(minor, p, s)] = device_uuid(node, minor, p.name, s)
    return out


# --- the Node object ------------------------------------------------------------------


def gpu_node(name: str, gpus: Gpus | Iterable[Gpu] | None = None, *, owner: str = "",
             labels: Mapping[str, str] | None = None,
             allocatable: Mapping[str, str] | None = None, taints: Iterable[Mapping] = (),
             unschedulable: bool = False, mig_config: str = "", kwok: bool = True,
             agents: bool = True) -> dict[str, Any]:
    """A Node to create: a KWOK node (``kwok``) with the GPUs' annotation, from which
    the agents publish labels, allocatable and ResourceSlices (``agents=False``: the
    labels and allocatable the GPUs would give, and no agent changes them after);
    ``labels`` and ``allocatable`` are set as given on top."""
    if gpus is not None and not isinstance(gpus, Gpus):
        gpus = Gpus(tuple(gpus))
    annotations = {}
    if kwok:
        annotations["kwok.x-k8s.io/node"] = "fake"
    if gpus is not None and agents:
        annotations[GPUS_ANNOTATION] = gpus.to_json()
    all_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", "type": "kwok" if kwok else "process"}
    if owner:
        all_labels[OWNER_LABEL] = owner
    if gpus is not None:
        plugin_labels, _ = device_plugin_view(gpus)
        all_labels.update(plugin_labels)
    if mig_config:
        all_labels["nvidia.com/mig.config"] = mig_config
        all_labels["nvidia.com/mig.config.state"] = "success"
    all_labels.update(labels or {})
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    capacity = dict(resources)
    if gpus is not None:
        resources.update(device_plugin_view(gpus)[1])
        capacity.update(device_plugin_view(gpus, capacity=True)[1])
    resources.update(allocatable or {})
    capacity.update(allocatable or {})
    spec: dict[str, Any] = {}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": all_labels, "annotations": annotations},
        "spec": spec,
        "status": {"capacity": capacity, "allocatable": dict(resources),
                   "nodeInfo": {"kubeletVersion": "fake", "architecture": "amd64",
                                "operatingSystem": "linux"}},
    }


def mig_parted_config(name: str, configs: Mapping[str, Any]) -> dict[str, Any]:
    """A ConfigMap of mig-parted configs for MIG Manager (namespace gpu-operator):
    ``configs`` maps a config name to mig-parted's list of ``{devices, mig-enabled,
    mig-devices}``."""
    import yaml

    text = yaml.safe_dump({"version": "v1", "mig-configs": dict(configs)})
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "gpu-operator",
                         "labels": {"mig-spawner.test/mig-parted": "true"}},
            "data": {"config.yaml": text}}


def apply_mig_parted(gpus: Gpus, entries: list[Mapping[str, Any]]) -> Gpus:
    """The node's GPUs after MIG Manager applied one mig-parted config (raises
    ValueError for a layout a GPU cannot take)."""
    layouts: list[Mapping[str, int] | str] = []
    for minor, g in enumerate(gpus.gpus):
        entry = next((e for e in entries if e.get("devices") == "all"
                      or minor in (e.get("devices") or [])), None)
        if entry is None:
            layouts.append(g.layout)
        elif not entry.get("mig-enabled", True):
            layouts.append("off")
        else:
            layout = {str(k): int(v) for k, v in (entry.get("mig-devices") or {}).items()}
            placements(g.catalog, layout)  # fits, or ValueError
            layouts.append(layout)
    return gpus.relaid(layouts)


def counters_apart(version: str) -> bool:
    """Whether the API server of ``version`` ("v1.36.3") wants a ResourceSlice's shared
    counters apart from its devices (1.35+) or beside them (1.34)."""
    return int(version.lstrip("v").split(".")[1]) >= 35

