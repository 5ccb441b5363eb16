"""The slice map served as a JupyterHub managed service, for tests/test_slicemap_browser.py.

The hub starts this script (``c.JupyterHub.services``) with its ``JUPYTERHUB_*``
environment; it serves the observe package's routes and ``/metrics`` on the service URL,
reading the simulated GPU (``MIG_SPAWNER_SIM_STATE``) and the ledger
(``MIG_SLICEMAP_LEDGER_URL``). In production the slice service mounts the same routes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from pathlib import Path
from urllib.parse import urlparse

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from tornado import web

sys.path.insert(0, str(Path(__file__).parent))
from observe_world import POLICY

from mig_spawner import gpu
from mig_spawner.core.policy import build_policy
from mig_spawner.ledger import Ledger
from mig_spawner.observe.gpu_metrics import SliceCollector
from mig_spawner.observe.slicemap import slicemap_routes
from mig_spawner.observe.source import SliceSource


class Metrics(web.RequestHandler):
    def initialize(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.registry))


async def main() -> None:
    source = SliceSource(
        gpu.connect(None, os.environ["MIG_SPAWNER_SIM_STATE"]),
        Ledger.open(os.environ["MIG_SLICEMAP_LEDGER_URL"]),
        build_policy(offers=None, classes=None, groups=POLICY),
        idle_after=float(os.environ.get("MIG_SLICEMAP_IDLE_AFTER", "900")),
        max_age=0,
    )
    registry = CollectorRegistry()
    registry.register(SliceCollector(source.snapshot))
    prefix = os.environ["JUPYTERHUB_SERVICE_PREFIX"]
    routes = slicemap_routes(prefix, source.snapshot, refresh_seconds=1)
    routes.append((prefix.rstrip("/") + "/metrics", Metrics, {"registry": registry}))
    # HubOAuth keeps the user's token in a secure cookie: the application needs a secret.
    app = web.Application(routes, cookie_secret=secrets.token_bytes(32))
    where = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app.listen(where.port, where.hostname)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
