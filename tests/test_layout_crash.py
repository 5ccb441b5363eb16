"""kill -9 in the middle of applying a layout change, on SQLite and PostgreSQL.

The apply runs in a process of its own (``mig-spawner layout apply --wait``: the same
:class:`~mig_spawner.layout.LayoutApplier` the slice service runs at each sweep) while
this process keeps claiming slices as spawns would. The apply is killed with SIGKILL
while it is applying; then a fresh applier (a restarted service) carries the change on.
Nothing granted is ever destroyed, nothing is granted on a placement being changed, and
once done no instance is left that neither a lease nor the target knows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mig_spawner.core.layout import PlanState
from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Refused
from mig_spawner.gpu import GpuError, connect
from mig_spawner.layout import LayoutApplier
from mig_spawner.ledger import LeaseRequest, Ledger
from mig_spawner.spawner.decide import make_decide

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
                got.append(ledger.claim(LeaseRequest("u", f"s{n}"), decide))
                n += 1
            except Refused:
                pass
            time.sleep(0.02)


@pytest.mark.parametrize("round_", [0, 2])
def test_kill_9_mid_apply_resumes_with_no_orphan_instance_and_no_double_grant(
        tmp_path, backend_url, round_):
    state = str(tmp_path / "sim.json")
    connect(simulate=SIM, state_file=state).close()
    ledger = Ledger.open(backend_url)
    stop, got = threading.Event(), []
    claims = threading.Thread(target=claimer, args=(ledger, state, stop, got))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(os.getcwd()), os.environ.get("PYTHONPATH")]))}
    apply = subprocess.Popen(
        [sys.executable, "-m", "mig_spawner.cli.main", "layout", "apply", "--sim-state", state,
         "--ledger-url", backend_url, "--wait", "--interval", "0.05", TARGET],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(c.state is PlanState.APPLYING for c in ledger.layout_changes()):
            assert apply.poll() is None and time.monotonic() < deadline, "never applied"
            time.sleep(0.005)
        claims.start()
        time.sleep(0.02 * round_)  # a few steps in, at a different point each round
    finally:
        apply.send_signal(signal.SIGKILL)
        apply.wait()
    try:
        assert ledger.layout_changes(), "the kill came too late: nothing left to resume"
        with connect(state_file=state) as gpus:
            applier = LayoutApplier(ledger, gpus, lambda group: 3600.0)  # the restart
            for _ in range(20):
                applier.step()
                time.sleep(0.01)
            stop.set()
            claims.join()
            applier.step()
            inventory = gpus.inventory()
            devices = {d.uuid for d in inventory.mig_devices}
            held = ledger.active()
            # Every slice granted is still the instance it was granted: none destroyed
            # under a lease, none granted where an instance was being re-cut.
            assert all(lease.mig_uuid in devices for lease in held)
            assert {lease.id for lease in held} == {lease.id for lease in got}
            # No instance without its MIG device, and every instance is either one the
            # target has or one a lease still holds (its change waits for it).
            for gpu in inventory.gpus:
                assert len(gpu.gpu_instances) == len(gpu.mig_devices)
            for lease in held:
                ledger.release(lease.id, "stopped")
            for _ in range(3):
                applier.step()
            assert ledger.layout_changes() == []
            assert all(c.state is PlanState.DONE
                       for c in ledger.layout_changes(open_only=False)[-2:])
            for gpu in gpus.inventory().gpus:
                assert sorted((gi.profile, gi.start) for gi in gpu.gpu_instances) == [
                    ("1g.18gb", 0), ("1g.18gb", 1), ("2g.35gb", 2), ("3g.71gb", 4)]
                assert len(gpu.gpu_instances) == len(gpu.mig_devices)
    finally:
        stop.set()
        if claims.is_alive():
            claims.join()
        ledger.close()
