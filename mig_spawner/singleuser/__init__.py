"""A Jupyter Server extension, enabled in each single-user server by the MIG spawner,
that shows the slice service's warning before a stop inside JupyterLab and tells the
service what people do there.

It adds, under the server's base URL:

- ``mig-spawner/warning`` (GET): this server's pending warning, asked of the hub with
  the server's own ``JUPYTERHUB_API_TOKEN`` (so it sees nothing of other users);
- ``mig-spawner/keep`` (POST, xsrf-checked): "Keep my server", passed on to the hub;
- ``mig-spawner/activity`` (POST, xsrf-checked): the page's report that a person typed,
  clicked or scrolled in it;
- ``mig-spawner/probe`` (GET), for the slice service, everything a sweep reads here in
  one answer: the kernels (as ``api/kernels`` lists them), the server's status (as
  ``api/status``), and what people did: when a JupyterLab page last reported
  (``page_seen``: its every look for a warning is one), its latest such interaction,
  and its terminals' latest input or output (see docs/culling.md);
- ``mig-spawner/cull`` (POST), for the slice service: shut down the kernels it decided
  to cull, in one request, each only if it is still as the service saw it
  (:func:`mig_spawner.service.cull_rules.recheck_kernels`);
- ``mig-spawner/notice.js``: the script that turns the warning into a JupyterLab 4
  notification with a **Keep my server** button (``apputils:notify``), and reports
  interaction at most once per look.

None of these requests counts as the server's activity (jupyter_server's
``last_activity``): a page's background requests are not a person at work, nor is the
service's looking. ``probe`` and ``cull`` answer only a JupyterHub service let into this
server (``access:servers``: the slice service); a person's token or session, the
owner's too, gets 403.

The script is added to JupyterLab's page by an output transform, so nothing needs
building; it also sets JupyterLab's ``exposeAppInBrowser`` page option so the
script can reach the app's commands. Without JupyterLab nothing is injected, and the hub's home
page shows the same notice. Only callers the server itself lets in (its owner, or
whom they shared it with) reach these endpoints.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jupyter_core.utils import ensure_async
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.web import OutputTransform

from mig_spawner.hub.models import kernel_from_model, parse_timestamp
from mig_spawner.service.cull_rules import recheck_kernels

STATIC = Path(__file__).resolve().parent / "static"
#: Seconds between the script's looks for a warning (``MIG_SPAWNER_NOTICE_POLL``).
DEFAULT_POLL = 15


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "mig_spawner.singleuser"}]


#: Where the web app's settings keep what people did. Not ending in ``_last_activity``,
#: which jupyter_server would count as the server's activity.
PEOPLE = "mig_spawner_people"


def _seen(handler: APIHandler, interaction: bool) -> None:
    """Record that a JupyterLab page reported (and that a person interacted with it)."""
    people = handler.settings.setdefault(PEOPLE, {})
    people["page_seen"] = now = datetime.now(UTC)
    if interaction:
        people["interaction"] = now


def _iso(when: Any) -> str | None:
    return when.isoformat() if when is not None else None


class _Quiet(APIHandler):
    """An API handler whose requests are not the server's activity."""

    _track_activity = False


class _HubCall(_Quiet):
    """Calls the hub's mig-spawner API with this server's token."""

    async def hub(self, method: str, path: str) -> Any:
        api = os.environ.get("JUPYTERHUB_API_URL", "").rstrip("/")
        token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        if not api or not token:
            raise web.HTTPError(404, "not a JupyterHub server")
        request = HTTPRequest(
            f"{api}/mig-spawner/{path}", method=method,
            headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
            body="{}" if method == "POST" else None, request_timeout=20,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except (HTTPClientError, OSError) as e:
            self.log.warning("mig-spawner: hub %s %s failed: %s", method, path, e)
            raise web.HTTPError(502, "the hub did not answer; try again") from None
        return json.loads(response.body)


def _server_name() -> str:
    return os.environ.get("JUPYTERHUB_SERVER_NAME", "")


class WarningHandler(_HubCall):
    """This server's pending warning, or ``{"warning": null}``."""

    @web.authenticated
    async def get(self) -> None:
        _seen(self, interaction=False)
        found = await self.hub("GET", "warnings")
        mine = [w for w in found.get("warnings", []) if w.get("server") == _server_name()]
        self.finish({"warning": mine[0] if mine else None})


class KeepHandler(_HubCall):
    """Keep this server (passed on to the hub)."""

    @web.authenticated
    async def post(self) -> None:
        self.finish(await self.hub("POST", f"keep/{quote(_server_name(), safe='')}"))


class ActivityHandler(_Quiet):
    """What people did here, as the page reports it."""

    @web.authenticated
    def post(self) -> None:
        _seen(self, interaction=True)
        self.set_status(204)
        self.finish()


class _ForTheService(_Quiet):
    """A handler that answers a JupyterHub service only (the slice service): a person
    is refused, the server's owner too, who has the kernels API for their own use."""

    def caller(self) -> str:
        """The calling service's name; 403 for anyone else."""
        hub_user = getattr(self.current_user, "hub_user", None) or {}
        if hub_user.get("kind") != "service":
            raise web.HTTPError(403, "only the slice service may call this")
        return str(hub_user.get("name", ""))


class ProbeHandler(_ForTheService):
    """Everything the slice service reads of this server, in one answer."""

    @web.authenticated
    async def get(self) -> None:
        self.caller()
        kernels = await ensure_async(self.kernel_manager.list_kernels())
        people = self.settings.get(PEOPLE, {})
        self.finish({
            "kernels": kernels,
            # What api/status says (jupyter_server's APIStatusHandler).
            "status": {
                "started": _iso(self.settings.get("started")),
                "last_activity": _iso(self.application.last_activity()),
                "connections": sum(k["connections"] for k in kernels),
                "kernels": len(kernels),
            },
            "people": {
                "page_seen": _iso(people.get("page_seen")),
                "interaction": _iso(people.get("interaction")),
                "terminal": _iso(self.settings.get("terminal_last_activity")),
            },
        })


class CullHandler(_ForTheService):
    """Shut down the kernels the slice service decided to cull, in one request:
    ``{"kernels": [{"id", "last_activity"}], "cull_busy", "cull_connected"}``, each
    ``last_activity`` the one it judged. Answers which were ``shut_down``, ``kept`` (in
    use since the look), ``unknown`` (no such kernel here) and ``failed``."""

    @web.authenticated
    async def post(self) -> None:
        service = self.caller()
        asked, cull_busy, cull_connected = self._asked()
        km = self.kernel_manager
        running = {k["id"]: kernel_from_model(k)
                   for k in await ensure_async(km.list_kernels())}
        plan = recheck_kernels(running, asked, cull_busy, cull_connected)
        if plan.unknown:
            self.log.warning("mig-spawner: service %s asked to shut down kernels this "
                             "server does not have: %s", service, ", ".join(plan.unknown))
        outcomes = await asyncio.gather(
            *(ensure_async(km.shutdown_kernel(k)) for k in plan.shut_down),
            return_exceptions=True)
        failed = []
        for kernel_id, outcome in zip(plan.shut_down, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self.log.error("mig-spawner: shutting kernel %s down failed: %r",
                               kernel_id, outcome)
                failed.append(kernel_id)
        self.finish({"shut_down": [k for k in plan.shut_down if k not in failed],
                     "kept": list(plan.kept), "unknown": list(plan.unknown),
                     "failed": failed})

    def _asked(self) -> tuple[list[tuple[str, datetime | None]], bool, bool]:
        """The request's kernels (id, judged activity) and flags; 400 if malformed."""
        try:
            body = json.loads(self.request.body or b"{}")
            asked = [(str(k["id"]), parse_timestamp(k.get("last_activity")))
                     for k in body["kernels"]]
            return asked, bool(body.get("cull_busy")), bool(body.get("cull_connected"))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise web.HTTPError(400, f"expected {{'kernels': [{{'id', 'last_activity'}}]}}: "
                                f"{e!r}") from None


class ScriptHandler(web.StaticFileHandler):
    """Serves notice.js (no authentication needed: it holds no data)."""


def _script_tag(base_url: str) -> bytes:
    poll = os.environ.get("MIG_SPAWNER_NOTICE_POLL", str(DEFAULT_POLL))
    src = url_path_join(base_url, "mig-spawner", "notice.js")
    return (f'<script src="{src}" data-base-url="{base_url}" data-poll="{float(poll):g}" '
            'id="mig-spawner-notice"></script>').encode()


def _inject_into_lab(base_url: str) -> type[OutputTransform]:
    tag = _script_tag(base_url)

    class InjectNotice(OutputTransform):
        """Adds the notice script to JupyterLab's page (rendered in one chunk)."""

        def __init__(self, request: Any) -> None:
            self.lab = "/lab" in request.path

        def transform_first_chunk(self, status_code: int, headers: Any, chunk: bytes,
                                  finishing: bool) -> tuple[int, Any, bytes]:
            html = headers.get("Content-Type", "").startswith("text/html")
            if self.lab and finishing and html and b"jupyter-config-data" in chunk:
                chunk = chunk.replace(b"</body>", tag + b"</body>", 1)
                if "Content-Length" in headers:
                    headers["Content-Length"] = str(len(chunk))
            return status_code, headers, chunk

    return InjectNotice


def _load_jupyter_server_extension(serverapp: Any) -> None:
    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [
        (url_path_join(base, "mig-spawner", "warning"), WarningHandler),
        (url_path_join(base, "mig-spawner", "keep"), KeepHandler),
        (url_path_join(base, "mig-spawner", "activity"), ActivityHandler),
        (url_path_join(base, "mig-spawner", "probe"), ProbeHandler),
        (url_path_join(base, "mig-spawner", "cull"), CullHandler),
        (url_path_join(base, "mig-spawner", "(notice\\.js)"), ScriptHandler,
         {"path": str(STATIC)}),
    ])
    web_app.transforms.insert(0, _inject_into_lab(base))
    # What LabApp.expose_app_in_browser sets: window.jupyterapp, whose commands the
    # script uses. Extensions load in name order, so this comes after JupyterLab's.
    web_app.settings.setdefault("page_config_data", {})["exposeAppInBrowser"] = True
    serverapp.log.info("mig-spawner: warnings before a stop shown in JupyterLab")
