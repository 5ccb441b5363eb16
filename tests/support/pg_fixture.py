"""A throwaway PostgreSQL cluster for the test session, from the distribution's binaries.

``tests/conftest.py`` loads it as a plugin (``pytest_plugins``), for every test.

``postgres_server`` (session scope: one per pytest-xdist worker) runs ``initdb`` +
``pg_ctl start`` in a private temporary directory and stops the cluster at the end.
It listens only on a unix socket inside that directory, so parallel test runs and
workers can never collide on a port. ``postgres_url`` (function scope) creates a fresh
database per test and returns its SQLAlchemy URL. ``postgres_cluster()`` gives a test a
cluster of its own, which it may stop and start (``stop()``, ``start()``).

When the binaries are missing the tests skip, loudly. Set
``MIG_SPAWNER_REQUIRE_SYSTEM=1`` (``make test`` does) to make that a failure instead,
and ``MIG_SPAWNER_PG_BIN`` to point at another ``bin`` directory.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import reaper
from tests.support.system_deps import missing

_DB_NAMES = itertools.count()


def _find_bin_dir() -> Path | None:
    explicit = os.environ.get("MIG_SPAWNER_PG_BIN")
    candidates = (
        [explicit]
        if explicit
        else sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))[
            ::-1
        ]
    )
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").is_file():
            return Path(candidate)
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def _free_port() -> int:
    # Only names the socket file (.s.PGSQL.<port>) in our private directory;
    # a free TCP port keeps the number unsurprising for anyone reading logs.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PostgresServer:
    """A running throwaway cluster: connect through ``socket_dir`` and ``port``."""

    bin_dir: Path
    socket_dir: Path
    port: int
    run_as: tuple[str, ...]

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (beside its socket)."""
        return self.socket_dir / "data"

    def start(self) -> None:
        """Start the cluster (again, after :meth:`stop`) and wait until it accepts
        connections."""
        # Durability off: this cluster lives for one test session.
        options = (
            f"-k {self.socket_dir} -p {self.port} -c listen_addresses='' -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=60"
        )
        _run(self.run_as, str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir),
             "-l", str(self.socket_dir / "postgres.log"), "-o", options, "-w", "-t", "60",
             "start")

    def stop(self, mode: str = "immediate") -> None:
        """Stop the cluster: ``immediate`` (the default) as a crash would, every
        connection cut with no shutdown checkpoint; ``fast`` or ``smart`` as an admin."""
        _run(self.run_as, str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir),
             "-m", mode, "-w", "stop")

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL of ``database`` on this cluster (user ``postgres``, trust auth)."""
        return f"postgresql+psycopg2://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def psql(self, sql: str) -> str:
        """Run one SQL command as the superuser and return its output."""
        result = subprocess.run(
            [
                *self.run_as,
                str(self.bin_dir / "psql"),
                "-h",
                str(self.socket_dir),
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-XAtqc",
                sql,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"psql {sql!r} failed: {result.stderr.strip()}")
        return result.stdout

    def block(self, database: str) -> None:
        """Make ``database`` unusable, as an outage would: refuse new connections and
        end the open ones."""
        self.psql(f"ALTER DATABASE {database} ALLOW_CONNECTIONS false")
        self.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database}'"
        )

    def unblock(self, database: str) -> None:
        """End what :meth:`block` did."""
        self.psql(f"ALTER DATABASE {database} ALLOW_CONNECTIONS true")


def _run(run_as: tuple[str, ...], *argv: str) -> None:
    result = subprocess.run(
        [*run_as, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )


@contextmanager
def postgres_cluster() -> Iterator[PostgresServer]:
    """A private PostgreSQL cluster, running until the ``with`` block ends; then stopped
    and deleted. For a test that stops and starts its own (``postgres_server`` is shared
    by every test of a worker)."""
    bin_dir = _find_bin_dir()
    if bin_dir is None:
        reason = (
            "PostgreSQL server binaries not found (looked in /usr/lib/postgresql/*/bin, "
            "$MIG_SPAWNER_PG_BIN and PATH): install postgresql (Debian: apt-get install "
            "postgresql-15) to run the PostgreSQL ledger tests"
        )
        missing(reason)

    # initdb refuses to run as root; the cluster then belongs to the postgres user,
    # in a directory of its own outside pytest's root-only (0700) tmp tree: in the test
    # run's folder, which goes with the run however it ends.
    run_as: tuple[str, ...] = ()
    base = Path(tempfile.mkdtemp(prefix="mig-spawner-pg-", dir=reaper.run_dir()))
    if os.geteuid() == 0:
        run_as = ("runuser", "-u", "postgres", "--")
        shutil.chown(base, user="postgres", group="postgres")
    server = PostgresServer(bin_dir=bin_dir, socket_dir=base, port=_free_port(), run_as=run_as)
    started = False
    try:
        _run(
            run_as,
            str(bin_dir / "initdb"),
            "-D",
            str(server.data_dir),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        reaper.register_cluster(server.data_dir)  # stopped too if the run is interrupted
        server.start()
        started = True
        yield server
    finally:
        if started:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
        reaper.forget_cluster(server.data_dir)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """Start a private PostgreSQL cluster for the whole session (of this pytest-xdist
    worker: each has its own); stop and delete it after."""
    with postgres_cluster() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A fresh, empty database on the session's cluster, as a SQLAlchemy URL."""
    name = f"test_{os.getpid()}_{next(_DB_NAMES)}"
    postgres_server.psql(f"CREATE DATABASE {name}")
    return postgres_server.url(name)
