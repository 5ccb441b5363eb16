"""KubeMIGSpawner: one MIG slice per notebook pod, through NVIDIA's device plugin.

The mixin gives the form, ``user_options`` validation, quotas and the lease;
KubeSpawner runs the pod. This class connects them to the cluster: the form and
the claim read free slices from the nodes and pods (cached a few seconds), the
lease records the pod (and, once it runs, its node), and the pod asks for the
slice as ``nvidia.com/mig-<profile>: 1`` (mixed strategy) or ``nvidia.com/gpu: 1``
on a ``<product>-MIG-<profile>`` node (single strategy). Guide: docs/kubernetes.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from traitlets import Dict, Enum, List, TraitError, Unicode, validate

from mig_spawner.config import Finite
from mig_spawner.core.catalog import CatalogError, model
from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.core.refusal import Reason
from mig_spawner.kube import (
    ClusterAvailability,
    ClusterReadError,
    ClusterSlices,
    KubeConfigError,
    SliceRequest,
    apply_to_pod,
    check_label_selector,
    check_labels,
    check_toleration,
    slice_request,
)
from mig_spawner.kube.dra import claim_template, template_name
from mig_spawner.kube.pods import (
    SchedulingEvents,
    claims_gone,
    ensure_claim_template,
)
from mig_spawner.ledger import Lease
from mig_spawner.release import HolderProbes, KubePods, LocalProcesses, SliceGpus

from . import progress
from .backend import ClaimPlan, SliceSupply, held_back
from .errors import admin_error, spawn_error
from .kube_decide import (
    CLUSTER_UNHEALTHY,
    ClaimTarget,
    free_by_model,
    make_kube_decide,
    wanted_on_cluster,
    without_held_nodes,
)
from .mixin import MIGSpawnerMixin

# Environment variables that choose GPUs or MIG capabilities inside a container.
DEVICE_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_MIG_CONFIG_DEVICES",
    "NVIDIA_MIG_MONITOR_DEVICES",
)
#: Seconds a stop waits for a DRA pod's claims to be removed after the pod.
CLAIM_WAIT = 30.0
#: Seconds a ResourceClaimTemplate seen in place is not read again.
TEMPLATE_TTL = 60.0


class _PodGone(KubeSpawner):
    """KubeSpawner's ``stop`` returns once the pod is gone (no longer Terminating), so
    its slice is free from then on. Right there, before the mixin releases the lease
    (and the wait list's grant step runs on that release), the cached read of the
    cluster, which may date from while the pod was Terminating, is dropped: a start or
    a grant right after the stop must not find the slice still taken."""

    async def stop(self, now: bool = False) -> None:
        pod = self._reflected_pod()  # type: ignore[attr-defined]
        try:
            await super().stop(now=now)
            uid = (pod.get("metadata") or {}).get("uid")
            if uid and (pod.get("spec") or {}).get("resourceClaims"):
                await self._claims_gone(uid)
        finally:
            self.availability.invalidate()  # type: ignore[attr-defined]

    async def _claims_gone(self, uid: str) -> None:
        """DRA: the pod's claims are removed after the pod, by the garbage collector;
        their devices are not free before (the lease is released after this)."""
        try:
            gone = await claims_gone(self.resource_api,  # type: ignore[attr-defined]
                                     self.namespace, uid, CLAIM_WAIT)
        except ClusterReadError as e:
            gone = False
            self.log.warning("Cannot see whether the claims of pod %s are gone: %s", uid, e)
        if not gone:
            self.log.warning("The claims of pod %s/%s (uid %s) are still there after %s s",
                             self.namespace, self.pod_name, uid, CLAIM_WAIT)


@dataclass(frozen=True)
class KubeFleet:
    """One read of the cluster, and the nodes layout changes hold from new pods."""

    slices: ClusterSlices
    #: Holds per (node, ``KUBE_NODE``), as ``ledger.holds.held()`` gives them (docs/layout.md).
    holds: Mapping[tuple[str, str], frozenset[int]] = field(default_factory=dict)


class KubeMIGSpawner(MIGSpawnerMixin, _PodGone):
    """A KubeSpawner whose pods each get one MIG slice that the user's groups allow."""

    mig_strategy = Enum(
        ["auto", "mixed", "single"],
        default_value="auto",
        help="""The device plugin's ``--mig-strategy`` (GPU Operator: ``mig.strategy``).

        ``auto`` (default) reads each node's ``nvidia.com/mig.strategy`` label set by GPU
        Feature Discovery. ``mixed``: pods request ``nvidia.com/mig-<profile>: 1``.
        ``single``: pods request ``nvidia.com/gpu: 1`` and select the node labelled
        ``nvidia.com/gpu.product=<product>-MIG-<profile>``.
        """,
    ).tag(config=True)

    mig_resource_api = Enum(
        ["device-plugin", "dra"],
        default_value="device-plugin",
        help="""How the cluster hands out MIG devices.

        ``device-plugin`` (default): NVIDIA's device plugin (GPU Operator); free slices
        are node allocatable less pod requests, and a pod asks for
        ``nvidia.com/mig-<profile>: 1`` (see ``mig_strategy``). ``dra``: NVIDIA's DRA
        driver (``gpu.nvidia.com``, DeviceClass ``mig.nvidia.com``); free slices are the
        MIG devices of ResourceSlices that no allocated ResourceClaim holds, and a pod
        carries a ResourceClaim made from a ResourceClaimTemplate per GPU model and
        profile, which the hub creates in its namespace when missing.
        ``python -m mig_spawner.kube`` says which one the cluster serves.
        """,
    ).tag(config=True)

    mig_tolerations = List(
        Dict(),
        help="""Tolerations added to GPU pods only (Kubernetes Toleration fields, camelCase).

        E.g. ``[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]``
        when the GPU nodes carry that taint. Nodes whose NoSchedule/NoExecute taints these
        do not tolerate are not offered on the form. ``KubeSpawner.tolerations`` still
        applies to every pod.
        """,
    ).tag(config=True)

    mig_node_selector = Dict(
        value_trait=Unicode(),
        help="""Node selector labels added to GPU pods only, on top of
        ``KubeSpawner.node_selector`` (e.g. ``{"pool": "gpu"}``).""",
    ).tag(config=True)

    mig_product_models = Dict(
        value_trait=Unicode(),
        help="""Extra ``nvidia.com/gpu.product`` label values -> catalog model key, for
        GPUs whose label the catalog does not know, e.g.
        ``{"NVIDIA-H200-SXM-141GB": "h200"}``. Keys: the label without ``-MIG-...``.""",
    ).tag(config=True)

    mig_availability_ttl = Finite(
        10.0, min=0.0,
        help="""Seconds a read of the cluster's nodes and pods is reused for spawn forms.
        Claims always re-read when the cached read is older than 2 seconds.""",
    ).tag(config=True)

    mig_node_label_selector = Unicode(
        "",
        help="""Label selector for the nodes to read, e.g. ``nvidia.com/gpu.present=true``
        (empty: all nodes). Cuts the Node list on big clusters.""",
    ).tag(config=True)

    supply_scope: ClassVar[str] = "in the cluster"
    backend_errors: ClassVar[dict[type[Exception], str]] = {
        **MIGSpawnerMixin.backend_errors,
        ClusterReadError: "The cluster's GPU nodes",
    }

    # This start's slice request, built in prepare_slice, applied in get_pod_manifest and
    # dropped when start ends: nothing of one spawn survives into the next.
    _slice_request: SliceRequest | None = None
    _kube_choice: ClaimTarget | None = None
    # This start's relay of the scheduler's FailedScheduling events to the progress page.
    _scheduling: asyncio.Future | None = None
    # Claims re-read the cluster when the cached snapshot is older than this.
    claim_max_age: ClassVar[float] = 2.0
    # One reader (and cache) per API client and settings, shared by every spawner.
    _readers: ClassVar[dict[tuple, ClusterAvailability]] = {}
    # When each (namespace, name) ResourceClaimTemplate was last seen there (DRA), or
    # the check under way.
    _templates_seen: ClassVar[dict[tuple[str, str], float | asyncio.Future]] = {}

    @validate("mig_tolerations")
    def _check_tolerations(self, proposal: dict) -> list[dict]:
        try:
            return [check_toleration(t) for t in proposal["value"]]
        except KubeConfigError as e:
            raise TraitError(f"KubeMIGSpawner.mig_tolerations: {e}") from None

    @validate("mig_node_selector")
    def _check_node_selector(self, proposal: dict) -> dict[str, str]:
        try:
            return check_labels(proposal["value"])
        except KubeConfigError as e:
            raise TraitError(f"KubeMIGSpawner.mig_node_selector: {e}") from None

    @validate("mig_node_label_selector")
    def _check_label_selector(self, proposal: dict) -> str:
        try:
            return check_label_selector(proposal["value"])
        except KubeConfigError as e:
            raise TraitError(f"KubeMIGSpawner.mig_node_label_selector: {e}") from None

    @validate("mig_product_models")
    def _check_product_models(self, proposal: dict) -> dict[str, str]:
        try:
            return {label: model(key).key for label, key in proposal["value"].items()}
        except CatalogError as e:
            raise TraitError(f"KubeMIGSpawner.mig_product_models: {e}") from None

    # --- the cluster ------------------------------------------------------------------

    @property
    def availability(self) -> ClusterAvailability:
        """The shared, cached reader of free slices, on KubeSpawner's API client."""
        key = (
            id(self.api),
            self.mig_availability_ttl,
            self.mig_strategy,
            tuple(sorted(self.mig_product_models.items())),
            repr(self.mig_tolerations),
            self.mig_node_label_selector,
            self.mig_resource_api,
        )
        reader = self._readers.get(key)
        if reader is None or reader.api is not self.api:
            reader = self._readers[key] = ClusterAvailability(
                self.api,
                resource_api=self.resource_api if self.mig_resource_api == "dra" else None,
                ttl=self.mig_availability_ttl,
                strategy=None if self.mig_strategy == "auto" else self.mig_strategy,
                product_models=self.mig_product_models,
                tolerations=self.mig_tolerations,
                node_selector=self.mig_node_label_selector,
            )
        return reader

    @property
    def resource_api(self) -> Any:
        """``resource.k8s.io/v1`` on KubeSpawner's API client (DRA)."""
        from kubernetes_asyncio.client import ResourceV1Api

        return ResourceV1Api(self.api.api_client)

    @property
    def pod_ref(self) -> str:
        """``namespace/pod-name``, as leases and the cluster snapshot name pods."""
        return f"{self.namespace}/{self.pod_name}"

    # --- the mixin's hooks: the cluster instead of the local GPUs --------------------

    async def slice_supply(self) -> SliceSupply:
        """The cluster's free slices (cached), less the leases whose pods are not there
        yet and the nodes a layout change holds."""
        slices, holds, held = await asyncio.gather(
            self.availability.slices(), self._holds(), self.held_leases())
        return self.supply_from(KubeFleet(slices, holds), held)

    async def read_fleet(self) -> KubeFleet:
        """A read of the cluster no older than :attr:`claim_max_age`, and of the nodes
        layout changes hold."""
        slices, holds = await asyncio.gather(
            self.availability.slices(max_age=self.claim_max_age), self._holds())
        return KubeFleet(slices, holds)

    async def _holds(self) -> Mapping[tuple[str, str], frozenset[int]]:
        return await self.runtime.run(lambda: self.runtime.ledger().holds.held())

    def supply_from(self, fleet: KubeFleet, held: Sequence[Lease]) -> SliceSupply:
        """The cluster's free slices in ``fleet``, less the leases whose pods are not
        there yet; a held node's slices are not free but being re-cut (docs/layout.md)."""
        held = tuple(held)
        free = free_by_model(without_held_nodes(fleet.slices, fleet.holds), held)
        recut = held_back(free_by_model(fleet.slices, held), free) if fleet.holds else {}
        return SliceSupply(tuple(model(key) for key in fleet.slices.model_keys()), free, held,
                           recut=recut, unhealthy=dict.fromkeys(fleet.slices.unhealthy(),
                                                                CLUSTER_UNHEALTHY))

    def plan_claim(self, fleet: KubeFleet, offer: Offer, mine: UserPolicy) -> ClaimPlan:
        """Decide on ``fleet``; the decision picks the nodes' target."""
        choice = self._kube_choice = ClaimTarget()

        def granted(lease: Lease) -> str:
            # The claim consumed a slice the cached snapshot still shows as free.
            self.availability.invalidate()
            target = choice.target
            return model(target.model_key).display_name if target else "an unknown GPU"

        # The claim reads the holds again in its transaction (LedgerView.holds).
        decide = make_kube_decide(mine, offer, fleet.slices, self.pod_ref, choice)
        return ClaimPlan(decide, granted, wanted_on_cluster(offer, fleet.slices))

    def activation_details(self, lease: Lease) -> dict[str, Any]:
        """The node the pod runs on (admins, the slice service) and its UID: the
        lease's holder, which whoever releases the lease checks first."""
        pod = self._reflected_pod()
        details = {
            "node": (pod.get("spec") or {}).get("nodeName"),
            "pod_uid": (pod.get("metadata") or {}).get("uid"),
        }
        return {key: value for key, value in details.items() if value}

    def gpu_access(self) -> Callable[[], SliceGpus | None]:
        """No local GPU: the device plugin gives each pod its slice."""
        return lambda: None

    def confinement(self) -> None:
        """Nothing on the hub's host confines a pod: the node's runtime does."""
        return None

    def holder_probes(self) -> HolderProbes:
        """The lease's pod, through the Kubernetes API: one the hub does not track that
        still runs is deleted (``delete_grace_period``) and waited for; one the API
        cannot tell about keeps the slice."""

        async def api() -> Any:
            return self.api

        return HolderProbes(local=LocalProcesses(self.runtime.run), pods=KubePods(api))

    def _term_grace(self) -> float:
        return float(self.delete_grace_period)

    async def prepare_slice(self, lease: Lease) -> None:
        """Compose what the pod must ask for (the mixin releases the lease if this fails),
        and follow what the scheduler says about the pod."""
        self._slice_request = self.slice_request_for(lease, self._kube_choice)
        if self._slice_request.claim_template:
            await self._ensure_template(lease)
        await self._follow_scheduling()

    async def _ensure_template(self, lease: Lease) -> None:
        """The ResourceClaimTemplate the pod's claim is made from exists (DRA)."""
        target = self._kube_choice.target if self._kube_choice else None
        if target is None:
            return
        template = claim_template(target.model_key, target.profile, self.namespace)
        key = (self.namespace, template["metadata"]["name"])
        seen = self._templates_seen.get(key)
        if isinstance(seen, float) and time.monotonic() - seen < TEMPLATE_TTL:
            return  # seen a moment ago: a class start asks once, not once per server
        if not isinstance(seen, asyncio.Future) or seen.done():
            # One read (and create) for every start that needs it now.
            seen = self._templates_seen[key] = asyncio.ensure_future(
                ensure_claim_template(self.resource_api, template))
        try:
            await asyncio.shield(seen)
            self._templates_seen[key] = time.monotonic()
        except ClusterReadError as e:
            self._templates_seen.pop(key, None)
            raise admin_error("The hub cannot prepare the cluster's GPU claim",
                              Reason.MIG_CONFIG, f"lease {lease.id}: {e}; {e.hint}") from None

    async def _follow_scheduling(self) -> None:
        """Until the start ends, show each FailedScheduling event of the pod about to be
        created on the progress page ("0/3 nodes are available: 3 Insufficient
        nvidia.com/mig-1g.18gb"): the user sees why the server waits. Only the progress
        page misses them when the Events cannot be read."""

        async def relay() -> None:
            try:
                events = SchedulingEvents.of(self.api, self.namespace)
                async for message in events.follow(self.pod_name, self.start_timeout):
                    self.progress_log.add(75, progress.unschedulable(message))
            except Exception as e:  # the API went away: the start itself will say so
                self.log.info("Stopped following the scheduling of %s: %s",
                              self._log_name, e)

        self._scheduling = asyncio.ensure_future(relay())

    def slice_request_for(self, lease: Lease, choice: ClaimTarget | None) -> SliceRequest:
        """Resource, selector and tolerations for the lease's slice on the chosen nodes."""
        target = choice.target if choice else None
        if target is None:  # decide() sets it whenever it grants
            raise spawn_error(
                "The hub lost track of the reserved slice; try again.",
                reason=Reason.MIG_CONFIG,
                log_message=f"lease {lease.id}: claim granted without a target",
            )
        if target.strategy == "dra":
            return SliceRequest(
                profile=lease.profile, strategy="mixed", resource="",
                node_selector=dict(self.mig_node_selector),
                tolerations=tuple(dict(t) for t in self.mig_tolerations),
                claim_template=template_name(target.model_key, target.profile),
            )
        try:
            return slice_request(
                lease.profile,
                target.strategy,
                product=target.product_labels[0] if target.strategy == "single" else None,
                products=target.product_labels if target.strategy == "mixed" else (),
                tolerations=self.mig_tolerations,
                node_selector=self.mig_node_selector,
            )
        except KubeConfigError as e:
            raise admin_error(
                "The hub's Kubernetes GPU settings are wrong",
                Reason.MIG_CONFIG,
                str(e),
            ) from None

    # --- the pod ----------------------------------------------------------------------

    async def load_user_options(self) -> None:
        """mig-spawner's ``profile`` option names a MIG slice, not a KubeSpawner
        ``profile_list`` entry; the two cannot be combined."""
        if self.profile_list:
            raise admin_error(
                "The hub's spawner configuration is wrong",
                Reason.MIG_CONFIG,
                "KubeMIGSpawner does not support KubeSpawner.profile_list (its "
                "'profile' user option picks the MIG slice); remove profile_list",
            )

    async def get_pod_manifest(self) -> Any:
        """KubeSpawner's manifest, plus this start's slice (nothing when none is held)."""
        pod = await super().get_pod_manifest()
        lease = getattr(self, "_lease", None)
        if self._slice_request is not None and lease is not None and lease.id == self.lease_id:
            apply_to_pod(pod, self._slice_request)
        return pod

    def get_env(self) -> dict[str, str]:
        """The mixin's environment without the variables that select devices.

        The device plugin gives the container its slice (and sets the device variables
        itself), so they are removed, even when the hub's config sets them:
        ``NVIDIA_VISIBLE_DEVICES=all`` in a pod's environment can give it every GPU of
        the node under the default container toolkit settings.
        """
        env = super().get_env()
        for name in DEVICE_VARIABLES:
            if env.pop(name, None) is not None:
                self.log.warning("Not passing %s to %s: the device plugin sets it",
                                 name, self._log_name)
        return env

    async def start(self) -> Any:
        """Start as the mixin does; nothing of this start's slice survives into the next.
        The API refusing the pod (RBAC, admission) is said in plain words to the user
        and in full in the hub log."""
        try:
            return await super().start()
        except ApiException as e:
            if e.status not in (403, 422):
                raise
            raise self._refused_by_api(e) from None
        finally:
            self._slice_request = None
            self._kube_choice = None
            if self._scheduling is not None:
                self._scheduling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._scheduling
                self._scheduling = None

    def _refused_by_api(self, e: ApiException) -> Exception:
        """A 403 (the service account may not) or 422 (the pod is invalid) from the API."""
        try:
            message = json.loads(e.body or b"{}").get("message", "")
        except ValueError:
            message = str(e.body)[:200]
        if e.status == 403 and "error looking up service account" in message:
            # ServiceAccount admission: the pod's account (the namespace's 'default'
            # unless KubeSpawner.service_account names one) does not exist (yet).
            detail = (f"the Kubernetes API refused pod {self.pod_ref}: HTTP 403: {message}. "
                      "Create the service account, or set KubeSpawner.service_account to "
                      f"one that exists in namespace {self.namespace}")
            problem = "The cluster lacks the account this server would run as"
        elif e.status == 403:
            detail = (f"the Kubernetes API refused pod {self.pod_ref}: HTTP 403: {message}. "
                      "The hub's service account needs the Role in docs/kubernetes.md "
                      "('RBAC') in namespace " + self.namespace)
            problem = "The cluster does not let the hub start servers"
        else:
            detail = f"the Kubernetes API refused pod {self.pod_ref} as invalid: {message}"
            problem = "The cluster refused this server's settings"
        self.log.error("Start of %s: %s", self._log_name, detail)
        return admin_error(problem, Reason.MIG_CONFIG, detail)

    def _reflected_pod(self) -> dict:
        pod = self.pod_reflector.pods.get(self.pod_ref) if self.pod_reflector else None
        return pod or {}
