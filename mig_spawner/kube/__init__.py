"""Kubernetes adapter: what a pod needs to get a MIG slice from NVIDIA's device plugin,
and which slices the cluster has free (docs/kubernetes.md)."""

from .availability import ClusterAvailability, ClusterReadError
from .cluster import ClusterSlices, NodeSlices, SkippedNode, cluster_slices, pod_requests
from .resources import (
    GPU_RESOURCE,
    PRODUCT_LABEL,
    STRATEGIES,
    STRATEGY_LABEL,
    KubeConfigError,
    SliceRequest,
    apply_to_pod,
    check_kube_profiles,
    check_toleration,
    kube_profile_problem,
    mig_resource,
    model_for_label,
    parse_product_label,
    single_product_label,
    slice_request,
)

__all__ = [
    "GPU_RESOURCE",
    "PRODUCT_LABEL",
    "STRATEGIES",
    "STRATEGY_LABEL",
    "ClusterAvailability",
    "ClusterReadError",
    "ClusterSlices",
    "KubeConfigError",
    "NodeSlices",
    "SkippedNode",
    "SliceRequest",
    "apply_to_pod",
    "check_kube_profiles",
    "check_toleration",
    "cluster_slices",
    "kube_profile_problem",
    "mig_resource",
    "model_for_label",
    "parse_product_label",
    "pod_requests",
    "single_product_label",
    "slice_request",
]
