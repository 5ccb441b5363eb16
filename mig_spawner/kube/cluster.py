"""Free MIG slices of a cluster, computed from the Kubernetes API's Node and Pod JSON.

Pure: takes the ``items`` of a NodeList and a PodList exactly as the API returns them
and answers, per catalog GPU model and profile, how many slices are free on which node.
A node's slices are ``status.allocatable`` of the device plugin's resources; a slice is
used when a pod bound to that node (``spec.nodeName``) that has not terminated requests
it. :mod:`mig_spawner.kube.availability` does the reading and caching.

Counts come from ``allocatable``, not from GFD's ``nvidia.com/mig-<profile>.count``
labels: the device plugin leaves unhealthy devices out of ``allocatable``, and that is
what the scheduler places pods against. The kubelet keeps them in ``capacity``, so
capacity less allocatable is what the cluster reports unhealthy (the form says why a
size vanished). Labels give the product, the strategy and the MIG Manager state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_spawner.core.catalog import WHOLE_GPU

from .resources import (
    CONFIG_STATE_LABEL,
    CONFIG_SUCCESS,
    GPU_RESOURCE,
    MIG_RESOURCE_PREFIX,
    PRODUCT_LABEL,
    STRATEGIES,
    STRATEGY_LABEL,
    gpu_resource_of,
    model_for_label,
    parse_product_label,
    profile_of_resource,
    tolerates,
)

TERMINATED_PHASES = ("Succeeded", "Failed")
# Taint effects that keep new pods off a node (PreferNoSchedule only discourages).
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class NodeSlices:
    """The MIG slices of one schedulable node whose MIG layout is in place."""

    name: str
    model_key: str
    product_label: str
    strategy: str
    allocatable: Mapping[str, int]
    used: Mapping[str, int]
    pods: frozenset[str] = frozenset()
    #: Slices per profile the node has but the cluster reports unhealthy: the device
    #: plugin left them out of allocatable, or the DRA driver tainted them or took them
    #: out of its ResourceSlice. Neither free nor used: nothing is scheduled on them.
    unhealthy: Mapping[str, int] = field(default_factory=dict)

    def free(self, profile: str) -> int:
        """Slices of ``profile`` no running or pending pod on this node holds."""
        return max(0, self.allocatable.get(profile, 0) - self.used.get(profile, 0))


@dataclass(frozen=True)
class SkippedNode:
    """A GPU node whose slices are not offered now, and why (shown to admins)."""

    name: str
    reason: str


@dataclass(frozen=True)
class Target:
    """Nodes of one GPU model that advertise one profile the same way, so that one pod
    spec (resource, selector) can land on any of them."""

    model_key: str
    profile: str
    strategy: str
    product_labels: tuple[str, ...]
    nodes: tuple[str, ...]
    free: int


@dataclass(frozen=True)
class ClusterSlices:
    """Every offered node's slices, and the GPU nodes left out with the reason."""

    nodes: tuple[NodeSlices, ...] = ()
    skipped: tuple[SkippedNode, ...] = ()
    # "namespace/name" of every pod whose requests were counted, so that a caller can
    # tell which of its own spawns this snapshot already sees.
    counted_pods: frozenset[str] = field(default_factory=frozenset)

    def free(self) -> dict[str, dict[str, int]]:
        """Free slices per catalog model key, then per profile (zero counts kept: the
        profile exists in the cluster but is all taken)."""
        out: defaultdict[str, dict[str, int]] = defaultdict(dict)
        for node in self.nodes:
            for profile in node.allocatable:
                per_model = out[node.model_key]
                per_model[profile] = per_model.get(profile, 0) + node.free(profile)
        return dict(out)

    def unhealthy(self) -> dict[str, dict[str, int]]:
        """Slices per catalog model key, then per profile, that offered nodes have but
        the cluster reports unhealthy (:attr:`NodeSlices.unhealthy`)."""
        out: defaultdict[str, dict[str, int]] = defaultdict(dict)
        for node in self.nodes:
            for profile, count in node.unhealthy.items():
                per_model = out[node.model_key]
                per_model[profile] = per_model.get(profile, 0) + count
        return dict(out)

    def withheld(self, wants: Mapping[str, str]) -> tuple[int, int]:
        """For a request meaning ``wants`` (model key -> profile): how many of its
        slices the cluster reports unhealthy, and how many pods hold."""
        bad = used = 0
        for n in self.nodes:
            if (profile := wants.get(n.model_key)) is not None:
                bad += n.unhealthy.get(profile, 0)
                used += n.used.get(profile, 0)
        return bad, used

    def targets(self, wants: Mapping[str, str]) -> list[Target]:
        """Where a request meaning ``wants`` (model key -> profile) can go, most free first
        (ties by model key, then product label, so the choice is deterministic).

        Mixed-strategy nodes of one model share a target (the resource name picks the
        profile); single-strategy nodes are grouped by product label, which a node
        selector has to name exactly.
        """
        groups: dict[tuple[str, str, str, str], list[NodeSlices]] = defaultdict(list)
        for n in self.nodes:
            profile = wants.get(n.model_key)
            if profile is None or profile not in n.allocatable:
                continue
            label = n.product_label if n.strategy == "single" else ""
            groups[(n.model_key, profile, n.strategy, label)].append(n)
        found = [
            Target(
                model_key=key,
                profile=profile,
                strategy=strategy,
                product_labels=tuple(sorted({n.product_label for n in members})),
                nodes=tuple(n.name for n in members),
                free=sum(n.free(profile) for n in members),
            )
            for (key, profile, strategy, _), members in groups.items()
        ]
        return sorted(found, key=lambda t: (-t.free, t.model_key, t.product_labels))

    def model_keys(self) -> tuple[str, ...]:
        """Catalog models present on offered nodes, sorted."""
        return tuple(sorted({n.model_key for n in self.nodes}))


def unhealthy_words(node: NodeSlices) -> str:
    """``"3g.40gb: 2, 1g.10gb: 1"``: the node's slices the cluster reports unhealthy,
    for admins (the check command, ``doctor --kube``)."""
    return ", ".join(f"{p}: {n}" for p, n in sorted(node.unhealthy.items()))


def unhealthy_reason(node: NodeSlices) -> str:
    """What the cluster did to the node's unhealthy slices, in words (doctor, the map)."""
    if node.strategy == "dra":
        return "the DRA driver tainted them or took them out of its ResourceSlice"
    return "the device plugin left them out of allocatable (capacity has them)"


def quantity(value: Any) -> int:
    """An extended-resource quantity: the API server only accepts whole numbers for
    device plugin resources, so no Kubernetes suffixes (``m``, ``Ki`` ...) occur."""
    return int(str(value).strip())


def _requests(container: Mapping[str, Any]) -> dict[str, int]:
    """GPU requests of one container. Extended resources may be given as a limit only;
    the API server then sets the request equal to it."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    out: dict[str, int] = {}
    for name, value in merged.items():
        if name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX):
            out[name] = quantity(value)
    return out


def _add(total: dict[str, int], more: Mapping[str, int]) -> dict[str, int]:
    return {k: total.get(k, 0) + more.get(k, 0) for k in {*total, *more}}


def _max(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in {*a, *b}}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """The pod's effective GPU requests by Kubernetes' rules.

    Regular containers run together, so their requests add up; init containers run one
    at a time before them, so the pod needs the largest of them; sidecars (init
    containers with ``restartPolicy: Always``) keep running, so they add to every later
    init container and to the regular containers.
    """
    spec = pod.get("spec") or {}
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for container in spec.get("initContainers") or []:
        asks = _requests(container)
        if container.get("restartPolicy") == "Always":
            sidecars = _add(sidecars, asks)
            init_peak = _max(init_peak, sidecars)
        else:
            init_peak = _max(init_peak, _add(sidecars, asks))
    running = dict(sidecars)
    for container in spec.get("containers") or []:
        running = _add(running, _requests(container))
    return {k: v for k, v in _max(running, init_peak).items() if v}


def _ready(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _strategy(labels: Mapping[str, str], allocatable: Mapping[str, Any], forced: str | None) -> str:
    if forced:
        return forced
    label = labels.get(STRATEGY_LABEL, "")
    if label in STRATEGIES:
        return label
    # No GFD label: infer it from what the device plugin advertises.
    if any(name.startswith(MIG_RESOURCE_PREFIX) for name in allocatable):
        return "mixed"
    if parse_product_label(labels.get(PRODUCT_LABEL, "")).profile:
        return "single"
    return label or "none"


def _is_gpu_node(labels: Mapping[str, str], allocatable: Mapping[str, Any]) -> bool:
    return PRODUCT_LABEL in labels or any(
        name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX) for name in allocatable
    )


def _sharing(labels: Mapping[str, str]) -> str | None:
    """The label that shows the device plugin shares devices (replicas > 1), or None."""
    product = labels.get(PRODUCT_LABEL, "")
    if parse_product_label(product).shared:
        return f"{PRODUCT_LABEL}={product}"
    for key, value in labels.items():
        if key.startswith("nvidia.com/") and key.endswith(".replicas") and value not in ("", "1"):
            return f"{key}={value}"
    return None


def _capacity(
    strategy: str, labels: Mapping[str, str], allocatable: Mapping[str, Any]
) -> tuple[dict[str, int], str | None]:
    """Profile -> allocatable slices, or a reason why the node has none to offer."""
    if strategy == "mixed":
        slices = {
            profile: quantity(value)
            for name, value in allocatable.items()
            if (profile := profile_of_resource(name))
        }
        # Mixed strategy advertises the node's GPUs with MIG off as nvidia.com/gpu:
        # whole GPUs, offered as such (unless the product label says they are MIG
        # slices: a single-strategy node that the config calls mixed).
        single = parse_product_label(labels.get(PRODUCT_LABEL, "")).profile
        if not single and quantity(allocatable.get(GPU_RESOURCE, 0)):
            slices[WHOLE_GPU] = quantity(allocatable[GPU_RESOURCE])
        return slices, None if slices else "no nvidia.com/mig-* resources are allocatable"
    if strategy == "single":
        profile = parse_product_label(labels.get(PRODUCT_LABEL, "")).profile
        if profile is None:
            return {}, (
                f"single strategy, but {PRODUCT_LABEL}={labels.get(PRODUCT_LABEL)!r} names no "
                "MIG profile (is MIG enabled on its GPUs?)"
            )
        return {profile: quantity(allocatable.get(GPU_RESOURCE, 0))}, None
    return {}, f"MIG strategy is {strategy!r}: the device plugin advertises no MIG slices"


def _not_schedulable(node: Mapping[str, Any]) -> str | None:
    if (node.get("spec") or {}).get("unschedulable"):
        return "cordoned (spec.unschedulable)"
    return None if _ready(node) else "not Ready"


def _untolerated(node: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]
                 ) -> str | None:
    tolerations = list(tolerations)
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not tolerates(tolerations, taint):
            return (f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} "
                    "is not tolerated (KubeMIGSpawner.mig_tolerations)")
    return None


def node_problem(node: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]
                 ) -> str | None:
    """Why a GPU pod cannot be placed on ``node`` now (cordoned, not Ready, a taint the
    pods do not tolerate), or ``None``."""
    return _not_schedulable(node) or _untolerated(node, tolerations)


def _offered(
    node: Mapping[str, Any],
    forced_strategy: str | None,
    product_models: Mapping[str, str] | None,
    tolerations: Iterable[Mapping[str, Any]],
) -> NodeSlices | SkippedNode | None:
    """The node's slices, or why it is left out; ``None`` for a node without GPUs."""
    meta = node.get("metadata") or {}
    name = meta.get("name", "?")
    labels = meta.get("labels") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    if not _is_gpu_node(labels, allocatable):
        return None
    if (problem := _not_schedulable(node)) is not None:
        return SkippedNode(name, problem)
    reported = labels.get(CONFIG_STATE_LABEL)
    if reported is not None and reported != CONFIG_SUCCESS:
        return SkippedNode(
            name, f"MIG Manager is applying a layout ({CONFIG_STATE_LABEL}={reported})"
        )
    shared = _sharing(labels)
    if shared:
        return SkippedNode(
            name, f"{shared}: time-slicing or MPS shares each slice between pods, and "
            "mig-spawner gives each server a slice of its own"
        )
    if (problem := _untolerated(node, tolerations)) is not None:
        return SkippedNode(name, problem)
    product = labels.get(PRODUCT_LABEL, "")
    gpu = model_for_label(product, product_models) if product else None
    if gpu is None:
        return SkippedNode(
            name,
            f"{PRODUCT_LABEL}={product!r} is not a MIG GPU of the catalog "
            "(map it with KubeMIGSpawner.mig_product_models)",
        )
    strategy = _strategy(labels, allocatable, forced_strategy)
    try:
        slices, problem = _capacity(strategy, labels, allocatable)
        # The kubelet counts every device the plugin lists in capacity, and only the
        # healthy ones in allocatable (no capacity given: nothing known to be missing).
        capacity = (node.get("status") or {}).get("capacity")
        existing = _capacity(strategy, labels, capacity)[0] if capacity else slices
    except ValueError as e:
        return SkippedNode(name, f"unreadable allocatable quantity ({e})")
    if problem:
        return SkippedNode(name, problem)
    unknown = sorted(p for p in slices if not gpu.has_profile(p))
    if unknown:
        return SkippedNode(
            name, f"profile(s) {', '.join(unknown)} are not {gpu.display_name} profiles"
        )
    unhealthy = {p: n - slices.get(p, 0) for p, n in existing.items()
                 if n > slices.get(p, 0) and gpu.has_profile(p)}
    return NodeSlices(name, gpu.key, product, strategy, slices, {}, unhealthy=unhealthy)


def _resource_of(node: NodeSlices) -> dict[str, str]:
    """Device plugin resource name -> profile, for the node's strategy."""
    if node.strategy == "single":
        (profile,) = node.allocatable
        return {GPU_RESOURCE: profile}
    return {gpu_resource_of(p): p for p in node.allocatable}


def cluster_slices(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    *,
    strategy: str | None = None,
    product_models: Mapping[str, str] | None = None,
    tolerations: Iterable[Mapping[str, Any]] = (),
) -> ClusterSlices:
    """Free slices per node from NodeList and PodList ``items``.

    ``strategy`` forces the device plugin strategy (else each node's
    ``nvidia.com/mig.strategy`` label, else inferred); ``product_models`` maps product
    label values the catalog does not know to model keys; ``tolerations`` are those the
    notebook pods get, so that nodes with other taints are not offered.
    """
    tolerations = list(tolerations)
    offered: dict[str, NodeSlices] = {}
    skipped: list[SkippedNode] = []
    for node in nodes:
        result = _offered(node, strategy, product_models, tolerations)
        if isinstance(result, NodeSlices):
            offered[result.name] = result
        elif result is not None:
            skipped.append(result)
    used: defaultdict[str, dict[str, int]] = defaultdict(dict)
    holders: defaultdict[str, set[str]] = defaultdict(set)
    counted: set[str] = set()
    for pod in pods:
        spec = pod.get("spec") or {}
        node_name = spec.get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node_name not in offered or phase in TERMINATED_PHASES:
            continue
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        counted.add(key)
        names = _resource_of(offered[node_name])
        for resource, count in pod_requests(pod).items():
            if resource in names:
                profile = names[resource]
                used[node_name][profile] = used[node_name].get(profile, 0) + count
                holders[node_name].add(key)
    result_nodes = tuple(
        NodeSlices(
            n.name, n.model_key, n.product_label, n.strategy, n.allocatable,
            used.get(n.name, {}), frozenset(holders.get(n.name, ())), n.unhealthy,
        )
        for n in sorted(offered.values(), key=lambda n: n.name)
    )
    return ClusterSlices(
        nodes=result_nodes,
        skipped=tuple(sorted(skipped, key=lambda s: s.name)),
        counted_pods=frozenset(counted),
    )
