"""Prometheus metrics per MIG slice: state, holder, memory, processes, age, idle time, quota.

:class:`SliceCollector` is a custom collector: every scrape takes one slice map (see
:mod:`.slice_state`) and turns it into gauges, so the numbers are never staler than
the scrape. Register it on the slice service's registry::

    registry.register(SliceCollector(source.snapshot, gpm=GpmSampler()))

Names follow JupyterHub's (``jupyterhub_...``): ``mig_spawner_`` then the thing, with
labels ``host``, ``gpu`` (index), ``gi`` (GPU instance ID), ``profile``, ``state``,
``user`` and ``group``. ``gpu`` plus ``gi`` are what NVIDIA dcgm-exporter calls
``gpu`` and ``GPU_I_ID``, so its per-instance metrics join onto these (docs/operations.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mig_spawner.gpu.gpm import GpmSampler
from mig_spawner.observe.slice_state import SLICE_STATES, SliceMap, SliceRow, counts_by

log = logging.getLogger(__name__)

PREFIX = "mig_spawner"
_MIB = 1024 * 1024
# One series per slice: bounded by the number of MIG devices (at most 7 per GPU).
SLICE_LABELS = ("host", "gpu", "gi", "profile", "state", "user", "group")
LEASE_LABELS = ("host", "gpu", "gi", "profile", "user", "group")


def _gauge(name: str, doc: str, labels: tuple[str, ...], unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels), unit=unit)


def _slice_labels(host: str, row: SliceRow) -> list[str]:
    return [host, str(row.gpu_index), "" if row.gi_id is None else str(row.gi_id),
            row.profile, row.state, row.user or "", row.group or ""]


def _lease_labels(host: str, row: SliceRow) -> list[str]:
    return [host, str(row.gpu_index), "" if row.gi_id is None else str(row.gi_id),
            row.profile, row.user or "", row.group or ""]


class SliceCollector(Collector):
    """Exports one slice map per scrape. ``snapshot`` returns it; ``gpm`` (optional)
    adds per-instance SM activity where the GPU supports NVML GPM."""

    def __init__(self, snapshot: Callable[[], SliceMap], gpm: GpmSampler | None = None
                 ) -> None:
        self._snapshot = snapshot
        self._gpm = gpm

    def describe(self) -> list[GaugeMetricFamily]:
        """Nothing up front: registering must not walk NVML (the scrape does)."""
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = _gauge("slice_collector_up",
                    "1 when the last scrape read the GPUs and the ledger, 0 when it failed.", ())
        try:
            view = self._snapshot()
        except Exception:
            # A scrape must not fail as a whole: say "down" and let the alert fire.
            log.exception("cannot build the slice map for /metrics")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._state_counts(view)
        yield from self._per_slice(view)
        yield from self._per_gpu(view)
        yield from self._per_group(view)
        if self._gpm is not None:
            try:
                activity = list(self._activity(view, self._gpm))
            except Exception:
                # Activity is a bonus: a GPM hiccup must not cost the slice metrics.
                log.exception("cannot sample NVML GPM for per-slice SM activity")
            else:
                yield from activity

    @staticmethod
    def _state_counts(view: SliceMap) -> Iterator[GaugeMetricFamily]:
        slices = _gauge("slices", "MIG slices by GPU, profile and state "
                        "(free, leased, idle, orphan).", ("host", "gpu", "profile", "state"))
        counts = counts_by(view.slices, "gpu_index", "profile", "state")
        profiles = {(r.gpu_index, r.profile) for r in view.slices}
        for gpu, profile in sorted(profiles):
            # Zeros too, so that "no free 1g slice" is a value an alert can compare.
            for state in SLICE_STATES:
                slices.add_metric([view.host, str(gpu), profile, state],
                                  counts.get((gpu, profile, state), 0))
        yield slices

    @staticmethod
    def _per_slice(view: SliceMap) -> Iterator[GaugeMetricFamily]:
        info = _gauge("slice_info", "One series per slice: its state and holder (value 1).",
                      (*SLICE_LABELS, "mig_uuid", "server"))
        used = _gauge("slice_memory_used", "GPU memory used on the MIG slice.",
                      SLICE_LABELS, unit="bytes")
        total = _gauge("slice_memory_total", "GPU memory of the MIG slice.",
                       SLICE_LABELS, unit="bytes")
        procs = _gauge("slice_processes", "Processes running on the MIG slice.", SLICE_LABELS)
        age = _gauge("lease_age", "Seconds since the slice's server started.",
                     LEASE_LABELS, unit="seconds")
        idle = _gauge("lease_idle", "Seconds since the slice's server was last active.",
                      LEASE_LABELS, unit="seconds")
        idle_limit = _gauge("lease_idle_limit", "The idle limit in force (waited or unwaited).",
                            LEASE_LABELS, unit="seconds")
        left = _gauge("lease_session_left", "Seconds until the lease's expires_at "
                      "(max session age), when the slice service stops its server.",
                      LEASE_LABELS, unit="seconds")
        gpu_idle = _gauge("lease_gpu_idle", "Seconds since the lease's slice last did GPU "
                          "work (compute processes with SM activity).", LEASE_LABELS,
                          unit="seconds")
        peak = _gauge("lease_peak_memory", "Most GPU memory the lease's slice held.",
                      LEASE_LABELS, unit="bytes")
        for row in view.slices:
            labels = _slice_labels(view.host, row)
            info.add_metric([*labels, row.mig_uuid or "", row.server or ""], 1)
            if row.mig_uuid is not None and row.memory_total_mib:
                used.add_metric(labels, row.memory_used_mib * _MIB)
                total.add_metric(labels, row.memory_total_mib * _MIB)
                procs.add_metric(labels, row.processes)
            if row.user is not None:
                lease = _lease_labels(view.host, row)
                if row.age_seconds is not None:
                    age.add_metric(lease, row.age_seconds)
                if row.idle_seconds is not None:
                    idle.add_metric(lease, row.idle_seconds)
                if row.idle_limit_seconds is not None:
                    idle_limit.add_metric(lease, row.idle_limit_seconds)
                if row.session_left_seconds is not None:
                    left.add_metric(lease, row.session_left_seconds)
                if row.gpu_idle_seconds is not None:
                    gpu_idle.add_metric(lease, row.gpu_idle_seconds)
                if row.peak_memory_mib is not None:
                    peak.add_metric(lease, row.peak_memory_mib * _MIB)
        yield from (info, used, total, procs, age, idle, idle_limit, left, gpu_idle, peak)

    @staticmethod
    def _per_gpu(view: SliceMap) -> Iterator[GaugeMetricFamily]:
        free = _gauge("gpu_unallocated_memory_slices",
                      "Memory slices of a MIG GPU that no instance covers.", ("host", "gpu"))
        for gpu in view.gpus:
            if gpu.mig_enabled and gpu.memory_slices:
                free.add_metric([view.host, str(gpu.index)], len(gpu.free_memory_slices))
        yield free

    @staticmethod
    def _per_group(view: SliceMap) -> Iterator[GaugeMetricFamily]:
        held = _gauge("group_slices", "Slices held by leases charged to the group (hub-wide).",
                      ("group",))
        compute = _gauge("group_compute_slices", "Compute slices held by the group's leases.",
                         ("group",))
        quota = _gauge("group_quota_slices", "The group's quota_slices (absent: unlimited).",
                       ("group",))
        quota_compute = _gauge("group_quota_compute_slices",
                               "The group's quota_compute_slices (absent: unlimited).",
                               ("group",))
        for group in view.groups:
            held.add_metric([group.name], group.slices)
            compute.add_metric([group.name], group.compute_slices)
            if group.quota_slices is not None:
                quota.add_metric([group.name], group.quota_slices)
            if group.quota_compute_slices is not None:
                quota_compute.add_metric([group.name], group.quota_compute_slices)
        yield from (held, compute, quota, quota_compute)

    @staticmethod
    def _activity(view: SliceMap, gpm: GpmSampler) -> Iterator[GaugeMetricFamily]:
        supported = _gauge("gpm_supported",
                           "1 when NVML GPM gives per-instance SM activity on this GPU.",
                           ("host", "gpu"))
        active = _gauge("slice_sm_active_ratio",
                        "Share of the slice's SMs busy since the previous scrape (NVML GPM).",
                        LEASE_LABELS)
        for gpu in view.gpus:
            ok = gpm.supported(gpu.index)
            supported.add_metric([view.host, str(gpu.index)], int(ok))
            if not ok:
                continue
            rows = {r.gi_id: r for r in gpu.slices if r.gi_id is not None and r.mig_uuid}
            for gi_id, value in gpm.sm_activity(gpu.index, rows).items():
                active.add_metric(_lease_labels(view.host, rows[gi_id]), value)
        yield from (supported, active)
