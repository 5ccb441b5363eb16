"""SM activity per GPU instance, from NVML GPU Performance Monitoring (GPM).

In MIG mode ``nvmlDeviceGetUtilizationRates`` answers NOT_SUPPORTED, so per-instance
activity needs GPM (Hopper and later, driver R520+): ``nvmlGpmMigSampleGet`` takes a
sample of one GPU instance and ``nvmlGpmMetricsGet`` turns two samples into rates.
:class:`GpmSampler` keeps the previous sample of each instance, so every call reports
the activity since the call before (Prometheus scrapes make a natural interval).

Where GPM is missing (Ampere GPUs, older drivers, the simulator) the sampler says so
once per GPU and returns nothing: per-instance activity then comes from NVIDIA
dcgm-exporter (``DCGM_FI_PROF_SM_ACTIVE`` with a ``GPU_I_ID`` label), see
docs/operations.md. Use it in the process whose :class:`~mig_spawner.gpu.GpuAdapter`
initialised NVML, while that adapter is open.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import pynvml

log = logging.getLogger(__name__)

# Ratios, not percentages: Prometheus convention (NVML reports 0-100).
_PERCENT = 100.0


class GpmSampler:
    """Per-GPU-instance SM utilisation between consecutive :meth:`sm_activity` calls."""

    def __init__(self) -> None:
        self._supported: dict[int, bool] = {}
        self._previous: dict[tuple[int, int], Any] = {}

    def supported(self, gpu_index: int) -> bool:
        """Whether GPU ``gpu_index`` supports GPM (asked once, then remembered)."""
        known = self._supported.get(gpu_index)
        if known is None:
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
                known = bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
            except pynvml.NVMLError as exc:
                # FunctionNotFound (old driver), NotSupported (pre-Hopper): no GPM here.
                log.info("GPU %d: no NVML GPM (%s); per-instance SM activity "
                         "needs dcgm-exporter", gpu_index, exc)
                known = False
            self._supported[gpu_index] = known
        return known

    def sm_activity(self, gpu_index: int, gi_ids: Iterable[int]) -> dict[int, float]:
        """GPU instance ID -> share of its SMs busy (0.0-1.0) since the previous call.

        The first call for an instance only takes its baseline sample, so it is missing
        from the result; so is any instance whose sample failed (it may have just been
        destroyed). Samples of instances not in ``gi_ids`` are dropped.
        """
        if not self.supported(gpu_index):
            return {}
        wanted = set(gi_ids)
        for key in [k for k in self._previous if k[0] == gpu_index and k[1] not in wanted]:
            self._free(self._previous.pop(key))
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
        activity = {}
        for gi_id in sorted(wanted):
            value = self._sample(handle, gpu_index, gi_id)
            if value is not None:
                activity[gi_id] = value
        return activity

    def _sample(self, handle: Any, gpu_index: int, gi_id: int) -> float | None:
        key = (gpu_index, gi_id)
        sample = pynvml.nvmlGpmSampleAlloc()
        try:
            pynvml.nvmlGpmMigSampleGet(handle, gi_id, sample)
        except pynvml.NVMLError as exc:
            log.debug("GPM sample of GPU %d GI %d failed: %s", gpu_index, gi_id, exc)
            self._free(sample)
            return None
        previous = self._previous.pop(key, None)
        self._previous[key] = sample
        if previous is None:
            return None
        try:
            return self._sm_util(previous, sample)
        except pynvml.NVMLError as exc:
            log.debug("GPM metrics of GPU %d GI %d failed: %s", gpu_index, gi_id, exc)
            return None
        finally:
            self._free(previous)

    @staticmethod
    def _sm_util(first: Any, second: Any) -> float | None:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = first
        request.sample2 = second
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        pynvml.nvmlGpmMetricsGet(request)
        metric = request.metrics[0]
        if metric.nvmlReturn != pynvml.NVML_SUCCESS:
            return None
        return max(0.0, min(1.0, metric.value / _PERCENT))

    @staticmethod
    def _free(sample: Any) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlGpmSampleFree(sample)

    def close(self) -> None:
        """Free the samples kept between calls."""
        for sample in self._previous.values():
            self._free(sample)
        self._previous.clear()
