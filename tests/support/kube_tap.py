"""A tap between a client under test and the real API server: it counts the requests
and can answer some of them with an error instead (fault injection). Everything else
passes through unchanged, watches streamed as they come.

Plain HTTP on a loopback port, forwarding over TLS to the API server with the
client's own bearer token, so that RBAC sees the client. It runs on an event loop
of its own in a thread, so that a hub in another process can use it too.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

#: Headers a proxy must not copy (hop by hop, or recomputed).
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
        "content-encoding"}


@dataclass
class Fault:
    """Answer requests that ``match`` with ``status`` and the API's Status body."""

    status: int
    message: str
    match: Callable[[str, str], bool]
    reason: str = ""

    def body(self) -> bytes:
        reason = self.reason or {403: "Forbidden", 404: "NotFound", 410: "Expired",
                                 503: "ServiceUnavailable"}.get(self.status, "InternalError")
        return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {},
                           "status": "Failure", "message": self.message,
                           "reason": reason, "code": self.status}).encode()


@dataclass
class Seen:
    """One request that passed the tap."""

    method: str
    path: str
    query: dict[str, str]
    body: bytes = b""
    status: int = 0
    path_qs: str = ""
    #: The API server's ``Warning`` headers on the answer (an unknown field it dropped,
    #: a deprecated API ...).
    warnings: tuple[str, ...] = ()


@dataclass
class Tap:
    """The tap for one API server (``upstream``, trusted through ``ca``)."""

    upstream: str
    ca: str
    url: str = ""
    requests: list[Seen] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: Called with each request (``Seen``) before it is passed on, in the tap's thread.
    hooks: list[Callable[[Seen], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kube-tap")
        self._lock = threading.Lock()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        # The requests of the watches being passed on, by id (requests do not hash).
        self._streams: dict[int, web.Request] = {}

    # --- what tests use ------------------------------------------------------------

    def count(self, method: str = "GET", path: str | re.Pattern = "", *,
              watch: bool | None = None) -> int:
        """Requests of ``method`` whose path is ``path`` (a pattern: matches it);
        ``watch`` True/False: only watches / only non-watch requests."""
        with self._lock:
            seen = list(self.requests)
        return sum(1 for r in seen if r.method == method and (
            not path or (path.fullmatch(r.path) if isinstance(path, re.Pattern)
                         else r.path == path)) and (
            watch is None or (r.query.get("watch", "").lower() in ("true", "1")) == watch))

    def matching(self, method: str, path: str) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.method == method and r.path == path]

    def fail(self, status: int, message: str,
             match: Callable[[str, str], bool] = lambda method, path: True,
             reason: str = "") -> Fault:
        """From now on answer matching requests with ``status`` (undo: :meth:`heal`)."""
        fault = Fault(status, message, match, reason)
        with self._lock:
            self.faults.append(fault)
        return fault

    def heal(self) -> None:
        with self._lock:
            self.faults.clear()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def drop_watches(self) -> list[str]:
        """Cut every watch passing through now, as a lost connection or a restarted
        API server would (the client sees its stream end mid-way). Returns their
        paths."""
        async def cut() -> list[str]:
            paths = []
            for request in list(self._streams.values()):
                if request.transport is not None:
                    request.transport.abort()
                    paths.append(request.path)
            return paths

        return asyncio.run_coroutine_threadsafe(cut(), self._loop).result(30)

    # --- the server ----------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> str:
        context = ssl.create_default_context(cafile=self.ca)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=0),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                    shutdown_timeout=0.25)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen = Seen(request.method, request.path, dict(request.query), body,
                    path_qs=request.path_qs)
        with self._lock:
            self.requests.append(seen)
            fault = next((f for f in self.faults if f.match(request.method, request.path)),
                         None)
            hooks = list(self.hooks)
        for hook in hooks:
            await asyncio.to_thread(hook, seen)
        if fault is not None:
            seen.status = fault.status
            return web.Response(status=fault.status, body=fault.body(),
                                content_type="application/json")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        assert self._session is not None
        try:
            upstream = await self._session.request(
                request.method, self.upstream + request.path_qs, data=body or None,
                headers=headers)
        except aiohttp.ClientError as e:
            seen.status = 502
            return web.Response(status=502, text=str(e))
        seen.status = upstream.status
        seen.warnings = tuple(upstream.headers.getall("Warning", ()))
        response = web.StreamResponse(status=upstream.status, headers={
            k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
        if upstream.headers.get("Content-Encoding"):
            response.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
        await response.prepare(request)
        watching = seen.query.get("watch", "").lower() in ("true", "1")
        if watching:
            self._streams[id(request)] = request
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientError, asyncio.CancelledError):
            pass
        finally:
            self._streams.pop(id(request), None)
            upstream.release()
        return response

    def stop(self) -> None:
        async def close() -> None:
            # Upstream first: the watches still streamed through the tap end with it,
            # and the server's shutdown need not wait for them.
            if self._session is not None:
                await self._session.close()
            if self._runner is not None:
                await self._runner.cleanup()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
