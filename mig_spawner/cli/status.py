"""``mig-spawner status``: each GPU's memory slices with the instances laid on them."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..core.catalog import WHOLE_GPU, find_model_for_product, format_gib
from ..core.inventory import Gpu, GpuInstance, Inventory, MigDevice
from ..core.kinds import offered_whole

CELL = 10  # characters per memory slice in the picture


def _mode_text(gpu: Gpu) -> str:
    if not gpu.mig_supported:
        return "no MIG support"
    if gpu.mig_current != gpu.mig_pending:
        now, later = ("on" if m else "off" for m in (gpu.mig_current, gpu.mig_pending))
        return f"MIG {now}, {later} after reset"
    return "MIG on" if gpu.mig_current else "MIG off"


def _device_for(gpu: Gpu, gi: GpuInstance) -> MigDevice | None:
    return next((d for d in gpu.mig_devices if d.gi_id == gi.gi_id), None)


def _box(label: str, size: int) -> str:
    """A box ``[ label ]`` exactly ``size`` cells wide."""
    inner = CELL * size - 2
    return "[" + label[:inner].center(inner) + "]"


def slice_row(gpu: Gpu, memory_slices: int) -> str:
    """One line: the GPU's memory slices, each instance drawn across the slices it covers.

    A ``*`` after the profile marks an instance with running processes, a ``?`` one
    whose processes the driver would not tell.
    """
    by_start = {gi.start: gi for gi in gpu.gpu_instances}
    parts: list[str] = []
    s = 0
    while s < memory_slices:
        gi = by_start.get(s)
        if gi is None:
            parts.append(" " + "·free·".center(CELL - 2) + " ")
            s += 1
            continue
        dev = _device_for(gpu, gi)
        label = gi.profile + _busy_mark(dev)
        parts.append(_box(label, gi.size))
        s += gi.size
    return "".join(parts)


def _busy_mark(dev: MigDevice | None) -> str:
    if dev is None:
        return ""
    return "?" if dev.processes_unknown else "*" if dev.busy else ""


def render_text(inv: Inventory) -> str:
    """The human picture: one block per GPU, then a table of MIG devices."""
    lines = [f"host {inv.host}  driver {inv.driver_version}  NVML {inv.nvml_version}", ""]
    for gpu in inv.gpus:
        model = find_model_for_product(gpu.product)
        lines.append(f"GPU {gpu.index}  {gpu.product}  {gpu.uuid}  {_mode_text(gpu)}")
        if model is None or not gpu.mig_current:
            if offered_whole(gpu):
                lines.append(f"  whole GPU, {format_gib(gpu.memory_total_mib)}: offered as "
                             f"{WHOLE_GPU!r} to the groups that allow it")
            lines.append("")
            continue
        header = "".join(f"{i:^{CELL}}" for i in range(model.memory_slices))
        lines.append("  slices " + header)
        lines.append("         " + slice_row(gpu, model.memory_slices))
        lines.append("")
    devices = inv.mig_devices
    if devices:
        lines.append(_device_table(devices))
    else:
        lines.append("no MIG devices")
    lines.append("")
    lines.append("* = processes running on the instance; ? = its processes cannot be read")
    return "\n".join(lines)


def _device_table(devices: tuple[MigDevice, ...]) -> str:
    rows = [("GPU", "GI", "CI", "PROFILE", "PLACEMENT", "MEMORY USED", "PIDS", "UUID")]
    for d in devices:
        rows.append(
            (
                str(d.gpu_index),
                str(d.gi_id),
                str(d.ci_id),
                d.profile,
                f"{d.start}:{d.size}",
                f"{format_gib(d.memory_used_mib)} / {format_gib(d.memory_total_mib)}",
                "unknown" if d.processes_unknown else ",".join(map(str, d.pids)) or "-",
                d.uuid,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def to_json(inv: Inventory) -> dict[str, Any]:
    """The inventory as JSON-ready data (the ``--json`` output)."""
    return asdict(inv)


def render_json(inv: Inventory) -> str:
    return json.dumps(to_json(inv), indent=2)
