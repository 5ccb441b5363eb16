"""Dynamic Resource Allocation (``resource.k8s.io/v1``) for the stand-in API server.

ResourceSlices (what a DRA driver publishes per node), DeviceClasses, and
ResourceClaimTemplates / ResourceClaims: a pod's claim made from a template when the
pod is created (as the resourceclaim controller does), allocated by the scheduler to
a device whose class and request CEL selectors hold (evaluated with ``cel-python``, as
the scheduler evaluates them) and whose counters (partitionable devices, dynamic MIG)
are not used up, and deleted with its pod. Builders for NVIDIA's DRA driver's objects
(``gpu.nvidia.com``, DeviceClass ``mig.nvidia.com``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

import celpy

DRIVER = "gpu.nvidia.com"
API = "/apis/resource.k8s.io/v1"
#: The DeviceClass the DRA driver's Helm chart installs for MIG devices.
MIG_CLASS = {
    "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
    "metadata": {"name": "mig.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": (
        "device.driver == 'gpu.nvidia.com' && "
        "device.attributes['gpu.nvidia.com'].type == 'mig'")}}]},
}


def mig_device(gpu: int, profile: str, start: int, product: str = "NVIDIA H200") -> dict:
    """One static MIG device as the driver publishes it (attributes as in its
    ``CommonAttributesMig``; capacity trimmed)."""
    return {
        "name": f"gpu-{gpu}-mig-{profile.replace('.', '')}-{start}",
        "attributes": {
            "type": {"string": "mig"},
            "profile": {"string": profile},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "parentUUID": {"string": f"GPU-{gpu:08d}-0000-0000-0000-000000000000"},
            "uuid": {"string": f"MIG-{gpu:04d}{start:04d}-0000-0000-0000-000000000000"},
            "driverVersion": {"version": "580.82.7"},
            "cudaComputeCapability": {"version": "9.0.0"},
        },
        "capacity": {"multiprocessors": {"value": "16"}, "memory": {"value": "17179869184"}},
    }


def resource_slice(node_name: str, devices: Iterable[dict], *,
                   shared_counters: Iterable[dict] = ()) -> dict:
    """A node's ResourceSlice of the NVIDIA DRA driver."""
    spec: dict[str, Any] = {
        "driver": DRIVER, "nodeName": node_name,
        "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
        "devices": list(devices),
    }
    if shared_counters:
        spec["sharedCounters"] = list(shared_counters)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node_name}-{DRIVER}-abcde", "uid": f"uid-rs-{node_name}"},
            "spec": spec}


def _cel_device(driver: str, device: Mapping[str, Any]) -> Any:
    """The ``device`` variable of DRA's CEL: attributes and capacity by domain (an
    unqualified name is in the driver's domain)."""
    attributes: dict[str, dict] = {}
    for name, value in (device.get("attributes") or {}).items():
        domain, _, short = name.rpartition("/")
        attributes.setdefault(domain or driver, {})[short] = next(iter(value.values()))
    return celpy.json_to_cel({"driver": driver, "attributes": attributes})


def selects(expressions: Iterable[str], driver: str, device: Mapping[str, Any]) -> bool:
    """Whether every CEL expression holds for the device (a missing attribute: no)."""
    env = celpy.Environment()
    variables = {"device": _cel_device(driver, device)}
    for expression in expressions:
        result = env.program(env.compile(expression)).evaluate(variables)
        if not isinstance(result, celpy.celtypes.BoolType) or not result:
            return False
    return True


def _counters(entries: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for e in entries:
        for name, c in (e.get("counters") or {}).items():
            key = (e.get("name") or e.get("counterSet"), name)
            out[key] = out.get(key, 0) + int(str(c["value"]))
    return out


class Dra:
    """The DRA objects of one stand-in and the allocation the scheduler does."""

    def __init__(self) -> None:
        self.slices: list[dict] = []
        self.classes: list[dict] = [copy.deepcopy(MIG_CLASS)]
        self.templates: list[dict] = []
        self.claims: list[dict] = []

    def claims_of(self, pod: Mapping[str, Any]) -> list[dict]:
        uid = pod["metadata"].get("uid")
        return [c for c in self.claims if any(
            o.get("uid") == uid for o in c["metadata"].get("ownerReferences") or [])]

    def make_claims(self, pod: Mapping[str, Any]) -> None:
        """The pod's claims from its templates (the resourceclaim controller); a missing
        template makes none (the pod then cannot be scheduled)."""
        meta = pod["metadata"]
        statuses = []
        for ref in pod["spec"].get("resourceClaims") or []:
            template = next((t for t in self.templates
                             if t["metadata"]["name"] == ref.get("resourceClaimTemplateName")
                             and t["metadata"]["namespace"] == meta["namespace"]), None)
            if template is None:
                continue
            name = f"{meta['name']}-{ref['name']}-x7k2p"
            self.claims.append({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {
                    "name": name, "namespace": meta["namespace"], "uid": f"uid-claim-{name}",
                    "annotations": {"resource.kubernetes.io/pod-claim-name": ref["name"]},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                         "uid": meta["uid"], "controller": True,
                                         "blockOwnerDeletion": True}],
                },
                "spec": copy.deepcopy(template["spec"]["spec"]),
                "status": {},
            })
            statuses.append({"name": ref["name"], "resourceClaimName": name})
        pod.setdefault("status", {})["resourceClaimStatuses"] = statuses

    def _taken(self) -> set[tuple[str, str, str]]:
        return {(r["driver"], r["pool"], r["device"]) for c in self.claims
                for r in (((c.get("status") or {}).get("allocation") or {}).get("devices")
                          or {}).get("results") or []}

    def plan(self, pod: Mapping[str, Any], node_name: str) -> list[tuple[dict, dict]] | None:
        """(claim, result) for each of the pod's claims on ``node_name``, or None when
        not all can be allocated there."""
        refs = pod["spec"].get("resourceClaims") or []
        claims = self.claims_of(pod)
        if len(claims) < len(refs):
            return None
        taken = self._taken()
        plan = []
        for claim in claims:
            if (claim.get("status") or {}).get("allocation"):
                continue
            for request in claim["spec"]["devices"]["requests"]:
                found = self._device(request, node_name, taken)
                if found is None:
                    return None
                taken.add((found["driver"], found["pool"], found["device"]))
                plan.append((claim, {"request": request["name"], **found}))
        return plan

    def _device(self, request: Mapping[str, Any], node_name: str,
                taken: set[tuple[str, str, str]]) -> dict | None:
        exactly = request["exactly"]
        cls = next((c for c in self.classes
                    if c["metadata"]["name"] == exactly["deviceClassName"]), None)
        if cls is None:
            return None
        expressions = [s["cel"]["expression"] for s in
                       [*(cls["spec"].get("selectors") or []), *(exactly.get("selectors") or [])]]
        for rs in self.slices:
            spec = rs["spec"]
            if spec.get("nodeName") != node_name:
                continue
            pool = spec["pool"]["name"]
            left = _counters(spec.get("sharedCounters") or [])
            for d in spec["devices"]:
                if (spec["driver"], pool, d["name"]) in taken:
                    for key, value in _counters(d.get("consumesCounters") or []).items():
                        left[key] -= value
            for d in spec["devices"]:
                if (spec["driver"], pool, d["name"]) in taken:
                    continue
                needs = _counters(d.get("consumesCounters") or [])
                if any(left.get(k, 0) < v for k, v in needs.items()):
                    continue
                if selects(expressions, spec["driver"], d):
                    return {"driver": spec["driver"], "pool": pool, "device": d["name"]}
        return None

    def allocate(self, pod: Mapping[str, Any], plan: list[tuple[dict, dict]],
                 node_name: str) -> None:
        meta = pod["metadata"]
        for claim, result in plan:
            claim["status"] = {
                "allocation": {
                    "devices": {"results": [result]},
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{
                        "key": "metadata.name", "operator": "In", "values": [node_name]}]}]},
                },
                "reservedFor": [{"resource": "pods", "name": meta["name"],
                                 "uid": meta["uid"]}],
            }

    def forget(self, pod: Mapping[str, Any]) -> None:
        """The pod went: its generated claims go too (owner references)."""
        for claim in self.claims_of(pod):
            self.claims.remove(claim)


def dra_routes(standin: Any) -> list[tuple[str, type, dict]]:
    """Handlers for the ``resource.k8s.io/v1`` objects of ``standin``."""
    from tests.support.kube_standin import _Base

    class _List(_Base):
        group = "resource.k8s.io"
        api_version = "resource.k8s.io/v1"
        fields = ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.driver")

        def items(self, namespace: str | None) -> list[dict]:
            return [o for o in self.objects()
                    if namespace is None or o["metadata"].get("namespace") == namespace]

        def objects(self) -> list[dict]:
            raise NotImplementedError

    class _Slices(_List):
        kind, resource, namespaced = "ResourceSliceList", "resourceslices", False

        def objects(self) -> list[dict]:
            return standin.dra.slices

    class _Classes(_List):
        kind, resource, namespaced = "DeviceClassList", "deviceclasses", False

        def objects(self) -> list[dict]:
            return standin.dra.classes

    class _Claims(_List):
        kind, resource = "ResourceClaimList", "resourceclaims"

        def objects(self) -> list[dict]:
            return standin.dra.claims

    class _Templates(_List):
        kind, resource = "ResourceClaimTemplateList", "resourceclaimtemplates"

        def objects(self) -> list[dict]:
            return standin.dra.templates

        def post(self, namespace: str) -> None:
            if self._refused("create", namespace):
                return
            body = json.loads(self.request.body)
            from tests.support import kube_admission

            try:
                kube_admission.validate(body, "resource.k8s.io/v1", "ResourceClaimTemplate")
            except kube_admission.Invalid as e:
                self._send(422, e.status())
                return
            body["metadata"]["namespace"] = namespace
            standin.dra.templates.append(body)
            self._send(201, body)

    class _Template(_Templates):
        kind = "ResourceClaimTemplate"

        async def get(self, namespace: str, name: str) -> None:  # type: ignore[override]
            if self._refused("get", namespace, name):
                return
            found = next((t for t in standin.dra.templates if t["metadata"]["name"] == name
                          and t["metadata"]["namespace"] == namespace), None)
            if found is None:
                self._status(404, "NotFound",
                             f'resourceclaimtemplates.resource.k8s.io "{name}" not found')
                return
            self._send(200, found)

    args = {"standin": standin}
    return [
        (f"{API}/resourceslices", _Slices, args),
        (f"{API}/deviceclasses", _Classes, args),
        (f"{API}/resourceclaims", _Claims, args),
        (f"{API}/namespaces/([^/]+)/resourceclaims", _Claims, args),
        (f"{API}/namespaces/([^/]+)/resourceclaimtemplates", _Templates, args),
        (f"{API}/namespaces/([^/]+)/resourceclaimtemplates/([^/]+)", _Template, args),
    ]
