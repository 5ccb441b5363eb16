"""The report as people read it: a text table, JSON, the advice with its mig-parted YAML."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

import yaml

from mig_spawner.report.advise import Advice, mig_parted_config
from mig_spawner.report.demand import UsageRow
from mig_spawner.report.sample import RESAMPLES, plural

HEADER = ("PROFILE", "CLASS", "GROUP", "REQUESTS", "GRANTED", "REFUSED:LAYOUT", "REFUSED:POLICY",
          "HOLD H", "MEDIAN MIN", "IDLE", "PEAK")


def _cells(row: UsageRow) -> tuple[str, ...]:
    return (
        row.profile or "-",
        ", ".join(row.classes) or "-",
        row.group,
        str(row.requests),
        str(row.granted),
        str(row.refused_capacity),
        str(row.refused_policy),
        f"{row.hold_hours:.1f}",
        "-" if row.median_hold_minutes is None else f"{row.median_hold_minutes:.0f}",
        "-" if row.idle_share is None else f"{row.idle_share:.0%}",
        str(row.peak_concurrent),
    )


def table(rows: Sequence[UsageRow]) -> str:
    """Aligned columns, one line per (profile, group), and per class where a refused
    spawn asked for a class and no profile is known."""
    lines = [HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                  for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()
        for line in lines
    )


def usage_text(rows: Sequence[UsageRow], since: datetime, until: datetime) -> str:
    """The usage section: window, table, and how to read it."""
    head = f"MIG slice usage {since:%Y-%m-%d %H:%M} .. {until:%Y-%m-%d %H:%M} UTC"
    if not rows:
        return f"{head}\n\nno leases or refusals in this window"
    notes = [
        "CLASS = the slice classes refused spawns asked for; PROFILE - = refused before a "
        "slice was chosen.",
        "REFUSED:LAYOUT = no free slice of that profile (another layout could help);",
        "REFUSED:POLICY = quota, user limit or profile not allowed (a policy matter).",
        "IDLE = share of hold time after the server's last recorded activity.",
        "PEAK = most slices of that profile the group held at once.",
    ]
    return "\n".join([head, "", table(rows), "", *notes])


def advice_text(advice: Advice) -> str:
    """Current vs proposed layout per GPU, the replayed refusals with their ranges, the
    cautions, and the YAML to apply."""
    lines = ["Layout advice (replay of the history through the allocator, pool mode)", "",
             f"  sample: {advice.sample.describe()}", ""]
    if advice.too_small:
        return "\n".join([*lines, advice.summary()])
    for now, then in zip(advice.current, advice.proposed, strict=True):
        mark = ""
        if now.key() != then.key():
            mark = "  (changes"
            if advice.held.get(now.gpu_index):
                mark += f"; drain first: {plural(advice.held[now.gpu_index], 'lease')} held"
            mark += ")"
        lines.append(f"  GPU {now.gpu_index} {now.model_key}: {now.describe()}")
        lines.append(f"  {'':>{len(str(now.gpu_index)) + 4}} -> {then.describe()}{mark}")
    ranges = advice.ranges
    lines += ["", f"  refused now:      {advice.before.refused} of {advice.before.requests}"
                  f"  (range {ranges.before})",
              f"  refused proposed: {advice.after.refused} of {advice.after.requests}"
              f"  (range {ranges.after})",
              f"  refused dynamic:  {advice.dynamic.refused} of {advice.dynamic.requests}",
              f"  range: 5th-95th percentile over {RESAMPLES} redraws (with replacement, "
              f"seeded) of the sample's {plural(advice.sample.days, 'day')}",
              "", advice.summary()]
    cautions = advice.cautions()
    if cautions:
        lines += ["", "Before applying it:", *(f"  - {c}" for c in cautions)]
    if advice.changed:
        lines += ["", "mig-parted config (apply with nvidia-mig-parted, or label the node "
                  "nvidia.com/mig.config=mig-spawner-advised for the GPU Operator):", "",
                  mig_parted_yaml(advice)]
    return "\n".join(lines)


def mig_parted_yaml(advice: Advice) -> str:
    """The proposed layout, and the current one to roll back to, as mig-parted YAML."""
    config = mig_parted_config(advice.proposed)
    config["mig-configs"].update(
        mig_parted_config(advice.current, "mig-spawner-current")["mig-configs"])
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def to_json(rows: Sequence[UsageRow], advice: Advice | None, since: datetime,
            until: datetime) -> dict[str, Any]:
    """Everything in the report as JSON-ready data."""
    data: dict[str, Any] = {
        "since": since.isoformat(),
        "until": until.isoformat(),
        "usage": [asdict(r) for r in rows],
    }
    if advice is not None:
        data["advice"] = {
            "sample": {"requests": advice.sample.requests, "days": advice.sample.days,
                       "min_requests": advice.min_requests, "too_small": advice.too_small},
            "refused_before": advice.before.refused,
            "refused_after": advice.after.refused,
            "refused_dynamic": advice.dynamic.refused,
            "requests": advice.before.requests,
            "refused_before_range": asdict(advice.ranges.before),
            "refused_after_range": asdict(advice.ranges.after),
            "fewer_refusals_range": asdict(advice.ranges.gain),
            "changed_gpus": list(advice.changed),
            "drain_gpus": list(advice.to_drain),
            "dropped_profiles": {p: list(g) for p, g in advice.dropped.items()},
            "summary": advice.summary(),
            "cautions": advice.cautions(),
            "mig_parted": mig_parted_config(advice.proposed),
        }
    return data
