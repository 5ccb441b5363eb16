"""Async client for the JupyterHub REST API and for single-user servers behind the proxy.

One :class:`HubClient` holds kept-alive connections, one concurrency limit in all and
one per server, and one retry policy for every call the slice service makes:

- ``GET /hub/api/users?state=...``, paged with JupyterHub's pagination model
  (``Accept: application/jupyterhub-pagination+json``, follow ``_pagination.next``);
  the next page is requested while the current one is being consumed;
- ``DELETE /hub/api/users/<user>/server[s/<name>]`` to stop a server;
- ``GET <server>/api/kernels?no_track_activity=1`` (one list of every kernel),
  ``<server>/api/status`` (which Jupyter Server never counts as activity) and
  ``<server>/mig-spawner/activity`` (what people did there, from mig-spawner's
  single-user extension), and ``DELETE <server>/api/kernels/<id>?no_track_activity=1``,
  with the service's token (it needs the ``access:servers`` scope), at the server's
  *internal* URL that the spawner recorded in the lease. Not through the proxy:
  configurable-http-proxy marks a route active on every request it forwards, and the
  hub copies that onto the server's ``last_activity``, so reads through it would keep
  idle servers alive.

Connections are kept alive (HTTP/1.1, aiohttp, which JupyterHub itself depends on): a
sweep reads a server's kernels, status and activity and shuts its idle kernels down on
one connection, and the hub's API on a few, instead of one new connection per request.
The connections of an address with nothing in flight stay open for its next request,
for the :data:`IDLE_ADDRESSES` addresses used last (the others are closed), so a sweep
over thousands of servers holds a bounded number of sockets.

5xx answers and connection errors are retried with exponential backoff;
other errors raise :class:`HubError` at once with the hub's own message.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp

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
#: JupyterHub's filter of the users with a server running or pending
#: (``GET /users?state=active``); not a lease's state.
ACTIVE_USERS = "active"

# Answers worth trying again: the hub (or the proxy in front of a server) is
# restarting, overloaded or briefly unable to reach its database.
RETRY_STATUS = frozenset({500, 502, 503, 504})
#: The code of a connection error or timeout (as tornado and jupyterhub-idle-culler say).
NO_ANSWER = 599
#: Requests in flight at once to one server (its kernels, status and activity are read
#: together, then its idle kernels shut down one by one).
PER_SERVER = 2
#: Addresses whose kept-alive connections stay open while nothing is in flight to them,
#: per unit of concurrency: the least recently used beyond that are closed.
IDLE_ADDRESSES = 2


@dataclass(frozen=True)
class Response:
    """An answer: its HTTP status, reason phrase and body."""

    code: int
    reason: str
    body: bytes


class HubError(Exception):
    """A call to the hub or to a single-user server failed.

    ``code`` is the HTTP status (:data:`NO_ANSWER`, 599, for a connection error or
    timeout); the message names the request and what came back.
    """

    def __init__(self, method: str, url: str, code: int, reason: str) -> None:
        self.method = method
        self.url = url
        self.code = code
        self.reason = reason
        super().__init__(f"{method} {url} failed: {code} {reason}")


class HubUnavailable(HubError):
    """Retries were exhausted on 5xx answers or connection errors: try again later."""


def _reason(response: Response) -> str:
    """The hub's own error message (``{"message": ...}``) or the HTTP reason."""
    try:
        return str(json.loads(response.body)["message"])
    except (ValueError, TypeError, KeyError):
        return response.reason or ""


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url``."""
    end = url.find("/", url.find("//") + 2)
    return url if end < 0 else url[:end]


@functools.lru_cache(maxsize=4096)
def _address(origin: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``scheme://host[:port]``: where connections are kept."""
    parts = urlsplit(origin)
    return parts.scheme, parts.hostname or "", parts.port


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
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self._semaphore = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        # Per server (its root URL): a semaphore and how many requests use it now.
        self._per_server: dict[str, tuple[asyncio.Semaphore, int]] = {}
        # Per address (scheme, host, port): a session whose connections are kept alive,
        # and how many requests use it now; those with none, least recently used first.
        self._sessions: dict[tuple[str, str, int | None], tuple[aiohttp.ClientSession, int]] = {}
        self._idle: OrderedDict[tuple[str, str, int | None], None] = OrderedDict()

    async def close(self) -> None:
        """Close every kept-alive connection."""
        sessions = [session for session, _ in self._sessions.values()]
        self._sessions.clear()
        self._idle.clear()
        for session in sessions:
            await session.close()

    @asynccontextmanager
    async def _session(self, url: str) -> AsyncIterator[aiohttp.ClientSession]:
        """The session of ``url``'s address, counted as in use while the block runs."""
        address = _address(_origin(url))
        session, users = self._sessions.get(address, (None, 0))
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._concurrency),
                timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",))
        self._sessions[address] = (session, users + 1)
        self._idle.pop(address, None)
        try:
            yield session
        finally:
            session, users = self._sessions[address]
            self._sessions[address] = (session, users - 1)
            if users == 1:
                self._idle[address] = None
                while len(self._idle) > IDLE_ADDRESSES * self._concurrency:
                    oldest, _ = self._idle.popitem(last=False)
                    await self._sessions.pop(oldest)[0].close()

    @asynccontextmanager
    async def _server_slot(self, server: str | None) -> AsyncIterator[None]:
        """At most :data:`PER_SERVER` requests in flight to ``server`` (its root URL)."""
        if server is None:
            yield
            return
        semaphore, users = self._per_server.get(server, (None, 0))
        if semaphore is None:
            semaphore = asyncio.Semaphore(PER_SERVER)
        self._per_server[server] = (semaphore, users + 1)
        try:
            async with semaphore:
                yield
        finally:
            semaphore, users = self._per_server[server]
            if users == 1:
                del self._per_server[server]
            else:
                self._per_server[server] = (semaphore, users - 1)

    async def request(
        self,
        method: str,
        url: str,
        *,
        accept: str | None = None,
        ok: Collection[int] = (),
        retries: int | None = None,
        server: str | None = None,
    ) -> Response:
        """Make one API call with the concurrency limits, a timeout and retries.

        Codes below 400 and those in ``ok`` are returned; 5xx answers and
        connection errors are retried (``retries`` overrides the client's
        default) with exponential backoff, then raise :class:`HubUnavailable`;
        any other error raises :class:`HubError` at once. ``server`` (its root URL):
        the call counts against that server's limit too (:data:`PER_SERVER`).
        """
        headers = dict(self._headers)
        if accept:
            headers["Accept"] = accept
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            response = await self._send(method, url, headers, server)
            if response.code < 400 or response.code in ok:
                return response
            code = response.code
            reason = response.reason if code == NO_ANSWER else _reason(response)
            if code not in RETRY_STATUS and code != NO_ANSWER:
                raise HubError(method, url, code, reason)
            if attempt + 1 < attempts:
                delay = min(self.backoff_max, self.backoff_base * 2**attempt)
                self.log.warning(
                    "%s %s: %s %s; retry %d/%d in %.1fs",
                    method, url, code, reason, attempt + 1, attempts - 1, delay,
                )
                await asyncio.sleep(delay)
        raise HubUnavailable(method, url, code, reason)

    async def _send(self, method: str, url: str, headers: dict[str, str],
                    server: str | None) -> Response:
        """One attempt, within the limits, on a kept-alive connection; no answer (a
        refused, reset or closed connection, a timeout) is :data:`NO_ANSWER`."""
        try:
            async with (self._server_slot(server), self._semaphore,
                        self._session(url) as session,
                        session.request(method, url, headers=headers) as answer):
                return Response(answer.status, answer.reason or "", await answer.read())
        except TimeoutError as e:
            why = f"Timeout: no answer within {self._timeout.total:g} s {e}".strip()
        except (aiohttp.ClientError, OSError) as e:
            why = str(e) or type(e).__name__
        return Response(NO_ANSWER, why, b"")

    async def _get_json(self, url: str, **kwargs: Any) -> Any:
        response = await self.request("GET", url, **kwargs)
        return json.loads(response.body)

    async def version(self) -> str:
        """The hub's version (``GET /hub/api/``); also proves the URL and token work."""
        return str((await self._get_json(self.api_url + "/"))["version"])

    async def token_scopes(self) -> set[str]:
        """The scopes the hub granted our token (``GET /hub/api/user``), expanded."""
        return set((await self._get_json(self.api_url + "/user"))["scopes"])

    async def iter_users(self, state: str | None = ACTIVE_USERS) -> AsyncIterator[HubUser]:
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
        base = self.server_url(server, internal)
        url = base + "api/kernels?no_track_activity=1"
        return [kernel_from_model(k)
                for k in await self._get_json(url, retries=retries, server=base)]

    async def server_status(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> ServerStatus:
        """The server's own view of its activity (``/api/status`` is never tracked)."""
        base = self.server_url(server, internal)
        return status_from_model(await self._get_json(base + "api/status", retries=retries,
                                                      server=base))

    async def people_activity(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> PeopleActivity | None:
        """What mig-spawner's single-user extension saw people do on the server (never
        counted as activity itself); ``None`` for a server without the extension."""
        base = self.server_url(server, internal)
        try:
            return people_activity_from_model(await self._get_json(
                base + "mig-spawner/activity", retries=retries, server=base))
        except HubError as e:
            if e.code == 404:
                return None
            raise

    async def shutdown_kernel(
        self, server: HubServer, kernel_id: str, *, internal: str | None = None
    ) -> None:
        """Shut a kernel down without counting as activity; one already gone counts as done."""
        base = self.server_url(server, internal)
        url = base + f"api/kernels/{quote(kernel_id, safe='')}?no_track_activity=1"
        await self.request("DELETE", url, ok=(404,), server=base)
