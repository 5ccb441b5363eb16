"""The one release path, in-process: the simulator's GPU, a real SQLite ledger, real
processes. What holds a slice is stopped or keeps it; a dynamic instance goes before
its lease; a held give-back is retried until nothing holds it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest

from mig_spawner import holder
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Grant, LeaseRequest, LeaseState, Ledger, ReleaseCode
from mig_spawner.release import (
    UNCHECKABLE,
    GiveBack,
    HolderProbes,
    LocalProcesses,
    ReleaseEvents,
    Releaser,
)
from tests.mocking import mig_device
from tests.support.polling import until_async
from tests.support.processes import past_exec

SIM = "h200x1:layout=1g.18gb*2"


class Counted(ReleaseEvents):
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def stopping(self, lease, found) -> None:
        self.seen["stopping"] += 1

    def holder_unknown(self, lease, found, retry) -> None:
        self.seen["holder_unknown"] += 1

    def retrying(self, lease_id) -> None:
        self.seen["retrying"] += 1

    def released(self, lease, code) -> None:
        self.seen[f"released:{code}"] += 1


@pytest.fixture
def world(tmp_path):
    state = tmp_path / "sim.json"
    gpus = connect(simulate=SIM, state_file=str(state))
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    events = Counted()
    releaser = Releaser(
        lambda: ledger, lambda: gpus,
        HolderProbes(local=LocalProcesses(asyncio.to_thread, lambda: gpus)),
        run=asyncio.to_thread, grace=0.5, events=events)
    started: list[subprocess.Popen] = []

    def spawn(**env: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env={**os.environ, **env}, start_new_session=True)
        started.append(proc)
        return past_exec(proc)

    yield ledger, gpus, SimulatedHost.open(state), releaser, events, spawn
    for proc in started:
        proc.kill()
        proc.wait()
    ledger.close()
    gpus.close()


def claim(ledger: Ledger, user: str, **grant):
    fields = {"mode": "pool", "host": holder.this_host(), "gpu_uuid": "GPU-0", "gpu_index": 0,
              "start": 0, "size": 1, **grant}
    return ledger.leases.claim(LeaseRequest(user), lambda view: Grant(
        group="analysts", profile="1g.18gb", compute_slices=1, **fields))


async def test_a_process_that_keeps_the_device_but_names_another_lease_is_stopped_first(
    world,
):
    ledger, gpus, _, releaser, events, spawn = world
    device = gpus.inventory().mig_devices[0]
    lease = claim(ledger, "ana", mig_uuid=device.uuid)
    escaped = spawn(CUDA_VISIBLE_DEVICES=device.uuid, MIG_SPAWNER_LEASE_ID="not-this-one")
    outcome = await releaser.release(lease.id, ReleaseCode.STOPPED)
    assert outcome.result is GiveBack.RELEASED
    assert escaped.wait(5) == -signal.SIGTERM  # gone before the slice was free
    done = ledger.leases.get(lease.id)
    assert (done.state, done.release_code) == (LeaseState.RELEASED, ReleaseCode.STOPPED)
    assert events.seen == {"stopping": 1, "released:stopped": 1}
    assert (await releaser.release(lease.id, ReleaseCode.ORPHAN)).result is (
        GiveBack.ALREADY_RELEASED)


async def test_a_holder_stopped_for_a_drain_keeps_drain_though_the_hubs_poll_releases_first(
    world,
):
    """The slice service stops a held server's process to drain its GPU; the hub's poll
    sees the process gone and releases the lease itself, before the service's give-back.
    The lease keeps why it ended (drain), not the poll's server_exited."""
    ledger, gpus, _, releaser, _, spawn = world
    device = gpus.inventory().mig_devices[0]
    lease = claim(ledger, "ana", mig_uuid=device.uuid)
    server = spawn(CUDA_VISIBLE_DEVICES=device.uuid, MIG_SPAWNER_LEASE_ID=lease.id)
    hub = Releaser(lambda: ledger, lambda: gpus,
                   HolderProbes(local=LocalProcesses(asyncio.to_thread, lambda: gpus)),
                   run=asyncio.to_thread, grace=0.5)

    class PolledByTheHub(LocalProcesses):
        async def stop(self, lease, found, grace):
            stopped = await super().stop(lease, found, grace)
            assert (await hub.release(lease.id, ReleaseCode.SERVER_EXITED)).result is (
                GiveBack.RELEASED)
            return stopped

    releaser.probes = HolderProbes(local=PolledByTheHub(asyncio.to_thread, lambda: gpus))
    await releaser.release(lease.id, ReleaseCode.DRAIN, "GPU 0 is re-cut")
    assert server.wait(5) == -signal.SIGTERM
    done = ledger.leases.get(lease.id)
    assert (done.state, done.release_code) == (LeaseState.RELEASED, ReleaseCode.DRAIN)


async def test_what_the_gpu_lists_on_the_slice_keeps_it_held_until_gone_then_a_retry_frees_it(
    world, monkeypatch,
):
    ledger, gpus, sim, releaser, events, _ = world
    device = gpus.inventory().mig_devices[1]
    lease = claim(ledger, "bob", mig_uuid=device.uuid, start=1)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a PID NVML lists that this host does not show (another namespace)
    sim.set_processes(device.uuid, [(gone.pid, 100)])
    outcome = await releaser.release(lease, ReleaseCode.SERVER_EXITED, "status 1")
    assert (outcome.result, outcome.why) == (
        GiveBack.HELD, f"processes still run on its GPU instance (PIDs {gone.pid})")
    held = ledger.leases.get(lease.id)
    assert (held.state, held.held_by, held.release_code, held.release_detail) == (
        LeaseState.RELEASING, outcome.why, ReleaseCode.SERVER_EXITED, "status 1")
    assert ledger.leases.claim(LeaseRequest("carol"), lambda view: Grant(
        group="analysts", profile="1g.18gb", compute_slices=1, mode="pool",
        host=holder.this_host(), gpu_uuid="GPU-0", gpu_index=0, start=0, size=1,
        mig_uuid="MIG-other")).start == 0  # the held slice 1 is not on offer

    monkeypatch.setattr("mig_spawner.release.RETRY_FIRST", 0.05)
    finished = asyncio.get_running_loop().create_future()
    releaser.retry_later(lease.id, ReleaseCode.SERVER_EXITED, "status 1",
                         finished.set_result)
    releaser.retry_later(lease.id, ReleaseCode.SERVER_EXITED)  # one retry per lease
    # Retries that found it still listed kept it held.
    checked = events.seen["holder_unknown"]
    await until_async(lambda: events.seen["holder_unknown"] >= checked + 2, 10,
                      "two retries", show=lambda: events.seen)
    assert ledger.leases.get(lease.id).state == LeaseState.RELEASING
    sim.set_processes(device.uuid, [])
    assert (await asyncio.wait_for(finished, 5)).result is GiveBack.RELEASED
    assert ledger.leases.get(lease.id).release_detail == "status 1"
    assert events.seen["retrying"] == 1 and events.seen["released:server_exited"] == 1


async def test_a_dynamic_instance_is_destroyed_before_its_lease_is_released(world):
    ledger, gpus, _, releaser, _, _ = world
    gpus.destroy_instance(0, gpus.inventory().mig_devices[1].gi_id)
    made = gpus.create_instance(0, "1g.18gb", start=1)
    lease = claim(ledger, "dyn", mode="dynamic", start=1, mig_uuid=made.uuid,
                  gi_id=made.gi_id, ci_id=made.ci_id)
    assert (await releaser.release(lease, ReleaseCode.START_FAILED, "OSError")).done
    assert mig_device(gpus.inventory(), made.uuid) is None
    # Without GPU access here, the instance cannot go: the lease keeps its slice.
    again = gpus.create_instance(0, "1g.18gb", start=1)
    lease = claim(ledger, "dyn2", mode="dynamic", start=1, mig_uuid=again.uuid,
                  gi_id=again.gi_id, ci_id=again.ci_id)
    blind = Releaser(lambda: ledger, lambda: None,
                     HolderProbes(local=LocalProcesses(asyncio.to_thread)),
                     run=asyncio.to_thread)
    outcome = await blind.release(lease, ReleaseCode.ORPHAN)
    assert outcome.result is GiveBack.HELD
    assert "no GPU access" in ledger.leases.get(lease.id).held_by


async def test_a_holder_that_cannot_be_checked_keeps_the_slice_and_is_counted(world):
    ledger, _, _, releaser, events, _ = world
    far = claim(ledger, "far", host="gpu-host-9", mig_uuid="MIG-far")
    outcome = await releaser.release(far, ReleaseCode.ORPHAN)
    assert (outcome.result, outcome.why) == (GiveBack.HELD, UNCHECKABLE)
    assert ledger.leases.get(far.id).held_by == UNCHECKABLE  # the words its user will read
    pod = claim(ledger, "pod", mode="kube", host=None, gpu_uuid=None, gpu_index=None,
                start=None, size=None, pod="jupyter-pod")
    assert (await releaser.release(pod, ReleaseCode.STOPPED)).result is GiveBack.HELD
    assert events.seen == {"holder_unknown": 2}


@pytest.mark.parametrize("first", [ReleaseCode.BUDGET, ReleaseCode.DRAIN])
async def test_a_stop_after_the_service_said_why_is_counted_and_logged_with_that_why(
    world, first, caplog
):
    """The slice service records why it stops a server (a spent budget, a drain) before
    the hub's stop releases with 'stopped': the ledger keeps the first code, and so do
    the hub's release metric and log line."""
    ledger, gpus, _, releaser, events, _ = world
    lease = claim(ledger, "ana", mig_uuid=gpus.inventory().mig_devices[0].uuid)
    ledger.leases.end_for(lease.id, first, "stopped by the slice service")
    with caplog.at_level("INFO", logger="mig_spawner.release"):
        outcome = await releaser.release(lease.id, ReleaseCode.STOPPED)
    assert outcome.result is GiveBack.RELEASED
    assert ledger.leases.get(lease.id).release_code == first
    assert events.seen == {f"released:{first}": 1}
    [line] = [r.getMessage() for r in caplog.records if lease.id in r.getMessage()]
    assert f"({first}: stopped by the slice service)" in line and "stopped)" not in line
