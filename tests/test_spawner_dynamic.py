"""Dynamic mode in a real JupyterHub: an instance is created per server and destroyed after.

One hub for the module, on a simulated H200 in MIG mode with no instance at all.
"""

from __future__ import annotations

import pytest
from hub_harness import start_mig_hub

from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Ledger

pytestmark = pytest.mark.hub

SIM = "h200x1"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dynhub")
    hub = start_mig_hub(
        workdir,
        SIM,
        """
        c.LocalMIGSpawner.mig_mode = "dynamic"
        def _break(spawner):
            if spawner.user.name == "broken":
                spawner.cmd = ["/nonexistent/jupyterhub-singleuser"]
        c.Spawner.pre_spawn_hook = _break
        """,
    )
    hub.create_user("ana", groups=["analysts"])
    hub.create_user("broken", groups=["analysts"])
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def sim(hub):
    return SimulatedHost.from_spec(SIM, hub.workdir / "sim-gpus.json")


@pytest.fixture(scope="module")
def ledger(hub):
    with Ledger(f"sqlite:///{hub.workdir / 'mig_spawner_ledger.sqlite'}") as ledger:
        yield ledger


def _devices(hub):
    with connect(simulate=SIM, state_file=str(hub.workdir / "sim-gpus.json")) as adapter:
        return adapter.inventory().mig_devices


def test_instance_is_created_for_the_server_and_destroyed_after(hub, ledger):
    assert _devices(hub) == ()
    r, events = hub.spawn_and_follow("ana", {"profile": "medium"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    assert any(e["message"].startswith("Creating the 2g.35gb instance") for e in events), events
    (device,) = _devices(hub)
    assert device.profile == "2g.35gb"
    lease = ledger.active_for_server("ana")
    assert (lease.mode, lease.state, lease.mig_uuid) == ("dynamic", "active", device.uuid)
    seen = hub.run_in_kernel("ana", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert seen.strip() == device.uuid
    hub.stop_server("ana")
    assert _devices(hub) == ()
    assert ledger.active() == []


def test_an_instance_still_in_use_is_reported_not_destroyed(hub, ledger, sim):
    r = hub.spawn("ana", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ana")
    (device,) = _devices(hub)
    # A process that outlived the server (e.g. started with nohup) still uses the slice.
    sim.set_processes(device.uuid, [(4242, 1024)])
    hub.stop_server("ana")
    assert [d.uuid for d in _devices(hub)] == [device.uuid]
    lease = ledger.history(user="ana")[-1]
    assert lease.state == "releasing"  # still holds the slice: nobody else gets it
    assert "processes still run on its GPU instance (PIDs 4242)" in lease.release_reason
    # The same server cannot start again on top of it, and hears why in plain words.
    again = hub.spawn("ana", {"profile": "small"})
    assert again.status_code == 409, again.text
    assert again.json()["message"] == (
        "The slice of this server's last run is not given back yet: processes still run on "
        "its GPU instance (PIDs 4242). Try again in a minute; if it persists, tell a hub admin."
    )
    # Once the process is gone, the slice service (or an admin) finishes the release.
    sim.set_processes(device.uuid, [])


def test_a_failed_start_destroys_the_instance_it_created(hub, ledger):
    """The instance exists between create_instance and the server's start, which fails
    here (the server's command does not exist): the give-back must destroy it."""
    before = {d.uuid for d in _devices(hub)}
    hub.spawn("broken", {"profile": "medium"})
    hub.wait_until(lambda: hub.server_model("broken") is None, 60)
    last = ledger.history(user="broken")[-1]
    assert last.mig_uuid is not None  # it was created and recorded before the start
    assert not last.held and last.release_reason == "start-failed: FileNotFoundError"
    assert {d.uuid for d in _devices(hub)} == before  # nothing left behind on the GPU
