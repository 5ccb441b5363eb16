"""A small world for the observe/report tests: a simulated GPU host, a real ledger, a policy.

Real parts throughout: the GPU adapter on the NVML simulator (shared through a state
file, so a test can put processes on a slice), a SQLite ledger with a hand-moved clock,
and the policy built by ``build_policy``. Leases are claimed the way the spawner claims
them: one ``ledger.leases.claim`` per server with a ``Grant`` naming the MIG device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from mig_spawner import gpu
from mig_spawner.core.catalog import model
from mig_spawner.core.inventory import Inventory, MigDevice
from mig_spawner.core.policy import PolicySet, build_policy
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Grant, Lease, LeaseRequest, Ledger
from tests.mocking import Clock

POLICY = {
    "analysts": {"allowed": ["1g.18gb", "2g.35gb"], "quota_slices": 4,
                 "server_idle_timeout": "30m"},
    "research": {"allowed": ["1g.18gb", "3g.71gb"], "quota_slices": 2,
                 "max_session_age": "8h"},
}




@dataclass
class World:
    """GPU host + ledger + policy, as the slice service sees them."""

    sim: SimulatedHost
    adapter: gpu.GpuAdapter
    ledger: Ledger
    clock: Clock
    policy: PolicySet
    state_file: str
    leases: dict[str, Lease] = field(default_factory=dict)

    def inventory(self) -> Inventory:
        return self.adapter.inventory()

    def device(self, gpu_index: int, profile: str, nth: int = 0) -> MigDevice:
        """The ``nth`` MIG device of ``profile`` on GPU ``gpu_index`` (by start)."""
        found = sorted(
            (d for d in self.inventory().mig_devices
             if d.gpu_index == gpu_index and d.profile == profile),
            key=lambda d: d.start,
        )
        return found[nth]

    def lease(self, user: str, group: str, device: MigDevice, *, server: str = "",
              active: bool = True, expires_in: timedelta | None = None) -> Lease:
        """Claim ``device`` for ``user``'s server (pool mode) and mark it started;
        ``expires_in``: its max session age, from now."""
        compute = model("h200").profile(device.profile).compute_slices
        decision = Grant(
            group=group, profile=device.profile, compute_slices=compute, mode="pool",
            host=self.inventory().host, gpu_uuid=device.gpu_uuid,
            gpu_index=device.gpu_index, start=device.start, size=device.size,
            mig_uuid=device.uuid, gi_id=device.gi_id, ci_id=device.ci_id,
            expires_at=None if expires_in is None else self.clock.now + expires_in,
        )
        lease = self.ledger.leases.claim(LeaseRequest(user, server), lambda view: decision)
        if active:
            lease = self.ledger.leases.activate(lease.id)
        self.leases[user] = lease
        return lease

    def close(self) -> None:
        self.adapter.close()
        self.ledger.close()


def make_world(tmp_path: Path, spec: str = "h200x2:layout=3g.71gb,2g.35gb,1g.18gb*2"
               ) -> World:
    """A world whose GPUs all carry ``spec``'s layout; nothing leased yet."""
    state_file = str(tmp_path / "sim.json")
    adapter = gpu.connect(spec, state_file)
    clock = Clock()
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}", clock=clock)
    policy = build_policy(offers=None, classes=None, groups=POLICY)
    return World(SimulatedHost.open(state_file), adapter, ledger, clock, policy, state_file)
