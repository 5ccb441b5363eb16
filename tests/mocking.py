"""Fakes the tests share (as JupyterHub keeps its own in ``jupyterhub/tests/mocking.py``):
what a Spawner reads of a JupyterHub user, of its server's row and of the hub, clocks
the test moves by hand, and the node shapes more than one Kubernetes test needs. Real
parts stay real; these stand only where a test builds a spawner or a reader without a
hub or a cluster around it (tests/support/spawners.py builds the spawners)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from mig_spawner.core.catalog import model
from mig_spawner.core.inventory import Gpu, GpuInstance, GpuProcess, Inventory, MigDevice
from mig_spawner.core.lifecycle import PendingStop, StopRule, WarningState, in_order
from mig_spawner.ledger import Lease
from tests.support.kube_objects import gpu_labels, node

Layout = Iterable[tuple[str, int]]
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


@dataclass
class Clock:
    """Callable like ``utcnow``, so timestamps in ledgers and reports are exact;
    ``advance(minutes=5)`` moves it on."""

    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now


@dataclass
class Seconds:
    """Callable like ``time.monotonic``; the test moves ``now`` by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


class Group:
    """A JupyterHub group as a Spawner reads it: a name and its properties."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.properties: dict = {}


class User:
    """What a Spawner reads of JupyterHub's User (as KubeSpawner's own tests mock it)."""

    def __init__(self, name: str, groups: list[str]) -> None:
        self.name = name
        self.id = abs(hash(name)) % 10_000
        self.url = f"/user/{name}/"
        self.groups = [Group(g) for g in groups]
        self.settings: dict = {}


class Hub:
    """Where a Spawner's server finds the hub (JupyterHub's ``Hub`` object, as KubeSpawner's
    own tests mock it)."""

    public_host = "hub.example.org"
    url = "http://hub:8081/hub/"
    base_url = "/hub/"
    api_url = "http://hub:8081/hub/api"


class OrmSpawner:
    """The database row JupyterHub keeps per server: its name and last options."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.user_options: dict | None = None
        self.server = None


def h200_single(name: str, slices: int = 56, **kw) -> dict:
    """An H200 node cut all into 1g.18gb under the single strategy (8 GPUs x 7 = 56 by
    default), so the device plugin advertises plain ``nvidia.com/gpu``."""
    return node(
        name,
        gpu_labels("NVIDIA-H200-MIG-1g.18gb", "single", config="all-1g.18gb"),
        {"nvidia.com/gpu": str(slices)},
        **kw,
    )


def make_gpu(
    index: int,
    model_key: str = "h200",
    layout: Layout = (),
    *,
    mig: tuple[bool, bool] = (True, True),
    busy_starts: Iterable[int] = (),
) -> Gpu:
    """A GPU with instances (and one MIG device each) at ``(profile, start)``."""
    m = model(model_key)
    uuid = f"GPU-{index:04d}"
    busy = set(busy_starts)
    gis, devs = [], []
    for n, (name, start) in enumerate(layout):
        p = m.profile(name)
        gi = n + 1  # any unique ID: boards number instances differently
        gis.append(GpuInstance(gi, p.name, p.profile_id, start, p.placement_size))
        procs = (GpuProcess(4242, 100),) if start in busy else ()
        devs.append(MigDevice(f"MIG-{index}-{start}-{p.name}", index, uuid, n,
                              f"{m.product_names[0]} MIG {p.name}", p.name, gi, 0, start,
                              p.placement_size, p.memory_mib, 0, procs))
    return Gpu(index, uuid, m.product_names[0], model_key, index, m.memory_mib, mig[0], mig[1],
               gpu_instances=tuple(gis), mig_devices=tuple(devs))


def mig_device(inventory: Inventory, uuid: str) -> MigDevice | None:
    """The MIG device ``uuid`` of ``inventory``, if it lists one."""
    return next((d for d in inventory.mig_devices if d.uuid == uuid), None)


def make_inventory(*gpus: Gpu) -> Inventory:
    """One host's inventory holding ``gpus``, as the NVML adapter would read it."""
    return Inventory("node1", "580.65.06", "13.580", 13000, tuple(gpus))


def warned_of(lease: Lease, rule: StopRule | str, deadline: datetime,
              at: datetime | None = None) -> Lease:
    """``lease`` with a pending warning of ``rule``'s stop at ``deadline`` (given at
    ``at``), beside the ones it has, as the ledger's warnings store writes it."""
    stop = PendingStop(StopRule(rule), at or deadline, deadline)
    stops = in_order((*(s for s in lease.stops if s.rule is not stop.rule), stop))
    first = stops[0]
    return replace(lease, stops=stops, warning=first.rule, warned_at=first.warned_at,
                   warning_deadline=first.deadline, warning_state=WarningState.PENDING)
