"""The simulated host's state: GPUs, their instances, processes, health and events, and
the errors a test injected.

Plain mutable records with a JSON form, so that the state can live in a shared file.
The rules that change it (NVIDIA's MIG rules) are in ``rules.py``.
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass, field

from mig_spawner.core import catalog

from .spec import NON_MIG_MODELS, HostSpec

#: A MIG UUID, or (gpu index, GI ID, CI ID); or the UUID of a GPU with MIG off.
DeviceRef = str | tuple[int, int, int]

# Fixed namespace: simulated UUIDs are stable across runs and processes.
_NAMESPACE = uuid.UUID("6c0b3f3e-5b8e-4c4e-9a57-4d1f6b2a9c10")

# CUDA driver API version that each driver branch reports (nvmlSystemGetCudaDriverVersion).
# nvml.h: an event's GPU/compute instance ID when the event names no instance.
NOT_ATTRIBUTED = 0xFFFFFFFF
# Events kept in the state for event sets that have not read them yet.
EVENTS_KEPT = 256

_CUDA_BY_BRANCH = {450: 11000, 470: 11040, 525: 12000, 535: 12020, 550: 12040, 560: 12060,
                   570: 12080, 575: 12090, 580: 13000}


@dataclass
class SimComputeInstance:
    ci_id: int
    profile_index: int
    slice_count: int
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used MiB)
    memory_used_mib: int | None = None  # None: the sum of the processes' memory


@dataclass
class SimGpuInstance:
    gi_id: int
    profile_id: int
    start: int
    size: int
    cis: dict[int, SimComputeInstance] = field(default_factory=dict)


@dataclass
class SimGpu:
    index: int
    uuid: str
    product: str
    model_key: str | None  # None: a GPU without MIG
    memory_mib: int
    mig_current: int
    mig_pending: int
    gis: dict[int, SimGpuInstance] = field(default_factory=dict)
    id_scheme: str = "forward"  # how this board numbers GPU instances (rules.gi_id_for)
    # With MIG off, what runs on the GPU as a whole (as a compute instance's, with MIG on).
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used MiB)
    memory_used_mib: int | None = None  # None: the sum of the processes' memory
    # Health (docs/health.md): every call on a lost GPU answers GPU_IS_LOST.
    lost: bool = False
    ecc_enabled: bool = True
    ecc_uncorrected: list[int] = field(default_factory=lambda: [0, 0])  # volatile, aggregate
    # nvmlDeviceGetRemappedRows: rows remapped for correctable and for uncorrectable
    # errors, a remap pending (until a reset), a remap failed (for good).
    remapped_rows: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    pages_pending: bool = False  # retired pages wait for a reset (GPUs before Ampere)

    @property
    def model(self) -> catalog.GpuModel | None:
        return _model(self.model_key) if self.model_key else None


@dataclass
class InjectedError:
    """Make ``function`` return ``code`` for its next ``remaining`` calls."""

    function: str
    code: int
    remaining: int


@dataclass
class SimEvent:
    """An NVML event (``nvmlEventData_t``) the driver posted, numbered in order."""

    seq: int
    gpu: int
    event_type: int
    data: int  # the Xid of an Xid event, else 0
    gi_id: int  # 0xFFFFFFFF: not attributed to a GPU instance
    ci_id: int


@dataclass
class HostState:
    spec: str
    driver_version: str
    root: bool
    mig_config: bool
    gpus: list[SimGpu]
    injected_errors: list[InjectedError] = field(default_factory=list)
    process_api: str = "v3"  # newest nvmlDeviceGetComputeRunningProcesses this library has
    # spec perm=uid: the caller is root exactly when the calling process's euid is 0, so
    # each process sharing the state file is judged as itself.
    follows_uid: bool = False
    # The MIG monitor capability is world-readable (NVIDIA's default, 0444); False: root
    # only, as on a host or container that restricted it.
    monitor_world: bool = True
    # Events posted (the latest EVENTS_KEPT), for every process's event sets to read.
    events: list[SimEvent] = field(default_factory=list)
    event_seq: int = 0

    def post_event(self, gpu: int, event_type: int, data: int = 0,
                   gi_id: int = NOT_ATTRIBUTED, ci_id: int = NOT_ATTRIBUTED) -> None:
        """The driver posts an event on GPU ``gpu`` (for the event sets registered)."""
        self.event_seq += 1
        self.events.append(SimEvent(self.event_seq, gpu, event_type, data, gi_id, ci_id))
        del self.events[:-EVENTS_KEPT]

    @property
    def caller_root(self) -> bool:
        """The caller may do what root may (switch MIG mode, read parent-GPU totals)."""
        return self.root or (self.follows_uid and os.geteuid() == 0)

    @property
    def caller_config(self) -> bool:
        """The caller holds the MIG config capability (create and destroy instances)."""
        return self.caller_root or self.mig_config

    @property
    def caller_monitor(self) -> bool:
        """The caller may read the MIG monitor capability (list GPU/compute instances)."""
        return self.caller_root or self.monitor_world

    @property
    def cuda_version(self) -> int:
        branch = int(self.driver_version.split(".")[0])
        known = [b for b in _CUDA_BY_BRANCH if b <= branch]
        return _CUDA_BY_BRANCH[max(known)] if known else 11000

    @property
    def nvml_version(self) -> str:
        return f"{self.cuda_version // 1000}.{self.driver_version}"

    def to_json(self) -> dict:
        return {
            "format": 1,
            "spec": self.spec,
            "driver_version": self.driver_version,
            "root": self.root,
            "mig_config": self.mig_config,
            "injected_errors": [[f.function, f.code, f.remaining] for f in self.injected_errors],
            "process_api": self.process_api,
            "follows_uid": self.follows_uid,
            "monitor_world": self.monitor_world,
            "events": [[e.seq, e.gpu, e.event_type, e.data, e.gi_id, e.ci_id]
                       for e in self.events],
            "event_seq": self.event_seq,
            "gpus": [_gpu_json(g) for g in self.gpus],
        }

    @classmethod
    def from_json(cls, data: dict) -> HostState:
        return cls(
            spec=data["spec"],
            driver_version=data["driver_version"],
            root=data["root"],
            mig_config=data["mig_config"],
            injected_errors=[InjectedError(*f) for f in data.get("injected_errors", ())],
            process_api=data.get("process_api", "v3"),
            follows_uid=data.get("follows_uid", False),
            monitor_world=data.get("monitor_world", True),
            events=[SimEvent(*e) for e in data.get("events", ())],
            event_seq=data.get("event_seq", 0),
            gpus=[_gpu_from_json(g) for g in data["gpus"]],
        )


@functools.cache
def _model(key: str) -> catalog.GpuModel:
    return catalog.model(key)


@functools.lru_cache(maxsize=4096)  # asked for on every GetUUID; uuid5 is not free
def mig_device_uuid(gpu_uuid: str, gi_id: int, ci_id: int) -> str:
    """Modern MIG UUID (``MIG-xxxxxxxx-xxxx-5xxx-...``), stable for one GPU, GI and CI."""
    return f"MIG-{uuid.uuid5(_NAMESPACE, f'{gpu_uuid}/{gi_id}/{ci_id}')}"


def new_host_state(host: HostSpec, spec_text: str, place: str = "") -> HostState:
    """A fresh host as the spec describes it, without instances (``rules.apply_layout``).

    The GPU UUIDs derive from the spec and from ``place``: where the host is kept (its
    state file), so that two simulated hosts never share a UUID, as two real hosts'
    GPUs never do (each host's holder check scans the processes of the machine they
    run on, and must not take the other's servers for holders of its slices)."""
    seed = f"{spec_text}@{place}" if place else spec_text
    gpus = []
    for group_no, group in enumerate(host.groups):
        for _ in range(group.count):
            index = len(gpus)
            gpu_uuid = f"GPU-{uuid.uuid5(_NAMESPACE, f'{seed}/{group_no}/{index}')}"
            if group.model_key in NON_MIG_MODELS:
                product, memory = NON_MIG_MODELS[group.model_key]
                gpus.append(SimGpu(index, gpu_uuid, product, None, memory, 0, 0))
                continue
            model = catalog.model(group.model_key)
            current = 1 if group.mig == "on" else 0
            pending = 0 if group.mig == "off" else 1
            gpus.append(SimGpu(index, gpu_uuid, model.product_names[0], model.key,
                               model.memory_mib, current, pending, id_scheme=group.ids))
    return HostState(
        spec=spec_text,
        driver_version=host.driver_version,
        root=host.permission == "root",
        mig_config=host.permission in ("root", "config"),
        gpus=gpus,
        process_api=host.process_api,
        follows_uid=host.permission == "uid",
        monitor_world=host.monitor == "world",
    )


def _gpu_json(g: SimGpu) -> dict:
    return {
        "index": g.index, "uuid": g.uuid, "product": g.product, "model": g.model_key,
        "memory_mib": g.memory_mib, "mig": [g.mig_current, g.mig_pending],
        "ids": g.id_scheme, "processes": g.processes, "memory_used_mib": g.memory_used_mib,
        "lost": g.lost, "ecc": [g.ecc_enabled, *g.ecc_uncorrected],
        "remapped_rows": g.remapped_rows, "pages_pending": g.pages_pending,
        "gis": [
            {
                "id": gi.gi_id, "profile_id": gi.profile_id, "start": gi.start, "size": gi.size,
                "cis": [
                    {"id": ci.ci_id, "profile": ci.profile_index, "slices": ci.slice_count,
                     "processes": ci.processes, "memory_used_mib": ci.memory_used_mib}
                    for ci in gi.cis.values()
                ],
            }
            for gi in g.gis.values()
        ],
    }


def _gpu_from_json(d: dict) -> SimGpu:
    gpu = SimGpu(d["index"], d["uuid"], d["product"], d["model"], d["memory_mib"], *d["mig"],
                 id_scheme=d.get("ids", "forward"),
                 processes=[tuple(p) for p in d.get("processes", ())],
                 memory_used_mib=d.get("memory_used_mib"), lost=d.get("lost", False),
                 remapped_rows=list(d.get("remapped_rows", (0, 0, 0, 0))),
                 pages_pending=d.get("pages_pending", False))
    ecc = d.get("ecc")
    if ecc is not None:
        gpu.ecc_enabled, gpu.ecc_uncorrected = bool(ecc[0]), list(ecc[1:])
    for gi in d["gis"]:
        sim_gi = SimGpuInstance(gi["id"], gi["profile_id"], gi["start"], gi["size"])
        for ci in gi["cis"]:
            sim_gi.cis[ci["id"]] = SimComputeInstance(
                ci["id"], ci["profile"], ci["slices"],
                [tuple(p) for p in ci["processes"]], ci["memory_used_mib"],
            )
        gpu.gis[sim_gi.gi_id] = sim_gi
    return gpu
