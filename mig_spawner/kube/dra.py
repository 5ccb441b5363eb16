"""MIG slices served through Dynamic Resource Allocation (``resource.k8s.io/v1``).

NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu, driver name
``gpu.nvidia.com``) publishes each MIG device of a node as a device of a
ResourceSlice, with the attributes ``type: mig``, ``profile`` (``1g.18gb``) and
``productName`` (``NVIDIA H200``), under the DeviceClass ``mig.nvidia.com``. With
dynamic MIG the devices are every placement a profile could take, each consuming
counters (memory slices, multiprocessors ...) from its GPU's shared CounterSet, and
the driver creates the instance when a claim is allocated. Nothing appears in
``Node.status.allocatable`` then.

Pure, like :mod:`mig_spawner.kube.cluster`: free slices are the devices of
ResourceSlices that no allocated ResourceClaim holds (for partitionable devices: how
many more of a profile the GPU's counters left allow), on nodes that can take a pod
now. A device the driver taints ``NoSchedule``/``NoExecute`` (DRA device taints, gate
``DRADeviceTaints``: beta and on by default in 1.36) or takes out of its ResourceSlice
while GPU Feature Discovery still counts it (``nvidia.com/mig-<profile>.count``) is
what the cluster reports unhealthy: the scheduler allocates neither, and the form says
so. A pod asks through a ResourceClaimTemplate per GPU model and profile
(:func:`claim_template`): one request of DeviceClass ``mig.nvidia.com`` whose CEL
selector names the profile and the model's product names.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from mig_spawner.core.catalog import model, normalize_profile_name

from .cluster import BLOCKING_EFFECTS, ClusterSlices, NodeSlices, SkippedNode, node_problem
from .resources import (
    DRA_CLAIM,
    GPU_RESOURCE,
    MIG_RESOURCE_PREFIX,
    PRODUCT_LABEL,
    model_for_label,
)

# GPU Feature Discovery's count of a node's MIG devices of one profile, as NVML lists
# them (healthy or not): "nvidia.com/mig-1g.18gb.count".
_COUNT_LABEL = re.compile(r"^nvidia\.com/mig-(?P<profile>.+)\.count$")

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "mig.nvidia.com"
API_VERSION = "resource.k8s.io/v1"

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "": 1}
_AMOUNT = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T|)$")


def amount(value: Any) -> int:
    """A whole Kubernetes quantity (counters and capacities are whole numbers)."""
    match = _AMOUNT.match(str(value).strip())
    if not match:
        raise ValueError(f"not a whole quantity: {value!r}")
    return int(match[1]) * _SUFFIX[match[2]]


def attribute(device: Mapping[str, Any], name: str) -> Any:
    """A device attribute's value (``{"string": "1g.18gb"}`` -> ``"1g.18gb"``)."""
    value = (device.get("attributes") or {}).get(name) or {}
    return next(iter(value.values()), None) if isinstance(value, Mapping) else None


def _counters(entries: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    """(counter set, counter) -> amount, for ``sharedCounters`` / ``consumesCounters``."""
    out: dict[tuple[str, str], int] = {}
    for entry in entries:
        for name, counter in (entry.get("counters") or {}).items():
            key = (entry.get("name") or entry.get("counterSet") or "", name)
            out[key] = out.get(key, 0) + amount(counter.get("value", 0))
    return out


def allocated(claims: Iterable[Mapping[str, Any]]) -> tuple[set[tuple[str, str, str]],
                                                            set[str]]:
    """The devices (driver, pool, device) allocated to claims, and the pods
    (``namespace/name``) those claims are reserved for."""
    devices, pods = set(), set()
    for claim in claims:
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        for r in results:
            devices.add((r.get("driver", ""), r.get("pool", ""), r.get("device", "")))
        namespace = (claim.get("metadata") or {}).get("namespace", "")
        for ref in status.get("reservedFor") or []:
            if ref.get("resource") == "pods":
                pods.add(f"{namespace}/{ref.get('name', '')}")
    return devices, pods


def tainted(device: Mapping[str, Any]) -> bool:
    """Whether the driver tainted the device so that no claim without a toleration
    gets it (the scheduler's rule; mig-spawner's claims tolerate nothing)."""
    return any(t.get("effect") in BLOCKING_EFFECTS for t in device.get("taints") or [])


def _free_on_pool(devices: list[Mapping[str, Any]], shared: dict[tuple[str, str], int],
                  taken: set[str]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Free, used and tainted MIG devices per profile in one pool (a node's
    ResourceSlices).

    A device without counters is free unless allocated or tainted. Partitionable
    devices (dynamic MIG) are counted per profile greedily against what the allocated
    devices left of the counters: how many more of that profile alone could be
    allocated; tainted placements are left out of that.
    """
    left = dict(shared)
    for d in devices:
        if d["name"] in taken:
            for key, value in _counters(d.get("consumesCounters") or []).items():
                left[key] = left.get(key, 0) - value
    free: dict[str, int] = defaultdict(int)
    used: dict[str, int] = defaultdict(int)
    bad: dict[str, int] = defaultdict(int)
    by_profile: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for d in devices:
        if attribute(d, "type") != "mig" or not attribute(d, "profile"):
            continue
        profile = normalize_profile_name(str(attribute(d, "profile")))
        if d["name"] in taken:
            used[profile] += 1
        elif tainted(d):
            bad[profile] += 1
        else:
            by_profile[profile].append(d)
        free.setdefault(profile, 0)
    for profile, candidates in by_profile.items():
        budget = dict(left)
        for d in candidates:
            needs = _counters(d.get("consumesCounters") or [])
            if all(budget.get(key, 0) >= value for key, value in needs.items()):
                for key, value in needs.items():
                    budget[key] -= value
                free[profile] += 1
    return dict(free), dict(used), dict(bad)


def _counted(labels: Mapping[str, str]) -> dict[str, int]:
    """Profile -> MIG devices GPU Feature Discovery counts on the node (none: no labels,
    or dynamic MIG, where no instance exists before a claim)."""
    out = {}
    for key, value in labels.items():
        if (match := _COUNT_LABEL.match(key)) and value.strip().isdigit():
            out[normalize_profile_name(match["profile"])] = int(value)
    return out


def dra_slices(
    nodes: Iterable[Mapping[str, Any]],
    resource_slices: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
    *,
    driver: str = DRIVER,
    product_models: Mapping[str, str] | None = None,
    tolerations: Iterable[Mapping[str, Any]] = (),
) -> ClusterSlices:
    """Free MIG slices per node from NodeList, ResourceSliceList and ResourceClaimList
    ``items`` (the DRA counterpart of :func:`~mig_spawner.kube.cluster.cluster_slices`)."""
    tolerations = list(tolerations)
    taken, pods = allocated(claims)
    pools: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    shared: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
    pool_of: dict[str, str] = {}
    for rs in resource_slices:
        spec = rs.get("spec") or {}
        node_name = spec.get("nodeName")
        if spec.get("driver") != driver or not node_name:
            continue
        pool = (spec.get("pool") or {}).get("name", node_name)
        pool_of[node_name] = pool
        pools[node_name].extend(spec.get("devices") or [])
        shared[node_name].update(_counters(spec.get("sharedCounters") or []))
    offered, skipped = [], []
    for node in nodes:
        name = (node.get("metadata") or {}).get("name", "?")
        devices = pools.get(name)
        if not devices:
            continue
        problem = node_problem(node, tolerations)
        products = {str(attribute(d, "productName") or "") for d in devices
                    if attribute(d, "type") == "mig"}
        gpu = next((m for p in sorted(products) if (m := model_for_label(
            re.sub(r"\s+", "-", p), product_models))), None)
        if problem is None and gpu is None:
            problem = (f"DRA devices of product {', '.join(sorted(products)) or '?'} are not "
                       "MIG GPUs of the catalog (map it with KubeMIGSpawner.mig_product_models)")
        if problem is not None:
            skipped.append(SkippedNode(name, problem))
            continue
        ids = {d["name"] for d in devices if (driver, pool_of[name], d["name"]) in taken}
        free, used, bad = _free_on_pool(devices, shared[name], ids)
        unknown = sorted(p for p in {*free, *used, *bad} if not gpu.has_profile(p))
        if unknown:
            skipped.append(SkippedNode(name, f"profile(s) {', '.join(unknown)} are not "
                                             f"{gpu.display_name} profiles"))
            continue
        total = {p: free.get(p, 0) + used.get(p, 0) for p in {*free, *used, *bad}}
        # Counted by GFD but not published: the driver took them out (only this GPU
        # model's profiles: a node's other GPUs may be the device plugin's).
        labels = (node.get("metadata") or {}).get("labels") or {}
        for profile, count in _counted(labels).items():
            published = total.get(profile, 0) + bad.get(profile, 0)
            if gpu.has_profile(profile) and count > published:
                bad[profile] = bad.get(profile, 0) + count - published
                total.setdefault(profile, 0)
        offered.append(NodeSlices(name, gpu.key, ",".join(sorted(products)), "dra", total,
                                  used, frozenset(), unhealthy=bad))
    return ClusterSlices(
        nodes=tuple(sorted(offered, key=lambda n: n.name)),
        skipped=tuple(sorted(skipped, key=lambda s: s.name)),
        counted_pods=frozenset(pods),
    )


def template_name(model_key: str, profile: str) -> str:
    """``("h200", "1g.18gb")`` -> ``"mig-h200-1g-18gb"`` (a valid object name)."""
    return re.sub(r"[^a-z0-9-]+", "-", f"mig-{model_key}-{profile}".lower()).strip("-")


def selector(profile: str, products: Iterable[str]) -> str:
    """The CEL expression that selects a ``profile`` device of one of ``products``.

    Each attribute is checked to be there before it is compared: the scheduler's CEL
    aborts the claim's whole allocation on a device that lacks an attribute the
    expression reads ("no such key"), where a missing one must just not match (a
    device of an older driver, a GPU without MIG in a DeviceClass that admits both).
    """
    domain = f"device.attributes['{DRIVER}']"

    def equals(name: str, value: str) -> str:
        return f"'{name}' in {domain} && {domain}.{name} == '{value}'"

    expression = equals("profile", normalize_profile_name(profile))
    names = ", ".join(f"'{p}'" for p in sorted(set(products)))
    if not names:
        return expression
    return f"{expression} && 'productName' in {domain} && {domain}.productName in [{names}]"


def claim_template(model_key: str, profile: str, namespace: str) -> dict[str, Any]:
    """The ResourceClaimTemplate for one slice of ``profile`` on a ``model_key`` GPU."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name(model_key, profile), "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "mig-spawner"}},
        "spec": {"spec": {"devices": {"requests": [{
            "name": DRA_CLAIM,
            "exactly": {
                "deviceClassName": DEVICE_CLASS,
                "allocationMode": "ExactCount",
                "count": 1,
                "selectors": [{"cel": {"expression": selector(
                    profile, model(model_key).product_names)}}],
            },
        }]}}},
    }


def served_by(nodes: Iterable[Mapping[str, Any]],
              resource_slices: Iterable[Mapping[str, Any]], driver: str = DRIVER) -> str:
    """How the cluster hands out MIG devices on ``nodes``: ``"dra"`` (the DRA driver
    publishes MIG devices of one of them in ResourceSlices), ``"device-plugin"`` (one
    advertises ``nvidia.com/mig-*``, or ``nvidia.com/gpu`` on a ``-MIG-`` product), else
    ``"none"``. Slices of other nodes (another pool's) do not count."""
    nodes = list(nodes)
    names = {(n.get("metadata") or {}).get("name") for n in nodes}
    if any((rs.get("spec") or {}).get("driver") == driver
           and (rs.get("spec") or {}).get("nodeName") in names and any(
            attribute(d, "type") == "mig" for d in (rs.get("spec") or {}).get("devices") or [])
           for rs in resource_slices):
        return "dra"
    for n in nodes:
        allocatable = (n.get("status") or {}).get("allocatable") or {}
        product = ((n.get("metadata") or {}).get("labels") or {}).get(PRODUCT_LABEL, "")
        if any(r.startswith(MIG_RESOURCE_PREFIX) for r in allocatable) or (
                GPU_RESOURCE in allocatable and "-MIG-" in product.upper()):
            return "device-plugin"
    return "none"
