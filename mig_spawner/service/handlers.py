"""HTTP endpoints of the slice service: ``/health`` (JSON) and ``/metrics`` (Prometheus);
the admin slice map (:mod:`mig_spawner.observe.slicemap`) is mounted beside them.

Private by default: ``/metrics`` names users, groups and MIG devices, so it answers only
a hub token carrying :data:`METRICS_SCOPE` (``Authorization: Bearer <token>``, as
Prometheus sends with ``authorization: credentials_file``); ``/health`` says only
whether sweeps succeed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from jupyterhub.services.auth import HubAuth, HubAuthenticated, HubOAuth
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tornado import web

from mig_spawner.service.metrics import ServiceMetrics

#: The custom scope a token needs to read ``/metrics`` (defined and granted in
#: ``jupyterhub_config.d/30-slice-service.py``; docs/operations.md).
METRICS_SCOPE = "custom:mig-spawner:metrics"
METRICS_SCOPE_DESCRIPTION = "Read the slice service's Prometheus metrics (who holds which slice)."


class HealthHandler(web.RequestHandler):
    """``200 {"status": "ok"}`` while sweeps succeed; ``503`` with ``starting`` or
    ``failing`` otherwise, so a probe can alert. Nothing else: anyone may ask, and
    the reasons (with hosts and URLs) are in the service's log."""

    def initialize(self, health: Callable[[], dict[str, Any]]) -> None:
        self._health = health

    def get(self) -> None:
        status = self._health()["status"]
        self.set_status(200 if status == "ok" else 503)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": status}))


class MetricsHandler(HubAuthenticated, web.RequestHandler):
    """The service's own registry in Prometheus text format, for a bearer token with
    :data:`METRICS_SCOPE`: 401 without a token, 403 with one that lacks the scope."""

    # The slice map's class: one HubAuth singleton per process, whichever handler asks.
    hub_auth_class = HubOAuth
    hub_scopes = {METRICS_SCOPE}

    def initialize(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def prepare(self) -> None:
        # A header token only: a scraper has no cookie, and no token means no hub call.
        if not HubAuth.auth_header_pat.match(self.request.headers.get("Authorization", "")):
            raise web.HTTPError(401)
        if self.get_current_user() is None:
            raise web.HTTPError(403)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        if status_code == 401:
            self.set_header("WWW-Authenticate", 'Bearer realm="mig-spawner"')
        if status_code in (401, 403):
            self.finish(
                f"{status_code}: the slice service's metrics need a hub token with the "
                f"'{METRICS_SCOPE}' scope, sent as 'Authorization: Bearer <token>' "
                "(docs/operations.md).\n")
            return
        super().write_error(status_code, **kwargs)

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self._metrics.registry))


def make_web_app(
    prefix: str,
    metrics: ServiceMetrics,
    health: Callable[[], dict[str, Any]],
    extra_routes: Sequence[Any] = (),
    **settings: Any,
) -> web.Application:
    """Routes at ``/health`` and ``/metrics``, and also under the service prefix
    (``/services/<name>/``) where the hub's proxy forwards requests unchanged.

    ``extra_routes`` (the slice map's) are added as given; ``settings`` go to the
    tornado application (the slice map's OAuth cookie needs a ``cookie_secret``)."""
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    roots = {"/", prefix}
    routes: list[Any] = []
    for root in sorted(roots):
        routes.append((root + "health", HealthHandler, {"health": health}))
        routes.append((root + "metrics", MetricsHandler, {"metrics": metrics}))
    routes.extend(extra_routes)
    return web.Application(routes, **settings)
