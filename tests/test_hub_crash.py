"""Crashes in the middle of a burst of spawns, on a real hub: ``kill -9`` of the hub, of
the slice service beside it, and PostgreSQL stopped as a crash would stop it.

The restarted hub must converge in seconds: every server process it no longer tracks
is stopped (or still tracked, and kept), every lease is held by exactly one server the
hub runs, and the spawns that follow never put one MIG device in two live servers'
environments. The environments are read from the processes (/proc/<pid>/environ).

The hub is killed at two points: while leases are claimed and no server process exists
yet (a slow step between claim and spawn holds the burst there), and as soon as the
first server process exists (before the hub saved its state: the case that gave one
slice to two servers). Both on SQLite and on PostgreSQL. No slice service runs: the
hub alone must get it right.

The slice service is killed twice (while the burst's leases wait between claim and
spawn, longer than its orphan grace, and as the first server process appears) and
started again each time: a restarted service must take no pending or fresh server for
an orphan, and the burst must end as if it had never died. PostgreSQL is stopped with
``pg_ctl stop -m immediate`` while the burst's servers start (their claims committed,
their activations not yet written) and started again seconds later: what failed
meanwhile must be given back once the database is back, what runs must keep its lease.

After each crash the same checks: no MIG device in two live servers' environments, and
no lease lost: every live server holds a lease for its device, every held lease has a
live holder or says it is releasing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mig_spawner.ledger import Ledger
from tests.support.hub_harness import PAUSE_BEFORE_SPAWN, HubError, HubProcess, start_mig_hub
from tests.support.live_servers import (
    assert_no_lease_lost,
    assert_one_server_per_slice,
    environ_of,
    servers_of,
)
from tests.support.pg_fixture import postgres_cluster
from tests.support.polling import until
from tests.support.slice_service import SERVICE_CONFIG, Service

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*7"
BURST = 4  # users spawning at once when the hub dies
AFTER = 5  # servers started after the restart
CONVERGE = 30.0  # seconds the restarted hub has to stop or adopt what it lost
USERS = [f"u{i}" for i in range(AFTER)]

EXTRA = """
c.Spawner.poll_interval = 1
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.MIGPolicyConfig.group_policies["crowd"] = {"allowed": ["small"]}
"""


def running_users(hub: HubProcess) -> set[str]:
    return {u["name"] for u in hub.users() if u.get("servers")}


def converged(hub: HubProcess, ledger: Ledger, tag: str) -> bool:
    """Every lease held by a server the hub runs, every server process one of those."""
    held = {lease.user for lease in ledger.leases.active()}
    live = {env["JUPYTERHUB_USER"] for env in servers_of(tag).values()}
    running = running_users(hub)
    return held == running and live <= running


def kill_hub(hub: HubProcess) -> None:
    os.killpg(hub.proc.pid, signal.SIGKILL)  # the hub and its proxy; servers live on
    hub.proc.wait(10)


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.sqlite"
    return request.getfixturevalue("postgres_url")


@contextlib.contextmanager
def burst_hub(workdir: Path, ledger_url: str, extra: str = ""
              ) -> Iterator[tuple[HubProcess, Ledger, str]]:
    """A hub whose spawns wait while ``workdir/pause`` exists, with the users ``USERS``
    in a group allowed small slices; yields it, its ledger and the tag its servers
    carry. Stops it at the end and kills every server of it (a graceful stop of each,
    through the hub, would only take time: nothing is checked after the test)."""
    # Servers carry the tag in their environment, so that only this hub's count.
    tag = f"{os.getpid()}-{workdir.name}"
    hub = start_mig_hub(workdir, SIM, EXTRA + PAUSE_BEFORE_SPAWN + extra + (
        f"\nc.MIGSettings.ledger_url = {ledger_url!r}"
        f"\nc.Spawner.environment = {{'MIG_TEST_HUB': {tag!r}}}\n"
    ))
    ledger = Ledger.open(ledger_url)
    try:
        hub.create_users(USERS, groups=["crowd"])
        yield hub, ledger, tag
    finally:
        with contextlib.suppress(HubError):
            hub.stop_hub()
        for pid in servers_of(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ledger.close()


def fill_and_check(hub: HubProcess, ledger: Ledger, tag: str, kept: set[str]) -> None:
    """After a crash: start every user's server but ``kept`` (still running), then check
    that each MIG device is in one server, and each server holds its device's lease.
    The spawns go at once, as a burst: one after the other, each waits for a whole
    server start."""
    def start(user: str) -> None:
        r = hub.spawn(user, {"profile": "small"})
        assert r.status_code in (201, 202), r.text

    def ready(user: str) -> None:
        if user not in kept:
            start(user)
        try:
            hub.wait_ready(user, timeout=120)
        except HubError:
            if user not in kept or hub.server_model(user) is not None:
                raise
            # A server kept at the restart may still end by itself: one that started
            # while the hub was down cannot reach it and exits. Its user starts it again.
            start(user)
            hub.wait_ready(user, timeout=120)

    with ThreadPoolExecutor(len(USERS)) as pool:
        list(pool.map(ready, USERS))
    by_uuid = assert_one_server_per_slice(tag)
    assert sorted(by_uuid.values()) == USERS
    leases = {lease.user: lease.mig_uuid for lease in ledger.leases.active()}
    assert leases == {user: uuid for uuid, user in by_uuid.items()}
    assert_no_lease_lost(ledger, tag)


@pytest.mark.parametrize("kill_at", ["claimed", "first-process"])
def test_hub_killed_mid_burst_never_gives_one_slice_to_two_servers(
    tmp_path, ledger_url, kill_at
):
    pause = tmp_path / "pause"  # the hub runs in tmp_path
    if kill_at == "claimed":
        pause.touch()
    with burst_hub(tmp_path, ledger_url) as (hub, ledger, tag):
        with ThreadPoolExecutor(BURST) as pool:
            for user in USERS[:BURST]:
                pool.submit(_spawn_quietly, hub, user)
            if kill_at == "claimed":
                until(lambda: len(ledger.leases.active()) == BURST, 60, "the burst's leases",
                      show=hub.log_path)
                assert not servers_of(tag)
            else:
                until(lambda: servers_of(tag), 60, "a first server process", show=hub.log_path)
            kill_hub(hub)
        pause.unlink(missing_ok=True)
        left = servers_of(tag)
        assert_one_server_per_slice(tag)

        hub._launch(120)  # the same config, database and ports
        restarted = time.monotonic()
        until(lambda: converged(hub, ledger, tag), CONVERGE,
              f"hub converged (left running at the kill: {sorted(left)})",
              show=(hub.log_path, ledger.leases.active))
        took = time.monotonic() - restarted
        kept = running_users(hub)
        # Whatever the hub did not keep was stopped; what it kept it still runs.
        for pid, env in left.items():
            assert (environ_of(pid) is not None) == (env["JUPYTERHUB_USER"] in kept), (pid, env)

        # More spawns, up to every slice of the GPU.
        fill_and_check(hub, ledger, tag, kept)
        print(f"{kill_at}: {len(left)} server processes at the kill, "
              f"{len(kept)} kept; converged {took:.1f}s after the restart "
              f"({time.monotonic() - restarted:.1f}s to {AFTER} servers)")


#: The shipped sweep (1 min) and orphan grace (5 min), minutes as seconds.
SWEEP, ORPHAN_GRACE = 1, 5
SERVICE_EXTRA = SERVICE_CONFIG + f"""
c.SliceServiceApp.cull_every = {SWEEP}
c.SliceServiceApp.orphan_grace = {ORPHAN_GRACE}
"""


def test_slice_service_killed_mid_burst_releases_nothing_live(tmp_path):
    ledger_url = f"sqlite:///{tmp_path}/mig_spawner_ledger.sqlite"  # the service's
    pause = tmp_path / "pause"
    pause.touch()
    with burst_hub(tmp_path, ledger_url, SERVICE_EXTRA) as (hub, ledger, tag):
        service = Service(hub, hub.config_path)
        try:
            service.wait_up()
            with ThreadPoolExecutor(BURST) as pool:
                for user in USERS[:BURST]:
                    pool.submit(_spawn_quietly, hub, user)
                until(lambda: len(ledger.leases.active()) == BURST, 60, "the burst's leases",
                      show=hub.log_path)
                claimed = {lease.user: lease.id for lease in ledger.leases.active()}
                service = restart_service(hub, service)
                # Held between claim and spawn for longer than the grace after which the
                # service releases a lease whose server the hub does not run: sweeps
                # past it have left them.
                service.swept(after=datetime.now(UTC) + timedelta(seconds=ORPHAN_GRACE),
                              times=3)
                pause.unlink()
                until(lambda: servers_of(tag), 60, "a first server process", show=hub.log_path)
                service = restart_service(hub, service)
            for user in USERS[:BURST]:
                hub.wait_ready(user, timeout=120)
            assert {lease.user: lease.id for lease in ledger.leases.active()} == claimed
            fill_and_check(hub, ledger, tag, set(USERS[:BURST]))
            orphans = [lease for lease in ledger.leases.history() if lease.release_code == "orphan"]
            assert not orphans, service.log()
            assert service.proc.poll() is None, service.log()
        finally:
            service.close()


def restart_service(hub: HubProcess, service: Service) -> Service:
    """``kill -9`` the slice service, start it again; return the new one once it is up."""
    service.proc.kill()
    service.proc.wait(10)
    again = Service(hub, hub.config_path)
    again.wait_up()
    return again


OUTAGE = 5.0  # seconds PostgreSQL is down


def test_postgresql_stopped_mid_burst_loses_no_lease(tmp_path):
    pause = tmp_path / "pause"
    pause.touch()
    with postgres_cluster() as pg:
        pg.psql("CREATE DATABASE crash_ledger")
        with burst_hub(tmp_path, pg.url("crash_ledger")) as (hub, ledger, tag):
            with ThreadPoolExecutor(BURST + 1) as pool:
                for user in USERS[:BURST]:
                    pool.submit(_spawn_quietly, hub, user)
                until(lambda: len(ledger.leases.active()) == BURST, 60, "the burst's leases",
                      show=hub.log_path)
                pg.stop("immediate")
                try:
                    pause.unlink()  # the servers start, their leases unwritten
                    spawning = pool.submit(hub.spawn, USERS[BURST], {"profile": "small"})
                    time.sleep(OUTAGE)  # the outage's length is the scenario, not a wait
                finally:
                    pg.start()
                late = spawning.result(120)
            # A spawn the database could not take: refused in words, without the
            # database's name or where it lives, or taken once it was back.
            assert late.status_code in (201, 202, 503), late.text
            if late.status_code == 503:
                assert "ledger cannot be read" in late.json()["message"]
                for internal in ("crash_ledger", str(pg.socket_dir), "postgres", "://"):
                    assert internal not in late.text
            back = time.monotonic()
            until(lambda: not any(u["servers"] and not u["servers"][""]["ready"]
                                  for u in hub.users()) and converged(hub, ledger, tag),
                  CONVERGE, "spawns ended and the hub converged after the outage",
                  show=(hub.log_path, ledger.leases.active))
            took = time.monotonic() - back
            assert_one_server_per_slice(tag)
            assert_no_lease_lost(ledger, tag)
            fill_and_check(hub, ledger, tag, running_users(hub))
            print(f"PostgreSQL down {OUTAGE:.0f}s mid-burst: {len(running_users(hub))} "
                  f"servers; converged {took:.1f}s after it came back; the spawn during "
                  f"the outage: {late.status_code}")


def _spawn_quietly(hub: HubProcess, user: str) -> None:
    """A spawn request whose hub may die under it."""
    with contextlib.suppress(Exception):
        hub.spawn(user, {"profile": "small"})
