"""Async client for the JupyterHub REST API and for single-user servers behind the proxy.

One :class:`HubClient` holds kept-alive connections, one concurrency limit in all and
one per server, and one retry policy for every call the slice service makes:

- ``GET /hub/api/users?state=...``, paged with JupyterHub's pagination model
  (``Accept: application/jupyterhub-pagination+json``, follow ``_pagination.next``);
  the next page is requested while the current one is being consumed;
- ``DELETE /hub/api/users/<user>/server[s/<name>]`` to stop a server;
- on a server with mig-spawner's single-user extension (:mod:`mig_spawner.singleuser`),
  ``GET <server>/mig-spawner/probe``: its kernels, status and what people did there, in
  one answer, and ``POST <server>/mig-spawner/cull``: shut down a list of kernels, in one
  request;
- on a server without it, ``GET <server>/api/kernels?no_track_activity=1`` (one list of
  every kernel), ``<server>/api/status`` (which Jupyter Server never counts as activity)
  and ``DELETE <server>/api/kernels/<id>?no_track_activity=1``, one per kernel;

with the service's token (it needs the ``access:servers`` scope), at the server's
*internal* URL that the spawner recorded in the lease. Not through the proxy:
configurable-http-proxy marks a route active on every request it forwards, and the
hub copies that onto the server's ``last_activity``, so reads through it would keep
idle servers alive.

Connections are kept alive: the hub's API on a few (aiohttp, which JupyterHub itself
depends on), and each server's on :mod:`mig_spawner.hub.connections`' lean HTTP/1.1
connections: a sweep reads a server and shuts its idle kernels down on one connection,
a server's next request goes before the first of the servers not yet visited, and the
idle connections of the :data:`IDLE_ADDRESSES` addresses used last stay open (the
others are closed), so a sweep over thousands of servers holds a bounded number of
sockets.

5xx answers and connection errors are retried with exponential backoff;
other errors raise :class:`HubError` at once with the hub's own message.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp

from mig_spawner.hub.connections import Address, Connection, ConnectionPool, Slots
from mig_spawner.hub.models import (
    HubServer,
    HubUser,
    Kernel,
    KernelsShutDown,
    ServerLook,
    ServerStatus,
    kernel_from_model,
    look_from_model,
    shut_down_from_model,
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
#: Requests in flight at once to one server (without the single-user extension its
#: kernels and status are read together, then its idle kernels shut down).
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


class _ServerSlot:
    """A server's limit (:data:`PER_SERVER` requests in flight) and how many requests
    use it now (it is dropped when none does)."""

    __slots__ = ("semaphore", "users")

    def __init__(self) -> None:
        self.semaphore = asyncio.Semaphore(PER_SERVER)
        self.users = 0


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of ``url``."""
    end = url.find("/", url.find("//") + 2)
    return url if end < 0 else url[:end]


def _address(origin: str) -> Address:
    """(scheme, host, port) of ``scheme://host[:port]``: where connections are kept."""
    scheme, _, netloc = origin.partition("://")
    host, colon, port = netloc.rpartition(":")
    if colon and port.isdigit() and (host.endswith("]") or ":" not in host) and "@" not in host:
        return scheme.lower(), host.strip("[]").lower(), int(port)
    parts = urlsplit(origin)  # no port, or a form the shortcut does not read
    return parts.scheme, parts.hostname or "", parts.port


def _host(origin: str) -> bytes:
    """The Host header of a request to ``origin``."""
    netloc = origin.partition("//")[2]
    return netloc.encode("ascii") if netloc.isascii() else netloc.encode("idna")


def _target(url: str, origin: str) -> bytes:
    """The request target of ``url`` (its path and query), as sent."""
    target = url[len(origin):] or "/"
    if not target.isascii():
        target = quote(target, safe="!#$%&'()*+,/:;=?@[]~")
    return target.encode("ascii")


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
        self._token = f"token {token}".encode("latin-1")
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self._request_timeout = request_timeout
        self._connect_timeout = min(connect_timeout, request_timeout)
        self._slots = Slots(concurrency)
        self._concurrency = concurrency
        # Per server (its root URL): a semaphore and how many requests use it now.
        self._per_server: dict[str, _ServerSlot] = {}
        # The hub's API, on aiohttp's kept-alive connections (made at the first call).
        self._hub: aiohttp.ClientSession | None = None
        # Servers' idle connections.
        self._pool = ConnectionPool(IDLE_ADDRESSES * concurrency)

    async def close(self) -> None:
        """Close every kept-alive connection."""
        self._pool.close()
        if self._hub is not None:
            hub, self._hub = self._hub, None
            await hub.close()

    async def request(
        self,
        method: str,
        url: str,
        *,
        accept: str | None = None,
        ok: Collection[int] = (),
        retries: int | None = None,
        server: str | None = None,
        body: Any = None,
    ) -> Response:
        """Make one API call with the concurrency limits, a timeout and retries.

        Codes below 400 and those in ``ok`` are returned; 5xx answers and
        connection errors are retried (``retries`` overrides the client's
        default) with exponential backoff, then raise :class:`HubUnavailable`;
        any other error raises :class:`HubError` at once. ``server`` (its root URL):
        the call counts against that server's limit too (:data:`PER_SERVER`).
        ``body``: sent as JSON.
        """
        headers = self._headers
        if accept:
            headers = {**headers, "Accept": accept}
        data = None
        if body is not None:
            headers = {**headers, "Content-Type": "application/json"}
            data = json.dumps(body).encode()
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            response = await self._send(method, url, headers, server, data)
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
                    server: str | None, data: bytes | None = None) -> Response:
        """One attempt, within the limits, on a kept-alive connection; no answer (a
        refused, reset or closed connection, a timeout) is :data:`NO_ANSWER`."""
        if server is not None:
            return await self._send_to_server(method, url, headers, server, data)
        await self._slots.acquire()
        try:
            if self._hub is None or self._hub.closed:
                self._hub = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self._concurrency),
                    timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar(),
                    skip_auto_headers=("User-Agent",))
            async with self._hub.request(method, url, headers=headers, data=data) as answer:
                return Response(answer.status, answer.reason or "", await answer.read())
        except TimeoutError as e:
            return Response(NO_ANSWER, self._no_answer_within(e), b"")
        except (aiohttp.ClientError, OSError) as e:
            return Response(NO_ANSWER, str(e) or type(e).__name__, b"")
        finally:
            self._slots.release()

    def _no_answer_within(self, e: BaseException) -> str:
        return f"Timeout: no answer within {self._request_timeout:g} s {e}".strip()

    async def _send_to_server(self, method: str, url: str, headers: dict[str, str],
                              server: str, data: bytes | None) -> Response:
        """:meth:`_send` to a single-user server: on its kept-alive connection, where
        one is open, and then before the servers not yet visited."""
        origin = _origin(url)
        address = _address(origin)
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\nAuthorization: %s\r\n" % (
            method.encode("ascii"), _target(url, origin), _host(origin), self._token)]
        if "Accept" in headers:
            head.append(b"Accept: %s\r\n" % headers["Accept"].encode("latin-1"))
        if data is not None:
            head.append(b"Content-Type: application/json\r\n")
        if data is not None or method in ("POST", "PUT", "PATCH"):
            head.append(b"Content-Length: %d\r\n" % len(data or b""))
        request = b"".join([*head, b"\r\n", data or b""])
        # At most PER_SERVER requests in flight to one server (its root URL).
        slot = self._per_server.get(server)
        if slot is None:
            slot = self._per_server[server] = _ServerSlot()
        slot.users += 1
        try:
            async with slot.semaphore:
                await self._slots.acquire(first=self._pool.holds(address))
                try:
                    return await self._exchange(address, request)
                finally:
                    self._slots.release()
        finally:
            slot.users -= 1
            if not slot.users:
                del self._per_server[server]

    async def _exchange(self, address: Address, request: bytes) -> Response:
        """``request`` on a kept connection to ``address``, or a new one; a kept one that
        the server closed meanwhile (it answers nothing) is replaced once."""
        for kept in (self._pool.take(address), None):
            connection: Connection | None = kept
            began = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout_at(began + self._request_timeout) as deadline:
                    if connection is None:
                        deadline.reschedule(began + self._connect_timeout)
                        connection = await self._pool.open(address)
                        deadline.reschedule(began + self._request_timeout)
                    code, reason, body, reusable = await connection.exchange(request)
            except TimeoutError as e:
                if connection is not None:
                    connection.close()
                return Response(NO_ANSWER, self._no_answer_within(e), b"")
            except OSError as e:
                if connection is not None:
                    connection.close()
                if kept is not None and not kept.answered:
                    continue  # closed while it was kept: try a new connection
                return Response(NO_ANSWER, str(e) or type(e).__name__, b"")
            if reusable:
                self._pool.put(address, connection)
            else:
                connection.close()
            return Response(code, reason, body)
        raise AssertionError("unreachable")

    async def _json(self, url: str, method: str = "GET", **kwargs: Any) -> Any:
        """The JSON answer of :meth:`request`."""
        response = await self.request(method, url, **kwargs)
        return json.loads(response.body)

    async def version(self) -> str:
        """The hub's version (``GET /hub/api/``); also proves the URL and token work."""
        return str((await self._json(self.api_url + "/"))["version"])

    async def token_scopes(self) -> set[str]:
        """The scopes the hub granted our token (``GET /hub/api/user``), expanded."""
        return set((await self._json(self.api_url + "/user"))["scopes"])

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
            self._json(page_url({}), accept=PAGINATION_MEDIA_TYPE)
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
                            self._json(
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
                for k in await self._json(url, retries=retries, server=base)]

    async def server_status(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> ServerStatus:
        """The server's own view of its activity (``/api/status`` is never tracked)."""
        base = self.server_url(server, internal)
        return status_from_model(await self._json(base + "api/status", retries=retries,
                                                      server=base))

    async def look(
        self, server: HubServer, *, internal: str | None = None, retries: int = 1
    ) -> ServerLook | None:
        """The server's kernels, status and what people did there, in one request to
        mig-spawner's single-user extension (never counted as activity); ``None`` for a
        server without the extension (404)."""
        base = self.server_url(server, internal)
        try:
            return look_from_model(await self._json(
                base + "mig-spawner/probe", retries=retries, server=base))
        except HubError as e:
            if e.code == 404:
                return None
            raise

    async def shutdown_kernels(
        self, server: HubServer, kernels: Iterable[Kernel], *, cull_busy: bool,
        cull_connected: bool, internal: str | None = None,
    ) -> KernelsShutDown:
        """Ask a server with mig-spawner's single-user extension to shut ``kernels``
        down, in one request: each only if it is still as seen (its ``last_activity``;
        busy or connected only with ``cull_busy`` or ``cull_connected``)."""
        base = self.server_url(server, internal)
        asked = [{"id": k.id, "last_activity": k.last_activity.isoformat()
                  if k.last_activity else None} for k in kernels]
        return shut_down_from_model(await self._json(
            base + "mig-spawner/cull", method="POST", server=base, body={
                "kernels": asked, "cull_busy": cull_busy, "cull_connected": cull_connected}))

    async def shutdown_kernel(
        self, server: HubServer, kernel_id: str, *, internal: str | None = None
    ) -> None:
        """Shut a kernel down without counting as activity; one already gone counts as done."""
        base = self.server_url(server, internal)
        url = base + f"api/kernels/{quote(kernel_id, safe='')}?no_track_activity=1"
        await self.request("DELETE", url, ok=(404,), server=base)
