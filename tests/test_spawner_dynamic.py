"""Dynamic mode in a real JupyterHub: an instance is created per server and destroyed after.

One hub for the module, on a simulated H200 in MIG mode with no instance at all, its
ledger on PostgreSQL so that the tests can take the ledger down and bring it back.
Every failure of the GPU or of the ledger, at any step of a start or a stop, gives the
user a plain message (no address, no database name) and a status the API can act on;
a give-back that failed is retried and frees the slice soon after the fault clears.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Ledger
from tests.support.hub_harness import PAUSE_BEFORE_SPAWN, start_mig_hub
from tests.support.polling import until

pytestmark = pytest.mark.hub

SIM = "h200x1"


# What no message a user sees may contain: URLs, hosts, ports, paths, database names.
INTERNALS = re.compile(r"postgres|sqlite|://|127\.0\.0\.1|localhost|/tmp/|\.json|port|"
                       r"dynhub|Error\b|None")


@pytest.fixture(scope="module")
def database(postgres_server):
    name = f"dynhub_{os.getpid()}"
    postgres_server.psql(f"CREATE DATABASE {name}")
    return name


@pytest.fixture(scope="module")
def hub(tmp_path_factory, postgres_server, database):
    workdir = tmp_path_factory.mktemp("dynhub")
    hub = start_mig_hub(
        workdir,
        SIM,
        textwrap.dedent(f"""
        c.MIGSettings.ledger_url = "{postgres_server.url(database)}"
        c.LocalMIGSpawner.mig_mode = "dynamic"
        c.Spawner.poll_interval = 1
        def _break(spawner):
            if spawner.user.name == "broken":
                spawner.cmd = ["/nonexistent/jupyterhub-singleuser"]
        c.Spawner.pre_spawn_hook = _break
        """) + PAUSE_BEFORE_SPAWN,
    )
    hub.create_user("ana", groups=["analysts"])
    hub.create_user("broken", groups=["analysts"])
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def sim(hub):
    return SimulatedHost.from_spec(SIM, hub.workdir / "sim-gpus.json")


@pytest.fixture(scope="module")
def ledger(hub, postgres_server, database):
    with Ledger(postgres_server.url(database)) as ledger:
        yield ledger


@pytest.fixture
def outage(postgres_server, database):
    """Take the ledger down (``outage.start()``) and bring it back (``outage.end()``)."""

    class Outage:
        def start(self):
            postgres_server.block(database)

        def end(self):
            postgres_server.unblock(database)

    yield Outage()
    postgres_server.unblock(database)


def plain(message: str) -> str:
    assert not INTERNALS.search(message), f"internals shown to the user: {message!r}"
    return message


def wait_released(hub, ledger, user, timeout):
    """Seconds until ``user`` holds no lease; fails after ``timeout``."""
    started = time.monotonic()
    until(lambda: ledger.leases.active_for_server(user) is None, timeout, f"{user}'s slice free",
          show=hub.log_path)
    return time.monotonic() - started


def _devices(hub):
    with connect(simulate=SIM, state_file=str(hub.workdir / "sim-gpus.json")) as adapter:
        return adapter.inventory().mig_devices


def refused_then_freed(hub, ledger, outage, r) -> float:
    """Check that ``r``, ana's spawn while the ledger is down, was a plain 503 and left no
    server; end the outage; seconds until ana's slice is free and its instance gone."""
    try:
        assert r.status_code == 503, r.text
        assert plain(r.json()["message"]) == (
            "The lease ledger cannot be read right now. Try again in a minute; if it "
            "persists, tell a hub admin."
        )
        until(lambda: hub.server_model("ana") is None, 30, "ana's server gone",
              show=hub.log_path)
    finally:
        outage.end()
    took = wait_released(hub, ledger, "ana", 10)
    assert not _devices(hub)
    return took


def test_instance_is_created_for_the_server_and_destroyed_after(hub, ledger):
    assert _devices(hub) == ()
    r, events = hub.spawn_and_follow("ana", {"profile": "medium"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    assert any(e["message"].startswith("Creating the 2g.35gb instance") for e in events), events
    (device,) = _devices(hub)
    assert device.profile == "2g.35gb"
    lease = ledger.leases.active_for_server("ana")
    assert (lease.mode, lease.state, lease.mig_uuid) == ("dynamic", "active", device.uuid)
    seen = hub.run_in_kernel("ana", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert seen.strip() == device.uuid
    hub.stop_server("ana")
    assert _devices(hub) == ()
    assert ledger.leases.active() == []


def test_an_instance_still_in_use_is_reported_not_destroyed(hub, ledger, sim):
    r = hub.spawn("ana", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    (device,) = _devices(hub)
    # A process that outlived the server (e.g. started with nohup) still uses the slice.
    sim.set_processes(device.uuid, [(4242, 1024)])
    hub.stop_server("ana")
    assert [d.uuid for d in _devices(hub)] == [device.uuid]
    lease = ledger.leases.history(user="ana")[-1]
    assert lease.state == "releasing"  # still holds the slice: nobody else gets it
    assert lease.held_by == "processes still run on its GPU instance (PIDs 4242)"
    # The same server cannot start again on top of it, and hears why in plain words.
    again = hub.spawn("ana", {"profile": "small"})
    assert again.status_code == 409, again.text
    assert again.json()["message"] == (
        "The slice of this server's last run is not given back yet: processes still run on "
        "its GPU instance (PIDs 4242). Try again in a minute; if it persists, tell a hub admin."
    )
    # Once the process is gone, the hub's retry finishes the release within seconds.
    sim.set_processes(device.uuid, [])
    until(lambda: not ledger.leases.get(lease.id).held, 30, "the slice given back on a retry",
          show=hub.log_path)
    assert device.uuid not in {d.uuid for d in _devices(hub)}


def test_a_failed_start_destroys_the_instance_it_created(hub, ledger):
    """The instance exists between create_instance and the server's start, which fails
    here (the server's command does not exist): the give-back must destroy it."""
    before = {d.uuid for d in _devices(hub)}
    hub.spawn("broken", {"profile": "medium"})
    until(lambda: hub.server_model("broken") is None, 60, "the failed start over",
          show=hub.log_path)
    last = ledger.leases.history(user="broken")[-1]
    assert last.mig_uuid is not None  # it was created and recorded before the start
    assert not last.held
    assert (last.release_code, last.release_detail) == ("start_failed", "FileNotFoundError")
    assert {d.uuid for d in _devices(hub)} == before  # nothing left behind on the GPU


def test_a_destroy_that_fails_at_stop_is_said_and_retried_until_the_slice_is_free(
    hub, ledger, sim
):
    hub.spawn("ana", {"profile": "small"})
    hub.wait_ready("ana")
    (device,) = _devices(hub)
    sim.inject_error("nvmlComputeInstanceDestroy", "UNKNOWN", count=100_000)
    try:
        hub.stop_server("ana")
        lease = ledger.leases.history(user="ana")[-1]
        assert lease.state == "releasing", lease  # still holds the slice, and says why
        assert "the GPU did not let the hub destroy its instance" in lease.held_by
        again = hub.spawn("ana", {"profile": "small"})
        assert again.status_code == 409, again.text
        assert plain(again.json()["message"]) == (
            "The slice of this server's last run is not given back yet: the GPU did not let "
            "the hub destroy its instance yet; the hub keeps trying. Try again in a minute; "
            "if it persists, tell a hub admin."
        )
    finally:
        sim.clear_errors()
    took = wait_released(hub, ledger, "ana", 10)
    assert device.uuid not in {d.uuid for d in _devices(hub)}
    print(f"slice free {took:.1f}s after the GPU fault cleared")


def test_the_ledger_down_at_stop_and_at_start_gives_plain_503s_and_heals(
    hub, ledger, outage
):
    hub.spawn("ana", {"profile": "small"})
    hub.wait_ready("ana")
    outage.start()
    hub.stop_server("ana")  # the server stops; its slice cannot be given back yet
    took = refused_then_freed(hub, ledger, outage, hub.spawn("ana", {"profile": "small"}))
    r = hub.spawn("ana", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    hub.stop_server("ana")
    print(f"slice free {took:.1f}s after the ledger came back")


def refused_by_the_driver(hub, ledger, sim, call: str, error: str) -> str:
    """Ana's spawn while the simulated driver fails ``call`` with ``error``: checks it
    was a 503 that left no server and no lease; returns the (plain) message."""
    sim.inject_error(call, error)
    try:
        r = hub.spawn("ana", {"profile": "small"})
    finally:
        sim.clear_errors()
    assert r.status_code == 503, r.text
    until(lambda: hub.server_model("ana") is None, 30, "ana's refused spawn over",
          show=hub.log_path)
    assert ledger.leases.active_for_server("ana") is None
    return plain(r.json()["message"])


def test_an_instance_that_cannot_be_created_gives_a_plain_503(hub, ledger, sim):
    message = refused_by_the_driver(
        hub, ledger, sim, "nvmlDeviceCreateGpuInstanceWithPlacement", "UNKNOWN")
    assert message.startswith("Could not create the 1g.18gb instance")


def test_the_gpu_unreadable_at_claim_gives_a_plain_503(hub, ledger, sim):
    message = refused_by_the_driver(hub, ledger, sim, "nvmlDeviceGetCount_v2", "GPU_IS_LOST")
    assert message == (
        "The GPU inventory cannot be read right now. Try again in a minute; if it persists, "
        "tell a hub admin."
    )


def test_the_ledger_down_at_activation_stops_the_server_and_frees_the_slice_after(
    hub, ledger, outage
):
    pause = hub.workdir / "pause"
    pause.touch()
    with ThreadPoolExecutor(1) as pool:
        try:
            posted = pool.submit(hub.spawn, "ana", {"profile": "small"})
            until(lambda: ledger.leases.active_for_server("ana") is not None, 30, "ana's claim",
                  show=hub.log_path)
            outage.start()  # after the claim and the instance, before the activation
        finally:
            pause.unlink()
        r = posted.result(60)
    took = refused_then_freed(hub, ledger, outage, r)
    print(f"slice free {took:.1f}s after the ledger came back")


def test_a_server_that_dies_while_the_ledger_is_down_frees_its_slice_once_it_is_back(
    hub, ledger, outage
):
    hub.spawn("ana", {"profile": "small"})
    hub.wait_ready("ana")
    pid = hub.server_state("ana")["pid"]
    lease = ledger.leases.active_for_server("ana")
    outage.start()
    try:
        os.kill(pid, signal.SIGKILL)
        # The hub's poll sees it gone; its give-back fails (said in its log), and waits
        # for the ledger.
        until(lambda: hub.server_model("ana") is None and
              f"Could not release lease {lease.id}" in hub.log_tail(10**7), 30,
              "ana's server gone, its give-back failed", show=hub.log_path)
    finally:
        outage.end()
    took = wait_released(hub, ledger, "ana", 10)
    assert ledger.leases.history(user="ana")[-1].release_code == "server_exited"
    assert not _devices(hub)
    print(f"slice free {took:.1f}s after the ledger came back")
