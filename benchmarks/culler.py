"""Benchmark: one sweep of the slice service against jupyterhub-idle-culler, same run.

A stand-in hub (``tests/support/hub_standin.py``, in its own process so that it does not
share the service's CPU) serves ``/hub/api/users`` as JupyterHub 5/6 does: 5,000
users with a running server each, pages of 50 with ``_pagination.next``, one in
five servers idle for two hours. Both cullers use a one-hour idle limit and the
same concurrency, so both stop the same 1,000 servers.

1. server-level sweep: this service with ``probe_servers=False`` (hub data only,
   what jupyterhub-idle-culler judges on) vs ``jupyterhub_idle_culler.cull_idle``;
   ratio = service / idle-culler, goal <= 1.0. Each is run ``--repeat`` times
   against a fresh stand-in and the median is kept.
2. kernel-level sweep: the service reading every server, 20,000 kernels in all (half
   of them idle past the kernel limit), first sweep (it culls) and the next (nothing
   left to cull); goal <= 2 s each. The servers answer from ``--server-processes``
   stand-in processes of their own (the hub's server models point at them), so that
   the service's process does only the service's work: its wall time, its own CPU
   time, its requests (and per server) and the connections it opened are printed per
   sweep, with the stand-ins' CPU beside. Servers with mig-spawner's single-user
   extension (one ``mig-spawner/probe`` per server, one ``mig-spawner/cull`` per
   server with idle kernels) and servers without it (``api/kernels`` per server, a
   ``DELETE`` per idle kernel), both on kept-alive connections, against the baseline
   in the same run: the transport before (tornado's simple client, a new connection
   per request) to servers without the extension. ``--profile`` prints where the
   service's CPU went (cProfile).
3. server-level sweep with GPU sampling on: a simulated host of 8 H200 with 7 MIG
   devices each (56), GPM on, every device leased (SQLite ledger), a third running a
   process with SM activity; goal ratio <= 0.6. Also the cost of sampling the 56
   devices alone (processes, memory, GPM), median of 20 sweeps.

Run: ``nice -n 19 .venv/bin/python benchmarks/culler.py [--users 5000] [--concurrency 10]`` (the
load average is printed at start and end: on a shared machine the seconds are
inflated, the service's CPU much less so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
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


def _standin(*args: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.hub_standin", *args],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


class StandinHub:
    """A stand-in hub in a subprocess, fresh state per run; with ``server_processes``,
    the servers answer from that many subprocesses of their own, each server at a port
    of its own (as on a real hub, where each has its own address)."""

    def __init__(self, users: int, kernels: int, server_processes: int = 0,
                 extension: bool = False) -> None:
        common = ["--users", str(users), "--kernels", str(kernels),
                  "--now", datetime.now(UTC).isoformat()]
        if extension:
            common.append("--extension")
        self.dir = tempfile.TemporaryDirectory()
        share = -(-users // server_processes) if server_processes else 0
        self.servers = [_standin(*common, "--listen", str(share), "--lean")
                        for _ in range(server_processes)]
        hub_args = list(common)
        if self.servers:
            ports = Path(self.dir.name, "ports.json")
            ports.write_text(json.dumps([p for _, ps in self.servers for p in ps]))
            hub_args += ["--server-ports", str(ports)]
        self.hub, [port] = _standin(*hub_args)
        self.url = f"http://127.0.0.1:{port}"
        self.procs = [psutil.Process(p.pid) for p in [self.hub, *(p for p, _ in self.servers)]]

    def cpu(self) -> float:
        """CPU seconds the stand-in processes have used so far."""
        return sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def close(self) -> None:
        for proc in [self.hub, *(p for p, _ in self.servers)]:
            proc.terminate()
            proc.wait(10)
        self.dir.cleanup()


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
    """The transport to servers before kept-alive connections, as the baseline:
    tornado's simple client, which opens a connection for every request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tornado = AsyncHTTPClient(force_instance=True, max_clients=self._concurrency)

    async def _send_to_server(self, method: str, url: str, headers: dict[str, str],
                              server: str, data: bytes | None) -> Response:
        request = HTTPRequest(url, method=method, headers=headers, body=data,
                              allow_nonstandard_methods=True, request_timeout=60,
                              connect_timeout=10)
        try:
            async with self._slots_held():
                answer = await self._tornado.fetch(request, raise_error=False)
        except (HTTPClientError, OSError, StreamClosedError) as e:
            return Response(NO_ANSWER, str(e), b"")
        return Response(answer.code, answer.reason, answer.body or b"")

    @contextlib.asynccontextmanager
    async def _slots_held(self) -> Any:
        await self._slots.acquire()
        try:
            yield
        finally:
            self._slots.release()

    async def close(self) -> None:
        self._tornado.close()
        await super().close()


class Traffic:
    """Requests the service made and connections it opened (aiohttp and
    :mod:`mig_spawner.hub.connections` open them with the event loop's
    ``create_connection``, tornado's client with ``TCPClient``)."""

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


def summary(report: SweepReport, seconds: float, **measured: float) -> dict:
    assert report.complete, report.error
    kernels = sum(1 for d in report.carried_out if not d.stops_server)
    return {"seconds": seconds, "servers stopped": len(report.carried_out) - kernels,
            "kernels shut down": kernels, "servers": report.servers, **measured}


async def run_service(url: str, concurrency: int, kernel_limit: str | None = None,
                      sweeps: int = 1, world: GpuWorld | None = None,
                      hub: StandinHub | None = None,
                      profile: cProfile.Profile | None = None,
                      kept_alive: bool = True) -> list[dict]:
    """``sweeps`` sweeps in a row: the first culls, later ones find nothing to cull."""
    sweeper = make_sweeper(url, concurrency, kernel_limit, world, kept_alive)
    results = []
    for _ in range(sweeps):
        requests, connections = Traffic.requests, Traffic.connections
        standin = hub.cpu() if hub else 0.0
        began, cpu, queued = time.perf_counter(), time.process_time(), run_queue_wait()
        if profile:
            profile.enable()
        report = await sweeper.sweep()
        if profile:
            profile.disable()
        results.append(summary(
            report, time.perf_counter() - began, cpu=time.process_time() - cpu,
            queued=run_queue_wait() - queued,
            requests=Traffic.requests - requests,
            connections=Traffic.connections - connections,
            standin_cpu=(hub.cpu() - standin) if hub else 0.0))
    await sweeper.client.close()
    return results


async def run_idle_culler(url: str, concurrency: int) -> list[dict]:
    began = time.perf_counter()
    await cull_idle(url=f"{url}/hub/api", api_token="token", inactive_limit=IDLE_LIMIT,
                    logger=QUIET, concurrency=concurrency)
    return [{"seconds": time.perf_counter() - began}]


def against_fresh_hub(users: int, kernels: int,
                      run: Callable[[StandinHub], Awaitable[list[dict]]],
                      server_processes: int = 0, extension: bool = False) -> list[dict]:
    hub = StandinHub(users, kernels, server_processes, extension)
    try:
        return asyncio.run(run(hub))
    finally:
        hub.close()


def run_queue_wait() -> float:
    """Seconds this process's event loop (its main thread) has waited for a CPU while
    ready to run (Linux ``schedstat``): on a busy machine, the part of a sweep's wall
    time that is neither its own CPU nor waiting for answers. 0 where not available."""
    try:
        return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=5000)
    parser.add_argument("--kernels-per-server", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--server-processes", type=int, default=2,
                        help="stand-in processes the servers answer from")
    parser.add_argument("--only", choices=("server", "kernel"),
                        help="only the server-level sweeps, or only the kernel-level ones")
    parser.add_argument("--profile", action="store_true",
                        help="print where the service's CPU went in the kernel sweeps")
    args = parser.parse_args()
    n, c = args.users, args.concurrency
    print(f"culler benchmark: {n} users with running servers, concurrency {c}; {load()}",
          flush=True)
    if args.only != "kernel":
        server_level(args)
    if args.only != "server":
        kernel_level(args)
    print(load())


def server_level(args: argparse.Namespace) -> None:
    n, c = args.users, args.concurrency
    ours, theirs, with_gpus = [], [], []
    for _ in range(args.repeat):  # interleaved, so load from elsewhere hits both alike
        ours.append(against_fresh_hub(n, 0, lambda hub: run_service(hub.url, c))[0])
        theirs.append(against_fresh_hub(n, 0, lambda hub: run_idle_culler(hub.url, c))[0])
        world = GpuWorld()
        try:
            with_gpus.append(against_fresh_hub(
                n, 0, lambda hub, w=world: run_service(hub.url, c, world=w))[0])
        finally:
            world.close()
    base = statistics.median(r["seconds"] for r in theirs)
    mine = statistics.median(r["seconds"] for r in ours)
    mine_gpus = statistics.median(r["seconds"] for r in with_gpus)
    sampling, devices = sampling_cost()
    print(f"server level, median of {args.repeat}")
    print(f"{'sweep':<52}{'seconds':>9}{'ratio':>8}")
    rows = [
        ("jupyterhub-idle-culler cull_idle (baseline)", base, "stops the same idle servers"),
        ("slice service, server level", mine,
         f"{ours[0]['servers stopped']} stopped; goal ratio <= 1.0"),
        ("slice service, server level, GPU sampling on", mine_gpus,
         f"{with_gpus[0]['servers stopped']} stopped; goal ratio <= 0.6"),
        (f"  of which: sampling {devices} MIG devices", sampling,
         f"{sampling * 1000:.1f} ms per sweep: processes, memory, GPM SM activity"),
    ]
    for label, seconds, note in rows:
        print(f"{label:<52}{seconds:>9.2f}{seconds / base:>8.2f}   {note}", flush=True)


#: The kernel sweeps compared: (label, kept-alive connections, servers with mig-spawner's
#: single-user extension).
KERNEL_SWEEPS = (
    ("before: a connection per request, no extension (baseline)", False, False),
    ("kept-alive, servers without the extension", True, False),
    ("kept-alive, servers with mig-spawner's extension", True, True),
)


def kernel_level(args: argparse.Namespace) -> None:
    n, c, k = args.users, args.concurrency, args.kernels_per_server
    Traffic.count()
    sweeps = []
    for _, kept_alive, extension in KERNEL_SWEEPS:
        sweeps.append(against_fresh_hub(
            n, k, lambda hub, a=kept_alive: run_service(
                hub.url, c, kernel_limit="1h", sweeps=2, hub=hub, kept_alive=a),
            server_processes=args.server_processes, extension=extension))
    print(f"kernel level: {n * k} kernels on {n} servers, which answer from "
          f"{args.server_processes} stand-in processes; goal <= 2 s each sweep")
    print("seconds: the sweep's wall time; CPU s: the service's own (user and system); "
          "queued s: the service ready to run but waiting for a core")
    print(f"{'sweep':<46}{'seconds':>8}{'CPU s':>7}{'queued s':>9}{'requests':>9}"
          f"{'/server':>8}{'conns':>6}{'stand-in CPU s':>15}")
    for (how, _, _), runs in zip(KERNEL_SWEEPS, sweeps, strict=True):
        print(how)
        for sweep, which in zip(runs, ("first", "next"), strict=True):
            culls = (f"{sweep['servers stopped']} servers stopped, "
                     f"{sweep['kernels shut down']} kernels shut down")
            print(f"  {which + ' sweep':<44}{sweep['seconds']:>8.2f}{sweep['cpu']:>7.2f}"
                  f"{sweep['queued']:>9.2f}{sweep['requests']:>9}"
                  f"{sweep['requests'] / sweep['servers']:>8.2f}"
                  f"{sweep['connections']:>6}{sweep['standin_cpu']:>15.2f}   {culls}")
    base = sweeps[0]
    for (how, _, _), runs in zip(KERNEL_SWEEPS[1:], sweeps[1:], strict=True):
        print(f"{how} / baseline: " + "; ".join(
            f"{which} sweep {new['seconds'] / old['seconds']:.2f} wall, "
            f"{new['cpu'] / old['cpu']:.2f} service CPU"
            for which, new, old in zip(("first", "next"), runs, base, strict=True)))
    if args.profile:  # a run of its own: the profiler's cost would skew the rows above
        profile = cProfile.Profile(time.process_time)
        against_fresh_hub(n, k, lambda hub: run_service(
            hub.url, c, kernel_limit="1h", sweeps=2, hub=hub, profile=profile),
            server_processes=args.server_processes, extension=True)
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(order).print_stats(30)
            print(f"where the service's CPU went (both sweeps, kept-alive with the "
                  f"extension, another run under cProfile, by {order}; a coroutine's "
                  f"calls count each resumption):")
            print(out.getvalue())


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
