"""A small Kubernetes REST client for the test cluster: plain API JSON in and out.

The tests, the cluster's agents (tests/support/kube_agents.py) and the cluster fixture
read and write objects as the API serves them, so that what a test checks is what the
API server stored (defaults, generated names, UIDs), not what a client library made of
it. The product itself talks through kubernetes_asyncio, as KubeSpawner does.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp


class ApiError(Exception):
    """The API server answered with an error Status."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body.get('message', body)}")
        self.status = status
        self.body = dict(body)

    @property
    def reason(self) -> str:
        return str(self.body.get("reason", ""))


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and who asks: a bearer token, checked against ``ca``."""

    server: str
    token: str
    ca: str = ""

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https:"):
            return False
        return ssl.create_default_context(cafile=self.ca) if self.ca else False


def path_of(obj: Mapping[str, Any], *, subresource: str = "") -> str:
    """The REST path of an object of a kind this suite uses."""
    kind = obj["kind"]
    api_version = obj["apiVersion"]
    meta = obj.get("metadata") or {}
    plural = PLURALS[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    namespace = meta.get("namespace")
    collection = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    name = meta.get("name")
    path = f"{collection}/{name}" if name else collection
    return f"{path}/{subresource}" if subresource else path


PLURALS = {
    "Namespace": "namespaces", "Node": "nodes", "Pod": "pods", "ServiceAccount":
    "serviceaccounts", "ConfigMap": "configmaps", "Event": "events",
    "Role": "roles", "ClusterRole": "clusterroles", "RoleBinding": "rolebindings",
    "ClusterRoleBinding": "clusterrolebindings", "ResourceSlice": "resourceslices",
    "DeviceClass": "deviceclasses", "ResourceClaim": "resourceclaims",
    "ResourceClaimTemplate": "resourceclaimtemplates", "Lease": "leases",
}


class Kube:
    """One connection to the API server (an aiohttp session): ``await kube.get(path)``.

    Create it inside the event loop that uses it; ``close()`` at the end.
    """

    def __init__(self, credentials: Credentials, *, timeout: float = 30) -> None:
        self.credentials = credentials
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {credentials.token}",
                     "Accept": "application/json"},
            connector=aiohttp.TCPConnector(ssl=credentials.ssl_context(), limit=50),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout),
        )
        self.timeout = timeout

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, method: str, path: str, body: Any = None, *,
                      params: Mapping[str, Any] | None = None,
                      content_type: str = "application/json") -> Any:
        """One request; the answer's JSON. Raises :class:`ApiError` on an error Status."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        query = {k: str(v).lower() if isinstance(v, bool) else str(v)
                 for k, v in (params or {}).items() if v is not None}
        async with self._session.request(
                method, self.credentials.server + path, data=data, params=query,
                headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
            text = await r.text()
            try:
                answer = json.loads(text) if text else {}
            except ValueError:
                answer = {"message": text[:500]}
            if r.status >= 400:
                raise ApiError(r.status, answer if isinstance(answer, dict) else {})
            return answer

    async def get(self, path: str, **params: Any) -> Any:
        return await self.request("GET", path, params=params)

    async def find(self, path: str) -> dict | None:
        """The object at ``path``, or ``None`` when there is none (404)."""
        try:
            return await self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def items(self, path: str, **params: Any) -> list[dict]:
        """Every item of a list, all pages."""
        out: list[dict] = []
        token = None
        while True:
            page = await self.get(path, limit=500, **({"continue": token} if token else {}),
                                  **params)
            out.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return out

    async def create(self, obj: Mapping[str, Any]) -> dict:
        meta = dict(obj.get("metadata") or {})
        collection = {**obj, "metadata": {k: v for k, v in meta.items() if k != "name"}}
        return await self.request("POST", path_of(collection), obj)

    async def apply(self, obj: Mapping[str, Any]) -> dict:
        """Create the object, or replace the one of that name (its version kept)."""
        try:
            return await self.create(obj)
        except ApiError as e:
            if e.status != 409:
                raise
        current = await self.get(path_of(obj))
        body = {**obj, "metadata": {**obj["metadata"],
                                    "resourceVersion": current["metadata"]["resourceVersion"]}}
        return await self.request("PUT", path_of(obj), body)

    async def patch(self, path: str, patch: Any, *, kind: str = "merge") -> dict:
        """A merge patch (``kind="strategic"``: a strategic merge patch; ``"json"``: a
        JSON patch, a list of operations)."""
        content = {"merge": "application/merge-patch+json",
                   "strategic": "application/strategic-merge-patch+json",
                   "json": "application/json-patch+json"}[kind]
        return await self.request("PATCH", path, patch, content_type=content)

    async def delete(self, path: str, body: Mapping[str, Any] | None = None,
                     **params: Any) -> dict | None:
        """Delete; ``None`` when there was nothing to delete (404)."""
        try:
            return await self.request("DELETE", path, body, params=params)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def watch(self, path: str, *, resource_version: str = "", timeout: float = 300,
                    bookmarks: bool = False, **params: Any) -> AsyncIterator[dict]:
        """The watch events of a collection (``{"type": ..., "object": ...}``) from
        ``resource_version`` on, until the server ends the watch."""
        query = {"watch": "true", "timeoutSeconds": str(max(1, round(timeout))),
                 **({"resourceVersion": resource_version} if resource_version else {}),
                 **({"allowWatchBookmarks": "true"} if bookmarks else {}),
                 **{k: str(v) for k, v in params.items() if v is not None}}
        async with self._session.get(
                self.credentials.server + path, params=query,
                timeout=aiohttp.ClientTimeout(total=timeout + 30, sock_read=timeout + 30)
        ) as r:
            if r.status >= 400:
                raise ApiError(r.status, json.loads(await r.text() or "{}"))
            async for line in r.content:
                if line.strip():
                    yield json.loads(line)

    async def watch_object(self, path: str, check: Any, *, timeout: float = 30) -> dict | None:
        """Read ``path`` (an object, ``None`` when gone) until ``check(obj)`` is true,
        waiting on a watch of that one object between reads; the object last read."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        parent, _, name = path.rpartition("/")
        while True:
            found = await self.find(path)
            if check(found):
                return found
            left = deadline - loop.time()
            if left <= 0:
                shown = (found or {}).get("status", found)
                raise TimeoutError(f"{path}: not reached in {timeout} s; last: "
                                   f"{json.dumps(shown)[:1500]}")
            version = (found or {}).get("metadata", {}).get("resourceVersion", "")
            try:
                async with asyncio.timeout(min(left, 5)):
                    async for event in self.watch(parent, resource_version=version,
                                                  fieldSelector=f"metadata.name={name}",
                                                  timeout=min(left, 5)):
                        if event.get("type") in ("MODIFIED", "DELETED", "ADDED", "ERROR"):
                            break
            except (TimeoutError, ApiError):
                pass
