"""A tornado stand-in for the parts of the JupyterHub REST API a culler uses, at scale.

It answers as JupyterHub 5/6 does (``jupyterhub/apihandlers``): ``GET /hub/api/``;
``GET /hub/api/users`` with the ``state`` filter, ``offset``/``limit`` (default
page 50, at most 200) and, with ``Accept: application/jupyterhub-pagination+json``,
the ``{"items", "_pagination": {offset, limit, total, next}}`` model whose
``next.url`` is built from the request URL; ``DELETE /hub/api/users/<u>/server``
and ``.../servers/<name>`` (204); and, for single-user servers behind the proxy,
``/user/<u>/api/kernels``, ``/user/<u>/api/status`` and kernel DELETE, and with
``extension``, what mig-spawner's single-user extension adds for the slice service
(``mig-spawner/probe``, ``mig-spawner/cull``, deciding as the extension does with
:func:`~mig_spawner.service.cull_rules.recheck_kernels`); without it those are 404.

Used by tests that need thousands of users or injected faults (a real hub is
used where behaviour matters), and by ``benchmarks/culler.py`` in subprocesses:
``python -m tests.support.hub_standin --users 5000 --kernels 4`` prints the port it
listens on as a JSON list (``--listen N``: N ports, which all answer alike); with
``--server-ports FILE`` (a JSON list of ports) the hub's server models send each
server's requests (``full_url``) to one of those ports, in turn: each server at an
address of its own, as on a real hub, and their work not in the hub's process
(``--lean``: those processes answer as the servers only, without tornado).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from mig_spawner.core.policy import PolicySet
from mig_spawner.hub.client import HubClient
from mig_spawner.hub.models import kernel_from_model, parse_timestamp
from mig_spawner.service.cull_rules import recheck_kernels
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper

PAGE_DEFAULT, PAGE_MAX = 50, 200


def iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


@dataclass
class StandinState:
    """Users with one running default server each, and knobs for faults.

    ``fail_next`` answers that many API requests with ``fail_code`` (after
    ``ok_before_failing`` requests have been answered normally);
    ``delay`` holds every answer back that long (``max_in_flight`` then shows how
    many requests a client had open at once); ``requests`` counts every request
    by (method, first path part), and ``per_server`` every request to a server by
    (user, method, what: ``api/kernels``, ``api/kernels/<id>``, ``mig-spawner/probe``...);
    the servers of the users in ``unreachable`` answer 502, as the proxy does for a
    server that does not answer. ``extension``: the servers have mig-spawner's
    single-user extension.
    """

    users: dict[str, dict] = field(default_factory=dict)
    kernels: dict[str, list[dict]] = field(default_factory=dict)
    fail_next: int = 0
    fail_code: int = 503
    ok_before_failing: int = 0
    delay: float = 0.0
    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    unreachable: set[str] = field(default_factory=set)
    extension: bool = False
    per_server: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    @classmethod
    def build(cls, n_users: int, *, idle_every: int = 5, kernels_per_server: int = 0,
              now: datetime | None = None, extension: bool = False,
              server_ports: tuple[int, ...] = ()) -> StandinState:
        """``n_users`` with running servers; every ``idle_every``-th idle for 2 hours
        (the rest active a minute ago); each with ``kernels_per_server`` kernels,
        all idle for 2 hours on an idle server, every other one on an active server.
        ``server_ports``: the servers answer at these ports of 127.0.0.1, in turn."""
        now = now or datetime.now(UTC)
        state = cls(extension=extension)
        for i in range(n_users):
            name = f"user{i:05}"
            idle = idle_every and i % idle_every == 0
            active = now - (timedelta(hours=2) if idle else timedelta(minutes=1))
            state.users[name] = user_model(name, started=now - timedelta(hours=3),
                                           last_activity=active)
            if server_ports:
                state.users[name]["servers"][""]["full_url"] = (
                    f"http://127.0.0.1:{server_ports[i % len(server_ports)]}/user/{name}/")
            state.kernels[name] = [
                {"id": f"{name}-k{k}", "name": "python3",
                 "last_activity": iso(now - timedelta(hours=2 if idle or k % 2 == 0 else 0)),
                 "execution_state": "idle", "connections": 0}
                for k in range(kernels_per_server)
            ]
        return state

    def count(self, method: str, path: str) -> None:
        key = (method, path.strip("/").split("/")[0])
        self.requests[key] = self.requests.get(key, 0) + 1


def server_model(user: str, name: str, started: datetime, last_activity: datetime) -> dict:
    """A ready server, as ``APIHandler.server_model`` writes it."""
    url = f"/user/{user}/{name + '/' if name else ''}"
    return {
        "name": name, "display_name": name, "full_name": f"{user}/{name}",
        "last_activity": iso(last_activity), "started": iso(started), "pending": None,
        "ready": True, "stopped": False, "url": url, "user_options": {},
        "progress_url": f"/hub/api/users/{user}/server/progress",
        "full_url": None, "full_progress_url": None,
    }


def user_model(name: str, started: datetime, last_activity: datetime) -> dict:
    """A user with a running default server, as ``APIHandler.user_model`` writes it."""
    return {
        "kind": "user", "name": name, "admin": False, "roles": ["user"],
        "groups": ["analysts"], "server": f"/user/{name}/", "pending": None,
        "created": iso(started - timedelta(days=30)), "last_activity": iso(last_activity),
        "servers": {"": server_model(name, "", started, last_activity)},
    }


class StandinHandler(web.RequestHandler):
    def initialize(self, state: StandinState) -> None:
        self.state = state

    async def prepare(self) -> None:
        self.state.count(self.request.method, self.request.path.removeprefix("/hub/api"))
        self.state.in_flight += 1
        self.state.max_in_flight = max(self.state.max_in_flight, self.state.in_flight)
        if self.state.delay:
            await asyncio.sleep(self.state.delay)
        if self.state.ok_before_failing > 0:
            self.state.ok_before_failing -= 1
        elif self.state.fail_next > 0:
            self.state.fail_next -= 1
            self.set_status(self.state.fail_code)
            self.finish(json.dumps({"status": self.state.fail_code, "message": "hub is busy"}))

    def on_finish(self) -> None:
        self.state.in_flight -= 1

    def write_json(self, model: object) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(model))


class VersionHandler(StandinHandler):
    def get(self) -> None:
        self.write_json({"version": "5.2.1"})


class UsersHandler(StandinHandler):
    def get(self) -> None:
        state_filter = self.get_argument("state", None)
        users = [u for u in self.state.users.values()
                 if state_filter not in ("ready", "active") or u["servers"]]
        paged = "application/jupyterhub-pagination+json" in self.request.headers.get(
            "Accept", "")
        offset = int(self.get_argument("offset", "0"))
        limit = min(int(self.get_argument("limit", PAGE_DEFAULT if paged else PAGE_MAX)),
                    PAGE_MAX)
        items = users[offset:offset + limit]
        if not paged:
            self.write_json(items)
            return
        nxt = None
        if offset + limit < len(users):
            parsed = urlparse(self.request.full_url())
            query = parse_qs(parsed.query, keep_blank_values=True)
            query["offset"], query["limit"] = [offset + limit], [limit]
            nxt = {"offset": offset + limit, "limit": limit,
                   "url": urlunparse(parsed._replace(query=urlencode(query, doseq=True)))}
        self.write_json({"items": items, "_pagination": {
            "offset": offset, "limit": limit, "total": len(users), "next": nxt}})


class ServerHandler(StandinHandler):
    def delete(self, user: str, name: str = "") -> None:
        model = self.state.users.get(user)
        if model is None:
            raise web.HTTPError(404)
        model["servers"].pop(name or "", None)
        model["server"] = None
        self.state.stopped.append(f"{user}/{name or ''}")
        self.set_status(204)
        self.finish()


def server_answer(state: StandinState, method: str, user: str, what: str,
                  body: bytes) -> tuple[int, object]:
    """What ``user``'s server answers to ``method`` on ``what`` (the path below the
    server's root, no query): the status and a JSON model (``None``: no body). Counted
    in ``per_server``; 502 while the server is ``unreachable``; mig-spawner's endpoints
    are 404 without the ``extension``."""
    kernel_id = None
    if what.startswith("api/kernels/"):
        what, kernel_id = "api/kernels/<id>", what.removeprefix("api/kernels/")
    state.per_server[(user, method, what)] += 1
    if user in state.unreachable:
        return 502, {"message": "the server does not answer"}
    if what.startswith("mig-spawner/") and not state.extension:
        return 404, {"message": "Not Found"}
    kernels = state.kernels.get(user, [])
    model = state.users.get(user, {}).get("servers", {}).get("")
    status = model and {"started": model["started"], "last_activity": model["last_activity"],
                        "connections": 0, "kernels": len(kernels)}
    match method, what:
        case "GET", "api/kernels":
            return 200, kernels
        case "DELETE", "api/kernels/<id>":
            state.kernels[user] = [k for k in kernels if k["id"] != kernel_id]
            return 204, None
        case "GET", "api/status" if status:
            return 200, status
        case "GET", "mig-spawner/probe" if status:
            return 200, {"kernels": kernels, "status": status, "people": {
                "page_seen": None, "interaction": None, "terminal": None}}
        case "POST", "mig-spawner/cull":
            asked = json.loads(body)
            plan = recheck_kernels(
                {k["id"]: kernel_from_model(k) for k in kernels},
                [(k["id"], parse_timestamp(k["last_activity"])) for k in asked["kernels"]],
                asked["cull_busy"], asked["cull_connected"])
            state.kernels[user] = [k for k in kernels if k["id"] not in plan.shut_down]
            return 200, {"shut_down": plan.shut_down, "kept": plan.kept,
                         "unknown": plan.unknown, "failed": []}
    return 404, {"message": "Not Found"}


class UserServerHandler(StandinHandler):
    """A user's server (:func:`server_answer`)."""

    def answer(self, user: str, what: str) -> None:
        code, model = server_answer(self.state, self.request.method, user, what,
                                    self.request.body)
        self.set_status(code)
        if model is None:
            self.finish()
        else:
            self.write_json(model)

    get = post = delete = answer


class LeanServers(asyncio.Protocol):
    """Users' servers (:func:`server_answer`) for the benchmark: plain HTTP/1.1 on
    asyncio, without a web framework's cost per request, so that the servers' share of
    the machine's cores stays small beside the service's (on a real hub each runs on
    its own). No faults are injected here."""

    def __init__(self, state: StandinState) -> None:
        self.state = state
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buffer[:end]).decode("latin-1")
            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.lower().startswith("content-length:")), 0)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            method, target = head.split(" ", 2)[:2]
            user, _, what = target.partition("?")[0].removeprefix("/user/").partition("/")
            code, model = server_answer(self.state, method, user, what, body)
            payload = b"" if model is None else json.dumps(model).encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (
                                     code, b"OK" if code < 400 else b"Error", len(payload),
                                     payload))


def make_app(state: StandinState) -> web.Application:
    args = {"state": state}
    return web.Application([
        (r"/hub/api/", VersionHandler, args),
        (r"/hub/api/users", UsersHandler, args),
        (r"/hub/api/users/([^/]+)/server", ServerHandler, args),
        (r"/hub/api/users/([^/]+)/servers/([^/]+)", ServerHandler, args),
        (r"/user/([^/]+)/(.*)", UserServerHandler, args),
    ])


def listen(state: StandinState) -> tuple[HTTPServer, int]:
    """Serve ``state`` on a free localhost port in the current event loop."""
    [sock] = bind_sockets(0, "127.0.0.1", reuse_port=False)[:1]
    server = HTTPServer(make_app(state))
    server.add_sockets([sock])
    return server, sock.getsockname()[1]


async def _serve_forever(args: argparse.Namespace) -> None:
    logging.getLogger("tornado.access").setLevel(logging.ERROR)  # the 404s asked for
    ports = tuple(json.loads(Path(args.server_ports).read_text())) if args.server_ports else ()
    state = StandinState.build(
        args.users, idle_every=args.idle_every, kernels_per_server=args.kernels,
        now=datetime.fromisoformat(args.now) if args.now else None,
        extension=args.extension, server_ports=ports)
    sockets = [bind_sockets(0, "127.0.0.1")[0] for _ in range(args.listen)]
    if args.lean:
        loop = asyncio.get_running_loop()
        for sock in sockets:
            await loop.create_server(lambda: LeanServers(state), sock=sock)
    else:
        HTTPServer(make_app(state)).add_sockets(sockets)
    print(json.dumps([sock.getsockname()[1] for sock in sockets]), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=5000)
    parser.add_argument("--kernels", type=int, default=0, help="kernels per server")
    parser.add_argument("--idle-every", type=int, default=5)
    parser.add_argument("--extension", action="store_true",
                        help="the servers have mig-spawner's single-user extension")
    parser.add_argument("--now", help="the time the users' activity is counted from (ISO)")
    parser.add_argument("--server-ports", help="a JSON file: the ports the servers answer "
                        "at, in turn")
    parser.add_argument("--listen", type=int, default=1, help="ports to listen on")
    parser.add_argument("--lean", action="store_true",
                        help="answer as users' servers only, on plain asyncio (LeanServers)")
    asyncio.run(_serve_forever(parser.parse_args()))


def standin_sweeper(base: str, policy: PolicySet, **kw) -> Sweeper:
    """A slice service's :class:`Sweeper` reading the stand-in hub served at ``base`` with
    ``policy`` (quick retries; servers not probed unless ``probe_servers`` is given)."""
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=2, backoff_base=0.01)
    kw.setdefault("probe_servers", False)
    return Sweeper(client, policy, ServiceMetrics(), **kw)
