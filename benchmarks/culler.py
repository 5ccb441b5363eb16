"""Benchmark: one sweep of the slice service against jupyterhub-idle-culler, same run.

A stand-in hub (``tests/support/hub_standin.py``, in its own process so that it does not
share the client's CPU) serves ``/hub/api/users`` as JupyterHub 5/6 does: 5,000
users with a running server each, pages of 50 with ``_pagination.next``, one in
five servers idle for two hours. Both cullers use a one-hour idle limit and the
same concurrency, so both stop the same 1,000 servers.

1. server-level sweep: this service with ``probe_servers=False`` (hub data only,
   what jupyterhub-idle-culler judges on) vs ``jupyterhub_idle_culler.cull_idle``;
   ratio = service / idle-culler, goal <= 1.0. Each is run ``--repeat`` times
   against a fresh stand-in and the median is kept.
2. kernel-level sweep: the service reading ``/api/kernels`` of every server,
   20,000 kernels in all (half of them idle past the kernel limit), first sweep (it
   culls) and the next (nothing left to cull); goal <= 2 s each. Printed with the
   service's own CPU time per sweep, its requests and the connections it opened,
   against the same sweep on the transport before (tornado's simple client, which
   keeps no connection alive: one connection per request).
3. server-level sweep with GPU sampling on: a simulated host of 8 H200 with 7 MIG
   devices each (56), GPM on, every device leased (SQLite ledger), a third running a
   process with SM activity; goal ratio <= 0.6. Also the cost of sampling the 56
   devices alone (processes, memory, GPM), median of 20 sweeps.

Run: ``nice .venv/bin/python benchmarks/culler.py [--users 5000] [--concurrency 10]``.
The stand-in hub answers for every server from one process on this machine, so the
kernel sweep's seconds include its work too; the service's CPU is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyterhub_idle_culler import cull_idle
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.iostream import StreamClosedError
from tornado.tcpclient import TCPClient

from mig_spawner import gpu
from mig_spawner.config import MIGPolicyConfig
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.hub.client import NO_ANSWER, HubClient, Response
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper, SweepReport

REPO = Path(__file__).resolve().parents[1]
IDLE_LIMIT = 3600
QUIET = logging.getLogger("benchmark")
QUIET.setLevel(logging.CRITICAL)


class StandinHub:
    """A stand-in hub in a subprocess, fresh state per run."""

    def __init__(self, users: int, kernels: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.hub_standin",
             "--users", str(users), "--kernels", str(kernels)],
            stdout=subprocess.PIPE, text=True, cwd=REPO,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{self.proc.stdout.readline().strip()}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


GPU_SIM = "h200x8:layout=1g.18gb*7"


class GpuWorld:
    """56 simulated MIG devices with GPM, each leased to one of the stand-in's users."""

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        state = f"{self.dir.name}/sim.json"
        self.adapter = gpu.connect(GPU_SIM, state)
        host = SimulatedHost.open(state)
        host.set_gpm(True)
        self.ledger = Ledger.open(f"sqlite:///{self.dir.name}/ledger.sqlite")
        for i, device in enumerate(self.adapter.inventory().mig_devices):
            if i % 3 == 0:
                host.set_processes(device.uuid, [(1000 + i, 9000)])
                host.set_sm_activity(device.uuid, 60)
            decision = Grant(
                group="analysts", profile=device.profile, compute_slices=1, mode="pool",
                host=self.adapter.inventory().host, gpu_uuid=device.gpu_uuid,
                gpu_index=device.gpu_index, start=device.start, size=device.size,
                mig_uuid=device.uuid, gi_id=device.gi_id, ci_id=device.ci_id,
            )
            lease = self.ledger.leases.claim(LeaseRequest(f"user{i:05d}"),
                                             lambda view, d=decision: d)
            self.ledger.leases.activate(lease.id)
        self.devices = i + 1

    def close(self) -> None:
        self.ledger.close()
        self.adapter.close()
        self.dir.cleanup()


class NewConnectionEachRequest(HubClient):
    """The transport before kept-alive connections, as the baseline: tornado's simple
    client, which opens a connection for every request."""

    def __init__(self, *args: Any, concurrency: int, **kwargs: Any) -> None:
        super().__init__(*args, concurrency=concurrency, **kwargs)
        self._tornado = AsyncHTTPClient(force_instance=True, max_clients=concurrency)

    async def _send(self, method: str, url: str, headers: dict[str, str],
                    server: str | None) -> Response:
        request = HTTPRequest(url, method=method, headers=headers, request_timeout=60,
                              connect_timeout=10)
        try:
            async with self._semaphore:
                answer = await self._tornado.fetch(request, raise_error=False)
        except (HTTPClientError, OSError, StreamClosedError) as e:
            return Response(NO_ANSWER, str(e), b"")
        return Response(answer.code, answer.reason, answer.body or b"")

    async def close(self) -> None:
        self._tornado.close()


class Traffic:
    """Requests made and connections opened in this process (aiohttp opens them with
    the event loop's ``create_connection``, tornado's client with ``TCPClient``)."""

    requests = 0
    connections = 0

    @classmethod
    def count(cls) -> None:
        def counting(attribute: str, call: Any) -> Any:
            async def counted(*args: Any, **kwargs: Any) -> Any:
                setattr(cls, attribute, getattr(cls, attribute) + 1)
                return await call(*args, **kwargs)
            return counted

        HubClient.request = counting("requests", HubClient.request)  # type: ignore
        asyncio.BaseEventLoop.create_connection = counting(  # type: ignore[method-assign]
            "connections", asyncio.BaseEventLoop.create_connection)
        TCPClient.connect = counting("connections", TCPClient.connect)  # type: ignore


def make_sweeper(url: str, concurrency: int, kernel_limit: str | None,
                 world: GpuWorld | None = None, kept_alive: bool = True) -> Sweeper:
    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "server_idle_timeout": IDLE_LIMIT,
        "kernel_idle_timeout": kernel_limit,
    }}).build()
    client = (HubClient if kept_alive else NewConnectionEachRequest)(
        f"{url}/hub/api", "token", proxy_url=url, concurrency=concurrency, log=QUIET)
    extra = {} if world is None else {"gpus": world.adapter, "ledger": world.ledger}
    return Sweeper(client, policy, ServiceMetrics(), probe_servers=kernel_limit is not None,
                   log=QUIET, **extra)


def summary(report: SweepReport, seconds: float, cpu: float = 0.0, requests: int = 0,
            connections: int = 0) -> dict:
    assert report.complete, report.error
    kernels = sum(1 for d in report.carried_out if not d.stops_server)
    return {"seconds": seconds, "servers stopped": len(report.carried_out) - kernels,
            "kernels shut down": kernels, "cpu": cpu, "requests": requests,
            "connections": connections}


async def run_service(url: str, concurrency: int, kernel_limit: str | None = None,
                      sweeps: int = 1, world: GpuWorld | None = None,
                      kept_alive: bool = True) -> list[dict]:
    """``sweeps`` sweeps in a row: the first culls, later ones find nothing to cull."""
    sweeper = make_sweeper(url, concurrency, kernel_limit, world, kept_alive)
    results = []
    for _ in range(sweeps):
        requests, connections = Traffic.requests, Traffic.connections
        began, cpu = time.perf_counter(), time.process_time()
        report = await sweeper.sweep()
        results.append(summary(report, time.perf_counter() - began,
                               time.process_time() - cpu, Traffic.requests - requests,
                               Traffic.connections - connections))
    await sweeper.client.close()
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

    ours, theirs, with_gpus = [], [], []
    for _ in range(args.repeat):  # interleaved, so load from elsewhere hits both alike
        ours.append(against_fresh_hub(n, 0, lambda url: run_service(url, c))[0])
        theirs.append(against_fresh_hub(n, 0, lambda url: run_idle_culler(url, c))[0])
        world = GpuWorld()
        try:
            with_gpus.append(against_fresh_hub(
                n, 0, lambda url, w=world: run_service(url, c, world=w))[0])
        finally:
            world.close()
    base = statistics.median(r["seconds"] for r in theirs)
    mine = statistics.median(r["seconds"] for r in ours)
    mine_gpus = statistics.median(r["seconds"] for r in with_gpus)
    sampling, devices = sampling_cost()

    k = args.kernels_per_server
    Traffic.count()
    kernel_sweeps = {}
    for kept_alive in (False, True):
        kernel_sweeps[kept_alive] = against_fresh_hub(n, k, lambda url, a=kept_alive: run_service(
            url, c, kernel_limit="1h", sweeps=2, kept_alive=a))

    print(f"culler benchmark: {n} users with running servers, concurrency {c}, "
          f"median of {args.repeat}")
    print(f"{'sweep':<62}{'seconds':>9}{'ratio':>8}")
    rows = [
        ("jupyterhub-idle-culler cull_idle (baseline)", base, "stops the same idle servers"),
        ("slice service, server level", mine,
         f"{ours[0]['servers stopped']} stopped; goal ratio <= 1.0"),
        ("slice service, server level, GPU sampling on", mine_gpus,
         f"{with_gpus[0]['servers stopped']} stopped; goal ratio <= 0.6"),
        (f"  of which: sampling {devices} MIG devices", sampling,
         f"{sampling * 1000:.1f} ms per sweep: processes, memory, GPM SM activity"),
    ]
    for kept_alive, how in ((False, "a connection per request (before)"),
                            (True, "kept-alive connections")):
        first, steady = kernel_sweeps[kept_alive]
        for sweep, which, note in (
                (first, "first", f"{first['servers stopped']} servers stopped, "
                                 f"{first['kernels shut down']} kernels shut down"),
                (steady, "next", f"{steady['servers stopped'] + steady['kernels shut down']}"
                                 " culls (steady state)")):
            rows.append((f"kernel level, {which} sweep, {how}", sweep["seconds"],
                         f"{note}; service CPU {sweep['cpu']:.2f} s, {sweep['requests']} "
                         f"requests, {sweep['connections']} connections opened"))
    for label, seconds, note in rows:
        print(f"{label:<62}{seconds:>9.2f}{seconds / base:>8.2f}   {note}")
    ratios = [(kernel_sweeps[True][i]["seconds"] / kernel_sweeps[False][i]["seconds"],
               kernel_sweeps[True][i]["cpu"] / kernel_sweeps[False][i]["cpu"]) for i in (0, 1)]
    print(f"{n * k} kernels, kept-alive / before: first sweep {ratios[0][0]:.2f} "
          f"(service CPU {ratios[0][1]:.2f}), next {ratios[1][0]:.2f} (service CPU "
          f"{ratios[1][1]:.2f}); goal <= 2 s each")


def sampling_cost(sweeps: int = 20) -> tuple[float, int]:
    """Median seconds one sweep spends sampling every MIG device, and how many."""
    world = GpuWorld()
    try:
        sweeper = Sweeper(HubClient("http://127.0.0.1:1/hub/api", "t"),
                          MIGPolicyConfig().build(), ServiceMetrics(), gpus=world.adapter)
        sweeper.sample_slices()  # GPM baselines
        times = []
        for _ in range(sweeps):
            began = time.perf_counter()
            sweeper.sample_slices()
            times.append(time.perf_counter() - began)
        return statistics.median(times), world.devices
    finally:
        world.close()


if __name__ == "__main__":
    main()
