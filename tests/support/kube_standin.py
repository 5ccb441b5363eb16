"""A stand-in for the Kubernetes API server: serves Node and Pod lists as the API does.

Real HTTP (tornado, on a free port) and the real JSON shapes of ``GET /api/v1/nodes``,
``GET /api/v1/pods`` and ``GET /api/v1/namespaces/<ns>/pods``: ``NodeList`` /
``PodList`` envelopes, ``limit`` / ``continue`` paging, the ``status.phase`` and
``spec.nodeName`` field selectors and equality label selectors the API server
implements, and ``Status`` errors. It counts requests so that tests can see caching.
Objects are built with tests/support/kube_objects.py. A ``kubelet`` (optional) runs the
containers of scheduled pods, for end-to-end tests with real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from tornado.httpserver import HTTPServer
from tornado.iostream import StreamClosedError
from tornado.web import Application, RequestHandler

from tests.support.kube_objects import CREATED


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


# --- a scheduler just good enough for notebook pods -----------------------------------


def _gpu_asks(pod_obj: Mapping[str, Any]) -> Counter[str]:
    asks: Counter[str] = Counter()
    for c in pod_obj["spec"].get("containers") or []:
        resources = c.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in merged.items():
            if name.startswith("nvidia.com/"):
                asks[name] += int(value)
    return asks


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


class _Unsupported(Exception):
    """A field selector on a field the API server does not index for this kind."""


class _Base(RequestHandler):
    kind = ""
    fields: tuple[str, ...] = ()

    def initialize(self, standin: KubeStandin) -> None:
        self.standin = standin

    def _status(self, code: int, reason: str, message: str) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code,
        }))

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
        if self.standin.fail_with is not None:
            code, message = self.standin.fail_with
            self._status(code, "Forbidden" if code == 403 else "InternalError", message)
            return
        if self.get_argument("watch", "") in ("1", "true", "True"):
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
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"kind": self.kind, "apiVersion": "v1", "metadata": meta,
                                "items": page}))

    async def _watch(self, namespace: str | None) -> None:
        """Stream changes after ``resourceVersion`` as JSON lines until ``timeoutSeconds``
        (or the stand-in stops), like the API server's watch."""
        seen = int(self.get_argument("resourceVersion", "0") or 0)
        timeout = float(self.get_argument("timeoutSeconds", "30") or 30)
        deadline = asyncio.get_running_loop().time() + timeout
        self.set_header("Content-Type", "application/json")
        with contextlib.suppress(StreamClosedError):  # the client hung up: watch over
            await self._stream(namespace, seen, deadline)

    async def _stream(self, namespace: str | None, seen: int, deadline: float) -> None:
        while not self.standin.stopping:
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
    fields = ("metadata.name", "spec.unschedulable")

    def items(self, namespace: str | None) -> list[dict]:
        return list(self.standin.nodes)


class _Pods(_Base):
    kind = "PodList"
    fields = ("metadata.name", "metadata.namespace", "spec.nodeName", "status.phase")

    def items(self, namespace: str | None) -> list[dict]:
        return [p for p in self.standin.pods
                if namespace is None or p["metadata"]["namespace"] == namespace]

    def post(self, namespace: str | None = None) -> None:
        self.standin.hits[f"POST {self.request.path}"] += 1
        body = json.loads(self.request.body)
        name = body["metadata"]["name"]
        if any(p["metadata"]["name"] == name and p["metadata"]["namespace"] == namespace
               for p in self.standin.pods):
            self._status(409, "AlreadyExists", f'pods "{name}" already exists')
            return
        created = self.standin.create_pod(namespace or "default", body)
        self.set_status(201)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(created))


class _Pod(_Base):
    kind = "Pod"

    def _find(self, namespace: str, name: str) -> dict | None:
        return next((p for p in self.standin.pods if p["metadata"]["name"] == name
                     and p["metadata"]["namespace"] == namespace), None)

    async def get(self, namespace: str, name: str) -> None:  # type: ignore[override]
        self.standin.hits[self.request.path] += 1
        if self.standin.fail_with is not None:
            code, message = self.standin.fail_with
            self._status(code, "InternalError", message)
            return
        found = self._find(namespace, name)
        if found is None:
            self._status(404, "NotFound", f'pods "{name}" not found')
            return
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(found))

    def delete(self, namespace: str, name: str) -> None:
        self.standin.hits[f"DELETE {self.request.path}"] += 1
        self.standin.deletes.append((namespace, name, self.request.body and json.loads(
            self.request.body)))
        if self.standin.fail_with is not None:
            code, message = self.standin.fail_with
            self._status(code, "InternalError", message)
            return
        # DeleteOptions.preconditions.uid: the API server refuses when the pod is another.
        want = ((json.loads(self.request.body or b"{}") or {}).get("preconditions") or {}
                ).get("uid")
        found = self._find(namespace, name)
        if want and found is not None and found["metadata"].get("uid") != want:
            self._status(409, "Conflict", f"Precondition failed: UID in precondition: {want}")
            return
        gone = self.standin.delete_pod(namespace, name)
        if gone is None:
            self._status(404, "NotFound", f'pods "{name}" not found')
            return
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(gone))


class _Events(_Base):
    """No events: KubeSpawner lists and watches them for its progress messages."""

    kind = "EventList"
    fields = ("involvedObject.kind", "involvedObject.name", "involvedObject.namespace")

    def items(self, namespace: str | None) -> list[dict]:
        return []


class _NotFound(_Base):
    def get(self, *args: Any) -> None:  # type: ignore[override]
        self.standin.hits[self.request.path] += 1
        self._status(404, "NotFound", f"the server could not find the requested resource "
                     f"({self.request.path})")


class KubeStandin:
    """The stand-in server. ``nodes`` and ``pods`` are lists a test changes freely; pods
    created through the API are scheduled at once by a small scheduler that honours
    GPU requests, node selectors, required node affinity, taints and tolerations."""

    def __init__(
        self, nodes: Iterable[dict] = (), pods: Iterable[dict] = (), kubelet: Any = None
    ) -> None:
        self.kubelet = kubelet  # .run(pod) -> pod IP, .stop(pod); None: nothing runs
        self.nodes = list(nodes)
        self.pods = list(pods)
        self.hits: Counter[str] = Counter()
        self.requests: list[tuple[str, dict]] = []
        self.deletes: list[tuple[str, str, Any]] = []  # namespace, name, DeleteOptions
        self.fail_with: tuple[int, str] | None = None
        self.version = 100
        self.changes: list[tuple[int, str, str, dict]] = []
        self.changed = asyncio.Event()
        self.stopping = False
        self._server: HTTPServer | None = None
        self.url = ""

    def _record(self, kind: str, event: str, obj: dict) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.changes.append((self.version, kind, event, copy.deepcopy(obj)))
        self.changed.set()
        self.changed = asyncio.Event()

    def schedule(self, pod_obj: Mapping[str, Any]) -> str | None:
        """The first node (by name) the pod fits on, or ``None`` (it stays Pending)."""
        spec = pod_obj["spec"]
        asks = _gpu_asks(pod_obj)
        tolerations = spec.get("tolerations") or []
        terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution") or {}
                 ).get("nodeSelectorTerms") or []
        for n in sorted(self.nodes, key=lambda n: n["metadata"]["name"]):
            labels = n["metadata"].get("labels") or {}
            if n["spec"].get("unschedulable"):
                continue
            if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
                continue
            if terms and not any(
                all(_expression_holds(labels, e) for e in t.get("matchExpressions") or [])
                for t in terms
            ):
                continue
            if any(t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(
                    tolerations, t) for t in n["spec"].get("taints") or []):
                continue
            name = n["metadata"]["name"]
            used: Counter[str] = Counter()
            for other in self.pods:
                if other["spec"].get("nodeName") == name and other["status"].get(
                        "phase") not in ("Succeeded", "Failed"):
                    used.update(_gpu_asks(other))
            free = n["status"]["allocatable"]
            if all(int(free.get(r, 0)) - used[r] >= count for r, count in asks.items()):
                return name
        return None

    def create_pod(self, namespace: str, body: dict) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        meta.update(namespace=namespace, uid=f"uid-pod-{namespace}-{meta['name']}",
                    creationTimestamp=CREATED)
        node_name = self.schedule(obj)
        if node_name is None:
            obj["status"] = {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": f"0/{len(self.nodes)} nodes are available"}]}
        else:
            obj["spec"]["nodeName"] = node_name
            pod_ip = self.kubelet.run(obj) if self.kubelet else f"10.244.0.{len(self.pods) + 10}"
            obj["status"] = {
                "phase": "Running",
                "podIP": pod_ip,
                "containerStatuses": [
                    {"name": c["name"], "ready": True, "started": True, "restartCount": 0,
                     "image": c.get("image", ""),
                     "imageID": f"{c.get('image', '')}@sha256:{'0' * 64}",
                     "containerID": f"containerd://{'1' * 64}",
                     "state": {"running": {"startedAt": CREATED}}}
                    for c in obj["spec"]["containers"]
                ],
            }
        self.pods.append(obj)
        self._record("PodList", "ADDED", obj)
        return obj

    def delete_pod(self, namespace: str, name: str) -> dict | None:
        for i, p in enumerate(self.pods):
            if p["metadata"]["name"] == name and p["metadata"]["namespace"] == namespace:
                del self.pods[i]
                if self.kubelet and p["spec"].get("nodeName"):
                    self.kubelet.stop(p)
                self._record("PodList", "DELETED", p)
                return p
        return None

    def start(self) -> str:
        app = Application([
            (r"/api/v1/nodes", _Nodes, {"standin": self}),
            (r"/api/v1/pods", _Pods, {"standin": self}),
            (r"/api/v1/namespaces/([^/]+)/pods", _Pods, {"standin": self}),
            (r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", _Pod, {"standin": self}),
            (r"/api/v1/namespaces/([^/]+)/events", _Events, {"standin": self}),
            (r"/.*", _NotFound, {"standin": self}),
        ])
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
        return sum(n for path, n in self.hits.items() if path.startswith("/"))

