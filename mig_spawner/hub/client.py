"""Async client for the JupyterHub REST API and for single-user servers behind the proxy.

One :class:`HubClient` holds one tornado HTTP client, one concurrency limit and
one retry policy for every call the slice service makes:

- ``GET /hub/api/users?state=...``, paged with JupyterHub's pagination model
  (``Accept: application/jupyterhub-pagination+json``, follow ``_pagination.next``);
  the next page is requested while the current one is being consumed;
- ``DELETE /hub/api/users/<user>/server[s/<name>]`` to stop a server;
- ``GET <server>/api/kernels?no_track_activity=1``, ``<server>/api/status``
  (which Jupyter Server never counts as activity) and ``<server>/mig-spawner/activity``
  (what people did there, from mig-spawner's single-user extension), and
  ``DELETE <server>/api/kernels/<id>?no_track_activity=1``, with the service's token (it needs the
  ``access:servers`` scope), at the server's *internal* URL that the spawner
  recorded in the lease. Not through the proxy: configurable-http-proxy marks a
  route active on every request it forwards, and the hub copies that onto the
  server's ``last_activity``, so reads through it would keep idle servers alive.

5xx answers and connection errors are retried with exponential backoff;
other errors raise :class:`HubError` at once with the hub's own message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Collection
from typing import Any
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.iostream import StreamClosedError

from mig_spawner.hub.models import (
    HubServer,
    HubUser,
    Kernel,
    PeopleActivity,
    ServerStatus,
    kernel_from_model,
    people_activity_from_model,
    status_from_model,
    user_from_model,
)

PAGINATION_MEDIA_TYPE = "application/jupyterhub-pagination+json"

# Answers worth trying again: the hub (or the proxy in front of a server) is
# restarting, overloaded or briefly unable to reach its database.
RETRY_STATUS = frozenset({500, 502, 503, 504})


class HubError(Exception):
    """A call to the hub or to a single-user server failed.

    ``code`` is the HTTP status (599 for a connection error or timeout, as
    tornado reports them); the message names the request and what came back.
    """

    def __init__(self, method: str, url: str, code: int, reason: str) -> None:
        self.method = method
        self.url = url
        self.code = code
        self.reason = reason
        super().__init__(f"{method} {url} failed: {code} {reason}")


class HubUnavailable(HubError):
    """Retries were exhausted on 5xx answers or connection errors: try again later."""


def _reason(response: HTTPResponse) -> str:
    """The hub's own error message (``{"message": ...}``) or the HTTP reason."""
    try:
        return str(json.loads(response.body)["message"])
    except (ValueError, TypeError, KeyError):
        return response.reason or ""


class HubClient:
    """Talk to the JupyterHub REST API and to single-user servers through the proxy.

    ``api_url`` is the hub's API root (``JUPYTERHUB_API_URL``, e.g.
    ``http://127.0.0.1:8081/hub/api``). ``proxy_url`` is the public origin of
    the proxy (e.g. ``http://127.0.0.1:8000``), used for servers whose model has
    no ``full_url`` (the hub fills it only when ``JupyterHub.public_url`` is set).
    """

    def __init__(
        self,
        api_url: str,
        token: str,
        *,
        proxy_url: str | None = None,
        concurrency: int = 10,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        retries: int = 4,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        page_size: int = 0,
        log: logging.Logger | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        self.api_url = api_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/") if proxy_url else None
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.page_size = page_size
        self.log = log or logging.getLogger(__name__)
        self._headers = {"Authorization": f"token {token}"}
        self._timeouts = {"request_timeout": request_timeout, "connect_timeout": connect_timeout}
        self._semaphore = asyncio.Semaphore(concurrency)
        # Our own client instance: AsyncHTTPClient() is a per-loop singleton that
        # other code in the process (or a test) may configure differently.
        self._http = AsyncHTTPClient(force_instance=True, max_clients=concurrency)

    def close(self) -> None:
        """Close the HTTP client's connections."""
        self._http.close()

    async def request(
        self,
        method: str,
        url: str,
        *,
        accept: str | None = None,
        ok: Collection[int] = (),
        retries: int | None = None,
    ) -> HTTPResponse:
        """Make one API call with the concurrency limit, a timeout and retries.

        Codes below 400 and those in ``ok`` are returned; 5xx answers and
        connection errors are retried (``retries`` overrides the client's
        default) with exponential backoff, then raise :class:`HubUnavailable`;
        any other error raises :class:`HubError` at once.
        """
        headers = dict(self._headers)
        if accept:
            headers["Accept"] = accept
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            req = HTTPRequest(url, method=method, headers=headers, **self._timeouts)
            try:
                async with self._semaphore:
                    response = await self._http.fetch(req, raise_error=False)
            except (HTTPClientError, OSError, StreamClosedError) as e:
                # tornado raises for timeouts and refused/closed connections
                # even with raise_error=False.
                code = getattr(e, "code", 599)
                reason = str(e)
            else:
                if response.code < 400 or response.code in ok:
                    return response
                code, reason = response.code, _reason(response)
                if code not in RETRY_STATUS:
                    raise HubError(method, url, code, reason)
            if attempt + 1 < attempts:
                delay = min(self.backoff_max, self.backoff_base * 2**attempt)
                self.log.warning(
                    "%s %s: %s %s; retry %d/%d in %.1fs",
                    method, url, code, reason, attempt + 1, attempts - 1, delay,
                )
                await asyncio.sleep(delay)
        raise HubUnavailable(method, url, code, reason)

    async def _get_json(self, url: str, **kwargs: Any) -> Any:
        response = await self.request("GET", url, **kwargs)
        return json.loads(response.body)

    async def version(self) -> str:
        """The hub's version (``GET /hub/api/``); also proves the URL and token work."""
        return str((await self._get_json(self.api_url + "/"))["version"])

    async def token_scopes(self) -> set[str]:
        """The scopes the hub granted our token (``GET /hub/api/user``), expanded."""
        return set((await self._get_json(self.api_url + "/user"))["scopes"])

    async def iter_users(self, state: str | None = "active") -> AsyncIterator[HubUser]:
        """Yield every user, page by page, following ``_pagination.next``.

        ``state`` is JupyterHub's filter: ``"active"`` (a server running or
        pending), ``"ready"`` (a server running and not pending), ``"inactive"``
        or ``None`` (all users). The next page is requested before the items of
        the current one are yielded, so that the hub works while we do.
        """
        params: dict[str, str | int] = {}
        if state:
            params["state"] = state
        if self.page_size:
            params["limit"] = self.page_size
        users_url = self.api_url + "/users"

        def page_url(extra: dict[str, Any]) -> str:
            query = urlencode({**params, **extra})
            return f"{users_url}?{query}" if query else users_url

        pending = asyncio.ensure_future(
            self._get_json(page_url({}), accept=PAGINATION_MEDIA_TYPE)
        )
        try:
            while pending is not None:
                data = await pending
                pending = None
                if isinstance(data, list):
                    items = data  # a hub before 2.0: one unpaged list
                else:
                    items = data["items"]
                    nxt = data["_pagination"]["next"]
                    if nxt:
                        # Rebuild from offset/limit rather than use nxt["url"]
                        # verbatim: the hub builds that URL from the Host it saw,
                        # which differs from ours behind a rewriting proxy.
                        pending = asyncio.ensure_future(
                            self._get_json(
                                page_url({"offset": nxt["offset"], "limit": nxt["limit"]}),
                                accept=PAGINATION_MEDIA_TYPE,
                            )
                        )
                for item in items:
                    yield user_from_model(item)
        finally:
            if pending is not None:
                pending.cancel()

    async def stop_server(self, user: str, server_name: str = "") -> bool:
        """Ask the hub to stop a server. True once stopped, False while the stop is pending.

        A user or named server the hub no longer knows counts as stopped.
        """
        path = f"/users/{quote(user, safe='')}/server"
        if server_name:
            path += f"s/{quote(server_name, safe='')}"
        response = await self.request("DELETE", self.api_url + path, ok=(404,))
        return response.code != 202

    def server_url(self, server: HubServer, internal: str | None = None) -> str:
        """The URL of a server's root, ending in ``/``: ``internal`` (the address the
        lease recorded) when known, else through the proxy (which counts as activity)."""
        if internal:
            base = internal
        elif server.full_url:
            base = server.full_url
        elif self.proxy_url:
            base = self.proxy_url + server.url
        else:
            raise HubError(
                "GET", server.url, 0,
                "no proxy URL: set JupyterHub.public_url in the hub "
                "or the service's proxy_url so that servers can be reached",
            )
        return base if base.endswith("/") else base + "/"

    async def kernels(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> list[Kernel]:
        """The server's kernels, read without counting as activity."""
        url = self.server_url(server, internal) + "api/kernels?no_track_activity=1"
        return [kernel_from_model(k) for k in await self._get_json(url, retries=retries)]

    async def server_status(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> ServerStatus:
        """The server's own view of its activity (``/api/status`` is never tracked)."""
        url = self.server_url(server, internal) + "api/status"
        return status_from_model(await self._get_json(url, retries=retries))

    async def people_activity(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> PeopleActivity | None:
        """What mig-spawner's single-user extension saw people do on the server (never
        counted as activity itself); ``None`` for a server without the extension."""
        url = self.server_url(server, internal) + "mig-spawner/activity"
        try:
            return people_activity_from_model(await self._get_json(url, retries=retries))
        except HubError as e:
            if e.code == 404:
                return None
            raise

    async def shutdown_kernel(
        self, server: HubServer, kernel_id: str, *, internal: str | None = None
    ) -> None:
        """Shut a kernel down without counting as activity; one already gone counts as done."""
        url = (self.server_url(server, internal)
               + f"api/kernels/{quote(kernel_id, safe='')}?no_track_activity=1")
        await self.request("DELETE", url, ok=(404,))
