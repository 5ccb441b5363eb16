"""Fixtures the whole suite shares: the PostgreSQL server started for the session, a
fresh ledger database on each backend and an open SQLite ledger, the stand-ins for a
hub and for the Kubernetes API, each stopped when its test ends; how the tests
spread over the pytest-xdist workers (tests/support/scheduling.py), and the reaper that
ends what they started when the run ends, however it ends (tests/support/reaper.py)."""

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
from tests.support.kube_admission import documented_roles
from tests.support.kube_objects import write_kubeconfig
from tests.support.kube_standin import KubeStandin
from tests.support.spawners import REPO

#: Hooks and fixtures of the whole suite: how it spreads over xdist's workers, that
#: nothing it starts outlives it, and the PostgreSQL server (``postgres_server``,
#: ``postgres_url``).
pytest_plugins = ["tests.support.scheduling", "tests.support.reaper",
                  "tests.support.pg_fixture"]


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


@pytest.fixture
async def kube_standin() -> AsyncIterator[KubeStandin]:
    """The stand-in Kubernetes API server, running for one test."""
    server = KubeStandin()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def kube(kube_standin: KubeStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> AsyncIterator[KubeStandin]:
    """The stand-in Kubernetes API server as the hub sees it: KubeSpawner's default
    kubeconfig, and the hub may do what the Roles in docs/kubernetes.md allow, no more.
    KubeSpawner's pod reflectors (kept per class) stop with the test."""
    kube_standin.rbac = documented_roles(REPO / "docs" / "kubernetes.md")
    path = write_kubeconfig(tmp_path / "kubeconfig", kube_standin.url)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", path)
    yield kube_standin
    for reflector in list(KubeSpawner.reflectors.values()):
        await reflector.stop()
    KubeSpawner.reflectors.clear()
    KubeMIGSpawner._readers.clear()


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    """The URL of a new ledger on SQLite in the test's directory (not yet opened)."""
    return f"sqlite:///{tmp_path / 'ledger.sqlite'}"


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


@pytest.fixture(autouse=True)
async def close_hub_clients() -> AsyncIterator[None]:
    """Every :class:`HubClient` a test made is closed when it ends, in its event loop:
    aiohttp says so when a kept-alive session is left open (at the worker's exit, long
    after the test)."""
    made: weakref.WeakSet[HubClient] = weakref.WeakSet()
    init = HubClient.__init__

    def tracked(self: HubClient, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.add(self)

    HubClient.__init__ = tracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        HubClient.__init__ = init  # type: ignore[method-assign]
        for client in list(made):
            await client.close()
