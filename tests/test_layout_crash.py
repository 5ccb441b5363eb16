"""kill -9 in the middle of applying a layout change, on SQLite and PostgreSQL.

Twice: the slice service itself (against a stand-in hub) killed while applying and
started again; and the apply in a process of its own (``mig-spawner layout apply
--wait``: the same :class:`~mig_spawner.layout.LayoutApplier` the service runs at each
sweep) while this process keeps claiming slices as spawns would. The apply is killed with SIGKILL
while it is applying; then a fresh applier (a restarted service) carries the change on.
Nothing granted is ever destroyed, nothing is granted on a placement being changed, and
once done no instance is left that neither a lease nor the target knows.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mig_spawner.core.layout import PlanState, parse_spec, plan_layout
from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Refused
from mig_spawner.gpu import GpuError, connect
from mig_spawner.layout import LayoutApplier, begin
from mig_spawner.ledger import Lease, LeaseRequest, Ledger
from mig_spawner.spawner.decide import make_decide
from tests.support import reaper
from tests.support.polling import until, until_async

SIM = "h200x2:layout=1g.18gb*7"
#: Both GPUs: every 1g.18gb but the first two goes, a 3g.71gb and a 2g.35gb are made.
TARGET = "3g.71gb,2g.35gb,1g.18gb*2"
POLICY = build_policy(None, None, {"a": {"allowed": ["1g.18gb"], "max_slices_per_user": 99}})


def claimer(ledger: Ledger, state: str, stop: threading.Event, got: list) -> None:
    """Claims a 1g.18gb every few milliseconds, reading the GPUs afresh each time, as
    spawns would, and keeps what it gets."""
    with connect(state_file=state) as gpus:
        n = 0
        while not stop.is_set():
            try:
                inventory = gpus.inventory()
            except GpuError:
                continue  # read while an instance was being destroyed: read again
            decide = make_decide(POLICY.for_user(["a"]), POLICY.offer("1g.18gb"),
                                 inventory, "pool", "pack")
            try:
                got.append(ledger.leases.claim(LeaseRequest("u", f"s{n}"), decide))
                n += 1
            except Refused:
                pass
            time.sleep(0.02)  # a spawn's pace, a claim each step of the apply


def blocker(ledger: Ledger, state: str, start: int) -> Lease:
    """A lease on the 1g.18gb at ``start`` of GPU 0: claimed as spawns claim, the ones
    before it given back."""
    others = []
    with connect(state_file=state) as gpus:
        for n in range(7):
            decide = make_decide(POLICY.for_user(["a"]), POLICY.offer("1g.18gb"),
                                 gpus.inventory(), "pool", "pack")
            lease = ledger.leases.claim(LeaseRequest("b", f"b{n}"), decide)
            if lease.gpu_index == 0 and lease.start == start:
                for other in others:
                    ledger.leases.release(other.id, "stopped")
                return lease
            others.append(lease)
    raise AssertionError(f"the 1g.18gb at {start} of GPU 0 is not free")


@pytest.mark.parametrize("round_", [1])
def test_kill_9_mid_apply_resumes_with_no_orphan_instance_and_no_double_grant(
        tmp_path, backend_url, round_):
    state = str(tmp_path / "sim.json")
    connect(simulate=SIM, state_file=state).close()
    ledger = Ledger.open(backend_url)
    # A server on the last 1g.18gb of GPU 0, where the target puts the 3g.71gb: the
    # change applies up to it and waits for it to leave, so the kill below lands while
    # the change is applying, however fast or slow the machine (the apply alone is done
    # in milliseconds, and a loaded run once saw it end before a 5 ms poll did).
    stop, got = threading.Event(), [blocker(ledger, state, start=6)]
    claims = threading.Thread(target=claimer, args=(ledger, state, stop, got))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(os.getcwd()), os.environ.get("PYTHONPATH")]))}
    apply = subprocess.Popen(
        [sys.executable, "-m", "mig_spawner.cli.main", "layout", "apply", "--sim-state", state,
         "--ledger-url", backend_url, "--wait", "--interval", "0.05", TARGET],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def applying() -> bool:
            assert apply.poll() is None, "the apply ended before it applied"
            return any(c.state is PlanState.APPLYING for c in ledger.holds.changes())

        until(applying, 60, "the change applying", show=ledger.holds.changes, every=0.005)
        claims.start()
        time.sleep(0.02 * round_)  # a few steps in, at a different point each round
    finally:
        apply.send_signal(signal.SIGKILL)
        apply.wait()
    try:
        assert ledger.holds.changes(), "the kill came too late: nothing left to resume"
        with connect(state_file=state) as gpus:
            applier = LayoutApplier(ledger, gpus, lambda group: 3600.0)  # the restart
            for _ in range(20):
                applier.step()
                time.sleep(0.01)  # the claims' thread runs between two steps
            stop.set()
            claims.join()
            applier.step()
            inventory = gpus.inventory()
            devices = {d.uuid for d in inventory.mig_devices}
            held = ledger.leases.active()
            # Every slice granted is still the instance it was granted: none destroyed
            # under a lease, none granted where an instance was being re-cut.
            assert all(lease.mig_uuid in devices for lease in held)
            assert {lease.id for lease in held} == {lease.id for lease in got}
            # No instance without its MIG device, and every instance is either one the
            # target has or one a lease still holds (its change waits for it).
            for gpu in inventory.gpus:
                assert len(gpu.gpu_instances) == len(gpu.mig_devices)
            for lease in held:
                ledger.leases.release(lease.id, "stopped")
            for _ in range(3):
                applier.step()
            assert ledger.holds.changes() == []
            assert all(c.state is PlanState.DONE
                       for c in ledger.holds.changes(open_only=False)[-2:])
            for gpu in gpus.inventory().gpus:
                assert sorted((gi.profile, gi.start) for gi in gpu.gpu_instances) == [
                    ("1g.18gb", 0), ("1g.18gb", 1), ("2g.35gb", 2), ("3g.71gb", 4)]
                assert len(gpu.gpu_instances) == len(gpu.mig_devices)
    finally:
        stop.set()
        if claims.is_alive():
            claims.join()
        ledger.close()


def service(tmp_path, hub: str, url: str, config: str, log) -> subprocess.Popen:
    """``mig-spawner-service`` in a process of its own, sweeping every second."""
    env = {**os.environ, "JUPYTERHUB_API_URL": f"{hub}/hub/api", "JUPYTERHUB_API_TOKEN": "t"}
    return reaper.start(
        [sys.executable, "-m", "mig_spawner.service", f"--ledger-url={url}",
         f"--config-dir={config}", "--cull-every=1"], "the slice service",
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)


async def test_kill_9_of_the_slice_service_mid_apply_resumes_on_its_restart(
        tmp_path, backend_url, serve_hub):
    """The slice service carries a change on; killed outright while applying, the one
    started after it finishes the change: the target, every instance with its MIG
    device, no hold left."""
    from tests.support.hub_standin import StandinState

    hub = serve_hub(StandinState())
    state = str(tmp_path / "sim.json")
    connect(simulate=SIM, state_file=state).close()
    config = tmp_path / "service_config.py"
    config.write_text(f"c.MIGSettings.sim_state_file = {state!r}\n")
    ledger = Ledger.open(backend_url)
    log = (tmp_path / "service.log").open("ab")
    first = None
    try:
        target = parse_spec(TARGET)
        with connect(state_file=state) as gpus:
            inventory = gpus.inventory()
            begin(ledger, inventory.host, plan_layout(inventory, target), target)
        first = service(tmp_path, hub, backend_url, str(config), log)

        async def applying() -> bool:
            assert first.poll() is None, (tmp_path / "service.log").read_text()[-3000:]
            changes = await asyncio.to_thread(ledger.holds.changes)
            return any(c.state is PlanState.APPLYING for c in changes)

        await until_async(applying, 60, "the change applying", show=tmp_path / "service.log",
                          every=0.002)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert ledger.holds.changes(), "the kill came after the change was done"
        second = service(tmp_path, hub, backend_url, str(config), log)

        async def done() -> bool:
            assert second.poll() is None, (tmp_path / "service.log").read_text()[-3000:]
            return not await asyncio.to_thread(ledger.holds.changes)

        try:
            await until_async(done, 120, "the change done by the restarted service",
                              show=tmp_path / "service.log", every=0.1)
        finally:
            second.terminate()
            second.wait(10)
        with connect(state_file=state) as gpus:
            for gpu in gpus.inventory().gpus:
                assert sorted((gi.profile, gi.start) for gi in gpu.gpu_instances) == [
                    ("1g.18gb", 0), ("1g.18gb", 1), ("2g.35gb", 2), ("3g.71gb", 4)]
                assert len(gpu.gpu_instances) == len(gpu.mig_devices)
        assert ledger.holds.held() == {}
    finally:
        if first is not None and first.poll() is None:
            first.kill()
        log.close()
        ledger.close()
