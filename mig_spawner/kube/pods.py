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
from datetime import UTC, datetime, timedelta
from typing import Any

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


async def events_version(api: Any, namespace: str) -> str | None:
    """The namespace's Event list version now: a watch from it sees only later Events.
    Raises :class:`ClusterReadError` when the API cannot be read."""
    status, body = await _call(api.list_namespaced_event, "list events",
                               namespace=namespace, limit=1)
    if status != 200:
        raise _failed(f"listing events in {namespace}", status, body)
    return (body.get("metadata") or {}).get("resourceVersion")


async def scheduling_failures(api: Any, namespace: str, name: str, version: str | None,
                              timeout: float) -> AsyncIterator[str]:
    """The scheduler's ``FailedScheduling`` messages about pod ``name`` after
    ``version`` (:func:`events_version` before the pod was created, so that earlier pods
    of that name do not count), for up to ``timeout`` seconds.

    The scheduler reports the same failure again as one event series: the Event is
    updated (a MODIFIED change with a higher ``series.count``), not added again, and
    each repeat is said once more ("tried 2 times"). The watch is started again where
    it ended when the API server closes it or the connection drops, from the last
    version seen (bookmarks keep it current while nothing changes); a version the API
    server no longer has (410 Gone, after an etcd compaction) lists the Events again.
    """
    import aiohttp
    from kubernetes_asyncio import watch
    from kubernetes_asyncio.client.exceptions import ApiException

    selector = f"involvedObject.kind=Pod,involvedObject.name={name}"
    deadline = time.monotonic() + timeout
    said: dict[str, int] = {}  # event uid -> the repeat count said last
    relisted = False
    # A list after 410 shows earlier pods' Events too (same name): those made before
    # this wait began (a second's slack: timestamps are whole seconds) are not ours.
    since = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)

    def news(event: dict) -> str | None:
        if event.get("reason") != "FailedScheduling":
            return None
        uid = (event.get("metadata") or {}).get("uid", "")
        count = max(int((event.get("series") or {}).get("count") or 0),
                    int(event.get("count") or 0), 1)
        if said.get(uid, 0) >= count:
            return None
        said[uid] = count
        message = str(event.get("message", ""))
        return message if count == 1 else f"{message} (tried {count} times)"

    while (left := deadline - time.monotonic()) > 0:
        if relisted:
            relisted = False
            status, body = await _call(api.list_namespaced_event, "list events",
                                       namespace=namespace, field_selector=selector)
            if status != 200:
                raise _failed(f"listing events in {namespace}", status, body)
            version = (body.get("metadata") or {}).get("resourceVersion")
            for event in body.get("items") or []:
                made = (event.get("metadata") or {}).get("creationTimestamp") or ""
                if made and datetime.fromisoformat(made.replace("Z", "+00:00")) < since:
                    continue
                if (message := news(event)) is not None:
                    yield message
        stream = watch.Watch().stream(api.list_namespaced_event, namespace=namespace,
                                      field_selector=selector, resource_version=version,
                                      allow_watch_bookmarks=True,
                                      timeout_seconds=max(1, round(left)))
        try:
            async with stream:
                async for change in stream:
                    event = change.get("raw_object") or {}
                    version = (event.get("metadata") or {}).get("resourceVersion") or version
                    if change.get("type") in ("ADDED", "MODIFIED") and (
                            message := news(event)) is not None:
                        yield message
        except ApiException as e:
            if e.status != 410:
                raise
            relisted = True  # the version was compacted away: list again
        except (TimeoutError, aiohttp.ClientError):
            await asyncio.sleep(POLL)  # the connection dropped: watch again from version


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
