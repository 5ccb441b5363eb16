"""Scripted GPU activity in the simulator (NVML GPM) and the slice service's sampling.

The simulated driver answers pynvml's GPM calls as a Hopper GPU does, from activity a
test scripts per MIG device over time; the service's sampler reads it through the
same code it runs on a real driver.
"""

from __future__ import annotations

import pynvml
import pytest

from mig_spawner import gpu
from mig_spawner.config import MIGPolicyConfig
from mig_spawner.gpu.gpm import GpmSampler
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.hub.client import HubClient
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper

SIM = "h200x1:layout=3g.71gb,2g.35gb,1g.18gb*2"


@pytest.fixture
def world(tmp_path):
    """The service's GPU adapter, and a second view of the same host as a test's."""
    state = tmp_path / "sim.json"
    adapter = gpu.connect(SIM, state)
    yield adapter, SimulatedHost.open(state)
    adapter.close()


def test_gpm_is_off_until_scripted_like_a_gpu_without_it(world):
    adapter, _ = world
    device = adapter.inventory().mig_devices[0]
    sampler = GpmSampler()
    assert sampler.sm_activity(0, [device.gi_id]) == {}
    assert not sampler.supported(0)


def test_scripted_sm_activity_is_what_gpm_reports_over_time(world):
    adapter, host = world
    host.set_gpm(True)
    first, second = adapter.inventory().mig_devices[:2]
    sampler = GpmSampler()
    assert sampler.sm_activity(0, [first.gi_id, second.gi_id]) == {}  # baselines only
    host.set_sm_activity(first.uuid, 80)
    assert sampler.sm_activity(0, [first.gi_id, second.gi_id]) == {
        first.gi_id: 0.8, second.gi_id: 0.0}
    host.set_sm_activity((0, first.gi_id, first.ci_id), 0)  # the job ends
    assert sampler.sm_activity(0, [first.gi_id]) == {first.gi_id: 0.0}
    sampler.close()
    with pytest.raises(ValueError, match="percentage"):
        host.set_sm_activity(first.uuid, 120)


def test_gpm_metrics_without_two_samples_is_an_nvml_error(world):
    adapter, host = world
    host.set_gpm(True)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    sample = pynvml.nvmlGpmSampleAlloc()
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics = pynvml.NVML_GPM_METRICS_GET_VERSION, 1
    request.sample1 = request.sample2 = sample
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlGpmMetricsGet(request)  # allocated, never taken
    pynvml.nvmlGpmMigSampleGet(handle, adapter.inventory().mig_devices[0].gi_id, sample)
    pynvml.nvmlGpmSampleFree(sample)
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlGpmSampleFree(sample)


def test_the_service_samples_processes_memory_and_sm_activity_per_slice(world):
    adapter, host = world
    host.set_gpm(True)
    busy, held, quiet = adapter.inventory().mig_devices[:3]
    host.set_processes(busy.uuid, [(101, 20000)])
    host.set_memory_used(held.uuid, 30000)  # a dead kernel's memory, no process
    policy = MIGPolicyConfig().build()
    sweeper = Sweeper(HubClient("http://127.0.0.1:1/hub/api", "t"), policy, ServiceMetrics(),
                      gpus=adapter)
    sweeper.sample_slices()  # GPM baselines
    host.set_sm_activity(busy.uuid, 55)
    sampled = sweeper.sample_slices()
    assert sampled[busy.uuid].working and sampled[busy.uuid].sm_active == 0.55
    assert not sampled[held.uuid].working and sampled[held.uuid].memory_used_mib == 30000
    assert not sampled[quiet.uuid].working
