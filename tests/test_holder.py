"""The holder check on real processes: found by record or by environment, told apart
from a reused PID, stopped with TERM then KILL, and never guessed for another host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import pytest

from mig_spawner import holder
from mig_spawner.ledger import Lease
from tests.support.processes import past_exec

# Names of this worker's own: the check scans every process of the machine, and the
# tests of other pytest-xdist workers start theirs at the same time.
ME = os.getpid()
LEASE, OTHER_LEASE = f"lease0001-{ME}", f"lease0002-{ME}"
DEVICE = f"MIG-test-holder-{ME}"
# A process that ignores SIGTERM, as a server stuck in a kernel call might; it says when
# it does (a loaded machine may take seconds to get there).
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ignoring TERM', flush=True); time.sleep(60)")


def lease(**kw) -> Lease:
    fields = {"id": LEASE, "user": "ana", "server_name": "", "group": "analysts",
              "profile": "1g.18gb", "compute_slices": 1, "mode": "pool", "state": "active",
              "claimed_at": datetime.now(UTC), "host": holder.this_host(),
              "mig_uuid": DEVICE}
    return Lease(**{**fields, **kw})


@pytest.fixture
def spawn():
    started: list[subprocess.Popen] = []

    def run(code: str = "import time; time.sleep(60)", **env: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env},
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return past_exec(proc)

    yield run
    for proc in started:
        proc.kill()
        proc.wait()


def recorded(proc: subprocess.Popen) -> dict:
    process = holder.current(proc.pid)
    assert process is not None
    return {"holder_host": holder.this_host(), "holder_pid": process.pid,
            "holder_start": process.start}


def test_recorded_holder_runs_until_stopped_and_a_reused_pid_is_not_it(spawn):
    proc = spawn()
    record = recorded(proc)
    found = holder.check(lease(**record))
    assert found.state == holder.RUNNING and found.pids == [proc.pid]
    # The same PID with another start time is another process: the holder is gone.
    reused = {**record, "holder_start": record["holder_start"] - 1}
    assert holder.check(lease(**reused)).state == holder.GONE
    assert holder.stop(found, grace=2).state == holder.GONE
    assert proc.wait(5) < 0


def test_a_holder_never_recorded_is_found_by_the_lease_in_its_environment(spawn):
    mine = spawn(MIG_SPAWNER_LEASE_ID=LEASE)
    spawn(MIG_SPAWNER_LEASE_ID="another")  # another lease's server: not ours
    old = spawn(CUDA_VISIBLE_DEVICES=DEVICE)  # started without the variable
    found = holder.check(lease())
    assert found.state == holder.RUNNING
    assert sorted(found.pids) == sorted([mine.pid, old.pid])


def test_the_device_in_its_environment_makes_a_holder_whatever_lease_id_it_claims(spawn):
    """A process escaped from a server (``setsid``) that keeps the slice's device but
    names another lease: it uses the slice, so it holds it."""
    lying = spawn(CUDA_VISIBLE_DEVICES=DEVICE, MIG_SPAWNER_LEASE_ID="another")
    listed = spawn(CUDA_VISIBLE_DEVICES=f"0, {DEVICE[4:]}")  # one entry of several, bare uuid
    spawn(CUDA_VISIBLE_DEVICES=f"{DEVICE}-2")  # another slice: not a holder
    found = holder.check(lease())
    assert found.state == holder.RUNNING
    assert sorted(found.pids) == sorted([lying.pid, listed.pid])
    # A dynamic lease before its instance exists is named by its lease id only.
    early = spawn(MIG_SPAWNER_LEASE_ID=OTHER_LEASE)
    assert holder.check(lease(id=OTHER_LEASE, mig_uuid=None)).pids == [early.pid]


def test_what_the_gpu_lists_on_the_slice_holds_it_and_is_never_signalled(spawn):
    quiet = spawn()  # its environment names nothing
    # In the slice's device cgroup (the isolation hook): a holder, stopped like any.
    assert holder.check(lease(), members=[quiet.pid]).pids == [quiet.pid]
    # Listed by NVML on the slice: it holds it, but a PID from NVML may be of another
    # PID namespace, so it is reported, never signalled.
    seen = holder.check(lease(), on_device=[quiet.pid])
    assert (seen.state, seen.on_device, seen.processes) == (holder.UNKNOWN, (quiet.pid,), ())
    assert holder.stop(seen).state == holder.UNKNOWN and quiet.poll() is None
    # Listed beside a holder its environment names: that one is stopped, this reported.
    named = spawn(MIG_SPAWNER_LEASE_ID=LEASE)
    both = holder.check(lease(), on_device=[quiet.pid, named.pid])
    assert (both.state, both.pids, both.on_device) == (holder.RUNNING, [named.pid], (quiet.pid,))


def test_a_holder_that_ignores_term_is_killed_after_the_grace(spawn):
    proc = spawn(STUBBORN, MIG_SPAWNER_LEASE_ID=LEASE)
    assert proc.stdout.readline() == "ignoring TERM\n"
    started = time.monotonic()
    assert holder.stop(holder.check(lease()), grace=0.5).state == holder.GONE
    assert time.monotonic() - started >= 0.5  # TERM, the grace, then KILL
    assert proc.wait(5) == -9


def test_a_holder_on_another_host_is_unknown_not_gone():
    found = holder.check(lease(holder_host="gpu-host-9", holder_pid=1, holder_start=1))
    assert found.state == holder.UNKNOWN and "gpu-host-9" in found.why
    assert holder.check(lease(host="gpu-host-9")).state == holder.UNKNOWN
    assert holder.check(lease()).state == holder.GONE  # nothing runs for it here


def test_a_pod_holder_is_told_by_name_uid_and_phase_and_never_read_from_proc():
    kube = lease(mode="kube", host=None, mig_uuid=None, pod="jupyterhub/jupyter-ana",
                 holder_pod_uid="uid-1")
    # This host's /proc cannot see a pod: only the Kubernetes API can say.
    assert holder.check(kube).state == holder.UNKNOWN

    def pod(uid: str, phase: str = "Running") -> dict:
        return {"metadata": {"name": "jupyter-ana", "uid": uid}, "status": {"phase": phase}}

    assert holder.pod_holder(None, kube).state == holder.GONE
    assert holder.pod_holder(pod("uid-2"), kube).state == holder.GONE  # recreated
    assert holder.pod_holder(pod("uid-1", "Failed"), kube).state == holder.GONE
    running = holder.pod_holder(pod("uid-1"), kube)
    assert (running.state, running.pod) == (holder.RUNNING, "jupyterhub/jupyter-ana")
    # No UID recorded yet (the hub died while the pod started): the pod of that name.
    unrecorded = lease(mode="kube", host=None, pod="jupyterhub/jupyter-ana")
    assert holder.pod_holder(pod("uid-9"), unrecorded).state == holder.RUNNING
