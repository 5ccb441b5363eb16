"""One pod, read and deleted through the Kubernetes API: the holder of a Kubernetes lease.

``api`` is a ``kubernetes_asyncio.client.CoreV1Api`` (KubeSpawner's, or the slice
service's own). Raw responses (``_preload_content=False``), as
:mod:`mig_spawner.kube.availability` reads them: plain API JSON.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, ClassVar

from .availability import ClusterReadError

#: Seconds between reads while waiting for a deleted pod to go.
POLL = 0.2


def split_ref(ref: str) -> tuple[str, str]:
    """``namespace/name`` -> ``(namespace, name)`` (a bare name is in ``default``)."""
    namespace, _, name = ref.rpartition("/")
    return namespace or "default", name


async def _call(method: Any, what: str, **kwargs: Any) -> tuple[int, dict]:
    try:
        response = await method(_preload_content=False, **kwargs)
    except Exception as e:
        status = getattr(e, "status", None)  # ApiException: an HTTP answer after all
        if isinstance(status, int):
            body = getattr(e, "body", b"") or b""
            return status, _json(body)
        raise ClusterReadError(
            f"cannot {what} through the Kubernetes API: {type(e).__name__}: {e}",
            "check that the API server can be reached",
        ) from e
    return response.status, _json(await response.read())


def _json(body: bytes | str) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _failed(what: str, status: int, body: dict) -> ClusterReadError:
    hint = ("the service account needs 'get' and 'delete' on 'pods' "
            "(docs/kubernetes.md, 'RBAC')") if status == 403 else ""
    return ClusterReadError(f"{what} failed: HTTP {status}: {body.get('message', '')}", hint)


async def read_pod(api: Any, ref: str) -> dict | None:
    """The pod ``namespace/name`` as API JSON; ``None`` when there is none (404).
    Raises :class:`ClusterReadError` when the API cannot say."""
    namespace, name = split_ref(ref)
    status, body = await _call(api.read_namespaced_pod, f"read pod {ref}",
                               name=name, namespace=namespace)
    if status == 404:
        return None
    if status != 200:
        raise _failed(f"reading pod {ref}", status, body)
    return body


async def delete_pod(api: Any, ref: str, uid: str | None, grace: float, wait: float
                     ) -> dict | None:
    """Delete the pod gracefully (``grace`` seconds to SIGKILL) if it still has ``uid``
    (a precondition: a pod recreated under the name is left alone), then wait up to
    ``wait`` seconds for it to go. Returns what is still there under that name (``None``:
    nothing). Raises :class:`ClusterReadError` when the API cannot be read or refuses."""
    namespace, name = split_ref(ref)
    seconds = max(0, round(grace))
    options: dict[str, Any] = {"gracePeriodSeconds": seconds}
    if uid:
        options["preconditions"] = {"uid": uid}
    status, body = await _call(api.delete_namespaced_pod, f"delete pod {ref}", name=name,
                               namespace=namespace, body=options,
                               grace_period_seconds=seconds)
    # 409: the precondition failed, the pod of that name is another one.
    if status not in (200, 202, 404, 409):
        raise _failed(f"deleting pod {ref}", status, body)
    deadline = time.monotonic() + wait
    while True:
        pod = await read_pod(api, ref)
        if pod is None or (uid and pod_uid(pod) != uid) or time.monotonic() >= deadline:
            return pod
        await asyncio.sleep(POLL)


def pod_uid(pod: dict) -> str | None:
    """The pod's ``metadata.uid``."""
    return (pod.get("metadata") or {}).get("uid")


async def connect_api(host: str = "") -> Any:
    """A ``CoreV1Api`` configured as KubeSpawner does: in-cluster (service account),
    else ``~/.kube/config``; ``host`` overrides the API server's URL. Raises
    :class:`ClusterReadError` when neither gives a configuration."""
    # Imported here: kubernetes_asyncio comes with the ``kube`` extra only.
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            await config.load_kube_config(client_configuration=configuration)
        except Exception as e:
            raise ClusterReadError(
                f"no Kubernetes API configuration: {type(e).__name__}: {e}",
                "run in the cluster with a service account, or give a kubeconfig",
            ) from e
    if host:
        configuration.host = host
    return client.CoreV1Api(client.ApiClient(configuration))


#: Seconds the shared Events watch keeps going after its last follower left.
WATCH_LINGER = 5.0


class SchedulingEvents:
    """One watch of a namespace's ``FailedScheduling`` Events for every start under way
    there (:meth:`follow`), as KubeSpawner shares one pod reflector: a class starting
    at once costs the API server one watch, not one per server.

    The watch starts with the first follower and ends a few seconds after the last
    (:data:`WATCH_LINGER`). It is started again where it ended when the API server
    closes it or the connection drops, from the last version seen (bookmarks keep it
    current while nothing changes); a version the API server no longer has (410 Gone,
    after an etcd compaction: Events have no watch cache) lists the Events again.
    """

    _shared: ClassVar[dict[tuple[int, str], SchedulingEvents]] = {}
    SELECTOR = "involvedObject.kind=Pod,reason=FailedScheduling"

    def __init__(self, api: Any, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.followers: dict[str, set[asyncio.Queue]] = {}
        self.task: asyncio.Task | None = None

    @classmethod
    def of(cls, api: Any, namespace: str) -> SchedulingEvents:
        """The namespace's shared watch on ``api`` (made on first use)."""
        key = (id(api), namespace)
        found = cls._shared.get(key)
        if found is None or found.api is not api:
            found = cls._shared[key] = cls(api, namespace)
        return found

    async def follow(self, name: str, timeout: float) -> AsyncIterator[str]:
        """The messages about pod ``name`` from now on, for up to ``timeout`` seconds.

        A watch from now first lists what is there: Events made before this call (an
        earlier pod of that name's) are left out by their time. The scheduler reports
        the same failure again as one event series: the Event is updated (MODIFIED,
        a higher ``series.count``) and the repeat is said once more ("tried 2 times").
        """
        queue: asyncio.Queue[dict] = asyncio.Queue()
        self.followers.setdefault(name, set()).add(queue)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._watch())
        # Timestamps are whole seconds: a second's Events of an earlier pod can pass.
        since = datetime.now(UTC).replace(microsecond=0)
        said: dict[str, int] = {}  # event uid -> the repeat count said last
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    return
                if (message := _news(event, since, said)) is not None:
                    yield message
        finally:
            waiting = self.followers.get(name, set())
            waiting.discard(queue)
            if not waiting:
                self.followers.pop(name, None)

    def _deliver(self, event: dict) -> None:
        name = (event.get("involvedObject") or {}).get("name", "")
        for queue in self.followers.get(name, ()):
            queue.put_nowait(event)

    async def _watch(self) -> None:
        import aiohttp
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        version: str | None = None
        relist = False
        idle_since: float | None = None
        while True:
            if not self.followers:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= WATCH_LINGER:
                    return
            else:
                idle_since = None
            if relist:
                relist = False
                status, body = await _call(self.api.list_namespaced_event, "list events",
                                           namespace=self.namespace,
                                           field_selector=self.SELECTOR)
                if status != 200:
                    raise _failed(f"listing events in {self.namespace}", status, body)
                version = (body.get("metadata") or {}).get("resourceVersion")
                for event in body.get("items") or []:
                    self._deliver(event)
            stream = watch.Watch().stream(
                self.api.list_namespaced_event, namespace=self.namespace,
                field_selector=self.SELECTOR, resource_version=version,
                allow_watch_bookmarks=True, timeout_seconds=round(WATCH_LINGER) * 6)
            try:
                async with stream:
                    async for change in stream:
                        event = change.get("raw_object") or {}
                        version = (event.get("metadata") or {}).get(
                            "resourceVersion") or version
                        if change.get("type") in ("ADDED", "MODIFIED"):
                            self._deliver(event)
                        if not self.followers:
                            break  # linger outside the stream, then end or go on
            except ApiException as e:
                if e.status != 410:
                    raise
                relist = True  # the version was compacted away: list again
            except (TimeoutError, aiohttp.ClientError):
                await asyncio.sleep(POLL)  # the connection dropped: watch again
            if not self.followers:
                await asyncio.sleep(POLL)


def _news(event: dict, since: datetime, said: dict[str, int]) -> str | None:
    """The message of a FailedScheduling Event a follower has not said yet (with
    "(tried N times)" for a series' repeat), or ``None``."""
    made = (event.get("metadata") or {}).get("creationTimestamp") or ""
    if made and datetime.fromisoformat(made.replace("Z", "+00:00")) < since:
        return None
    uid = (event.get("metadata") or {}).get("uid", "")
    count = max(int((event.get("series") or {}).get("count") or 0),
                int(event.get("count") or 0), 1)
    if said.get(uid, 0) >= count:
        return None
    said[uid] = count
    message = str(event.get("message", ""))
    return message if count == 1 else f"{message} (tried {count} times)"


async def ensure_claim_template(resource_api: Any, template: dict) -> None:
    """Create the ResourceClaimTemplate ``template`` in its namespace unless one of that
    name is there (``resource_api``: a ``ResourceV1Api``). Raises
    :class:`ClusterReadError` when the API refuses."""
    meta = template["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    status, body = await _call(resource_api.read_namespaced_resource_claim_template,
                               f"read ResourceClaimTemplate {name}", name=name,
                               namespace=namespace)
    if status == 200:
        return
    if status == 404:
        status, body = await _call(resource_api.create_namespaced_resource_claim_template,
                                   f"create ResourceClaimTemplate {name}",
                                   namespace=namespace, body=template)
        if status in (200, 201, 409):  # 409: another spawn created it meanwhile
            return
    raise ClusterReadError(
        f"ResourceClaimTemplate {namespace}/{name}: HTTP {status}: {body.get('message', '')}",
        "the hub's service account needs 'get' and 'create' on 'resourceclaimtemplates' "
        "(API group resource.k8s.io) in its namespace (docs/kubernetes.md, 'RBAC')",
    )


async def claims_gone(resource_api: Any, namespace: str, pod_uid: str, wait: float) -> bool:
    """Wait up to ``wait`` seconds until no ResourceClaim in ``namespace`` that was
    made for the pod ``pod_uid`` (its owner) is left. The garbage collector removes a
    pod's generated claims only after the pod is gone, and until then the claim's
    device counts as allocated: the scheduler gives it to no other claim. Returns
    whether they are gone. Raises :class:`ClusterReadError` when the API cannot say."""
    deadline = time.monotonic() + wait
    while True:
        status, body = await _call(resource_api.list_namespaced_resource_claim,
                                   "list resourceclaims", namespace=namespace)
        if status != 200:
            raise _failed(f"listing resourceclaims in {namespace}", status, body)
        left = [c for c in body.get("items") or []
                if any(o.get("uid") == pod_uid
                       for o in (c.get("metadata") or {}).get("ownerReferences") or [])]
        if not left:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL)
