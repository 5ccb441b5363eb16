"""Fixtures the whole suite shares: the PostgreSQL server started for the session, a
fresh ledger database on each backend and an open SQLite ledger, the stand-in for a
hub (stopped when its test ends), the run's real Kubernetes cluster and each test's
namespace on it (``kube``, tests/support/kube_fixture.py); how the tests spread over
the pytest-xdist workers (tests/support/scheduling.py), and the reaper that ends what
they started when the run ends, however it ends (tests/support/reaper.py)."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from mig_spawner.hub.client import HubClient
from mig_spawner.ledger import Ledger
from tests.support.hub_standin import StandinState, listen

#: Hooks and fixtures of the whole suite: how it spreads over xdist's workers, that
#: nothing it starts outlives it, the PostgreSQL server (``postgres_server``,
#: ``postgres_url``) and the Kubernetes cluster (``kube_cluster``, ``kube``).
pytest_plugins = ["tests.support.scheduling", "tests.support.reaper",
                  "tests.support.pg_fixture", "tests.support.kube_fixture"]


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
