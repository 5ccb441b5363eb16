"""Benchmark: one sweep of the slice service against jupyterhub-idle-culler, same run.

A stand-in hub (``tests/hub_standin.py``, in its own process so that it does not
share the client's CPU) serves ``/hub/api/users`` as JupyterHub 5/6 does: 5,000
users with a running server each, pages of 50 with ``_pagination.next``, one in
five servers idle for two hours. Both cullers use a one-hour idle limit and the
same concurrency, so both stop the same 1,000 servers.

1. server-level sweep: this service with ``probe_servers=False`` (hub data only,
   what jupyterhub-idle-culler judges on) vs ``jupyterhub_idle_culler.cull_idle``;
   ratio = service / idle-culler, goal <= 1.0. Each is run ``--repeat`` times
   against a fresh stand-in and the median is kept.
2. kernel-level sweep: the service reading ``/api/kernels`` of every server,
   20,000 kernels in all (half of them idle past the kernel limit): its cost.

Run: ``.venv/bin/python benchmarks/culler.py [--users 5000] [--concurrency 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from jupyterhub_idle_culler import cull_idle

from mig_spawner.config import MIGPolicyConfig
from mig_spawner.hub.client import HubClient
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.runner import Sweeper, SweepReport

STANDIN = Path(__file__).resolve().parents[1] / "tests" / "hub_standin.py"
IDLE_LIMIT = 3600
QUIET = logging.getLogger("benchmark")
QUIET.setLevel(logging.CRITICAL)


class StandinHub:
    """A stand-in hub in a subprocess, fresh state per run."""

    def __init__(self, users: int, kernels: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(STANDIN), "--users", str(users), "--kernels", str(kernels)],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{self.proc.stdout.readline().strip()}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def make_sweeper(url: str, concurrency: int, kernel_limit: str | None) -> Sweeper:
    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "server_idle_timeout": IDLE_LIMIT,
        "kernel_idle_timeout": kernel_limit,
    }}).build()
    client = HubClient(f"{url}/hub/api", "token", proxy_url=url, concurrency=concurrency,
                       log=QUIET)
    return Sweeper(client, policy, ServiceMetrics(), probe_servers=kernel_limit is not None,
                   log=QUIET)


def summary(report: SweepReport, seconds: float) -> dict:
    assert report.complete, report.error
    kernels = sum(1 for d in report.carried_out if not d.stops_server)
    return {"seconds": seconds, "servers stopped": len(report.carried_out) - kernels,
            "kernels shut down": kernels}


async def run_service(url: str, concurrency: int, kernel_limit: str | None = None,
                      sweeps: int = 1) -> list[dict]:
    """``sweeps`` sweeps in a row: the first culls, later ones find nothing to cull."""
    sweeper = make_sweeper(url, concurrency, kernel_limit)
    results = []
    for _ in range(sweeps):
        began = time.perf_counter()
        report = await sweeper.sweep()
        results.append(summary(report, time.perf_counter() - began))
    sweeper.client.close()
    return results


async def run_idle_culler(url: str, concurrency: int) -> list[dict]:
    began = time.perf_counter()
    await cull_idle(url=f"{url}/hub/api", api_token="token", inactive_limit=IDLE_LIMIT,
                    logger=QUIET, concurrency=concurrency)
    return [{"seconds": time.perf_counter() - began}]


def against_fresh_hub(users: int, kernels: int,
                      run: Callable[[str], Awaitable[list[dict]]]) -> list[dict]:
    hub = StandinHub(users, kernels)
    try:
        return asyncio.run(run(hub.url))
    finally:
        hub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=5000)
    parser.add_argument("--kernels-per-server", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n, c = args.users, args.concurrency

    ours, theirs = [], []
    for _ in range(args.repeat):  # interleaved, so load from elsewhere hits both alike
        ours.append(against_fresh_hub(n, 0, lambda url: run_service(url, c))[0])
        theirs.append(against_fresh_hub(n, 0, lambda url: run_idle_culler(url, c))[0])
    base = statistics.median(r["seconds"] for r in theirs)
    mine = statistics.median(r["seconds"] for r in ours)

    k = args.kernels_per_server
    first, steady = against_fresh_hub(
        n, k, lambda url: run_service(url, c, kernel_limit="1h", sweeps=2)
    )

    print(f"culler benchmark: {n} users with running servers, concurrency {c}, "
          f"median of {args.repeat}")
    print(f"{'sweep':<46}{'seconds':>9}{'ratio':>8}")
    rows = [
        ("jupyterhub-idle-culler cull_idle (baseline)", base, "stops the same idle servers"),
        ("slice service, server level", mine,
         f"{ours[0]['servers stopped']} stopped; goal ratio <= 1.0"),
        (f"kernel level, {n * k} kernels, first sweep", first["seconds"],
         f"{first['servers stopped']} servers stopped, "
         f"{first['kernels shut down']} kernels shut down"),
        (f"kernel level, {n * k} kernels, next sweep", steady["seconds"],
         f"{steady['servers stopped'] + steady['kernels shut down']} culls (steady state)"),
    ]
    for label, seconds, note in rows:
        print(f"{label:<46}{seconds:>9.2f}{seconds / base:>8.2f}   {note}")


if __name__ == "__main__":
    main()
