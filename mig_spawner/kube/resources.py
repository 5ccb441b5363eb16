"""What a pod must carry to get one MIG slice from NVIDIA's device plugin.

Pure composition, no I/O. Two device plugin strategies (``--mig-strategy``):

* ``mixed``: one extended resource per profile, ``nvidia.com/mig-3g.71gb: 1``.
* ``single``: every slice of a node is the same profile and is advertised as
  ``nvidia.com/gpu``; the profile is told by the node label
  ``nvidia.com/gpu.product=<product>-MIG-<profile>``, which the pod selects.

Every function returns NEW dicts and lists, and :func:`apply_to_pod` replaces
(never mutates) what KubeSpawner put in a pod manifest. KubeSpawner hands its
trait objects (``node_selector``, ``extra_resource_limits`` ...) straight into
the manifest, so an in-place update would write the GPU request into the
spawner's config and a later CPU-only spawn would still ask for a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mig_spawner.core.catalog import (
    MODELS,
    CatalogError,
    GpuModel,
    is_whole_gpu,
    model,
    normalize_profile_name,
    parse_profile_name,
)

Strategy = Literal["mixed", "single"]
STRATEGIES: tuple[Strategy, ...] = ("mixed", "single")

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
PRODUCT_LABEL = "nvidia.com/gpu.product"
STRATEGY_LABEL = "nvidia.com/mig.strategy"
CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
#: The values MIG Manager writes in :data:`CONFIG_STATE_LABEL` (its own words, not a
#: layout change's state).
CONFIG_PENDING, CONFIG_SUCCESS, CONFIG_FAILED = "pending", "success", "failed"
NOTEBOOK_CONTAINER = "notebook"
#: The pod's DRA claim name (as :data:`mig_spawner.kube.dra.CLAIM`).
DRA_CLAIM = "mig"
#: The API server refuses label values (and node selector values) longer than this.
LABEL_VALUE_MAX = 63

# GFD builds the product label from NVML's name with spaces turned into dashes, then
# appends "-MIG-<profile>" (single strategy) and "-SHARED" (time-slicing replicas).
_SHARED_SUFFIX = "-shared"
_MIG_SUFFIX = re.compile(r"-MIG-(?P<profile>[1-8]g\.\d+gb(?:\+me\.all|\+me|-me|\+gfx)?)$",
                         re.IGNORECASE)


class KubeConfigError(ValueError):
    """A Kubernetes setting of mig-spawner that cannot work; the message says how to fix it."""


def kube_profile_problem(profile: str) -> str | None:
    """Why a pod cannot ask NVIDIA's device plugin for ``profile``, or ``None`` when it can.

    The device plugin publishes a variant (``+me``, ``+me.all``, ``-me``, ``+gfx``) under
    the plain profile's resource and label (a node with 1g.10gb and 1g.10gb+me
    instances shows ``nvidia.com/mig-1g.10gb: 2``, k8s-device-plugin#1462), and ``+``
    is not allowed in a resource name: a pod asking for the variant never schedules, and
    one asking for the plain name may get either.
    """
    name = normalize_profile_name(profile)
    try:
        variant = parse_profile_name(name)[2]
    except CatalogError:
        return None  # not a profile name at all: the policy check says so
    if not variant:
        return None
    plain = name[: -len(variant)]
    return (
        f"{name} cannot be requested on Kubernetes: NVIDIA's device plugin publishes "
        f"{variant} slices under the plain {plain} resource ({MIG_RESOURCE_PREFIX}{plain}, "
        f"or {GPU_RESOURCE} with the single strategy), so a pod cannot ask for the "
        f"{variant} part. Offer {plain} instead, or use the local backend for {variant} "
        "profiles."
    )


def check_kube_profiles(profiles: Iterable[str]) -> None:
    """Refuse, with every reason at once, profiles pods cannot ask the device plugin for."""
    problems = [p for p in map(kube_profile_problem, profiles) if p]
    if problems:
        raise KubeConfigError("\n".join(problems))


def mig_resource(profile: str) -> str:
    """``"3g.71gb"`` -> ``"nvidia.com/mig-3g.71gb"`` (device plugin, ``mixed`` strategy)."""
    return MIG_RESOURCE_PREFIX + normalize_profile_name(profile)


def gpu_resource_of(profile: str) -> str:
    """The mixed strategy's resource for ``profile``: ``nvidia.com/mig-<profile>``, or
    ``nvidia.com/gpu`` for a whole GPU (``catalog.WHOLE_GPU``: a GPU with MIG off)."""
    return GPU_RESOURCE if is_whole_gpu(profile) else mig_resource(profile)


def profile_of_resource(resource: str) -> str | None:
    """``"nvidia.com/mig-3g.71gb"`` -> ``"3g.71gb"``; ``None`` for any other resource."""
    if not resource.startswith(MIG_RESOURCE_PREFIX):
        return None
    return normalize_profile_name(resource[len(MIG_RESOURCE_PREFIX) :])


@dataclass(frozen=True)
class ProductLabel:
    """A parsed ``nvidia.com/gpu.product`` value: ``NVIDIA-H200-MIG-1g.18gb-SHARED``."""

    value: str
    product: str
    profile: str | None
    shared: bool


def parse_product_label(value: str) -> ProductLabel:
    """Split a GFD product label into the GPU product, the MIG profile (single strategy)
    and the time-slicing ``-SHARED`` flag."""
    text = value.strip()
    shared = text.lower().endswith(_SHARED_SUFFIX)
    if shared:
        text = text[: -len(_SHARED_SUFFIX)]
    match = _MIG_SUFFIX.search(text)
    profile = normalize_profile_name(match["profile"]) if match else None
    product = text[: match.start()] if match else text
    return ProductLabel(value=value, product=product, profile=profile, shared=shared)


def _product_key(name: str) -> str:
    """Compare NVML names and label values alike: ``"NVIDIA A100 80GB PCIe"`` and
    ``"A100-80GB-PCIe"`` (older drivers had no ``NVIDIA`` prefix) both give
    ``"a100-80gb-pcie"``."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    return key.removeprefix("nvidia-")


_MODEL_BY_LABEL = {_product_key(p): m for m in MODELS for p in m.product_names}


def model_for_label(value: str, extra: Mapping[str, str] | None = None) -> GpuModel | None:
    """The catalog model behind a ``nvidia.com/gpu.product`` label value, or ``None``.

    ``extra`` maps more product names (as on the label, without ``-MIG-...``) to catalog
    model keys, for products the catalog does not list under that name. A value of the
    full 63 characters may carry a product name GFD cut short (see
    :func:`single_product_label`): it means the one product whose name starts so.
    """
    product = parse_product_label(value).product
    for name, key in (extra or {}).items():
        if _product_key(name) == _product_key(product):
            return model(key)
    found = _MODEL_BY_LABEL.get(_product_key(product))
    if found is None and len(value.strip()) == LABEL_VALUE_MAX:
        cut = {m.key for k, m in _MODEL_BY_LABEL.items() if k.startswith(_product_key(product))}
        found = model(cut.pop()) if len(cut) == 1 else None
    return found


def single_product_label(product: str, profile: str) -> str:
    """The label the device plugin's ``single`` strategy puts on a node whose slices are all
    ``profile``: ``single_product_label("NVIDIA-H200", "1g.18gb")`` ->
    ``"NVIDIA-H200-MIG-1g.18gb"``. ``product`` may be a label value or an NVML name.

    A label value has at most 63 characters: ``NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-
    Workstation-Edition-MIG-1g.24gb`` has 67, which NFD drops (k8s-device-plugin#1876).
    GFD cuts the product name to fit and keeps ``-MIG-<profile>`` whole (#1880); so does
    this function, so that a pod never selects a value no node can carry.
    """
    base = parse_product_label(re.sub(r"\s+", "-", product.strip())).product
    suffix = f"-MIG-{normalize_profile_name(profile)}"
    if len(base) + len(suffix) > LABEL_VALUE_MAX:
        base = base[: LABEL_VALUE_MAX - len(suffix)].rstrip("-._")
    return base + suffix


@dataclass(frozen=True)
class SliceRequest:
    """What one pod asks for to get one slice: resource, node selector, tolerations.

    ``products`` (mixed strategy, optional) pins the pod to nodes whose product label is
    one of these values: a profile name such as ``1g.10gb`` exists on more than one GPU
    model, and a slice class means one model's profile.
    """

    profile: str
    strategy: Strategy
    resource: str
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    products: tuple[str, ...] = ()
    #: DRA: the ResourceClaimTemplate the pod's claim is made from (``resource`` is then
    #: empty: the claim, not an extended resource, gives the slice).
    claim_template: str = ""

    @property
    def resources(self) -> dict[str, str]:
        """Requests and limits (extended resources need both, and equal)."""
        return {self.resource: "1"} if self.resource else {}


def slice_request(
    profile: str,
    strategy: str,
    *,
    product: str | None = None,
    products: Iterable[str] = (),
    tolerations: Iterable[Mapping[str, Any]] = (),
    node_selector: Mapping[str, str] | None = None,
) -> SliceRequest:
    """Compose the request for one slice of ``profile`` under the device plugin ``strategy``.

    ``single`` needs ``product`` (a ``nvidia.com/gpu.product`` value or NVML name) to
    build the node selector ``nvidia.com/gpu.product=<product>-MIG-<profile>``;
    ``products`` (mixed) pins the pod to those product label values. ``tolerations`` and
    ``node_selector`` are added as configured (copied).
    """
    name = normalize_profile_name(profile)
    if not name:
        raise KubeConfigError("a slice request needs a MIG profile name, e.g. '1g.18gb'")
    check_kube_profiles([name])
    selector = dict(node_selector or {})
    pinned: tuple[str, ...] = ()
    if strategy == "mixed":
        resource = gpu_resource_of(name)
        pinned = tuple(sorted(set(products)))
    elif strategy == "single":
        if not product:
            raise KubeConfigError(
                f"the device plugin's 'single' strategy advertises every slice as "
                f"{GPU_RESOURCE}, so a {name} pod must select its node by product; no "
                f"product is known. Let mig-spawner read it from the nodes' "
                f"{PRODUCT_LABEL} label, or set KubeMIGSpawner.mig_product."
            )
        resource = GPU_RESOURCE
        selector[PRODUCT_LABEL] = single_product_label(product, name)
    else:
        raise KubeConfigError(
            f"unknown device plugin MIG strategy {strategy!r}; use one of {', '.join(STRATEGIES)}"
        )
    return SliceRequest(
        profile=name,
        strategy=strategy,  # type: ignore[arg-type]  # checked just above
        resource=resource,
        node_selector=selector,
        tolerations=tuple(dict(t) for t in tolerations),
        products=pinned,
    )


def check_toleration(toleration: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one configured toleration (Kubernetes ``Toleration`` fields, camelCase)."""
    allowed = {"key", "operator", "value", "effect", "tolerationSeconds"}
    unknown = set(toleration) - allowed
    if unknown:
        raise KubeConfigError(
            f"toleration {dict(toleration)!r} has unknown field(s) {sorted(unknown)}; "
            f"a Kubernetes toleration has {', '.join(sorted(allowed))}"
        )
    operator = toleration.get("operator", "Equal")
    if operator not in ("Equal", "Exists"):
        raise KubeConfigError(f"toleration operator must be 'Equal' or 'Exists', not {operator!r}")
    if operator == "Exists" and toleration.get("value"):
        raise KubeConfigError(f"toleration {dict(toleration)!r}: 'Exists' takes no value")
    if operator == "Equal" and not toleration.get("key"):
        raise KubeConfigError(f"toleration {dict(toleration)!r}: 'Equal' needs a key")
    effect = toleration.get("effect")
    if effect not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise KubeConfigError(
            f"toleration effect must be NoSchedule, PreferNoSchedule or NoExecute, not {effect!r}"
        )
    return dict(toleration)


# Kubernetes' label syntax (apimachinery's validation): a name of up to 63 characters,
# alphanumeric at both ends; a key is a name with an optional DNS-subdomain prefix.
_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = rf"(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}"
_LABEL_VALUE = rf"(?:{_LABEL_NAME})?"
_VALUES = rf"\(\s*{_LABEL_VALUE}(?:\s*,\s*{_LABEL_VALUE})*\s*\)"
# One requirement of a label selector: key, !key, key=v, key==v, key!=v, key in (v,...),
# key notin (v,...), key>N, key<N.
_REQUIREMENT = re.compile(
    rf"\s*(?:!\s*{_LABEL_KEY}|{_LABEL_KEY}(?:\s*(?:==?|!=)\s*{_LABEL_VALUE}"
    rf"|\s+(?:in|notin)\s*{_VALUES}|\s*[<>]\s*-?\d+)?)\s*")


def check_labels(labels: Mapping[str, Any]) -> dict[str, str]:
    """Validate node selector labels (key -> value) as Kubernetes would take them in a
    pod; one it refuses would fail every spawn that carries it."""
    for key, value in labels.items():
        if not isinstance(key, str) or not re.fullmatch(_LABEL_KEY, key):
            raise KubeConfigError(f"{key!r} is not a Kubernetes label key (e.g. 'pool' or "
                                  "'example.com/pool')")
        if not isinstance(value, str) or not re.fullmatch(_LABEL_VALUE, value):
            raise KubeConfigError(f"{key}: {value!r} is not a Kubernetes label value (up to "
                                  "63 letters, digits, '-', '_' or '.', alphanumeric at both "
                                  "ends)")
    return dict(labels)


def check_label_selector(selector: str) -> str:
    """Validate a label selector (``nvidia.com/gpu.present=true,pool in (a,b)``) as the
    API server would parse it; one it refuses would fail every read of the nodes."""
    # Commas inside "in (a,b)" do not separate requirements.
    for requirement in re.split(r",(?![^()]*\))", selector) if selector.strip() else ():
        if not _REQUIREMENT.fullmatch(requirement):
            raise KubeConfigError(
                f"{requirement.strip()!r} is not a label selector requirement; write e.g. "
                "'nvidia.com/gpu.present=true', 'pool!=cpu' or 'zone in (a,b)', comma "
                "separated")
    return selector


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether a taint is tolerated, by Kubernetes' matching rules."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


# --- the pod manifest ---------------------------------------------------------------

_TOLERATION_FIELDS = {
    "key": "key",
    "operator": "operator",
    "value": "value",
    "effect": "effect",
    "tolerationSeconds": "toleration_seconds",
}


def _toleration_model(toleration: Mapping[str, Any]) -> Any:
    from kubernetes_asyncio.client.models import V1Toleration

    fields_ = _TOLERATION_FIELDS.items()
    given = {attr: toleration[name] for name, attr in fields_ if name in toleration}
    return V1Toleration(**given)


def _pinned_terms(existing: list[Any], products: tuple[str, ...]) -> list[Any]:
    """Node selector terms that keep what ``existing`` requires AND one of ``products``.

    Terms are ORed and their expressions ANDed, so the product expression goes into every
    term (a new term object each), or into a term of its own when there was none.
    """
    from kubernetes_asyncio.client.models import V1NodeSelectorRequirement, V1NodeSelectorTerm

    def expression() -> Any:
        return V1NodeSelectorRequirement(key=PRODUCT_LABEL, operator="In", values=list(products))

    if not existing:
        return [V1NodeSelectorTerm(match_expressions=[expression()])]
    return [
        V1NodeSelectorTerm(
            match_expressions=[*(term.match_expressions or []), expression()],
            match_fields=term.match_fields,
        )
        for term in existing
    ]


def notebook_container(pod: Any) -> Any:
    """The container running the notebook server (KubeSpawner names it ``notebook``)."""
    containers = pod.spec.containers or []
    for container in containers:
        if container.name == NOTEBOOK_CONTAINER:
            return container
    if not containers:
        raise KubeConfigError("the pod manifest has no container to give the slice to")
    return containers[0]


def apply_to_pod(pod: Any, request: SliceRequest) -> Any:
    """Give KubeSpawner's pod manifest (a ``V1Pod``) the slice: resource request and
    limit on the notebook container (with DRA: a claim from the request's template in
    ``spec.resourceClaims`` and the container's ``resources.claims``), node selector,
    tolerations and product pinning.

    Each field is REPLACED by a new object made of the old content plus the slice, so the
    configured dicts that KubeSpawner put into the manifest as they are stay untouched.
    Returns ``pod``.
    """
    from kubernetes_asyncio.client.models import (
        CoreV1ResourceClaim,
        V1Affinity,
        V1NodeAffinity,
        V1NodeSelector,
        V1PodResourceClaim,
        V1ResourceRequirements,
    )

    container = notebook_container(pod)
    old = container.resources or V1ResourceRequirements()
    claims = list(old.claims or [])
    spec = pod.spec
    if request.claim_template:
        claims.append(CoreV1ResourceClaim(name=DRA_CLAIM))
        spec.resource_claims = [
            *(spec.resource_claims or []),
            V1PodResourceClaim(name=DRA_CLAIM,
                               resource_claim_template_name=request.claim_template),
        ]
    container.resources = V1ResourceRequirements(
        requests={**(old.requests or {}), **request.resources} or None,
        limits={**(old.limits or {}), **request.resources} or None,
        claims=claims or None,
    )
    if request.node_selector:
        spec.node_selector = {**(spec.node_selector or {}), **request.node_selector}
    if request.tolerations:
        spec.tolerations = [
            *(spec.tolerations or []),
            *(_toleration_model(t) for t in request.tolerations),
        ]
    if request.products:
        affinity = spec.affinity or V1Affinity()
        node_affinity = affinity.node_affinity or V1NodeAffinity()
        required = node_affinity.required_during_scheduling_ignored_during_execution
        spec.affinity = V1Affinity(
            node_affinity=V1NodeAffinity(
                preferred_during_scheduling_ignored_during_execution=(
                    node_affinity.preferred_during_scheduling_ignored_during_execution
                ),
                required_during_scheduling_ignored_during_execution=V1NodeSelector(
                    node_selector_terms=_pinned_terms(
                        list(required.node_selector_terms) if required else [], request.products
                    )
                ),
            ),
            pod_affinity=affinity.pod_affinity,
            pod_anti_affinity=affinity.pod_anti_affinity,
        )
    return pod
