"""A real JupyterHub + configurable-http-proxy in a subprocess, for end-to-end tests.

Reusable by any test module (spawner, slice service, browser):

    hub = HubProcess.start(tmp_path, config_files=[...], extra_config="c.X = 1")
    hub.create_user("ana", groups=["analysts"])
    hub.spawn("ana", {"profile": "1g.18gb"})
    hub.wait_ready("ana")
    hub.stop_hub()

Everything lives under the given directory (SQLite hub DB on disk, cookie
secret, logs), all ports are picked free, the hub and its proxy are a process group
that ends with the test run (:mod:`tests.support.reaper`), and the harness talks to the hub
through its public REST API with an admin token it granted itself through
``c.JupyterHub.services`` + ``load_roles``. Nothing here knows about MIG.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import websocket

from tests.support import reaper
from tests.support.polling import NotSeen, Shown, shown, until

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CHP = REPO / "node_modules" / ".bin" / "configurable-http-proxy"
ADMIN_SERVICE = "test-harness"


# The shipped snippets a MIG hub under test runs on: the spawner and the group policies.
MIG_SNIPPETS = tuple(REPO / "jupyterhub_config.d" / n for n in ("10-spawner.py", "20-groups.py"))
PORT_ATTEMPTS = 3
#: Seconds JupyterHub's LocalProcessSpawner gives a process it stops (a server, a managed
#: service) before it kills it: SIGINT, ``interrupt_timeout`` (10 s), SIGTERM,
#: ``term_timeout`` (5 s), then SIGKILL.
STOP_TIMEOUT = 10 + 5
# What a hub's log says when one of its ports was taken by someone else.
PORT_CLASH = ("Address already in use", "EADDRINUSE", "api_request to proxy failed")
#: What JupyterHub (5.3+) logs when a spawn's user_options reach no spawner hook; a hub
#: under test must never log it (checked at every stop, so every hub test guards it).
UNHANDLED_OPTIONS = "unhandled user_options"


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HubError(AssertionError):
    """The hub did not do what the test asked; carries the tail of the hub log."""


class NoProgress(HubError):
    """A spawn's progress stream was refused (the spawn had ended, or never began)."""


#: The statuses of a spawn the hub took: 201 running, 202 pending.
STARTED = (201, 202)


@dataclass
class HubProcess:
    """One running hub. ``url`` is the public (proxy) URL; API calls go through it."""

    workdir: Path
    config_path: Path
    url: str
    token: str
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    session: requests.Session = field(default_factory=requests.Session)
    #: What a failure shows beside the hub's log: the logs of the processes that run with
    #: it (the slice service adds its own, ``tests.support.slice_service``).
    beside: list[Shown] = field(default_factory=list)

    # --- lifecycle -------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        workdir: Path,
        config_files: Sequence[Path] = (),
        extra_config: str = "",
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> HubProcess:
        """Write a config that loads ``config_files`` in order, then start the hub.

        ``extra_config`` is Python appended last, so it overrides the files.
        The singleuser servers run as the current (test) user, not via setuid.
        """
        workdir.mkdir(parents=True, exist_ok=True)
        # A port picked free can be taken by another process before the hub binds it
        # (parallel test runs); the hub then dies at start. Try again on fresh ports.
        for attempt in range(1, PORT_ATTEMPTS + 1):
            hub = cls._configure(workdir, config_files, extra_config, env)
            log = workdir / "hub.log"
            start = log.stat().st_size if log.exists() else 0
            try:
                hub._launch(timeout)
            except HubError:
                # This attempt's whole log: the clash is said early, and the proxy's
                # complaints about the hub that never came up can fill any tail.
                with log.open("rb") as f:
                    f.seek(start)
                    said = f.read().decode(errors="replace")
                if attempt == PORT_ATTEMPTS or not any(m in said for m in PORT_CLASH):
                    raise
                continue
            return hub
        raise AssertionError("unreachable")

    @classmethod
    def _configure(
        cls,
        workdir: Path,
        config_files: Sequence[Path],
        extra_config: str,
        env: dict[str, str] | None,
    ) -> HubProcess:
        port, hub_port, api_port = free_port(), free_port(), free_port()
        token = secrets.token_hex(32)
        lines = [
            "# Written by tests/support/hub_harness.py",
            "c = get_config()  # noqa: F821",
            # Defaults that the config files may override: users need no Unix
            # account, servers run as the test user from the test's virtualenv.
            'c.JupyterHub.authenticator_class = "dummy"',
            f"c.Spawner.cmd = [{str(VENV_BIN / 'jupyterhub-singleuser')!r}]",
            'c.Spawner.args = ["--ServerApp.allow_root=True"]',
            # Loaded (pytest-xdist workers on two cores), a server may take most of a
            # minute to import; JupyterHub's defaults (start 60 s, HTTP 30 s) would stop
            # it half-way. Tests of these timeouts set their own.
            "c.Spawner.start_timeout = 120",
            "c.Spawner.http_timeout = 120",
            *(f"load_subconfig({str(p)!r})  # noqa: F821" for p in config_files),
            # What the harness needs, whatever the files say.
            f'c.JupyterHub.bind_url = "http://127.0.0.1:{port}"',
            'c.JupyterHub.hub_ip = "127.0.0.1"',
            f"c.JupyterHub.hub_port = {hub_port}",
            f'c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"',
            f"c.ConfigurableHTTPProxy.command = [{str(CHP)!r}]",
            f'c.JupyterHub.db_url = "sqlite:///{workdir}/jupyterhub.sqlite"',
            f'c.JupyterHub.cookie_secret_file = "{workdir}/jupyterhub_cookie_secret"',
            f'c.JupyterHub.pid_file = "{workdir}/jupyterhub.pid"',
            # Servers outlive a hub restart, as in production with a restarted hub; they
            # carry the test run's mark, so that the run ends them if it is interrupted.
            "c.JupyterHub.cleanup_servers = False",
            f"c.Spawner.env_keep.append({reaper.MARK!r})",
            f'c.JupyterHub.services.append({{"name": "{ADMIN_SERVICE}", "api_token": "{token}"}})',
            f'c.JupyterHub.load_roles.append({{"name": "admin", "services": ["{ADMIN_SERVICE}"]}})',
        ]
        config = "\n".join(lines) + "\n" + textwrap.dedent(extra_config) + "\n"
        config_path = workdir / "harness_config.py"
        config_path.write_text(config)
        hub_env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
        hub_env.update(env or {})
        hub = cls(workdir, config_path, f"http://127.0.0.1:{port}", token, env=hub_env)
        hub.session.headers["Authorization"] = f"token {token}"
        return hub

    def _launch(self, timeout: float) -> None:
        log = self.log_path.open("ab")
        self.proc = reaper.start(
            [str(VENV_BIN / "jupyterhub"), "-f", str(self.config_path)],
            "JupyterHub and its proxy",
            cwd=self.workdir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def up() -> bool:
            if self.proc.poll() is not None:
                self._kill_group()  # a proxy the dead hub started must not hold its port
                raise self.failure(f"hub exited with {self.proc.returncode}")
            try:
                return self.session.get(self.api("/"), timeout=2).ok
            except requests.ConnectionError:
                return False

        try:
            until(up, timeout, "the hub answering its API", show=self.show)
        except NotSeen as e:
            self._kill_group()
            raise HubError(str(e)) from None

    def _kill_group(self) -> None:
        """Kill the hub's process group: the hub and the proxy it started (servers run
        in sessions of their own)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stop_hub(self, timeout: float = 30) -> None:
        """Stop the hub (and its proxy), leaving single-user servers running; then fail
        if its log shows options that no spawner hook handled."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.check_log()

    def check_log(self) -> None:
        """Raise HubError when the hub logged :data:`UNHANDLED_OPTIONS`."""
        path = self.workdir / "hub.log"
        log = path.read_text(errors="replace") if path.exists() else ""
        lines = [line for line in log.splitlines() if UNHANDLED_OPTIONS in line.lower()]
        if lines:
            raise HubError("the hub left user_options unhandled:\n" + "\n".join(lines[:5]))

    def restart_hub(self, timeout: float = 60) -> None:
        """Stop the hub and start it again on the same config, DB and ports."""
        self.stop_hub()
        self._launch(timeout)

    def close(self) -> None:
        """Stop every server through the API, then the hub. For fixture teardown: the
        hub is stopped even when a server will not stop (a spawn still pending refuses
        a stop), and that is raised after."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                running = [user["name"] for user in self.users() if user.get("servers")]
                # All at once: a stop request may take its server's whole shutdown to answer.
                with ThreadPoolExecutor(max(1, min(len(running), 10))) as pool:
                    list(pool.map(lambda name: self.stop_server(name, wait=False), running))
                until(lambda: not any(u.get("servers") for u in self.users()), 30,
                      "every server stopped", show=self.show)
        finally:
            self.stop_hub()

    @property
    def log_path(self) -> Path:
        """The hub's log (the proxy's lines included), for a failed wait to show."""
        return self.workdir / "hub.log"

    @property
    def show(self) -> tuple[Shown, ...]:
        """What a failed wait or request shows: the hub's log and those :attr:`beside` it."""
        return (self.log, *self.beside)

    def log(self) -> str:
        """The hub's log less the harness's own answered reads: a wait's polls (one
        request each 0.2 s) would otherwise fill the tail a failure shows."""
        if not self.log_path.exists():
            return "(no hub log)"
        ours = f"({ADMIN_SERVICE}@"
        return "\n".join(
            line for line in self.log_path.read_text(errors="replace").splitlines()
            if not (ours in line and " 200 GET " in line))

    def failure(self, message: str, error: type[HubError] = HubError) -> HubError:
        """An ``error`` saying ``message`` and what :attr:`show` gives: every way the
        harness fails says what the hub (and the service) logged."""
        return error(f"{message}\n{shown(self.show)}")

    def log_tail(self, chars: int = 6000) -> str:
        path = self.log_path
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # --- REST API --------------------------------------------------------------------

    def api(self, path: str) -> str:
        return f"{self.url}/hub/api{path}"

    def request(self, method: str, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("timeout", 30)
        return self.session.request(method, self.api(path), **kw)

    def users(self) -> list[dict]:
        return self.request("GET", "/users").json()

    def user(self, name: str) -> dict:
        r = self.request("GET", f"/users/{name}")
        r.raise_for_status()
        return r.json()

    def create_user(self, name: str, groups: Sequence[str] = (), admin: bool = False) -> None:
        r = self.request("POST", f"/users/{name}", json={"admin": admin})
        if r.status_code not in (201, 409):
            raise self.failure(f"creating user {name}: {r.status_code} {r.text}")
        for group in groups:
            self.add_to_group(group, [name])

    def create_users(self, names: Sequence[str], groups: Sequence[str] = ()) -> None:
        """Create many users in one request, then put them all in ``groups``."""
        r = self.request("POST", "/users", json={"usernames": list(names)})
        if r.status_code not in (201, 409):
            raise self.failure(f"creating users: {r.status_code} {r.text}")
        for group in groups:
            self.add_to_group(group, names)

    def server_state(self, name: str, server: str = "") -> dict:
        """The spawner's persisted state (pid, ...), as an admin sees it."""
        model = self.server_model(name, server) or {}
        return model.get("state") or {}

    def add_to_group(self, group: str, users: Sequence[str]) -> None:
        r = self.request("POST", f"/groups/{group}")
        if r.status_code not in (201, 409):
            raise self.failure(f"creating group {group}: {r.status_code} {r.text}")
        r = self.request("POST", f"/groups/{group}/users", json={"users": list(users)})
        r.raise_for_status()

    def user_token(self, name: str) -> str:
        r = self.request("POST", f"/users/{name}/tokens", json={"note": "test"})
        r.raise_for_status()
        return r.json()["token"]

    def login(self, name: str, password: str = "test-password") -> requests.Session:
        """A browser-like session logged in through the hub's login form (cookies, xsrf).

        The hub's HTML pages (spawn form, ``?opt-`` query) accept no API token.
        """
        browser = requests.Session()
        browser.get(f"{self.url}/hub/login", timeout=30).raise_for_status()
        xsrf = browser.cookies.get("_xsrf", path="/hub/")
        r = browser.post(
            f"{self.url}/hub/login",
            data={"username": name, "password": password, "_xsrf": xsrf},
            timeout=30,
            allow_redirects=False,
        )
        if r.status_code != 302:
            raise self.failure(f"login of {name} failed: {r.status_code}")
        return browser

    @staticmethod
    def xsrf(browser: requests.Session) -> str:
        """The xsrf token a logged-in browser session must send with form posts."""
        return browser.cookies.get("_xsrf", path="/hub/") or ""

    # --- servers ---------------------------------------------------------------------

    def spawn(self, name: str, options: dict | None = None, server: str = "",
              expect: Collection[int] = ()) -> requests.Response:
        """POST a spawn; 201 = running, 202 = pending, 4xx = refused (see ``.json()``).
        With ``expect`` (e.g. :data:`STARTED`), another status fails with the logs."""
        path = f"/users/{name}/servers/{server}" if server else f"/users/{name}/server"
        body = None if options is None else json.dumps(options)
        r = self.request("POST", path, data=body, timeout=120)
        if expect and r.status_code not in expect:
            raise self.failure(f"the spawn of {name} answered {r.status_code}, not one of "
                               f"{sorted(expect)}: {r.text}")
        return r

    def server_model(self, name: str, server: str = "") -> dict | None:
        return self.user(name).get("servers", {}).get(server)

    def stopping(self, name: str, server: str = "") -> bool:
        """Whether the server is being stopped (the hub's pending stop) or is gone."""
        model = self.server_model(name, server)
        return model is None or model.get("pending") == "stop"

    def wait_ready(self, name: str, server: str = "", timeout: float = 60) -> dict:
        """Wait until the server is ready; raise with the hub log if it failed."""
        def ready() -> dict | None:
            model = self.server_model(name, server)
            if model is None:
                raise self.failure(f"{name}'s server is gone (failed start?)")
            return model if model.get("ready") else None

        return until(ready, timeout, f"{name}'s server ready", show=self.show)

    def stop_server(self, name: str, server: str = "", wait: bool = True) -> None:
        path = f"/users/{name}/servers/{server}" if server else f"/users/{name}/server"
        r = self.request("DELETE", path)
        if r.status_code not in (202, 204, 400):
            raise self.failure(f"stopping {name}: {r.status_code} {r.text}")
        if wait:
            until(lambda: self.server_model(name, server) is None, 30,
                  f"{name}'s server stopped", show=self.show)

    def progress(self, name: str, server: str = "", timeout: float = 60) -> list[dict]:
        """All progress events of a pending spawn, read from the event stream to its end."""
        path = f"/users/{name}/servers/{server}/progress" if server else (
            f"/users/{name}/server/progress"
        )
        events = []
        with self.request("GET", path, stream=True, timeout=timeout) as r:
            if not r.ok:
                raise self.failure(f"{name}'s progress: {r.status_code} {r.text}", NoProgress)
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    event = json.loads(line[5:])
                    events.append(event)
                    if event.get("ready") or event.get("failed"):
                        break
        return events

    def spawn_and_follow(
        self, name: str, options: dict | None = None, timeout: float = 120
    ) -> tuple[requests.Response, list[dict]]:
        """Spawn and, while the request is pending, read the progress stream from the start.

        The spawner's events are replayed to every reader, so joining late loses nothing;
        only a spawn that ends before the first read leaves just its final event.
        """
        with ThreadPoolExecutor(1) as pool:
            posted = pool.submit(self.spawn, name, options)

            def followed() -> tuple[requests.Response, list[dict]] | None:
                model = self.server_model(name)
                if model is not None and model.get("pending") == "spawn":
                    try:
                        events = self.progress(name, timeout=timeout)
                    except NoProgress:
                        return None  # the spawn ended between the two requests
                    return posted.result(timeout), events
                if posted.done() and (model is None or model.get("ready")):
                    # Over before it was seen pending: the stream still gives its end
                    # (JupyterHub keeps a failed spawn's error for it).
                    try:
                        events = self.progress(name, timeout=timeout)
                    except NoProgress:
                        events = []
                    return posted.result(), events
                return None

            return until(followed, timeout, f"the spawn of {name} followed",
                         show=self.show, every=0.05)

    # --- inside a single-user server -------------------------------------------------

    def run_in_kernel(self, name: str, code: str, timeout: float = 60) -> str:
        """Start a real kernel in ``name``'s server, run ``code``, return its stdout.

        Uses the server's REST API (``/api/kernels``) and the kernel's websocket
        channels, as JupyterLab does, with the hub's admin token (``access:servers``).
        """
        base = f"{self.url}/user/{name}/api/kernels"
        r = self.session.post(base, json={"name": "python3"}, timeout=timeout)
        if not r.ok:
            raise self.failure(f"a kernel for {name}: {r.status_code} {r.text}")
        kernel_id = r.json()["id"]
        try:
            return self.run_on_kernel(name, kernel_id, code, timeout)
        finally:
            self.session.delete(f"{base}/{kernel_id}", timeout=timeout)

    def run_on_kernel(self, name: str, kernel_id: str, code: str, timeout: float = 60) -> str:
        """Run ``code`` on a kernel of ``name``'s server as JupyterLab does (connect, run,
        disconnect) and return its stdout once the kernel is idle again."""
        with self.kernel_failures(), contextlib.closing(
                self.open_kernel(name, kernel_id, timeout)) as ws:
            msg_id = execute(ws, code)
            return "".join(_stdout_until_idle(ws, msg_id, timeout))

    def greet_kernel(self, name: str, kernel_id: str, timeout: float = 60) -> None:
        """Connect to a kernel of ``name``'s server as JupyterLab does when it opens a
        notebook, and return once the kernel has answered ``kernel_info``: it has booted.
        (Without a client, jupyter_server shows a kernel as ``starting`` until it dies.)"""
        with self.kernel_failures(), contextlib.closing(
                self.open_kernel(name, kernel_id, timeout)) as ws:
            msg_id = _send(ws, "kernel_info_request", {})
            for msg in _replies(ws, msg_id, timeout):
                if msg["msg_type"] == "kernel_info_reply":
                    return

    @contextlib.contextmanager
    def kernel_failures(self) -> Iterator[None]:
        """A kernel that errs, is silent or cannot be reached fails with the logs."""
        try:
            yield
        except (HubError, websocket.WebSocketException, OSError) as e:
            raise self.failure(f"kernel: {e!r}") from e

    def open_kernel(self, name: str, kernel_id: str, timeout: float) -> websocket.WebSocket:
        """The websocket channels of a kernel of ``name``'s server, through the proxy,
        with the admin token; the caller closes it."""
        ws_url = (f"{self.url}/user/{name}/api/kernels/{kernel_id}/channels"
                  .replace("http://", "ws://"))
        return websocket.create_connection(
            ws_url, header=[f"Authorization: token {self.token}"], timeout=timeout
        )


def execute(ws: websocket.WebSocket, code: str) -> str:
    """Send ``code`` to run on the kernel behind ``ws``; the request's message id."""
    return _send(ws, "execute_request", {"code": code, "silent": False,
                                         "store_history": False, "user_expressions": {},
                                         "allow_stdin": False})


def _send(ws: websocket.WebSocket, msg_type: str, content: dict) -> str:
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({
        "header": {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "username": "test",
            "session": uuid.uuid4().hex,
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "channel": "shell",
        "content": content,
    }))
    return msg_id


def _replies(ws: websocket.WebSocket, msg_id: str, timeout: float) -> Iterator[dict]:
    """The kernel's messages in answer to ``msg_id``, for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") == msg_id:
            yield msg
    raise HubError(f"kernel did not answer within {timeout}s")


def _stdout_until_idle(ws: websocket.WebSocket, msg_id: str, timeout: float) -> Iterator[str]:
    for msg in _replies(ws, msg_id, timeout):
        kind = msg["msg_type"]
        if kind == "stream" and msg["content"]["name"] == "stdout":
            yield msg["content"]["text"]
        elif kind == "error":
            raise HubError("kernel error: " + "\n".join(msg["content"]["traceback"]))
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return


#: Config (for ``extra_config``) that makes the MIG spawner wait between the claim and the
#: spawn while a file ``pause`` exists in the hub's directory, as a slow device
#: preparation would: a test can then kill the hub, or the ledger, at that point.
PAUSE_BEFORE_SPAWN = """
import asyncio, os
from mig_spawner.spawner.local import SimpleLocalMIGSpawner

class PausingSpawner(SimpleLocalMIGSpawner):
    async def prepare_slice(self, lease):
        while os.path.exists("pause"):
            await asyncio.sleep(0.1)
        await super().prepare_slice(lease)

c.JupyterHub.spawner_class = PausingSpawner
"""


def start_mig_hub(
    workdir: Path, sim: str, extra_config: str = "", spawner: str = "mig-simple", **kw: Any
) -> HubProcess:
    """A hub on the shipped snippets with the MIG spawner on simulated GPUs ``sim``.

    Servers run as the test user (``spawner``, by default ``mig-simple``); the simulator
    keeps its state in ``workdir/sim-gpus.json`` so tests can see and change it.
    ``extra_config`` is appended last; other keywords go to :meth:`HubProcess.start`.
    """
    kw.setdefault("timeout", 120)
    return HubProcess.start(
        workdir, MIG_SNIPPETS, simulated_spawner(workdir, sim, spawner)
        + textwrap.dedent(extra_config), **kw,
    )


def simulated_spawner(workdir: Path, sim: str, spawner: str = "mig-simple") -> str:
    """Config lines for ``spawner`` running servers as the test user, with homes under
    ``workdir``, on simulated GPUs ``sim`` whose state is ``workdir/sim-gpus.json``."""
    return textwrap.dedent(
        f"""
        c.JupyterHub.spawner_class = "{spawner}"
        c.SimpleLocalMIGSpawner.home_dir_template = "{workdir}/home/{{username}}"
        c.SimpleLocalProcessSpawner.home_dir_template = "{workdir}/home/{{username}}"
        c.MIGSettings.simulate = "{sim}"
        c.MIGSettings.sim_state_file = "{workdir}/sim-gpus.json"
        """
    )
