"""PNG plots of the report, drawn with matplotlib's ``Figure`` on the Agg canvas.

No pyplot: it keeps global state and picks a GUI backend; a bare ``Figure`` needs no
display and is safe to draw from several threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
from matplotlib.figure import Figure

from mig_spawner.ledger.reports import LeaseFacts
from mig_spawner.report.demand import UsageRow, held_steps, lease_end

#: Room left of the first lease, as a share of the plotted span, so its rise shows.
_LEAD = 0.05


def plot_window(leases: Sequence[LeaseFacts], since: datetime, until: datetime
                ) -> tuple[datetime, datetime]:
    """The span the concurrency plot shows: from a little before the first lease that
    held a slice in ``[since, until]`` to ``until``, so minutes of use are not a sliver
    of a 30-day axis; the whole window when no lease falls in it."""
    starts = [max(x.claimed_at, since) for x in leases
              if lease_end(x, until) >= since and x.claimed_at <= until]
    if not starts:
        return since, until
    first = min(starts)
    return max(since, first - (until - first) * _LEAD), until


def _window_title(start: datetime, end: datetime) -> str:
    day = "%Y-%m-%d %H:%M"
    same_day = start.date() == end.date()
    return f"{start:{day}} .. {end:{'%H:%M' if same_day else day}} UTC"


def concurrency_figure(leases: Sequence[LeaseFacts], since: datetime, until: datetime,
                       capacity: Mapping[str, int]) -> Figure:
    """Slices held over time per profile (to ``until``, see :func:`plot_window`), with
    the layout's capacity as dashed lines."""
    start, end = plot_window(leases, since, until)
    series = held_steps(leases, start, end)
    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    for profile in sorted(series):
        times, counts = series[profile]
        line = ax.step(times, counts, where="post", label=profile)[0]
        if capacity.get(profile):
            ax.axhline(capacity[profile], linestyle="--", linewidth=1, color=line.get_color())
    ax.set_title(f"MIG slices held per profile, {_window_title(start, end)}\n"
                 "(dashed: instances in the current layout)", fontsize="medium")
    ax.set_ylabel("slices held")
    ax.set_xlim(start, end)
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    locator = AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    return fig


def demand_figure(rows: Sequence[UsageRow], since: datetime, until: datetime) -> Figure:
    """Per profile: granted requests and refusals (layout and policy), stacked."""
    totals: dict[str, list[int]] = {}
    for row in rows:
        t = totals.setdefault(row.profile or f"class {', '.join(row.classes)}", [0, 0, 0])
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
    ax.set_title(f"Requests per profile, {_window_title(since, until)}", fontsize="medium")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("requests")
    # Room above the tallest bar for the legend.
    ax.set_ylim(0, max((sum(t) for t in totals.values()), default=1) * 1.35)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


def write_plots(directory: Path, leases: Sequence[LeaseFacts], rows: Sequence[UsageRow],
                since: datetime, until: datetime, capacity: Mapping[str, int]) -> list[Path]:
    """Both plots into ``directory`` (created if missing); returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in (("concurrency.png", concurrency_figure(leases, since, until, capacity)),
                      ("demand.png", demand_figure(rows, since, until))):
        fig.savefig(directory / name, dpi=110)
        written.append(directory / name)
    return written
