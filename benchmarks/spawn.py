"""Spawn-to-ready time with the MIG spawner against JupyterHub's plain local spawner.

Two real hubs run side by side with the same config, except the spawner class:
``SimpleLocalMIGSpawner`` (pool mode, simulated 2 x H200) and JupyterHub's own
``SimpleLocalProcessSpawner``, which the MIG spawner is built on. Spawns alternate
between them (A, B, A, B, ...), so both see the same machine load; each spawn is
timed from the REST request to the hub reporting the server ready. Prints a table
and the ratio of the medians (goal: at most 1.10).

    .venv/bin/python -m benchmarks.spawn [--rounds 8]   (from the repository root: it
    imports the test harness as ``tests.support``)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.support.hub_harness import HubProcess, start_mig_hub

SIM = "h200x1:layout=1g.18gb*7+h200x1:layout=1g.18gb*7"
GOAL = 1.10


def start_hub(workdir: Path, spawner: str) -> HubProcess:
    hub = start_mig_hub(workdir, SIM, spawner=spawner)
    hub.create_user("bench", groups=["analysts"])
    return hub


def spawn_to_ready(hub: HubProcess, options: dict | None) -> float:
    tic = time.perf_counter()
    r = hub.spawn("bench", options)
    if r.status_code not in (201, 202):
        raise SystemExit(f"spawn failed: {r.status_code} {r.text}")
    hub.wait_ready("bench")
    elapsed = time.perf_counter() - tic
    hub.stop_server("bench")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="spawns per spawner")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mig-bench-") as tmp:
        hubs = {
            "SimpleLocalProcessSpawner": start_hub(Path(tmp, "plain"), "simple"),
            "SimpleLocalMIGSpawner": start_hub(Path(tmp, "mig"), "mig-simple"),
        }
        options = {"SimpleLocalProcessSpawner": None, "SimpleLocalMIGSpawner": {"profile": "small"}}
        times: dict[str, list[float]] = {name: [] for name in hubs}
        try:
            for name, hub in hubs.items():  # one warm-up spawn each, not counted
                spawn_to_ready(hub, options[name])
            for _ in range(args.rounds):
                for name, hub in hubs.items():
                    times[name].append(spawn_to_ready(hub, options[name]))
        finally:
            for hub in hubs.values():
                hub.close()
    base = statistics.median(times["SimpleLocalProcessSpawner"])
    print(f"spawn-to-ready, {args.rounds} spawns each, alternating on two identical hubs")
    print(f"{'spawner':<28}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<28}{median:>10.2f}{min(values):>8.2f}{max(values):>8.2f}"
              f"{median / base:>8.2f}")
    ratio = statistics.median(times["SimpleLocalMIGSpawner"]) / base
    print(f"MIG / plain median ratio: {ratio:.2f} (goal <= {GOAL:.2f}: "
          f"{'met' if ratio <= GOAL else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
