"""``mig-spawner catalog``: the MIG profile table, from the catalog or from the live driver.

``--from-driver`` asks each MIG-enabled GPU's driver for its profiles
(``nvmlDeviceGetGpuInstanceProfileInfoV`` and the possible placements) and prints them in
the catalog's columns, next to the rows where the catalog differs. It only reads: it is
what to paste into a bug report about a GPU or driver the catalog gets wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..core.catalog import MODELS, Profile, compare_profiles, format_gib, model, profile_rows
from ..core.inventory import Gpu, Inventory

# The media engines as nvidia-smi heads them: decoders, encoders, JPEG decoders, OFA.
_COLUMNS = ("profile", "id", "compute_slices", "memory_slices", "memory", "memory_mib",
            "sm_count", "copy_engines", "dec", "enc", "jpeg", "ofa", "max_instances",
            "placement_starts")


def table(profiles: Iterable[Profile]) -> str:
    """The profiles as an aligned text table (memory in GiB, as every screen shows it, and
    the exact MiB the driver reports)."""
    rows = [_COLUMNS]
    for r in profile_rows(profiles):
        rows.append((str(r["profile"]), str(r["id"]), str(r["compute_slices"]),
                     str(r["memory_slices"]), format_gib(r["memory_mib"]),  # type: ignore[arg-type]
                     str(r["memory_mib"]), str(r["sm_count"]), str(r["copy_engines"]),
                     str(r["decoders"]), str(r["encoders"]), str(r["jpeg"]), str(r["ofa"]),
                     str(r["max_instances"]),
                     ",".join(map(str, r["placement_starts"]))))  # type: ignore[call-overload]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def driver_differences(gpu: Gpu) -> list[str]:
    """Rows where this GPU's driver and the catalog disagree (empty when either is silent)."""
    if gpu.model_key is None or not gpu.driver_profiles:
        return []
    return compare_profiles(model(gpu.model_key).profiles, gpu.driver_profiles)


def from_driver_json(inv: Inventory) -> dict[str, Any]:
    """Each GPU's driver-reported profile table, with the catalog's differences."""
    return {
        "driver_version": inv.driver_version,
        "nvml_version": inv.nvml_version,
        "gpus": [
            {
                "index": g.index, "product": g.product, "model_key": g.model_key,
                "mig_enabled": g.mig_enabled,
                "profiles": profile_rows(g.driver_profiles),
                "differences_from_catalog": driver_differences(g),
            }
            for g in inv.gpus
        ],
    }


def from_driver_text(inv: Inventory) -> str:
    lines = [f"driver {inv.driver_version}  NVML {inv.nvml_version}", ""]
    for g in inv.gpus:
        lines.append(f"GPU {g.index}  {g.product}  catalog key: {g.model_key or '(unknown)'}")
        if not g.driver_profiles:
            lines.append("  the driver lists no MIG profiles (MIG off, or no MIG support)")
        else:
            lines.append(table(g.driver_profiles))
            diffs = driver_differences(g)
            lines.extend(f"  differs from the catalog: {d}" for d in diffs)
            if g.model_key and not diffs:
                lines.append("  matches the catalog")
        lines.append("")
    return "\n".join(lines).rstrip()


def catalog_json(key: str | None) -> dict[str, Any]:
    models = [model(key)] if key else list(MODELS)
    return {"models": [
        {"key": m.key, "display_name": m.display_name, "products": list(m.product_names),
         "memory_slices": m.memory_slices, "min_driver": m.min_driver_major,
         "profiles": [dict(r, source=p.source, verified=p.verified)
                      for r, p in zip(profile_rows(m.profiles), m.profiles, strict=True)]}
        for m in models
    ]}


def catalog_text(key: str | None) -> str:
    models = [model(key)] if key else list(MODELS)
    return "\n\n".join(f"{m.display_name} ({m.key}; R{m.min_driver_major}+)\n{table(m.profiles)}"
                       for m in models)


def render(inv: Inventory | None, key: str | None, as_json: bool) -> str:
    """What the command prints: the driver's tables when ``inv`` is given, else the catalog."""
    if inv is not None:
        return json.dumps(from_driver_json(inv), indent=2) if as_json else from_driver_text(inv)
    return json.dumps(catalog_json(key), indent=2) if as_json else catalog_text(key)
