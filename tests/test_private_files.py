"""Files mig-spawner creates name who holds which slice: they are readable by their
owner only (0600), whatever the umask of the hub or the service."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Grant, LeaseRequest, Ledger


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the usual umask: new files would be world-readable
    yield
    os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}


def test_a_new_sqlite_ledger_and_its_wal_and_shm_files_are_private(tmp_path, umask_022):
    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        ledger.leases.claim(LeaseRequest("alice"), lambda view: Grant(
            group="g", profile="1g.18gb", compute_slices=1, mode="pool", host="h",
            gpu_uuid="GPU-1", gpu_index=0, start=0, size=1, mig_uuid="MIG-1"))
        found = modes(tmp_path)  # while open: the -wal and -shm files exist
    assert {"ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"} <= set(found)
    assert set(found.values()) == {0o600}, found


def test_the_simulators_state_and_lock_files_are_private(tmp_path, umask_022):
    host = SimulatedHost.from_spec("h200x1:layout=1g.18gb*7", tmp_path / "sim.json")
    del host
    found = modes(tmp_path)
    assert {"sim.json", "sim.json.lock"} <= set(found)
    assert set(found.values()) == {0o600}, found
