"""Fixtures the whole suite shares: the PostgreSQL server started for the session, a
fresh ledger database on each backend and an open SQLite ledger, the stand-in for a
hub (stopped when its test ends), the run's real Kubernetes cluster and each test's
namespace on it (tests/support/kube_fixture.py); and how the tests spread over the
pytest-xdist workers (tests/support/scheduling.py)."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio.config import kube_config
from kubespawner import KubeSpawner

from mig_spawner.hub.client import HubClient
from mig_spawner.ledger import Ledger
from mig_spawner.spawner.kube import KubeMIGSpawner
from tests.support.hub_standin import StandinState, listen
from tests.support.kube_fixture import kube, kube_cluster  # noqa: F401
from tests.support.pg_fixture import postgres_server, postgres_url  # noqa: F401
from tests.support.scheduling import pytest_collection_modifyitems  # noqa: F401


@pytest.fixture
async def serve_hub() -> AsyncIterator[Callable[[StandinState], str]]:
    """Serves a stand-in hub's state over HTTP in the test's event loop:
    ``base = serve_hub(state)`` gives the base URL (the hub API is under
    ``{base}/hub/api``); every one started is stopped at the end of the test."""
    servers = []

    def serve(state: StandinState) -> str:
        server, port = listen(state)
        servers.append(server)
        return f"http://127.0.0.1:{port}"

    yield serve
    for server in servers:
        server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty ledger database, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[Ledger]:
    """A new ledger on SQLite in the test's directory, open for the test (modules that
    need another clock or backend define their own)."""
    with Ledger.open(ledger_url) as opened:
        yield opened
