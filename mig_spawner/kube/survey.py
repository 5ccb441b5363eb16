"""What ``mig-spawner doctor --kube`` reads of a cluster, as the hub's own account.

Read-only: lists nodes, pods (or ResourceSlices and ResourceClaims), reads the API
server's version and the DeviceClass, and asks the API server what the account may do
(SelfSubjectAccessReview per permission the hub needs, and SelfSubjectRulesReview for
its rules in the hub's namespace; neither stores anything). The checks themselves are
pure (:mod:`mig_spawner.cli.doctor`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .__main__ import served as served_by_api
from .availability import ClusterAvailability, ClusterReadError
from .cluster import ClusterSlices
from .dra import DEVICE_CLASS
from .pods import _call


@dataclass(frozen=True)
class Permission:
    """One thing the hub's account must be allowed: a verb on a resource, in the hub's
    namespace (``namespaced``) or cluster-wide."""

    verb: str
    resource: str
    group: str = ""
    namespaced: bool = True
    why: str = ""

    def words(self, namespace: str) -> str:
        where = f"in namespace {namespace}" if self.namespaced else "in all namespaces"
        if self.resource == "nodes":
            where = "(cluster-wide)"
        group = f".{self.group}" if self.group else ""
        return f"{self.verb} {self.resource}{group} {where}"


#: What KubeSpawner and mig-spawner do with the API (docs/kubernetes.md, "RBAC").
NEEDED = (
    Permission("create", "pods", why="start servers"),
    Permission("get", "pods", why="follow and check servers"),
    Permission("list", "pods", why="follow servers"),
    Permission("watch", "pods", why="follow servers"),
    Permission("delete", "pods", why="stop servers"),
    Permission("list", "events", why="show why a pod waits"),
    Permission("watch", "events", why="show why a pod waits"),
    Permission("list", "nodes", namespaced=False, why="count free slices"),
    Permission("list", "pods", namespaced=False, why="count the slices pods hold"),
)
#: More with ``mig_resource_api = "dra"`` (docs/kubernetes.md, section 7).
NEEDED_DRA = (
    Permission("list", "resourceslices", "resource.k8s.io", namespaced=False,
               why="count free MIG devices"),
    Permission("list", "resourceclaims", "resource.k8s.io", namespaced=False,
               why="count allocated MIG devices"),
    Permission("get", "resourceclaimtemplates", "resource.k8s.io",
               why="find the claim template"),
    Permission("create", "resourceclaimtemplates", "resource.k8s.io",
               why="make the claim template"),
)


@dataclass(frozen=True)
class Survey:
    """One read of the cluster for the checks."""

    version: str
    namespace: str
    served: str  # "dra", "device-plugin" or "none" (dra.served_by)
    slices: ClusterSlices
    device_class: bool | None  # the DeviceClass is there (None: not asked: no DRA)
    denied: tuple[Permission, ...]
    rules: tuple[str, ...] = field(default_factory=tuple)  # SelfSubjectRulesReview, in words
    error: str = ""  # the cluster could not be read at all
    hint: str = ""


async def _allowed(auth: Any, p: Permission, namespace: str) -> bool:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {
                "verb": p.verb, "resource": p.resource, "group": p.group,
                **({"namespace": namespace} if p.namespaced else {})}}}
    status, answer = await _call(auth.create_self_subject_access_review,
                                 "review an access", body=body)
    if status not in (200, 201):
        raise ClusterReadError(f"SelfSubjectAccessReview failed: HTTP {status}: "
                               f"{answer.get('message', '')}")
    return bool((answer.get("status") or {}).get("allowed"))


async def _rules(auth: Any, namespace: str) -> tuple[str, ...]:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
            "spec": {"namespace": namespace}}
    status, answer = await _call(auth.create_self_subject_rules_review, "review rules",
                                 body=body)
    if status not in (200, 201):
        return ()
    out = []
    for rule in (answer.get("status") or {}).get("resourceRules") or []:
        resources = ",".join(rule.get("resources") or [])
        if resources.startswith("selfsubject"):
            continue
        out.append(f"{','.join(rule.get('verbs') or [])} {resources}")
    return tuple(out)


async def survey(core: Any, resource: Any, auth: Any, version_api: Any, *, namespace: str,
                 resource_api: str, strategy: str | None = None, node_selector: str = "",
                 tolerations: Iterable[Any] = ()) -> Survey:
    """Read the cluster as the hub would (``core``: ``CoreV1Api``, ``resource``:
    ``ResourceV1Api``, ``auth``: ``AuthorizationV1Api``, ``version_api``:
    ``VersionApi``). A read that fails at the start comes back as ``error``."""
    needed = NEEDED + (NEEDED_DRA if resource_api == "dra" else ())
    try:
        status, version = await _call(version_api.get_code, "read the version")
        availability = ClusterAvailability(
            core, ttl=0, strategy=strategy, node_selector=node_selector,
            tolerations=tolerations, resource_api=resource if resource_api == "dra" else None)
        allowed = await asyncio.gather(*(_allowed(auth, p, namespace) for p in needed))
        slices = await availability.slices()
    except ClusterReadError as e:
        return Survey("", namespace, "none", ClusterSlices(), None, (), (), str(e), e.hint)
    served = await served_by_api(core, resource, node_selector)
    device_class = None
    if resource_api == "dra" or served == "dra":
        code, answer = await _call(resource.read_device_class, "read the DeviceClass",
                                   name=DEVICE_CLASS)
        if code not in (200, 404):
            failed = (f"reading DeviceClass {DEVICE_CLASS} failed: HTTP {code}: "
                      f"{answer.get('message', '')}")
            return Survey("", namespace, served, slices, None, (), (), failed,
                          "the hub's ClusterRole in docs/kubernetes.md allows 'get' on "
                          "deviceclasses")
        device_class = code == 200
    return Survey(
        version=str(version.get("gitVersion", "")) if status == 200 else "",
        namespace=namespace, served=served, slices=slices, device_class=device_class,
        denied=tuple(p for p, ok in zip(needed, allowed, strict=True) if not ok),
        rules=await _rules(auth, namespace))
