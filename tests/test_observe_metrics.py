"""Prometheus metrics per slice, read back from the text a scrape returns."""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mig_spawner.gpu import GpuAdapter
from mig_spawner.gpu.gpm import GpmSampler
from mig_spawner.gpu.simulator import SimulatedNvmlLibrary
from mig_spawner.gpu.simulator.library import _decode, _out
from mig_spawner.observe.gpu_metrics import SliceCollector
from mig_spawner.observe.source import SliceSource
from tests.support.observe_world import World, make_world

MIB = 1024 * 1024


@pytest.fixture
def world(tmp_path):
    w = make_world(tmp_path)
    yield w
    w.close()


def scrape(registry: CollectorRegistry) -> dict[str, list[Any]]:
    """Sample name -> samples, parsed from the exposition text as Prometheus would."""
    text = generate_latest(registry).decode()
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples, name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, [])
             if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def registry_for(world: World, gpm: GpmSampler | None = None) -> CollectorRegistry:
    source = SliceSource(world.adapter, world.ledger, world.policy, max_age=0,
                         clock=world.clock, idle_after=600)
    registry = CollectorRegistry()
    registry.register(SliceCollector(source.snapshot, gpm=gpm))
    return registry


def test_slices_by_state_holder_memory_age_and_quota(world):
    big = world.device(0, "3g.71gb")
    world.lease("ada", "research", big)
    world.sim.set_processes(big.uuid, [(101, 4096)])
    world.lease("bob", "analysts", world.device(1, "1g.18gb"))
    world.clock.advance(minutes=20)
    world.ledger.usage.touch(world.leases["ada"].id, world.clock.now)
    world.ledger.usage.record_gpu(world.leases["ada"].id, gpu_active_at=world.clock.now,
                            peak_memory_mib=4096)
    stray = world.device(1, "2g.35gb")
    world.sim.set_processes(stray.uuid, [(666, 512)])

    m = scrape(registry_for(world))
    assert value(m, "mig_spawner_slice_collector_up") == 1
    assert value(m, "mig_spawner_slices", gpu="0", profile="3g.71gb", state="leased") == 1
    assert value(m, "mig_spawner_slices", gpu="0", profile="3g.71gb", state="free") == 0
    assert value(m, "mig_spawner_slices", gpu="1", profile="1g.18gb", state="idle") == 1
    assert value(m, "mig_spawner_slices", gpu="1", profile="1g.18gb", state="free") == 1
    assert value(m, "mig_spawner_slices", gpu="1", profile="2g.35gb", state="orphan") == 1
    assert value(m, "mig_spawner_slice_memory_used_bytes", user="ada") == 4096 * MIB
    total = big.memory_total_mib * MIB
    assert value(m, "mig_spawner_slice_memory_total_bytes", user="ada") == total
    assert value(m, "mig_spawner_slice_processes", gpu="1", state="orphan") == 1
    assert value(m, "mig_spawner_lease_age_seconds", user="bob", group="analysts") == 1200
    assert value(m, "mig_spawner_lease_idle_seconds", user="ada") == 0
    assert value(m, "mig_spawner_lease_idle_seconds", user="bob") == 1200
    assert value(m, "mig_spawner_lease_idle_limit_seconds", user="bob") == 1800
    assert value(m, "mig_spawner_lease_gpu_idle_seconds", user="ada") == 0
    assert value(m, "mig_spawner_lease_peak_memory_bytes", user="ada") == 4096 * MIB
    # bob's slice never did GPU work: no series for him.
    assert [s.labels["user"] for s in m["mig_spawner_lease_gpu_idle_seconds"]] == ["ada"]
    assert value(m, "mig_spawner_group_slices", group="research") == 1
    assert value(m, "mig_spawner_group_quota_slices", group="research") == 2
    assert value(m, "mig_spawner_group_compute_slices", group="research") == 3
    assert value(m, "mig_spawner_slice_info", user="ada", server="ada/", mig_uuid=big.uuid) == 1
    assert value(m, "mig_spawner_gpu_unallocated_memory_slices", gpu="0") == 0


def test_a_failing_gpu_read_reports_down_instead_of_breaking_the_scrape(world):
    registry = registry_for(world)
    world.sim.inject_error("nvmlDeviceGetCount_v2", "DRIVER_NOT_LOADED")
    m = scrape(registry)
    assert value(m, "mig_spawner_slice_collector_up") == 0
    assert "mig_spawner_slices" not in m
    assert value(scrape(registry), "mig_spawner_slice_collector_up") == 1  # recovers


def test_without_gpm_the_activity_metric_is_absent_and_says_why(world):
    m = scrape(registry_for(world, gpm=GpmSampler()))
    assert value(m, "mig_spawner_gpm_supported", gpu="0") == 0
    assert "mig_spawner_slice_sm_active_ratio" not in m


class GpmLibrary(SimulatedNvmlLibrary):
    """The simulator plus NVML GPM, as a Hopper driver has it; ``sm_util`` is set by the test.

    Exercises the sampler's real ctypes path (alloc, MIG sample, metrics, free)."""

    sm_util: dict[tuple[int, int], float]  # (GPU index, GI ID) -> percent

    def __init__(self, host: Any) -> None:
        super().__init__(host)
        self.sm_util = {}
        self.samples: dict[int, tuple[int, int]] = {}  # sample address -> (GPU, GI ID)
        self.freed = 0
        self._addresses = itertools.count(0x5000, 16)

    def _nvmlGpmQueryDeviceSupport(self, device: Any, ref: Any) -> None:
        _out(ref).isSupportedDevice = 1

    def _nvmlGpmSampleAlloc(self, ref: Any) -> None:
        ctypes.cast(ctypes.pointer(_out(ref)), ctypes.POINTER(ctypes.c_void_p))[0] = next(
            self._addresses)

    def _nvmlGpmMigSampleGet(self, device: Any, gi_id: Any, sample: Any) -> None:
        gpu = _decode(device)[1]
        self.samples[ctypes.cast(sample, ctypes.c_void_p).value] = (gpu, int(gi_id))

    def _nvmlGpmMetricsGet(self, ref: Any) -> None:
        request = _out(ref)
        where = self.samples[ctypes.cast(request.sample2, ctypes.c_void_p).value]
        request.metrics[0].value = self.sm_util.get(where, 0.0)
        request.metrics[0].nvmlReturn = pynvml.NVML_SUCCESS

    def _nvmlGpmSampleFree(self, sample: Any) -> None:
        self.freed += 1


def test_gpm_activity_per_instance_between_scrapes(world):
    library = GpmLibrary(world.sim)
    world.adapter.close()
    world.adapter = GpuAdapter(library=library)
    big = world.device(0, "3g.71gb")
    world.lease("ada", "research", big)
    library.sm_util = {(0, big.gi_id): 87.5}
    registry = registry_for(world, gpm=GpmSampler())

    first = scrape(registry)  # baseline samples only
    assert value(first, "mig_spawner_gpm_supported", gpu="0") == 1
    assert "mig_spawner_slice_sm_active_ratio" not in first
    second = scrape(registry)
    assert value(second, "mig_spawner_slice_sm_active_ratio", gpu="0", user="ada") == 0.875
    assert value(second, "mig_spawner_slice_sm_active_ratio", gpu="1",
                 gi=str(big.gi_id)) == 0.0
    assert library.freed == 8  # one earlier sample per instance, given back

    # A failing GPM call costs the activity series, not the scrape.
    world.sim.inject_error("nvmlGpmSampleAlloc", "UNKNOWN")
    third = scrape(registry)
    assert "mig_spawner_slice_sm_active_ratio" not in third
    assert value(third, "mig_spawner_slices", gpu="0", profile="3g.71gb", state="leased") == 1
