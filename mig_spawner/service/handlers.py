"""HTTP endpoints of the slice service: ``/health`` (JSON) and ``/metrics`` (Prometheus);
the admin slice map (:mod:`mig_spawner.observe.slicemap`) is mounted beside them."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tornado import web

from mig_spawner.service.metrics import ServiceMetrics


class HealthHandler(web.RequestHandler):
    """``200 {"status": "ok", ...}`` while sweeps succeed; ``503`` with the last
    error while the hub (or the ledger) cannot be reached, so a probe can alert."""

    def initialize(self, health: Callable[[], dict[str, Any]]) -> None:
        self._health = health

    def get(self) -> None:
        report = self._health()
        self.set_status(200 if report["status"] == "ok" else 503)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(report))


class MetricsHandler(web.RequestHandler):
    """The service's own registry in Prometheus text format."""

    def initialize(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

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
