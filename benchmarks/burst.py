"""A class-start burst on a real hub: the MIG spawner against JupyterHub's plain spawner.

Three cases on real hubs (JupyterHub, configurable-http-proxy, jupyter_server
single-user servers) on a simulated H200 host, and one without servers:

0. **Claims alone**: N spawners of this process claim at once through the mixin's claim
   path (validation, stale-lease check, fleet read, ledger claim), with no server
   starting: the claim's own p95, free of the servers' start-up CPU, in claim passes
   (one read of the GPUs and one transaction for the claims that came together) and,
   as the baseline in the same run, each claim alone in its own trip as before passes.
   Goal: <= 0.5 s at N = 100.
1. **Burst**: N users of a queueing group press Start within one second. The plain
   ``SimpleLocalProcessSpawner`` hub runs first, then the ``SimpleLocalMIGSpawner`` hub
   (one after the other, never at once), with at least N slices. Measured: the hub's
   own API (``GET /hub/api/``, probed every 0.1 s) p95 during the burst, time from
   Start to ready, each hub's CPU and how late its event loop ran (a 20 ms timer), and
   (MIG) the claim's duration from the hub log, in parts: the wait for a worker thread,
   the work there, the wait for the event loop. Goals: API p95 <= 1.2x plain, time to ready <=
   1.0x plain, claim p95 <= 1 s at N = 100. With
   ``--nice 10`` both hubs start their servers behind the hub (``LocalMIGSpawner.nice``):
   without it, on Linux each starting server gets as much CPU as the whole hub, and every
   figure measures that more than either spawner.
2. **Fewer slices than users**: S slices, N users; the S servers are stopped one by
   one and each release's time to the next waiter's grant is read from the ledger
   (release ``released_at`` -> grant ``claimed_at``). Goal: <= 0.2 s.
3. **Waiting costs nothing**: one slice held, W users waiting, nobody spawning: the hub
   process's CPU above its idle CPU. Goal: <= 0.05 core at W = 40.

Run from the repository root (it imports the test harness as ``tests.support``)::

    .venv/bin/python -m benchmarks.burst --quick          # N = 10, W = 10: a few minutes
    .venv/bin/python -m benchmarks.burst --n 20 50 100 --waiters 40
    .venv/bin/python -m benchmarks.burst --n 20 --rounds 3 --skip claims waiting idle
    .venv/bin/python -m benchmarks.burst --n 50 --nice 10 --skip claims waiting idle

It prints figures and ratios; it is a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import LeaseRequest, Ledger
from mig_spawner.spawner import LocalMIGSpawner, waiting
from tests.support.hub_harness import HubError, HubProcess, start_mig_hub
from tests.support.polling import until
from tests.support.spawners import make_spawner, mig_config

SLICES_PER_GPU = 7
GOALS = {"api": 1.2, "ready": 1.0, "claim": 1.0, "claims_in_process": 0.5, "grant": 0.2,
         "cpu": 0.05}
EXTRA = """
c.JupyterHub.concurrent_spawn_limit = 0
c.JupyterHub.active_server_limit = 0
c.Spawner.start_timeout = 900
c.Spawner.http_timeout = 900
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 1}
c.MIGPolicyConfig.group_policies["burst"] = {
    "allowed": ["small"], "queue": True, "max_wait": "1h"}
"""
PROBE_EVERY = 0.1
CLAIMED = re.compile(r"Lease \w+: .* claimed in (\d+) ms "
                     r"\(the claim's trip: (\d+) ms waiting for a worker thread, (\d+) ms there, "
                     r"(\d+) ms waiting for the event loop\)")


def sim_for(slices: int) -> str:
    """A simulated host of H200s cut into 1g.18gb with at least ``slices`` slices (all of
    them on one GPU when fewer than 7)."""
    if slices < SLICES_PER_GPU:
        return f"h200x1:layout=1g.18gb*{slices}"
    gpus = -(-slices // SLICES_PER_GPU)
    return f"h200x{gpus}:layout=1g.18gb*{SLICES_PER_GPU}"


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] if ordered else 0.0


#: A probe both hubs load: a timer every 20 ms on the hub's event loop writes how late it
#: ran (wall time, seconds late) to LAG_FILE. A claim's result waits for that loop as
#: everything else in the hub does; the plain hub's stalls say how much of that wait is
#: JupyterHub's own.
LOOP_PROBE = """
import asyncio as _asyncio, time as _time
def _probe_loop(path, every=0.02):
    loop, out = _asyncio.get_running_loop(), open(path, "w", buffering=1)
    due = [_time.perf_counter() + every]
    def tick():
        now = _time.perf_counter()
        out.write(f"{_time.time():.3f} {now - due[0]:.4f}\\n")
        due[0] = now + every
        loop.call_later(every, tick)
    loop.call_later(every, tick)
_probe_loop(LAG_FILE)
"""
LAG_FILE = "loop-lag.txt"


#: ``--nice`` for the plain hub: the step ``LocalMIGSpawner.nice`` adds, on JupyterHub's
#: own spawner, so that both hubs' servers come behind their hub the same way.
NICE_PLAIN = """
from jupyterhub.spawner import SimpleLocalProcessSpawner
from mig_spawner.spawner.local import lower_priority

class BehindTheHub(SimpleLocalProcessSpawner):
    def make_preexec_fn(self, name):
        lower, then = lower_priority({nice}), super().make_preexec_fn(name)
        return lambda: (lower(), then())

c.JupyterHub.spawner_class = BehindTheHub
"""


def start_hub(workdir: Path, spawner: str, slices: int, users: list[str],
              nice: int = 0) -> HubProcess:
    extra = EXTRA + LOOP_PROBE.replace("LAG_FILE", repr(str(workdir / LAG_FILE)))
    if nice:
        extra += (f"c.LocalMIGSpawner.nice = {nice}\n" if spawner.startswith("mig")
                  else NICE_PLAIN.format(nice=nice))
    hub = start_mig_hub(workdir, sim_for(slices), extra, spawner=spawner)
    hub.create_users(users, groups=["burst"])
    return hub


def hub_cpu_seconds(hub: HubProcess) -> float:
    """User + system CPU seconds of the hub process itself (not proxy, not servers)."""
    assert hub.proc is not None
    fields = Path(f"/proc/{hub.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session(hub: HubProcess) -> requests.Session:
    s = requests.Session()
    s.headers["Authorization"] = f"token {hub.token}"
    return s


@dataclass
class Burst:
    """What one burst measured."""

    api: list[float] = field(default_factory=list)
    ready: dict[str, float] = field(default_factory=dict)
    pressed: dict[str, float] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    began: float = 0.0  # wall clock, the first press
    ended: float = 0.0  # wall clock, the last server ready

    def loop_stalls(self, hub: HubProcess) -> tuple[float, float]:
        """Seconds the hub's event loop ran late during the burst, in all and at most
        once (:data:`LOOP_PROBE`)."""
        late = [float(lag) for at, lag in (
            line.split() for line in (hub.workdir / LAG_FILE).read_text().splitlines())
            if self.began <= float(at) <= self.ended]
        return sum(late), max(late, default=0.0)

    def to_ready(self) -> list[float]:
        return [self.ready[n] - self.pressed[n] for n in self.ready]


def press_start(hub: HubProcess, names: list[str], options: dict | None, spread: float = 1.0,
                until_ready: int | None = None, timeout: float = 900) -> Burst:
    """``names`` press Start within ``spread`` seconds; the hub's API is probed meanwhile;
    returns once ``until_ready`` (default: all) servers are ready."""
    result = Burst()
    done = threading.Event()
    want = len(names) if until_ready is None else until_ready

    def probe() -> None:
        s = requests.Session()
        while not done.is_set():
            tic = time.perf_counter()
            with contextlib.suppress(requests.RequestException):
                s.get(f"{hub.url}/hub/api/", timeout=120)
            result.api.append(time.perf_counter() - tic)
            time.sleep(PROBE_EVERY)

    def press(i: int, name: str) -> None:
        time.sleep(spread * i / len(names))
        result.pressed[name] = time.monotonic()
        body = None if options is None else options
        r = session(hub).post(f"{hub.url}/hub/api/users/{name}/server", json=body,
                              timeout=900)
        if r.status_code not in (201, 202):
            result.refused.append(f"{name}: {r.status_code} {r.text[:200]}")

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    result.began = time.time()
    pressers = [threading.Thread(target=press, args=(i, n), daemon=True)
                for i, n in enumerate(names)]
    for t in pressers:
        t.start()
    watcher = session(hub)
    deadline = time.monotonic() + timeout
    while len(result.ready) < want and time.monotonic() < deadline:
        users = watcher.get(f"{hub.url}/hub/api/users", timeout=120).json()
        now = time.monotonic()
        for user in users:
            server = (user.get("servers") or {}).get("")
            if server and server.get("ready") and user["name"] in result.pressed:
                result.ready.setdefault(user["name"], now)
        if result.refused:
            break
        time.sleep(0.25)
    result.ended = time.time()
    done.set()
    for t in pressers:
        t.join(5)
    prober.join(5)
    if result.refused:
        raise SystemExit("spawns refused: " + "; ".join(result.refused[:3]))
    return result


def claim_times(hub: HubProcess) -> list[tuple[float, ...]]:
    """Each claim's duration (leaving out time in line), then of the trip that claimed
    the wait for a worker thread (the issue's "claim wait"), the work there and the wait
    for the hub's event loop, in seconds, from the MIG hub's log."""
    text = (hub.workdir / "hub.log").read_text(errors="replace")
    return [tuple(int(ms) / 1000 for ms in found) for found in CLAIMED.findall(text)]


def case_claims(n: int, tmp: Path, alone: bool = False) -> list[float]:
    """Each of ``n`` concurrent in-process claims' duration (case 0): in claim passes
    (``waiting.claim``), or with ``alone`` each in its own trip, as before passes: its
    stale-lease read, its own read of the GPUs, the line and its own claim transaction
    (the baseline)."""
    sim = sim_for(n)
    name = f"claims-{n}-{'alone' if alone else 'passes'}"
    SimulatedHost.from_spec(sim, tmp / f"{name}.json")
    c = mig_config(f"sqlite:///{tmp}/{name}.sqlite", sim=sim,
                   sim_state=tmp / f"{name}.json", policies={
                       "burst": {"allowed": ["1g.18gb"], "queue": True, "max_wait": "1h"}})
    spawners = [make_spawner(c, f"c{i:03d}", ["burst"]) for i in range(n + 1)]

    def first_try_alone(spawner: LocalMIGSpawner, offer: Offer, mine: UserPolicy) -> None:
        ledger, request = spawner.runtime.ledger(), LeaseRequest(spawner.user.name, "")
        assert ledger.leases.active_for_server(request.user, "") is None
        plan = spawner.plan_here(offer, mine)({})  # a read of the GPUs of its own
        assert not ledger.waits.waiting()
        ledger.leases.claim(request, plan.decide)

    async def claim(spawner: LocalMIGSpawner) -> float:
        tic = time.perf_counter()
        spawner.user_options = {"profile": "1g.18gb"}
        offer, mine = spawner._validate(spawner.user_options)
        if alone:
            await spawner.runtime.run(first_try_alone, spawner, offer, mine)
        else:
            await waiting.claim(spawner, offer, mine)
        return time.perf_counter() - tic

    async def burst() -> list[float]:
        await claim(spawners[-1])  # the ledger opened and migrated first
        return list(await asyncio.gather(*(claim(s) for s in spawners[:-1])))

    return asyncio.run(burst())


def case_burst(n: int, tmp: Path, rounds: int, nice: int = 0) -> dict[str, list]:
    """``rounds`` bursts of ``n`` users on each hub, alternating plain and MIG (never at
    once): per round, each hub's API p95, median time to ready and the hub process's
    CPU seconds during the burst; the claims pooled. ``nice``: both hubs start their
    servers at that nice value."""
    users = [f"b{i:03d}" for i in range(n)]
    out: dict[str, list] = {"plain": [], "mig": [], "claims": []}
    for r in range(rounds):
        for label, spawner, options in (("plain", "simple", None),
                                        ("mig", "mig-simple", {"profile": "small"})):
            hub = start_hub(tmp / f"burst-{n}-{label}-{r}", spawner, n, users, nice)
            try:
                cpu = hub_cpu_seconds(hub)
                burst = press_start(hub, users, options)
                out[label].append((p95(burst.api), statistics.median(burst.to_ready()),
                                   hub_cpu_seconds(hub) - cpu, *burst.loop_stalls(hub)))
                if label == "mig":
                    out["claims"] += claim_times(hub)
            finally:
                hub.close()
    return out


def case_waiting(slices: int, users: int, tmp: Path
                 ) -> tuple[list[float], list[float], int]:
    """Release -> the next waiter's grant, for each of the ``slices`` servers stopped;
    and how late the hub's event loop ran at most (:data:`LOOP_PROBE`) while each stop
    was under way: JupyterHub's stop handler's hold on the loop, which a grant made on
    the loop would wait for; and how many waited at the first stop (the host has
    ``slices`` rounded up to whole GPUs)."""
    names = [f"w{i:03d}" for i in range(users)]
    workdir = tmp / f"wait-{slices}-{users}"
    hub = start_hub(workdir, "mig-simple", slices, names)
    gaps, stalls, waiters = [], [], 0
    try:
        press_start(hub, names, {"profile": "small"}, until_ready=slices)
        with Ledger.open(f"sqlite:///{workdir}/mig_spawner_ledger.sqlite") as ledger:
            deadline = time.monotonic() + 60
            while len(ledger.waits.waiting()) < users - slices and time.monotonic() < deadline:
                time.sleep(0.2)
            # The holders, once their spawns are over: JupyterHub refuses (500, "pending
            # spawn") to stop a server whose spawn still runs.
            api = session(hub)

            def running(name: str) -> bool:
                server = (api.get(f"{hub.url}/hub/api/users/{name}", timeout=60).json()
                          .get("servers") or {}).get("")
                return bool(server and server.get("ready") and not server.get("pending"))

            holders = [lease.user for lease in ledger.leases.active()]
            until(lambda: all(map(running, holders)), 300, "the holders' servers ready")
            waiters = len(ledger.waits.waiting())
            for name in holders:
                before = {lease.id for lease in ledger.leases.active()}
                began = time.time()
                hub.stop_server(name)
                until(lambda before=before: any(
                    lease.id not in before for lease in ledger.leases.active()), 30,
                    "the next waiter granted", show=hub.log_path)
                ended = time.time()
                stalls.append(max((float(lag) for at, lag in (
                    line.split() for line in (workdir / LAG_FILE).read_text().splitlines())
                    if began <= float(at) <= ended), default=0.0))
                released = max((lease for lease in ledger.leases.history(user=name)
                                if lease.released_at), key=lambda lease: lease.released_at)
                granted = next(lease for lease in ledger.leases.active() if lease.id not in before)
                gaps.append((granted.claimed_at - released.released_at).total_seconds())
    finally:
        try:
            hub.close()
        except HubError:  # a stop refused while the last grants' spawns are pending
            hub.stop_hub()  # JupyterHub stops their servers as it shuts down
    return gaps, stalls, waiters


def case_idle_waiters(waiters: int, tmp: Path, window: float) -> tuple[float, float]:
    """Hub CPU (cores) with one server and nobody waiting, then with ``waiters`` waiting."""
    names = ["holder", *(f"q{i:03d}" for i in range(waiters))]
    workdir = tmp / f"idle-{waiters}"
    hub = start_hub(workdir, "mig-simple", 1, names)
    try:
        press_start(hub, names[:1], {"profile": "small"})
        time.sleep(3)
        tic, cpu = time.monotonic(), hub_cpu_seconds(hub)
        time.sleep(window)
        idle = (hub_cpu_seconds(hub) - cpu) / (time.monotonic() - tic)
        with Ledger.open(f"sqlite:///{workdir}/mig_spawner_ledger.sqlite") as ledger:
            press_start(hub, names[1:], {"profile": "small"}, until_ready=0)
            deadline = time.monotonic() + 120
            while len(ledger.waits.waiting()) < waiters and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(3)  # the joins' own passes are over
            tic, cpu = time.monotonic(), hub_cpu_seconds(hub)
            time.sleep(window)
            busy = (hub_cpu_seconds(hub) - cpu) / (time.monotonic() - tic)
    finally:
        hub.close()
    return idle, busy


def verdict(value: float, goal: float) -> str:
    return "met" if value <= goal else "NOT met"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[20, 50, 100],
                        help="burst sizes (users pressing Start at once)")
    parser.add_argument("--waiters", type=int, default=40,
                        help="users waiting while nobody spawns (case 3)")
    parser.add_argument("--wait-slices", type=int, default=5,
                        help="slices for case 2, each released once")
    parser.add_argument("--wait-users", type=int, default=15,
                        help="users for case 2: those beyond the slices wait")
    parser.add_argument("--rounds", type=int, default=1,
                        help="bursts per hub and size, alternating plain and MIG: one burst's "
                             "tail swings by 10-20 %% on a loaded machine")
    parser.add_argument("--nice", type=int, default=0,
                        help="both hubs start their servers at this nice value "
                             "(LocalMIGSpawner.nice; the plain hub the same way): the hub "
                             "ahead of the servers, as docs/admin-install.md advises")
    parser.add_argument("--quick", action="store_true",
                        help="N = 10, 4 slices for 10 users, W = 10, short windows")
    parser.add_argument("--skip", choices=["claims", "burst", "waiting", "idle"], nargs="*",
                        default=[])
    args = parser.parse_args()
    sizes, waiters, window, rounds = args.n, args.waiters, 15.0, args.rounds
    wait_slices, wait_users = args.wait_slices, args.wait_users
    if args.quick:
        sizes, waiters, window, wait_slices, wait_users = [10], 10, 8.0, 4, 10
    with tempfile.TemporaryDirectory(prefix="mig-burst-") as name:
        tmp = Path(name)
        if "claims" not in args.skip:
            for n in sizes:
                alone, took = case_claims(n, tmp, alone=True), case_claims(n, tmp)
                print(f"0. {n} claims at once in-process, no servers: in passes median "
                      f"{statistics.median(took):.3f} s, p95 {p95(took):.3f} s; each alone "
                      f"(before passes) median {statistics.median(alone):.3f} s, p95 "
                      f"{p95(alone):.3f} s; p95 ratio {p95(took) / p95(alone):.2f} (goal <= "
                      f"{GOALS['claims_in_process']} s at N = 100: "
                      f"{verdict(p95(took), GOALS['claims_in_process'])})", flush=True)
        if "burst" not in args.skip:
            behind = f"; servers at nice {args.nice}" if args.nice else ""
            print(f"1. Burst: N users press Start within 1 s (plain hub, then MIG; "
                  f"{rounds} round(s), the median of the rounds' figures{behind})")
            print(f"{'N':>5}{'api p95 plain':>15}{'api p95 mig':>13}{'ratio':>7}"
                  f"{'ready med plain':>17}{'ready med mig':>15}{'ratio':>7}"
                  f"{'claim p95':>11}{'thread p95':>13}{'work p95':>11}{'loop p95':>11}")
            print("      claim: asked for a slice -> the lease back on the hub's event loop;"
                  " thread, work, loop: the claim's trip's wait for a worker thread, its work"
                  " there, its wait for the event loop to take the result back")
            for n in sizes:
                got = case_burst(n, tmp, rounds, args.nice)
                plain, mig = (
                    [statistics.median(figures) for figures in zip(*got[label], strict=True)]
                    for label in ("plain", "mig"))
                (api_plain, ready_plain, cpu_plain), (api_mig, ready_mig, cpu_mig) = (
                    plain[:3], mig[:3])
                claims, waits, work, back = ([c[i] for c in got["claims"]] for i in range(4))
                api, ready = api_mig / api_plain, ready_mig / ready_plain
                print(f"{n:>5}{api_plain:>15.3f}{api_mig:>13.3f}{api:>7.2f}"
                      f"{ready_plain:>17.2f}{ready_mig:>15.2f}{ready:>7.2f}"
                      f"{p95(claims):>11.3f}{p95(waits):>13.3f}{p95(work):>11.3f}"
                      f"{p95(back):>11.3f}", flush=True)
                print(f"      hub process CPU during the burst: plain {cpu_plain:.2f} s, MIG "
                      f"{cpu_mig:.2f} s ({cpu_mig / cpu_plain:.2f}x); its event loop ran "
                      f"late by {plain[3]:.1f} s in all, at most {plain[4]:.2f} s at once "
                      f"(plain), {mig[3]:.1f} s, at most {mig[4]:.2f} s (MIG)")
                if rounds > 1:
                    print("      rounds (api p95 s, ready median s, hub CPU s): "
                          + "; ".join(f"{name} " + ", ".join(
                              f"({a:.3f}, {b:.1f}, {c:.2f})" for a, b, c, *_ in got[label])
                              for name, label in (("plain", "plain"), ("MIG", "mig"))))
                print(f"      goals: api <= {GOALS['api']}x plain ({verdict(api, GOALS['api'])}),"
                      f" ready <= {GOALS['ready']}x ({verdict(ready, GOALS['ready'])}), claim "
                      f"p95 <= {GOALS['claim']} s ({verdict(p95(claims), GOALS['claim'])}; its "
                      f"wait for a thread: {verdict(p95(waits), GOALS['claim'])})",
                      flush=True)
        if "waiting" not in args.skip:
            gaps, stalls, waiters = case_waiting(wait_slices, wait_users, tmp)
            print(f"2. {wait_users} users, {sim_for(wait_slices)} ({waiters} waiting): "
                  f"release -> next grant p50 {statistics.median(gaps):.3f} s, p95 "
                  f"{p95(gaps):.3f} s, max {max(gaps):.3f} s over {len(gaps)} releases (goal "
                  f"<= {GOALS['grant']} s: {verdict(p95(gaps), GOALS['grant'])}); the hub's "
                  f"event loop ran late during each stop by p50 {statistics.median(stalls):.3f}"
                  f" s, p95 {p95(stalls):.3f} s at most at once (JupyterHub's stop handler)",
                  flush=True)
        if "idle" not in args.skip:
            idle, busy = case_idle_waiters(waiters, tmp, window)
            print(f"3. {waiters} waiting, nobody spawning: hub CPU {busy:.3f} core, idle "
                  f"{idle:.3f}: {busy - idle:+.3f} core (goal <= {GOALS['cpu']}: "
                  f"{verdict(busy - idle, GOALS['cpu'])})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
