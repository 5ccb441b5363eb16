"""The cluster's free MIG slices, read through ``kubernetes_asyncio`` and cached briefly.

:class:`ClusterAvailability` lists Nodes and non-terminated Pods (the same
``CoreV1Api`` client KubeSpawner uses), computes :class:`ClusterSlices` with
:func:`mig_spawner.kube.cluster.cluster_slices`, and keeps the answer for
``ttl`` seconds. Concurrent callers while a read is in flight share it, so a
burst of spawn-form renders costs two API calls, not two per user.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .cluster import ClusterSlices, cluster_slices
from .dra import dra_slices

# Pods in these phases hold nothing; the API server filters them out for us.
NOT_TERMINATED = "status.phase!=Succeeded,status.phase!=Failed"
PAGE_SIZE = 500


class ClusterReadError(RuntimeError):
    """The Kubernetes API refused or failed a read; ``hint`` says what to check."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


_FORBIDDEN_HINT = (
    "the hub's service account needs a ClusterRole that allows 'list' on 'nodes' and "
    "'pods' in all namespaces (with DRA also 'resourceslices' and 'resourceclaims' in "
    "API group resource.k8s.io; see docs/kubernetes.md, 'RBAC')"
)


async def _list_all(method: Callable[..., Any], what: str, **kwargs: Any) -> list[dict]:
    """Every item of a list call, page by page (``limit`` / ``continue``), as API JSON.

    ``_preload_content=False`` returns the raw response, as KubeSpawner's reflector
    reads it: plain dicts, without building thousands of model objects per read.
    """
    items: list[dict] = []
    token: str | None = None
    restarts = 0
    while True:
        page_args = {**({"limit": PAGE_SIZE} if not restarts else {}), **kwargs}
        if token:
            page_args["_continue"] = token
        try:
            response = await method(_preload_content=False, **page_args)
        except Exception as e:  # aiohttp connection errors, timeouts
            raise ClusterReadError(
                f"cannot list {what} from the Kubernetes API: {type(e).__name__}: {e}",
                "check that the hub can reach the API server (KubeSpawner.k8s_api_host)",
            ) from e
        body = await response.read()
        if response.status == 410 and token and not restarts:
            # The continue token expired (its version was compacted away, or the
            # API server's cache let it go): the pages read so far may be stale, so
            # the list starts again, whole, as client-go's pager falls back to.
            items, token, restarts = [], None, restarts + 1
            continue
        if response.status != 200:
            hint = _FORBIDDEN_HINT if response.status == 403 else ""
            try:
                message = json.loads(body).get("message", "")
            except ValueError:
                message = body[:200].decode("utf-8", "replace")
            raise ClusterReadError(
                f"listing {what} failed: HTTP {response.status}: {message}", hint
            )
        page = json.loads(body)
        items.extend(page.get("items") or [])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items


class ClusterAvailability:
    """Free slices of the cluster, read at most once per ``ttl`` seconds.

    ``api`` is a ``kubernetes_asyncio.client.CoreV1Api``; ``resource_api`` (a
    ``ResourceV1Api``) when the cluster serves MIG through DRA: slices are then read
    from ResourceSlices and ResourceClaims (:func:`~mig_spawner.kube.dra.dra_slices`)
    instead of node allocatable and pod requests. ``strategy``,
    ``product_models`` and ``tolerations`` are passed to
    :func:`~mig_spawner.kube.cluster.cluster_slices`; ``node_selector`` (a label
    selector string such as ``"nvidia.com/gpu.present=true"``) narrows the Node list.
    """

    def __init__(
        self,
        api: Any,
        *,
        ttl: float = 10.0,
        strategy: str | None = None,
        product_models: Mapping[str, str] | None = None,
        tolerations: Iterable[Mapping[str, Any]] = (),
        node_selector: str = "",
        clock: Callable[[], float] = time.monotonic,
        resource_api: Any = None,
    ) -> None:
        if ttl < 0:
            raise ValueError(f"ttl must be >= 0 seconds, got {ttl}")
        self.api = api
        self.resource_api = resource_api
        self.ttl = ttl
        self.strategy = strategy
        self.product_models = dict(product_models or {})
        self.tolerations = [dict(t) for t in tolerations]
        self.node_selector = node_selector
        self._clock = clock
        self._cached: tuple[float, ClusterSlices] | None = None
        self._inflight: asyncio.Future[ClusterSlices] | None = None

    def invalidate(self) -> None:
        """Forget the cached answer: the next :meth:`slices` reads the cluster."""
        self._cached = None

    async def slices(self, *, max_age: float | None = None) -> ClusterSlices:
        """The cluster's slices, at most ``max_age`` (default ``ttl``) seconds old."""
        limit = self.ttl if max_age is None else max_age
        cached = self._cached
        if cached is not None and self._clock() - cached[0] <= limit:
            return cached[1]
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._read())
        # shield: one caller's cancellation must not cancel the read the others await.
        inflight = self._inflight
        try:
            return await asyncio.shield(inflight)
        finally:
            if inflight.done() and self._inflight is inflight:
                self._inflight = None

    async def _read(self) -> ClusterSlices:
        started = self._clock()
        selector = {"label_selector": self.node_selector} if self.node_selector else {}
        if self.resource_api is not None:
            nodes, devices, claims = await asyncio.gather(
                _list_all(self.api.list_node, "nodes", **selector),
                _list_all(self.resource_api.list_resource_slice, "resourceslices"),
                _list_all(self.resource_api.list_resource_claim_for_all_namespaces,
                          "resourceclaims"),
            )
            result = dra_slices(nodes, devices, claims, product_models=self.product_models,
                                tolerations=self.tolerations)
            self._cached = (started, result)
            return result
        nodes, pods = await asyncio.gather(
            _list_all(self.api.list_node, "nodes", **selector),
            _list_all(
                self.api.list_pod_for_all_namespaces, "pods", field_selector=NOT_TERMINATED
            ),
        )
        result = cluster_slices(
            nodes,
            pods,
            strategy=self.strategy,
            product_models=self.product_models,
            tolerations=self.tolerations,
        )
        self._cached = (started, result)
        return result
