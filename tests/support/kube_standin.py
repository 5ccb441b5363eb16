"""A stand-in for the Kubernetes API server that behaves like one where it matters.

Real HTTP (tornado, on a free port) and the real JSON shapes: ``NodeList`` / ``PodList``
/ ``EventList`` envelopes, ``limit`` / ``continue`` paging, the field selectors the API
server indexes and equality label selectors, watches as JSON lines, ``Status`` errors.
Objects are built with tests/support/kube_objects.py. Like the API server and the
cluster behind it:

* **admission**: a created pod passes the API's OpenAPI schema and the API server's own
  rules (tests/support/kube_admission.py), else ``422 Invalid`` with its words;
* **RBAC** (``rbac``, optional): the documented Roles' rules; what they do not allow is
  answered with the API server's 403 body;
* **scheduling**: a pod is bound to the first node (by name) whose allocatable CPU,
  memory, pod count and extended resources still hold it and whose selectors, affinity
  and taints let it; else it stays ``Pending`` with a ``FailedScheduling`` Event in the
  scheduler's words, and is retried whenever a pod goes (or :meth:`retry_pending`);
* **graceful deletion**: a deleted pod on a node is ``Terminating`` (``deletionTimestamp``
  set, phase still ``Running``, its resources still used) until its containers stop,
  at most its grace period (``shutdown_seconds`` stands for how long they take);
* **DRA** (tests/support/kube_dra.py): ResourceSlices, DeviceClasses, claims made
  from a pod's ResourceClaimTemplates and allocated by the scheduler by their CEL
  selectors;
* **watch expiry**: :meth:`expire_watches` compacts the history; a watch from an older
  ``resourceVersion`` gets an ``ERROR`` event with ``410 Gone``, so clients relist.

It counts requests so that tests can see caching. A ``kubelet`` (optional) runs the
containers of scheduled pods, for end-to-end tests with real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from tornado.httpserver import HTTPServer
from tornado.iostream import StreamClosedError
from tornado.web import Application, RequestHandler

from tests.support import kube_admission
from tests.support.kube_admission import Invalid, Rule, forbidden, quantity
from tests.support.kube_dra import Dra, dra_routes
from tests.support.kube_objects import CREATED

MIG_CONFIG = "nvidia.com/mig.config"
MIG_STATE = "nvidia.com/mig.config.state"
#: Phases in which a pod holds nothing on its node.
DONE_PHASES = ("Succeeded", "Failed")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = (value or {}).get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def _selector_terms(text: str) -> list[tuple[str, str, str]]:
    terms = []
    for raw in filter(None, (t.strip() for t in text.split(","))):
        for op in ("!=", "==", "="):
            if op in raw:
                key, value = raw.split(op, 1)
                terms.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
                break
        else:
            terms.append((raw, "exists", ""))
    return terms


def _matches(actual: str | None, op: str, value: str) -> bool:
    if op == "exists":
        return actual is not None
    if op == "=":
        return actual == value
    return actual != value


def _expression_holds(labels: Mapping[str, str], expr: Mapping[str, Any]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise ValueError(f"operator {op} not supported by the stand-in")


def _tolerated(tolerations: list[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _container_asks(container: Mapping[str, Any]) -> dict[str, Decimal]:
    """What one container requests; a limit without a request is the request (the API
    server's defaulting)."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: quantity(value) for name, value in merged.items()}


def pod_asks(pod_obj: Mapping[str, Any]) -> Counter:
    """The pod's effective requests (containers add up, the largest init container
    counts alone) and one of the node's ``pods``."""
    spec = pod_obj["spec"]
    running: Counter = Counter()
    for c in spec.get("containers") or []:
        running.update(_container_asks(c))
    for c in spec.get("initContainers") or []:
        for name, value in _container_asks(c).items():
            running[name] = max(running[name], value)
    running["pods"] = Decimal(1)
    return running


class _Unsupported(Exception):
    """A field selector on a field the API server does not index for this kind."""


class _Base(RequestHandler):
    kind = ""
    resource = ""  # the RBAC resource ("pods", "nodes" ...)
    group = ""  # the RBAC API group ("" is the core group)
    namespaced = True
    fields: tuple[str, ...] = ()

    def initialize(self, standin: KubeStandin) -> None:
        self.standin = standin

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        })

    def _send(self, code: int, body: Any) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def _refused(self, verb: str, namespace: str | None, name: str = "") -> bool:
        """Answer (and return True) when the request is not to be served: the test's
        ``fail_with``, or RBAC."""
        if self.standin.fail_with is not None:
            code, message = self.standin.fail_with
            self._status(code, "Forbidden" if code == 403 else "InternalError", message)
            return True
        denied = self.standin.authorize(verb, self.group, self.resource,
                                        namespace if self.namespaced else None, name)
        if denied is not None:
            self._send(403, denied)
            return True
        return False

    def items(self, namespace: str | None) -> list[dict]:
        raise NotImplementedError

    def _selected(self, items: list[dict]) -> list[dict]:
        """Apply ``fieldSelector`` and ``labelSelector`` as the API server does; a field it
        does not index raises :class:`_Unsupported` (HTTP 400)."""
        for key, op, value in _selector_terms(self.get_argument("fieldSelector", "")):
            if key not in self.fields:
                raise _Unsupported(key)
            items = [i for i in items if _matches(_field(i, key), op, value)]
        for key, op, value in _selector_terms(self.get_argument("labelSelector", "")):
            items = [i for i in items
                     if _matches((i["metadata"].get("labels") or {}).get(key), op, value)]
        return items

    async def get(self, namespace: str | None = None) -> None:
        self.standin.hits[self.request.path] += 1
        self.standin.requests.append((self.request.path, dict(self.request.query_arguments)))
        watching = self.get_argument("watch", "") in ("1", "true", "True")
        if self._refused("watch" if watching else "list", namespace):
            return
        if watching:
            await self._watch(namespace)
            return
        try:
            items = self._selected(self.items(namespace))
        except _Unsupported as e:
            self._status(400, "BadRequest", f"field label not supported: {e}")
            return
        start = int(self.get_argument("continue", "0") or 0)
        limit = int(self.get_argument("limit", "0") or 0)
        page = items[start : start + limit] if limit else items[start:]
        meta: dict[str, Any] = {"resourceVersion": str(self.standin.version)}
        if limit and start + limit < len(items):
            meta["continue"] = str(start + limit)
            meta["remainingItemCount"] = len(items) - start - limit
        self._send(200, {"kind": self.kind, "apiVersion": self.api_version, "metadata": meta,
                         "items": page})

    api_version = "v1"

    async def _watch(self, namespace: str | None) -> None:
        """Stream changes after ``resourceVersion`` as JSON lines until ``timeoutSeconds``
        (or the stand-in stops), like the API server's watch; a version older than the
        kept history gets ``410 Gone``."""
        seen = int(self.get_argument("resourceVersion", "0") or 0)
        timeout = float(self.get_argument("timeoutSeconds", "30") or 30)
        deadline = asyncio.get_running_loop().time() + timeout
        self.set_header("Content-Type", "application/json")
        with contextlib.suppress(StreamClosedError):  # the client hung up: watch over
            if seen and seen < self.standin.oldest:
                self._expired(seen)
                return
            await self._stream(namespace, seen, deadline)

    def _expired(self, seen: int) -> None:
        self.write(json.dumps({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f"too old resource version: {seen} ({self.standin.oldest})",
            "reason": "Expired", "code": 410}}) + "\n")
        self.finish()

    async def _stream(self, namespace: str | None, seen: int, deadline: float) -> None:
        epoch = self.standin.epoch
        while not self.standin.stopping:
            if self.standin.epoch != epoch:
                self._expired(seen)
                return
            for version, kind, event, obj in self.standin.changes:
                if version <= seen or kind != self.kind:
                    continue
                seen = version
                if namespace and obj["metadata"].get("namespace") != namespace:
                    continue
                if not self._selected([obj]):
                    continue
                self.write(json.dumps({"type": event, "object": obj}) + "\n")
            await self.flush()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            waiter = self.standin.changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter.wait(), min(left, 0.5))
        self.finish()


class _Nodes(_Base):
    kind = "NodeList"
    resource = "nodes"
    namespaced = False
    fields = ("metadata.name", "spec.unschedulable")

    def items(self, namespace: str | None) -> list[dict]:
        return list(self.standin.nodes)


class _Pods(_Base):
    kind = "PodList"
    resource = "pods"
    fields = ("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase")

    def items(self, namespace: str | None) -> list[dict]:
        return [p for p in self.standin.pods
                if namespace is None or p["metadata"]["namespace"] == namespace]

    def post(self, namespace: str | None = None) -> None:
        self.standin.hits[f"POST {self.request.path}"] += 1
        if self._refused("create", namespace):
            return
        body = json.loads(self.request.body)
        name = body["metadata"]["name"]
        try:
            kube_admission.validate(body, "v1", "Pod")
        except Invalid as e:
            self.standin.refused.append(e)
            self._send(422, e.status())
            return
        if any(p["metadata"]["name"] == name and p["metadata"]["namespace"] == namespace
               for p in self.standin.pods):
            self._status(409, "AlreadyExists", f'pods "{name}" already exists')
            return
        self._send(201, self.standin.create_pod(namespace or "default", body))


class _Pod(_Base):
    kind = "Pod"
    resource = "pods"

    def _find(self, namespace: str, name: str) -> dict | None:
        return self.standin.find_pod(namespace, name)

    async def get(self, namespace: str, name: str) -> None:  # type: ignore[override]
        self.standin.hits[self.request.path] += 1
        if self._refused("get", namespace, name):
            return
        found = self._find(namespace, name)
        if found is None:
            self._status(404, "NotFound", f'pods "{name}" not found')
            return
        self._send(200, found)

    def delete(self, namespace: str, name: str) -> None:
        self.standin.hits[f"DELETE {self.request.path}"] += 1
        options = json.loads(self.request.body or b"{}") or {}
        self.standin.deletes.append((namespace, name, self.request.body and options))
        if self._refused("delete", namespace, name):
            return
        # DeleteOptions.preconditions.uid: the API server refuses when the pod is another.
        want = (options.get("preconditions") or {}).get("uid")
        found = self._find(namespace, name)
        if want and found is not None and found["metadata"].get("uid") != want:
            self._status(409, "Conflict", f"Precondition failed: UID in precondition: {want}")
            return
        grace = options.get("gracePeriodSeconds", self.get_argument("gracePeriodSeconds", None))
        gone = self.standin.terminate_pod(namespace, name,
                                          None if grace is None else int(grace))
        if gone is None:
            self._status(404, "NotFound", f'pods "{name}" not found')
            return
        self._send(200, gone)


class _Node(_Base):
    """One Node: read it, or patch its labels (a merge patch, as ``kubectl label`` and
    the Python client's ``patch_node`` send one); a new ``nvidia.com/mig.config`` goes to
    the stand-in's MIG Manager."""

    kind = "Node"
    resource = "nodes"
    namespaced = False

    async def get(self, name: str) -> None:  # type: ignore[override]
        self.standin.hits[self.request.path] += 1
        if self._refused("get", None, name):
            return
        found = self.standin.find_node(name)
        if found is None:
            self._status(404, "NotFound", f'nodes "{name}" not found')
            return
        self._send(200, found)

    def patch(self, name: str) -> None:
        self.standin.hits[f"PATCH {self.request.path}"] += 1
        if self._refused("patch", None, name):
            return
        found = self.standin.find_node(name)
        if found is None:
            self._status(404, "NotFound", f'nodes "{name}" not found')
            return
        body = json.loads(self.request.body or b"{}")
        labels = ((body.get("metadata") or {}).get("labels") or {}) if isinstance(
            body, dict) else {}
        self._send(200, self.standin.label_node(found, labels))


class _Events(_Base):
    """Events (core/v1), as KubeSpawner lists and watches them for its progress."""

    kind = "EventList"
    resource = "events"
    fields = ("involvedObject.kind", "involvedObject.name", "involvedObject.namespace",
              "involvedObject.uid", "reason", "type")

    def items(self, namespace: str | None) -> list[dict]:
        return [e for e in self.standin.events
                if namespace is None or e["metadata"]["namespace"] == namespace]


class _NotFound(_Base):
    def get(self, *args: Any) -> None:  # type: ignore[override]
        self.standin.hits[self.request.path] += 1
        self._status(404, "NotFound", f"the server could not find the requested resource "
                     f"({self.request.path})")


class KubeStandin:
    """The stand-in server. ``nodes`` and ``pods`` are lists a test changes freely
    (after changing nodes, :meth:`retry_pending` lets the scheduler look again).
    ``rbac``: the rules the hub's service account has (None: everything allowed)."""

    def __init__(
        self, nodes: Iterable[dict] = (), pods: Iterable[dict] = (), kubelet: Any = None,
        *, rbac: Iterable[Rule] | None = None, shutdown_seconds: float = 0.2,
    ) -> None:
        self.kubelet = kubelet  # .run(pod) -> pod IP, .stop(pod); None: nothing runs
        self.nodes = list(nodes)
        self.pods = list(pods)
        self.events: list[dict] = []
        self.dra = Dra()  # ResourceSlices, DeviceClasses, claims and their templates
        self.rbac = None if rbac is None else list(rbac)
        # How long a deleted pod's containers take to stop (capped by its grace period).
        self.shutdown_seconds = shutdown_seconds
        self.hits: Counter[str] = Counter()
        self.requests: list[tuple[str, dict]] = []
        self.deletes: list[tuple[str, str, Any]] = []  # namespace, name, DeleteOptions
        self.refused: list[Invalid] = []  # what admission refused
        self.fail_with: tuple[int, str] | None = None
        # MIG Manager: mig-parted config name -> MIG devices per GPU by profile, and how
        # long a re-cut takes; what it was asked to do, in order.
        self.mig_configs: dict[str, dict[str, int]] = {}
        self.mig_manager_seconds = 0.2
        self.mig_manager_runs: list[tuple[str, str]] = []
        self.version = 100
        self.oldest = 0  # watches from an older resourceVersion get 410 Gone
        self.epoch = 0  # bumped by expire_watches: open watches end with 410
        self.changes: list[tuple[int, str, str, dict]] = []
        self.changed = asyncio.Event()
        self.stopping = False
        self._server: HTTPServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    # --- the API's bookkeeping --------------------------------------------------------

    def _record(self, kind: str, event: str, obj: dict) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.changes.append((self.version, kind, event, copy.deepcopy(obj)))
        self.changed.set()
        self.changed = asyncio.Event()

    def authorize(self, verb: str, group: str, resource: str, namespace: str | None,
                  name: str = "") -> dict | None:
        """``None`` when RBAC allows the request, else the API server's 403 body."""
        if self.rbac is None or any(r.allows(verb, group, resource, namespace)
                                    for r in self.rbac):
            return None
        return forbidden(verb, group, resource, namespace, name)

    def expire_watches(self) -> None:
        """Compact the history: open watches end with ``410 Gone``, and so does every
        watch from a resourceVersion before now (clients must list again)."""
        self.oldest = self.version + 1
        self.changes.clear()
        self.epoch += 1
        self.changed.set()
        self.changed = asyncio.Event()

    def find_node(self, name: str) -> dict | None:
        return next((n for n in self.nodes if n["metadata"]["name"] == name), None)

    # --- NVIDIA's MIG Manager (GPU Operator), as far as a node's labels show it -------

    def label_node(self, found: dict, labels: Mapping[str, str | None]) -> dict:
        """Merge ``labels`` into the node's (None removes one). A changed
        ``nvidia.com/mig.config`` starts MIG Manager: ``nvidia.com/mig.config.state``
        goes ``pending`` and, ``mig_manager_seconds`` later, the node is re-cut to that
        config of ``mig_configs`` (its ``nvidia.com/mig-<profile>`` capacity and
        allocatable become the config's counts per GPU times ``nvidia.com/gpu.count``)
        and the state ``success``; ``failed`` when the config is unknown or a pod on the
        node still holds a MIG device (MIG Manager cannot re-cut a GPU in use)."""
        mine = found["metadata"].setdefault("labels", {})
        before = mine.get(MIG_CONFIG)
        for key, value in labels.items():
            if value is None:
                mine.pop(key, None)
            else:
                mine[key] = value
        if mine.get(MIG_CONFIG) != before and mine.get(MIG_CONFIG) is not None:
            mine[MIG_STATE] = "pending"
            assert self._loop is not None
            self._loop.call_later(self.mig_manager_seconds, self._recut,
                                  found["metadata"]["name"], mine[MIG_CONFIG])
        self._record("NodeList", "MODIFIED", found)
        return found

    def _recut(self, name: str, config: str) -> None:
        found = self.find_node(name)
        if found is None or found["metadata"]["labels"].get(MIG_CONFIG) != config:
            return  # relabelled meanwhile: the newer config's turn
        labels = found["metadata"]["labels"]
        busy = [p for p in self.pods if (p.get("spec") or {}).get("nodeName") == name
                and (p.get("status") or {}).get("phase") not in DONE_PHASES
                and any(r.startswith("nvidia.com/mig-") for r in pod_asks(p))]
        self.mig_manager_runs.append((name, config))
        if config not in self.mig_configs or busy:
            labels[MIG_STATE] = "failed"
        else:
            gpus = int(labels.get("nvidia.com/gpu.count", "1"))
            for part in ("capacity", "allocatable"):
                held = found["status"][part]
                for key in [k for k in held if k.startswith("nvidia.com/mig-")]:
                    del held[key]
                for profile, count in self.mig_configs[config].items():
                    held[f"nvidia.com/mig-{profile}"] = str(count * gpus)
            labels[MIG_STATE] = "success"
        self._record("NodeList", "MODIFIED", found)
        self.retry_pending()

    def find_pod(self, namespace: str, name: str) -> dict | None:
        return next((p for p in self.pods if p["metadata"]["name"] == name
                     and p["metadata"]["namespace"] == namespace), None)

    def event(self, pod_obj: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Record an Event about the pod, as the scheduler or the kubelet posts it."""
        meta = pod_obj["metadata"]
        self.events.append({
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                         "namespace": meta["namespace"], "uid": str(uuid.uuid4()),
                         "creationTimestamp": _now()},
            "involvedObject": {"kind": "Pod", "namespace": meta["namespace"],
                               "name": meta["name"], "uid": meta.get("uid"),
                               "apiVersion": "v1"},
            "reason": reason, "message": message, "type": kind,
            "source": {"component": "default-scheduler"},
            "reportingComponent": "default-scheduler", "reportingInstance": "",
            "firstTimestamp": None, "lastTimestamp": None,
            "eventTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "count": 1, "action": "Scheduling",
        })
        self._record("EventList", "ADDED", self.events[-1])

    # --- the scheduler --------------------------------------------------------------

    def _misfit(self, pod_obj: Mapping[str, Any], n: Mapping[str, Any]) -> list[str]:
        """Why the pod does not fit on node ``n`` (the scheduler's words), or []: its
        filters in their order, the first that fails tells."""
        spec = pod_obj["spec"]
        labels = n["metadata"].get("labels") or {}
        if n["spec"].get("unschedulable"):
            return ["node(s) were unschedulable"]
        for t in n["spec"].get("taints") or []:
            if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(
                    spec.get("tolerations") or [], t):
                return [f"node(s) had untolerated taint {{{t['key']}: {t.get('value', '')}}}"]
        terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}
                 ).get("nodeSelectorTerms") or []
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()) or (
            terms and not any(
                all(_expression_holds(labels, e) for e in t.get("matchExpressions") or [])
                for t in terms)):
            return ["node(s) didn't match Pod's node affinity/selector"]
        name = n["metadata"]["name"]
        used: Counter = Counter()
        for other in self.pods:
            if other is not pod_obj and other["spec"].get("nodeName") == name and other[
                    "status"].get("phase") not in DONE_PHASES:
                used.update(pod_asks(other))
        free = n["status"]["allocatable"]
        short = sorted(
            "Too many pods" if r == "pods" else f"Insufficient {r}"
            for r, count in pod_asks(pod_obj).items()
            if count and quantity(free.get(r, 0)) - used[r] < count
        )
        if not short and spec.get("resourceClaims") and self.dra.plan(pod_obj, name) is None:
            return ["cannot allocate all claims"]
        return short

    def schedule(self, pod_obj: Mapping[str, Any]) -> tuple[str | None, str]:
        """The first node (by name) the pod fits on, or ``None`` and the scheduler's
        FailedScheduling message."""
        reasons: Counter[str] = Counter()
        helpless = 0
        for n in sorted(self.nodes, key=lambda n: n["metadata"]["name"]):
            why = self._misfit(pod_obj, n)
            if not why:
                return n["metadata"]["name"], ""
            reasons.update(why)
            helpless += not all(w.startswith(("Insufficient", "Too many", "cannot allocate"))
                                for w in why)
        total = len(self.nodes)
        histogram = ", ".join(f"{count} {why}" for why, count in sorted(reasons.items()))
        preemption = ", ".join(part for part in (
            f"{total - helpless} No preemption victims found for incoming pod"
            if total - helpless else "",
            f"{helpless} Preemption is not helpful for scheduling" if helpless else "",
        ) if part)
        return None, (f"0/{total} nodes are available: {histogram}. preemption: 0/{total} "
                      f"nodes are available: {preemption}.")

    def _bind(self, obj: dict, node_name: str) -> None:
        if obj["spec"].get("resourceClaims"):
            self.dra.allocate(obj, self.dra.plan(obj, node_name) or [], node_name)
        obj["spec"]["nodeName"] = node_name
        pod_ip = self.kubelet.run(obj) if self.kubelet else f"10.244.0.{len(self.pods) + 10}"
        obj["status"] = {
            **{k: v for k, v in obj["status"].items() if k == "resourceClaimStatuses"},
            "phase": "Running",
            "podIP": pod_ip,
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {"name": c["name"], "ready": True, "started": True, "restartCount": 0,
                 "image": c.get("image", ""),
                 "imageID": f"{c.get('image', '')}@sha256:{'0' * 64}",
                 "containerID": f"containerd://{'1' * 64}",
                 "state": {"running": {"startedAt": CREATED}}}
                for c in obj["spec"]["containers"]
            ],
        }
        meta = obj["metadata"]
        self.event(obj, "Normal", "Scheduled",
                   f"Successfully assigned {meta['namespace']}/{meta['name']} to {node_name}")

    def create_pod(self, namespace: str, body: dict) -> dict:
        """Store a new pod and schedule it (Pending with an Event when nothing fits)."""
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        meta.update(namespace=namespace, uid=f"uid-pod-{namespace}-{meta['name']}",
                    creationTimestamp=CREATED)
        self.pods.append(obj)
        obj["status"] = {"phase": "Pending"}
        self.dra.make_claims(obj)
        node_name, why = self.schedule(obj)
        if node_name is None:
            self._unschedulable(obj, why)
        else:
            self._bind(obj, node_name)
        self._record("PodList", "ADDED", obj)
        return obj

    def _unschedulable(self, obj: dict, why: str) -> None:
        obj["status"] = {**{k: v for k, v in obj["status"].items()
                            if k == "resourceClaimStatuses"},
                         "phase": "Pending", "qosClass": "BestEffort", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": why, "lastTransitionTime": _now()}]}
        self.event(obj, "Warning", "FailedScheduling", why)

    def retry_pending(self) -> None:
        """Let the scheduler try every Pending pod again (oldest first), as it does when
        a pod goes or a node changes."""
        for obj in list(self.pods):
            if obj["spec"].get("nodeName") or obj["metadata"].get("deletionTimestamp"):
                continue
            node_name, why = self.schedule(obj)
            if node_name is None:
                if obj["status"].get("conditions", [{}])[0].get("message") != why:
                    self._unschedulable(obj, why)
                    self._record("PodList", "MODIFIED", obj)
                continue
            self._bind(obj, node_name)
            self._record("PodList", "MODIFIED", obj)

    # --- deletion -------------------------------------------------------------------

    def terminate_pod(self, namespace: str, name: str, grace: int | None) -> dict | None:
        """Delete gracefully: a pod on a node is Terminating until its containers stop
        (``shutdown_seconds``, at most ``grace``); one on no node, or with ``grace`` 0,
        goes at once. Returns the pod (``None``: there is none)."""
        p = self.find_pod(namespace, name)
        if p is None:
            return None
        if grace is None:
            grace = int(p["spec"].get("terminationGracePeriodSeconds", 30))
        meta = p["metadata"]
        if not p["spec"].get("nodeName") or grace == 0 or self._loop is None:
            meta.setdefault("deletionTimestamp", _now())
            self.delete_pod(namespace, name)
            return p
        if meta.get("deletionTimestamp"):
            return p  # already on its way
        meta["deletionTimestamp"] = _now()
        meta["deletionGracePeriodSeconds"] = grace
        self._record("PodList", "MODIFIED", p)
        if self.kubelet:
            self.kubelet.stop(p)  # SIGTERM now, as the kubelet does
        self._loop.call_later(min(grace, self.shutdown_seconds), self._gone,
                              namespace, name, meta["uid"])
        return copy.deepcopy(p)

    def _gone(self, namespace: str, name: str, uid: str) -> None:
        p = self.find_pod(namespace, name)
        if p is not None and p["metadata"]["uid"] == uid:
            self.delete_pod(namespace, name)

    def delete_pod(self, namespace: str, name: str) -> dict | None:
        """Remove the pod at once (``kubectl delete --grace-period=0 --force``); the
        scheduler then looks at the Pending pods again."""
        for i, p in enumerate(self.pods):
            if p["metadata"]["name"] == name and p["metadata"]["namespace"] == namespace:
                del self.pods[i]
                self.dra.forget(p)
                if self.kubelet and p["spec"].get("nodeName") and not p["metadata"].get(
                        "deletionGracePeriodSeconds"):
                    self.kubelet.stop(p)
                self._record("PodList", "DELETED", p)
                self.retry_pending()
                return p
        return None

    # --- the server -----------------------------------------------------------------

    def routes(self) -> list[tuple[str, type, dict]]:
        return [
            (r"/api/v1/nodes", _Nodes, {"standin": self}),
            (r"/api/v1/nodes/([^/]+)", _Node, {"standin": self}),
            (r"/api/v1/pods", _Pods, {"standin": self}),
            (r"/api/v1/namespaces/([^/]+)/pods", _Pods, {"standin": self}),
            (r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", _Pod, {"standin": self}),
            (r"/api/v1/events", _Events, {"standin": self}),
            (r"/api/v1/namespaces/([^/]+)/events", _Events, {"standin": self}),
            *dra_routes(self),
        ]

    def start(self) -> str:
        """Serve on a free port (call it inside the event loop that is to serve)."""
        self._loop = asyncio.get_running_loop()
        app = Application([*self.routes(), (r"/.*", _NotFound, {"standin": self})])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        self._server = HTTPServer(app)
        self._server.add_sockets([sock])
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    def stop(self) -> None:
        self.stopping = True
        self.changed.set()
        if self._server is not None:
            self._server.stop()
            self._server = None

    def list_hits(self) -> int:
        """How many Node and Pod list requests (``GET``) the API served."""
        return sum(n for path, n in self.hits.items()
                   if path.startswith("/") and not path.endswith("/events"))
