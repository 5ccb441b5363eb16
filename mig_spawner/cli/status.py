"""``mig-spawner status``: each GPU's memory slices with the instances laid on them, and,
where the ledger can be read, who holds each slice, for which server and purpose, since
when."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..core.catalog import WHOLE_GPU, find_model_for_product, format_gib
from ..core.durations import rounded_duration
from ..core.inventory import Gpu, GpuInstance, Inventory, MigDevice
from ..core.kinds import offered_whole

if TYPE_CHECKING:  # the slice map pulls in the ledger (SQLAlchemy): only for its type
    from ..observe.slice_state import SliceMap, SliceRow

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


def render_text(inv: Inventory, holders: SliceMap | None = None,
                ledger_note: str = "") -> str:
    """The human picture: one block per GPU, then a table of MIG devices; with
    ``holders`` (the slice map joined from the ledger), who holds each one, for which
    server and purpose, and for how long. ``ledger_note``: why there are no holders."""
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
        fault = _fault_of(gpu, holders)
        if fault:
            lines.append(f"  withheld: {fault} (after repair: mig-spawner health clear "
                         f"{gpu.index})")
        lines.append("")
    devices = inv.mig_devices
    if devices:
        lines.append(_device_table(devices, _rows_by_uuid(holders)))
    else:
        lines.append("no MIG devices")
    if holders is not None and holders.lost:
        lines += ["", "Held leases on GPUs this host does not show:"]
        lines += [f"  {row.server} ({row.profile}): {row.note}" for row in holders.lost]
    if holders is not None:
        lines += _what_comes_next(holders)
    lines.append("")
    lines.append("* = processes running on the instance; ? = its processes cannot be read")
    if ledger_note:
        lines.append(ledger_note)
    return "\n".join(lines)


def _fault_of(gpu: Gpu, holders: SliceMap | None) -> str | None:
    """The GPU faults the ledger holds on ``gpu``, in words (docs/health.md)."""
    if holders is None:
        return None
    return next((row.fault for row in holders.gpus if row.uuid == gpu.uuid), None)


def _what_comes_next(holders: SliceMap) -> list[str]:
    """Per held server, the next stop if nobody uses it from now on and its pending
    warnings; then the wait list in the order it is served."""
    lines = []
    coming = [row for row in holders.slices if row.user is not None
              and (row.next_text or row.warnings_text)]
    if coming:
        lines += ["", "Next stops (if nobody uses the server from now on):"]
        lines += [f"  {row.server} ({row.profile}, GPU {row.gpu_index}): "
                  + "; ".join(filter(None, [row.next_text, row.warnings_text]))
                  for row in coming]
    if holders.waiting:
        lines += ["", "Waiting, in the order they are served:"]
        lines += [f"  {i}. {w.user}/{w.server_name} for {w.offer} (group {w.group}), "
                  f"waiting {_age(w.waited_seconds)}"
                  + (", next for its size" if w.next else f", place {w.place} for its size")
                  for i, w in enumerate(holders.waiting, 1)]
    return lines


def _rows_by_uuid(holders: SliceMap | None) -> dict[str, SliceRow] | None:
    if holders is None:
        return None
    return {row.mig_uuid: row for row in holders.slices if row.mig_uuid}


def _age(seconds: float | None) -> str:
    """``"2h 5m"``: whole minutes from a minute on, whole seconds below."""
    return "-" if seconds is None else rounded_duration(seconds)


def holder_cells(row: SliceRow | None) -> tuple[str, str, str, str]:
    """HOLDER, SERVER, PURPOSE, AGE of one slice (``-`` where free)."""
    if row is None or row.user is None:
        return ("-", "-", "-", "-")
    return (row.user, row.server_name or "(default)", row.purpose or "-",
            _age(row.age_seconds))


def _device_table(devices: tuple[MigDevice, ...],
                  holders: dict[str, SliceRow] | None = None) -> str:
    head: tuple[str, ...] = ("GPU", "GI", "CI", "PROFILE", "PLACEMENT", "MEMORY USED", "PIDS")
    if holders is not None:
        head += ("HOLDER", "SERVER", "PURPOSE", "AGE")
    rows = [(*head, "UUID")]
    for d in devices:
        cells: tuple[str, ...] = (
            str(d.gpu_index),
            str(d.gi_id),
            str(d.ci_id),
            d.profile,
            f"{d.start}:{d.size}",
            f"{format_gib(d.memory_used_mib)} / {format_gib(d.memory_total_mib)}",
            "unknown" if d.processes_unknown else ",".join(map(str, d.pids)) or "-",
        )
        if holders is not None:
            cells += holder_cells(holders.get(d.uuid))
        rows.append((*cells, d.uuid))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def to_json(inv: Inventory, holders: SliceMap | None = None) -> dict[str, Any]:
    """The inventory as JSON-ready data (the ``--json`` output); with ``holders``, a
    ``holders`` list: each held slice's MIG UUID, user, server, purpose, age in seconds."""
    data = asdict(inv)
    if holders is not None:
        data["holders"] = [
            {"mig_uuid": row.mig_uuid, "gpu_index": row.gpu_index, "profile": row.profile,
             "user": row.user, "server_name": row.server_name, "group": row.group,
             "purpose": row.purpose, "age_seconds": row.age_seconds, "state": row.state,
             "idle_limit_seconds": row.idle_limit_seconds,
             "idle_limit_waited": row.idle_limit_waited, "next_stop": row.next_stop,
             "next_stop_in_seconds": row.next_stop_in_seconds,
             "next_stop_why": row.next_stop_why,
             "warnings": [asdict(w) for w in row.warnings]}
            for row in holders.slices if row.user is not None
        ]
        data["waiting"] = [{**asdict(w), "since": w.since.isoformat()}
                           for w in holders.waiting]
    return data


def render_json(inv: Inventory, holders: SliceMap | None = None) -> str:
    return json.dumps(to_json(inv, holders), indent=2)
