"""PNG plots of the report, drawn with matplotlib's ``Figure`` on the Agg canvas.

No pyplot: it keeps global state and picks a GUI backend; a bare ``Figure`` needs no
display and is safe to draw from several threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path

from matplotlib.figure import Figure

from mig_spawner.ledger import Lease
from mig_spawner.report.demand import UsageRow, concurrency_series

#: At most this many points per concurrency curve, whatever the window.
_POINTS = 400


def concurrency_plot(leases: Sequence[Lease], since: datetime, until: datetime,
                     capacity: Mapping[str, int], path: Path) -> Path:
    """Slices held over time per profile, with the layout's capacity as dashed lines."""
    step = max((until - since) / _POINTS, timedelta(minutes=1))
    times, series = concurrency_series(leases, since, until, step)
    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    for profile in sorted(series):
        line = ax.step(times, series[profile], where="post", label=profile)[0]
        if capacity.get(profile):
            ax.axhline(capacity[profile], linestyle="--", linewidth=1, color=line.get_color())
    ax.set_title("MIG slices held, per profile (dashed: instances in the current layout)")
    ax.set_ylabel("slices held")
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="upper left", fontsize="small")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def demand_plot(rows: Sequence[UsageRow], path: Path) -> Path:
    """Per profile: granted requests and refusals (layout and policy), stacked."""
    totals: dict[str, list[int]] = {}
    for row in rows:
        t = totals.setdefault(row.profile, [0, 0, 0])
        t[0] += row.granted
        t[1] += row.refused_capacity
        t[2] += row.refused_policy
    names = sorted(totals)
    granted = [totals[n][0] for n in names]
    layout = [totals[n][1] for n in names]
    policy = [totals[n][2] for n in names]
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    ax.bar(names, granted, label="granted", color="#4c9a2a")
    ax.bar(names, layout, bottom=granted, label="refused: no free slice", color="#d1495b")
    ax.bar(names, policy, bottom=[g + c for g, c in zip(granted, layout, strict=True)],
           label="refused: policy", color="#edae49")
    ax.set_title("Requests per profile")
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_plots(directory: Path, leases: Sequence[Lease], rows: Sequence[UsageRow],
                since: datetime, until: datetime, capacity: Mapping[str, int]) -> list[Path]:
    """Both plots into ``directory`` (created if missing); returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        concurrency_plot(leases, since, until, capacity, directory / "concurrency.png"),
        demand_plot(rows, directory / "demand.png"),
    ]
