"""Prometheus metrics of the slice service, in a registry of its own.

Every decision and repair is counted here, so that an admin can see on a
dashboard why slices came back to the pool. A registry per service instance
(rather than prometheus_client's global one) keeps several instances in one
process, as in tests, from colliding.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "mig_spawner_service"


class ServiceMetrics:
    """The counters, gauges and histogram the slice service exports on ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            f"{PREFIX}_cull_decisions", "Cull decisions made (also in dry-run mode).",
            ["kind", "reason", "group"], registry=r,
        )
        self.culls = Counter(
            f"{PREFIX}_culls", "Kernels shut down and servers stopped by the service.",
            ["kind", "reason", "group"], registry=r,
        )
        self.slices_reclaimed = Counter(
            f"{PREFIX}_slices_reclaimed",
            "MIG slices returned to the pool: leased servers stopped, or orphan leases released.",
            ["reason", "group"], registry=r,
        )
        self.orphans_repaired = Counter(
            f"{PREFIX}_orphans_repaired",
            "Ledger leases released because the hub no longer ran their server.",
            ["group"], registry=r,
        )
        self.holders_stopped = Counter(
            f"{PREFIX}_holders_stopped",
            "Server processes (or Kubernetes pods) of orphan leases, which the hub no "
            "longer tracked, stopped before their lease was released.", registry=r,
        )
        self.holders_unknown = Counter(
            f"{PREFIX}_holders_unknown",
            "Orphan releases held back because the lease's server process could not be "
            "checked or stopped (other host, no permission, Kubernetes API unreadable); "
            "the slice stays held.",
            registry=r,
        )
        self.unleased_devices = Gauge(
            f"{PREFIX}_unleased_busy_devices",
            "MIG devices, and whole GPUs with MIG off, running processes that no lease "
            "accounts for (reported, not killed).",
            registry=r,
        )
        self.gpu_faults = Counter(
            "mig_spawner_gpu_faults",
            "GPU faults found and held (docs/health.md), by GPU index and kind (xid, ecc, "
            "row_remap, retired_pages, lost, missing_instance).",
            ["gpu", "kind"], registry=r,
        )
        self.withheld_slices = Gauge(
            "mig_spawner_withheld_slices",
            "Memory slices withheld from new servers because their GPU or MIG device "
            "reported a hardware fault, until an admin clears it.",
            registry=r,
        )
        self.errors = Counter(
            f"{PREFIX}_errors",
            "Errors during sweeps, by where they happened.",
            ["kind"], registry=r,
        )
        self.sweep_duration = Histogram(
            f"{PREFIX}_sweep_duration_seconds", "Time one sweep took.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.warnings = Counter(
            f"{PREFIX}_warnings",
            "Warnings of a coming stop recorded for users (shown in JupyterLab and on "
            "the hub's home page).",
            ["reason", "group"], registry=r,
        )
        self.gpu_sample_duration = Histogram(
            f"{PREFIX}_gpu_sample_duration_seconds",
            "Time one sweep took to sample every MIG device (processes, memory, GPM).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self.gpu_working = Counter(
            f"{PREFIX}_slices_gpu_working",
            "Leased slices a sweep found doing GPU work (summed over sweeps).",
            ["group"], registry=r,
        )
        self.servers_seen = Gauge(
            f"{PREFIX}_servers_seen", "Running servers the last complete sweep saw.",
            registry=r,
        )
        self.budget_used = Gauge(
            f"{PREFIX}_budget_used_slice_hours",
            "Compute-slice-hours a group's leases held within its budget window (groups "
            "with a budget; members' own budgets are in `mig-spawner report`).",
            ["group"], registry=r,
        )
        self.budget_total = Gauge(
            f"{PREFIX}_budget_slice_hours",
            "A group's budget per window in compute-slice-hours, with extra hours granted.",
            ["group"], registry=r,
        )
        self.layout_gpus = Gauge(
            f"{PREFIX}_layout_gpus",
            "GPUs whose layout change is under way, by state (pending, draining, applying).",
            ["state"], registry=r,
        )
        self.pending_stops = Gauge(
            f"{PREFIX}_pending_stops",
            "Stops their users are warned of and that are still to come, by rule (each "
            "stop its own warning; as the last sweep read the ledger).",
            ["rule"], registry=r,
        )
        self.last_sweep = Gauge(
            f"{PREFIX}_last_success_timestamp_seconds",
            "Unix time when the last sweep completed without error.", registry=r,
        )
