"""``kill -9`` of the hub in the middle of a burst of spawns, on a real hub.

The restarted hub must converge in seconds: every server process it no longer tracks
is stopped (or still tracked, and kept), every lease is held by exactly one server the
hub runs, and the spawns that follow never put one MIG device in two live servers'
environments. The environments are read from the processes (/proc/<pid>/environ).

The hub is killed at two points: while leases are claimed and no server process exists
yet (a slow step between claim and spawn holds the burst there), and as soon as the
first server process exists (before the hub saved its state: the case that gave one
slice to two servers). Both on SQLite and on PostgreSQL. No slice service runs: the
hub alone must get it right.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mig_spawner.ledger import Ledger
from tests.support.hub_harness import PAUSE_BEFORE_SPAWN, HubError, HubProcess, start_mig_hub

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*7"
BURST = 4  # users spawning at once when the hub dies
AFTER = 5  # servers started after the restart
CONVERGE = 30.0  # seconds the restarted hub has to stop or adopt what it lost

EXTRA = """
c.Spawner.poll_interval = 1
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.MIGPolicyConfig.group_policies["crowd"] = {"allowed": ["small"]}
"""


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state in ("Z", "X"):
        return None
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


def servers_of(tag: str) -> dict[int, dict[str, str]]:
    """PID -> environment of every live process a server of the hub ``tag`` runs."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = _environ(int(entry.name))
        if env and "MIG_SPAWNER_LEASE_ID" in env and env.get("MIG_TEST_HUB") == tag:
            found[int(entry.name)] = env
    return found


def assert_one_server_per_slice(tag: str) -> dict[str, str]:
    """No MIG UUID in two live servers' environments (two leases: a server and its
    kernels share one; two runs of one user's server do not); returns UUID -> user."""
    holders: dict[str, set[tuple[str, str]]] = {}
    for env in servers_of(tag).values():
        server = (env["MIG_SPAWNER_LEASE_ID"], env["JUPYTERHUB_USER"])
        holders.setdefault(env["CUDA_VISIBLE_DEVICES"], set()).add(server)
    doubles = {uuid: servers for uuid, servers in holders.items() if len(servers) > 1}
    assert not doubles, f"MIG devices in two live servers: {doubles}"
    return {uuid: next(iter(servers))[1] for uuid, servers in holders.items()}


def running_users(hub: HubProcess) -> set[str]:
    return {u["name"] for u in hub.users() if u.get("servers")}


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def converged(hub: HubProcess, ledger: Ledger, tag: str) -> bool:
    """Every lease held by a server the hub runs, every server process one of those."""
    held = {lease.user for lease in ledger.active()}
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


@pytest.mark.parametrize("kill_at", ["claimed", "first-process"])
def test_hub_killed_mid_burst_never_gives_one_slice_to_two_servers(
    tmp_path, ledger_url, kill_at
):
    # Servers carry the tag in their environment, so that only this hub's count.
    tag = f"{os.getpid()}-{tmp_path.name}"
    hub = start_mig_hub(tmp_path, SIM, EXTRA + PAUSE_BEFORE_SPAWN + (
        f"\nc.MIGSettings.ledger_url = {ledger_url!r}"
        f"\nc.Spawner.environment = {{'MIG_TEST_HUB': {tag!r}}}\n"
    ))
    ledger = Ledger.open(ledger_url)
    pause = tmp_path / "pause"  # the hub runs in tmp_path
    if kill_at == "claimed":
        pause.touch()
    users = [f"u{i}" for i in range(AFTER)]
    try:
        hub.create_users(users, groups=["crowd"])
        with ThreadPoolExecutor(BURST) as pool:
            for user in users[:BURST]:
                pool.submit(_spawn_quietly, hub, user)
            if kill_at == "claimed":
                wait_for(lambda: len(ledger.active()) == BURST, 60, "the burst's leases")
                assert not servers_of(tag)
            else:
                wait_for(lambda: bool(servers_of(tag)), 60, "a first server process")
            kill_hub(hub)
        pause.unlink(missing_ok=True)
        left = servers_of(tag)
        assert_one_server_per_slice(tag)

        hub._launch(120)  # the same config, database and ports
        restarted = time.monotonic()
        took = wait_for(lambda: converged(hub, ledger, tag), CONVERGE,
                        f"hub converged (left running at the kill: {sorted(left)})")
        kept = running_users(hub)
        # Whatever the hub did not keep was stopped; what it kept it still runs.
        for pid, env in left.items():
            assert (_environ(pid) is not None) == (env["JUPYTERHUB_USER"] in kept), (pid, env)

        # More spawns, up to every slice of the GPU.
        for user in users:
            if user not in kept:
                r = hub.spawn(user, {"profile": "small"})
                assert r.status_code in (201, 202), r.text
        for user in users:
            hub.wait_ready(user, timeout=120)
        by_uuid = assert_one_server_per_slice(tag)
        assert sorted(by_uuid.values()) == users
        leases = {lease.user: lease.mig_uuid for lease in ledger.active()}
        assert leases == {user: uuid for uuid, user in by_uuid.items()}
        print(f"{kill_at}: {len(left)} server processes at the kill, "
              f"{len(kept)} kept; converged {took:.1f}s after the restart "
              f"({time.monotonic() - restarted:.1f}s to {AFTER} servers)")
    finally:
        with contextlib.suppress(HubError):
            hub.close()
        for pid in servers_of(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ledger.close()


def _spawn_quietly(hub: HubProcess, user: str) -> None:
    """A spawn request whose hub may die under it."""
    with contextlib.suppress(Exception):
        hub.spawn(user, {"profile": "small"})
