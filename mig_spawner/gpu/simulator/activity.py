"""Scripted GPU activity for the simulator: NVML GPM (SM activity per GPU instance).

Processes and memory per MIG device are scripted with ``SimulatedHost.set_processes``
and ``set_memory_used``; this module adds what a Hopper GPU's GPM reports:

- ``host.set_gpm(True)`` makes every simulated GPU answer ``nvmlGpmQueryDeviceSupport``
  as supported (off by default: the simulator then behaves like a GPU without GPM,
  where per-instance activity is unknown);
- ``host.set_sm_activity(device, percent)`` sets the share of the device's SMs busy
  from now on (0-100); a test changes it over time as a workload would.

Both are kept beside the host's state file (``<state>.activity.json``), so a test
process scripts what the hub and the slice service sample. ``SimulatedNvmlLibrary``
gets the GPM calls from :class:`GpmFunctions`; ``SimulatedHost`` the helpers from
:class:`ActivityScript`.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
from typing import TYPE_CHECKING, Any

import pynvml
from pynvml import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED

from .rules import SimError, mig_devices
from .state import DeviceRef, HostState, mig_device_uuid


class ActivityScript:
    """Test helpers of :class:`~mig_spawner.gpu.simulator.SimulatedHost` for GPM (a
    base of it: what it asks of the host is declared here, so this module does not
    import the host's)."""

    _script: dict[str, Any] | None = None
    _script_stamp: float | None = None
    state_file: str | None

    if TYPE_CHECKING:
        @property
        def state(self) -> HostState: ...

        def refresh(self) -> HostState: ...

    def set_gpm(self, supported: bool) -> None:
        """Whether the simulated GPUs support GPM (per-instance SM activity)."""
        script = self._activity()
        script["gpm"] = bool(supported)
        self._save_activity(script)

    def set_sm_activity(self, device: DeviceRef, percent: float) -> None:
        """Make ``device``'s SMs ``percent`` busy (0-100) from now on."""
        if not 0 <= percent <= 100:
            raise ValueError(f"SM activity is a percentage (0-100), not {percent}")
        gpu_index, gi_id = self._gi_of(device)
        script = self._activity()
        script.setdefault("sm", {})[f"{gpu_index}:{gi_id}"] = float(percent)
        self._save_activity(script)

    def gpm_supported(self) -> bool:
        """What ``nvmlGpmQueryDeviceSupport`` answers."""
        return bool(self._activity().get("gpm"))

    def sm_percent(self, gpu_index: int, gi_id: int) -> float:
        """The scripted SM activity of one GPU instance now (0 unless set)."""
        return float(self._activity().get("sm", {}).get(f"{gpu_index}:{gi_id}", 0.0))

    def _gi_of(self, device: DeviceRef) -> tuple[int, int]:
        for gpu in self.refresh().gpus:
            for gi, ci in mig_devices(gpu):
                if device in ((gpu.index, gi.gi_id, ci.ci_id),
                              mig_device_uuid(gpu.uuid, gi.gi_id, ci.ci_id)):
                    return gpu.index, gi.gi_id
        raise KeyError(f"no simulated MIG device {device!r}")

    def _activity_file(self) -> str | None:
        return f"{self.state_file}.activity.json" if self.state_file else None

    def _activity(self) -> dict[str, Any]:
        path = self._activity_file()
        if path is None:
            if self._script is None:
                self._script = {}
            return self._script
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return {}
        if stamp != self._script_stamp:  # re-read only when a test changed it
            with open(path, encoding="utf-8") as f:
                self._script, self._script_stamp = json.load(f), stamp
        return dict(self._script or {})

    def _save_activity(self, script: dict[str, Any]) -> None:
        path = self._activity_file()
        if path is None:
            self._script = script
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(script, f)
        os.replace(tmp, path)


# Samples are opaque pointers to pynvml; ours point at nothing and key this table.
_samples: dict[int, float | None] = {}
_sample_ids = itertools.count(1)


def _sample_id(sample: Any) -> int:
    value = ctypes.cast(sample, ctypes.c_void_p).value
    if not value:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT)
    return value


class GpmFunctions:
    """The GPM symbols of :class:`~mig_spawner.gpu.simulator.SimulatedNvmlLibrary`.

    A sample records the scripted SM activity of its GPU instance when it was taken;
    ``nvmlGpmMetricsGet`` reports the later sample's, as if the workload ran at that
    level for the whole interval.
    """

    host: ActivityScript  # the SimulatedHost

    def _nvmlGpmQueryDeviceSupport(self, handle: Any, ref: Any) -> None:
        self._gpu(self.host.state, handle)  # type: ignore[attr-defined]
        ref._obj.isSupportedDevice = int(self.host.gpm_supported())

    def _nvmlGpmSampleAlloc(self, ref: Any) -> None:
        sample_id = next(_sample_ids)
        _samples[sample_id] = None
        ctypes.c_void_p.from_buffer(ref._obj).value = sample_id

    def _nvmlGpmSampleFree(self, sample: Any) -> None:
        key = _sample_id(sample)
        if key not in _samples:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        del _samples[key]

    def _nvmlGpmMigSampleGet(self, handle: Any, gi_id: Any, sample: Any) -> None:
        gpu = self._gpu(self.host.state, handle)[1]  # type: ignore[attr-defined]
        gi = int(getattr(gi_id, "value", gi_id))
        if not self.host.gpm_supported():
            raise SimError(NVML_ERROR_NOT_SUPPORTED)
        if not gpu.mig_current or gi not in gpu.gis:
            raise SimError(pynvml.NVML_ERROR_NOT_FOUND)
        key = _sample_id(sample)
        if key not in _samples:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        _samples[key] = self.host.sm_percent(gpu.index, gi)

    def _nvmlGpmMetricsGet(self, ref: Any) -> None:
        request = ref._obj
        first, second = (_samples.get(_sample_id(s)) for s in (request.sample1, request.sample2))
        if first is None or second is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT)
        for metric in request.metrics[: request.numMetrics]:
            if metric.metricId == pynvml.NVML_GPM_METRIC_SM_UTIL:
                metric.nvmlReturn, metric.value = pynvml.NVML_SUCCESS, second
            else:
                metric.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
