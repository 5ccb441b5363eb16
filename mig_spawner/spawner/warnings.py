"""The hub's side of the warning before the slice service stops a server.

The slice service records a pending warning on the lease (which stop, when). Here the
hub serves it to the user and takes the answer:

- ``GET /hub/api/mig-spawner/warnings``: the current user's own servers with a
  pending warning (reason, time left, whether Keep can still extend);
- ``POST /hub/api/mig-spawner/keep/<server name>``: "Keep my server" for one of the
  current user's own servers (:meth:`mig_spawner.ledger.warnings.Warnings.keep`).

Both act only on the servers of the user who calls them: a browser logged in to the
hub (cookie, with the xsrf token JupyterHub's pages carry), or the user's single-user
server with its own ``JUPYTERHUB_API_TOKEN`` (the extension in
:mod:`mig_spawner.singleuser`). They need the caller to hold ``users:activity`` for
that user, which both have and which a Keep is: activity. Anyone else gets 403 (an API
answers, it does not redirect to the login page). A warning whose stop is more than
:data:`STALE_AFTER` overdue is not shown: the stop did not come (the slice service
withdraws it at its next sweep). The hub's home page shows
the notice through the template in ``templates/hub`` (:func:`configure_hub`).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import has_scope
from prometheus_client import Counter
from tornado import web

from mig_spawner.core.durations import format_duration, rounded_duration
from mig_spawner.core.keep import keep_can_help
from mig_spawner.core.lifecycle import StopRule
from mig_spawner.ledger import Lease

TEMPLATES = Path(__file__).resolve().parents[1] / "templates" / "hub"
#: Enables the single-user extension (and lets its script reach JupyterLab's commands).
SINGLEUSER_CONFIG = Path(__file__).resolve().parents[1] / "singleuser" / "jupyter-config"

KEEPS = Counter(
    "mig_spawner_keeps", "Answers to a warning ('Keep my server'), by outcome.",
    ["outcome", "reason", "group"],
)

#: Seconds past its deadline after which a pending warning is no longer shown.
STALE_AFTER = 60.0

REASONS = {
    StopRule.SERVER_IDLE: "it has not been used for a while",
    StopRule.KERNEL_IDLE: "unused for a while; its variables are lost, the server stays",
    StopRule.MAX_SESSION_AGE: "it reached your group's longest session",
    StopRule.BUDGET: "its GPU-hour budget runs out",
    StopRule.DRAIN: "an admin is re-cutting its GPU",
    StopRule.GPU_FAULT: "its GPU reported a hardware fault",
}


def notice(lease: Lease, now: datetime, extend_by: float | None, max_extensions: int
           ) -> dict[str, Any]:
    """What the pages show for one warned server: plain words, no URLs or hosts, and
    short (JupyterLab cuts a notification's text at 140 characters)."""
    deadline = lease.warning_deadline or now
    left = max(0.0, (deadline - now).total_seconds())
    rule = StopRule(lease.warning or StopRule.SERVER_IDLE)
    extensions_left = max(0, max_extensions - (lease.extensions or 0)) if extend_by else 0
    if rule is StopRule.GPU_FAULT and lease.warning_deadline is None:
        # The group leaves such servers to finish: told, not stopped.
        name = f" {lease.server_name}" if lease.server_name else ""
        return {
            "server": lease.server_name, "reason": rule, "seconds_left": None,
            "deadline": None, "keep": False,
            "message": f"The GPU of your server{name}"
                       " reported a hardware fault: save your work, it may fail any time.",
        }
    if rule in (StopRule.DRAIN, StopRule.GPU_FAULT):
        keep = "Save your work: this stop cannot be put off."
    elif rule is StopRule.MAX_SESSION_AGE:
        keep = (f"Keep adds {format_duration(extend_by)} ({extensions_left} more allowed)."
                if extensions_left else "No more extensions: save your work.")
    elif rule is StopRule.BUDGET:
        keep = "Keep cannot add hours: save your work."
    else:
        keep = "Save your work, or keep it."
    what = f"Your server{' ' + lease.server_name if lease.server_name else ''} stops"
    if rule is StopRule.KERNEL_IDLE:
        what = (f"A kernel of your server{' ' + lease.server_name if lease.server_name else ''}"
                " is shut down")
        keep = "Use it or keep it."
    return {
        "server": lease.server_name,
        "reason": rule,
        "seconds_left": round(left),
        "deadline": deadline.isoformat(),
        # The pages offer "Keep my server" only where it can do something: a re-cut's
        # stop, a spent budget and a session with no extension left cannot be put off
        # (Keep could only refuse).
        "keep": keep_can_help(lease, now, extend_by=extend_by, max_extensions=max_extensions),
        "message": f"{what} in about {rounded_duration(left)}: {REASONS.get(rule, rule)}. {keep}",
    }


def pending(lease: Lease, now: datetime) -> bool:
    """Whether the lease's warning is still one to show: its stop is not long overdue."""
    if lease.warning is None:
        return False
    deadline = lease.warning_deadline
    return deadline is None or (now - deadline).total_seconds() <= STALE_AFTER


class _OwnServers(APIHandler):
    """Base: the calling user's own MIG spawners, and the check that they may act."""

    def _user(self) -> Any:
        user = self.current_user
        if user is None or not hasattr(user, "spawners"):
            raise web.HTTPError(403, "only a user can see or keep their servers")
        if not has_scope(f"users:activity!user={user.name}", self.parsed_scopes, db=self.db):
            raise web.HTTPError(403, "this token may not report activity for the user")
        return user

    @staticmethod
    def _mig_spawners(user: Any) -> dict[str, Any]:
        return {name: spawner for name, spawner in user.spawners.items()
                if hasattr(spawner, "runtime") and spawner.active}

    @staticmethod
    async def _lease(user: Any, name: str, spawner: Any) -> Lease | None:
        return await spawner.runtime.run(
            lambda: spawner.runtime.ledger().leases.active_for_server(user.name, name)
        )

    @staticmethod
    def _limits(spawner: Any, lease: Lease) -> tuple[float | None, int]:
        group = spawner.policies().group(lease.group)
        return group.extend_by, group.max_extensions


class WarningsHandler(_OwnServers):
    """``GET``: the current user's warned servers (see the module docstring)."""

    async def get(self) -> None:
        user = self._user()
        now = datetime.now(UTC)
        found = []
        for name, spawner in self._mig_spawners(user).items():
            lease = await self._lease(user, name, spawner)
            if lease is not None and pending(lease, now):
                found.append(notice(lease, now, *self._limits(spawner, lease)))
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"warnings": found}))


class KeepHandler(_OwnServers):
    """``POST``: "Keep my server" for one of the current user's servers."""

    async def post(self, server_name: str | None = None) -> None:
        user = self._user()
        name = server_name or ""
        spawner = self._mig_spawners(user).get(name)
        lease = await self._lease(user, name, spawner) if spawner is not None else None
        if spawner is None or lease is None:
            raise web.HTTPError(404, "this server is not running")
        extend_by, max_extensions = self._limits(spawner, lease)
        result = await spawner.runtime.run(
            lambda: spawner.runtime.ledger().warnings.keep(
                lease.id, extend_by=extend_by, max_extensions=max_extensions)
        )
        rule = lease.warning or StopRule.SERVER_IDLE
        KEEPS.labels(result.outcome, rule, lease.group).inc()
        self.log.info("Keep of %s/%s (lease %s, %s): %s", user.name, name, lease.id, rule,
                      result.outcome)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"outcome": result.outcome, "message": result.message}))


def warning_environment(env: dict[str, str]) -> dict[str, str]:
    """What a single-user server needs to show the warning in JupyterLab: our Jupyter
    config directory ahead of any in ``env`` (it enables :mod:`mig_spawner.singleuser`;
    other config files still load, since Jupyter merges every directory on the path)."""
    theirs = env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep)
    paths = dict.fromkeys([str(SINGLEUSER_CONFIG), *filter(None, theirs)])
    return {"JUPYTER_CONFIG_PATH": os.pathsep.join(paths)}


def configure_hub(c: Any) -> None:
    """Add the warning's endpoints, the hub home page's notice, the pending page's
    headline (the latest progress step), the admin page's reason for a refused start
    and the 403 page's scope hint to a hub config
    ``c``. mig-spawner's one hub template folder goes first: JupyterHub's own
    templates are the last entry of ``template_paths``, and ours extend them (by their
    ``templates/`` prefix). An admin who wants an own ``home.html`` prepends a folder
    after this call."""
    c.JupyterHub.template_paths.insert(0, str(TEMPLATES))
    c.JupyterHub.extra_handlers.extend([
        (r"/api/mig-spawner/warnings", WarningsHandler),
        (r"/api/mig-spawner/keep(?:/([^/]*))?", KeepHandler),
    ])
