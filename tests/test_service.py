"""The slice service's sweeps, endpoints and config, against the stand-in hub.

The stand-in gives scale (hundreds of users over many pages) and faults on demand;
tests/test_service_e2e.py runs the service against a real JupyterHub.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from traitlets.config import Config

from mig_spawner import holder
from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.lifecycle import StopRule
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.hub.client import HubClient
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.service.app import SliceServiceApp, missing_scopes
from mig_spawner.service.handlers import make_web_app
from mig_spawner.service.metrics import ServiceMetrics
from mig_spawner.service.sweeper import Sweeper
from tests.mocking import mig_device
from tests.support.hub_standin import StandinState, listen, standin_sweeper
from tests.support.polling import until

POLICY = MIGPolicyConfig(group_policies={
    "analysts": {"allowed": ["1g.18gb"], "server_idle_timeout": "1h"},
}).build()
KERNEL_POLICY = MIGPolicyConfig(group_policies={"analysts": {
    "allowed": ["1g.18gb"], "server_idle_timeout": "1h", "kernel_idle_timeout": "1h",
}}).build()


@pytest.fixture
async def standin(serve_hub):
    state = StandinState.build(300, idle_every=3)
    return state, serve_hub(state)


def sweeper_for(base: str, **kw) -> Sweeper:
    return standin_sweeper(base, POLICY, **kw)


def sample(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(
        generate_latest(metrics.registry).decode()
    ):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def test_every_idle_server_on_every_page_is_stopped(standin):
    state, base = standin
    sweeper = sweeper_for(base)
    report = await sweeper.sweep()
    # Stopping while paging would shift later pages and skip users: none may be missed.
    assert sorted(state.stopped) == [f"user{i:05}/" for i in range(0, 300, 3)]
    assert report.complete and report.servers == 300
    assert {d.rule.value for d in report.carried_out} == {"server_idle"}
    assert sample(sweeper.metrics, "mig_spawner_service_culls_total", kind="server",
                  reason="server_idle", group="analysts") == 100


async def test_dry_run_decides_and_counts_but_stops_nothing(standin):
    state, base = standin
    sweeper = sweeper_for(base, dry_run=True)
    report = await sweeper.sweep()
    assert state.stopped == [] and len(report.decisions) == 100 and report.carried_out == []
    assert sample(sweeper.metrics, "mig_spawner_service_cull_decisions_total",
                  reason="server_idle") == 100


async def test_hub_outage_fails_the_sweep_not_the_service_and_it_resumes(standin):
    state, base = standin
    sweeper = sweeper_for(base)
    state.fail_next = 100
    report = await sweeper.sweep()
    assert not report.complete and "503" in report.error and state.stopped == []
    assert sample(sweeper.metrics, "mig_spawner_service_errors_total", kind="hub") == 1

    state.fail_next = 0  # the hub is back
    report = await sweeper.sweep()
    assert report.complete and len(state.stopped) == 100


async def test_a_server_without_the_extension_is_asked_for_it_once_per_start(serve_hub):
    """The stand-in's servers have no mig-spawner single-user extension (404): each
    sweep still reads their kernels, but asks for the extension's probe only again once
    the server has restarted."""
    state = StandinState.build(20, kernels_per_server=1)
    base = serve_hub(state)
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
    sweeper = Sweeper(client, KERNEL_POLICY, ServiceMetrics())
    asked = []
    look = client.look

    async def counted(server, **kw):
        asked.append(server.user)
        return await look(server, **kw)

    client.look = counted
    await sweeper.sweep()
    assert len(asked) == 20
    kernel_lists = state.requests[("GET", "user")]
    await sweeper.sweep()
    assert len(asked) == 20  # not asked again...
    assert state.requests[("GET", "user")] == kernel_lists + 16  # ...its kernels are
    restarted = state.users["user00007"]["servers"][""]
    restarted["started"] = restarted["last_activity"]
    await sweeper.sweep()
    assert asked[20:] == ["user00007"]
    await sweeper.close()


async def test_a_server_with_the_extension_is_read_in_one_request_and_culled_in_one(
        serve_hub):
    """With mig-spawner's single-user extension, a sweep reads each server once and shuts
    its idle kernels down in one more request; the same kernels and servers go as on
    servers without it, where each kernel takes a DELETE of its own."""
    now = datetime.now(UTC)
    culled, left = {}, {}
    for extension in (True, False):
        state = StandinState.build(30, kernels_per_server=4, now=now, extension=extension)
        base = serve_hub(state)
        client = HubClient(f"{base}/hub/api", "t", proxy_url=base, retries=0)
        sweeper = Sweeper(client, KERNEL_POLICY, ServiceMetrics())
        first = await sweeper.sweep()
        asked_first = dict(state.per_server)
        culled[extension] = sorted((d.user, d.kernel_id or "", d.rule.value)
                                   for d in first.carried_out)
        left[extension] = {u: [k["id"] for k in ks] for u, ks in state.kernels.items()}
        second = await sweeper.sweep()
        assert second.carried_out == []
        asked_second = state.per_server - Counter(asked_first)
        await sweeper.close()
        if not extension:
            continue
        # One look per server, one cull per server with idle kernels that keeps running.
        kept = {d.user for d in first.carried_out if d.rule is StopRule.KERNEL_IDLE}
        assert len(kept) == 24  # the 6 idle servers are stopped instead
        assert asked_first == {
            **{(u, "GET", "mig-spawner/probe"): 1 for u in state.users},
            **{(u, "POST", "mig-spawner/cull"): 1 for u in kept}}
        # Then one request per running server, each sweep.
        assert asked_second == {(u, "GET", "mig-spawner/probe"): 1 for u in kept}
    assert culled[True] == culled[False] and len(culled[True]) == 6 + 24 * 2
    assert left[True] == left[False]


def claim(ledger: Ledger, user: str, start: int, **grant) -> str:
    # Leases of this host: the service checks their holders through /proc here.
    grant = {"mode": "pool", "host": holder.this_host(), "gpu_uuid": "GPU-0",
             "mig_uuid": f"MIG-{start}", **grant}

    def decide(view):
        return Grant(group="analysts", profile="1g.18gb", compute_slices=1, gpu_index=0,
                        start=start, size=1, **grant)
    return ledger.leases.claim(LeaseRequest(user), decide).id


@pytest.fixture
def ledger(tmp_path):
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.sqlite", clock=lambda: an_hour_ago) as led:
        yield led


async def test_orphan_whose_holder_runs_is_stopped_first_and_other_hosts_are_reported(
    standin, ledger, tmp_path, caplog
):
    _, base = standin
    lease_id = claim(ledger, "ghost", 0)
    # The server the hub lost track of: its environment names the lease.
    ghost = subprocess.Popen(["sleep", "60"], env={**os.environ, "MIG_SPAWNER_LEASE_ID": lease_id})
    elsewhere = claim(ledger, "far", 1, host="another-host")
    sweeper = sweeper_for(base, ledger=ledger, orphan_grace=0)
    try:
        with caplog.at_level(logging.WARNING, "mig_spawner"):
            report = await sweeper.sweep()
        assert ghost.wait(5) == -signal.SIGTERM
        assert [x.id for x in report.orphans_released] == [lease_id]
        # The log says which holder the hub does not track (no server was recorded).
        assert (f"stopping other processes on its slice (PIDs [{ghost.pid}]), which the hub "
                "does not track") in caplog.text
        # Not checkable from here: it keeps its slice, and the metric says so.
        assert ledger.leases.get(elsewhere).held
        assert sweeper.metrics.holders_unknown._value.get() == 1
        assert sweeper.metrics.holders_stopped._value.get() == 1
    finally:
        ghost.kill()


async def test_orphan_lease_released_after_grace_but_running_servers_keep_theirs(
    standin, ledger
):
    _, base = standin
    running = claim(ledger, "user00001", 0)  # the stand-in runs user00001's server
    orphan = claim(ledger, "ghost", 1)  # no such server on the hub
    clock = [datetime.now(UTC)]
    sweeper = sweeper_for(base, ledger=ledger, orphan_grace=60, clock=lambda: clock[0])

    assert (await sweeper.sweep()).orphans_released == []  # grace starts now
    clock[0] += timedelta(seconds=61)
    report = await sweeper.sweep()
    assert [lease.id for lease in report.orphans_released] == [orphan]
    assert ledger.leases.get(orphan).state == "released"
    assert ledger.leases.get(orphan).release_code == "orphan"
    assert ledger.leases.get(running).held
    assert sample(sweeper.metrics, "mig_spawner_service_slices_reclaimed_total",
                  reason="orphan", group="analysts") == 1


async def test_listing_cut_short_releases_no_orphans_but_handles_listed_servers(
    standin, ledger
):
    state, base = standin
    orphan = claim(ledger, "ghost", 0)
    sweeper = sweeper_for(base, ledger=ledger, orphan_grace=0)
    state.ok_before_failing, state.fail_next = 1, 100  # page 1 comes, page 2 never does
    report = await sweeper.sweep()
    assert not report.complete and report.orphans_released == []
    assert ledger.leases.get(orphan).held
    # The first page's idle servers were judged, but not stopped while the hub fails.
    assert len(report.decisions) == 17 and state.stopped == []

    state.fail_next = 0
    report = await sweeper.sweep()
    assert [x.id for x in report.orphans_released] == [orphan]
    assert len(state.stopped) == 100


async def test_health_and_metrics_endpoints(standin):
    _, base = standin
    app = SliceServiceApp(hub_api_url=f"{base}/hub/api", api_token="t",
                          check_gpus=False, probe_servers=False, config_dir="")
    metrics = ServiceMetrics()
    [sock] = bind_sockets(0, "127.0.0.1")[:1]
    server = HTTPServer(make_web_app("/services/slices/", metrics, app.health))
    server.add_sockets([sock])
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    http = AsyncHTTPClient(force_instance=True)
    try:
        r = await http.fetch(f"{url}/services/slices/health", raise_error=False)
        assert r.code == 503 and json.loads(r.body) == {"status": "starting"}  # no sweep yet

        sweeper = Sweeper(HubClient(f"{base}/hub/api", "t"), POLICY, metrics,
                          probe_servers=False)
        app._last_report = await sweeper.sweep()
        r = await http.fetch(f"{url}/health")
        assert r.code == 200 and json.loads(r.body) == {"status": "ok"}  # nothing private
        # Metrics name users and groups: no token, no metrics (with one: the e2e tests).
        for path in ("/metrics", "/services/slices/metrics"):
            r = await http.fetch(url + path, raise_error=False)
            assert r.code == 401 and b"custom:mig-spawner:metrics" in r.body
            assert b"analysts" not in r.body and r.headers["WWW-Authenticate"].startswith(
                "Bearer")
    finally:
        http.close()
        server.stop()


# -- configuration ------------------------------------------------------------------


def test_durations_accept_units_and_bad_values_say_what_to_write():
    app = SliceServiceApp(cull_every="2m", orphan_grace="never")
    assert app.cull_every == 120 and app.orphan_grace == float("inf")
    with pytest.raises(ValueError, match=r"cull_every: 'soon' is not a duration"):
        SliceServiceApp(cull_every="soon")
    with pytest.raises(ValueError, match="concurrency must be 1 or more"):
        SliceServiceApp(concurrency=0)


def test_config_dir_gives_the_hub_policy_and_the_command_line_wins(tmp_path):
    (tmp_path / "10-policy.py").write_text(
        'c.MIGPolicyConfig.group_policies = {"analysts": {"allowed": ["1g.18gb"],'
        ' "kernel_idle_timeout": "20m"}}\n'
        "c.SliceServiceApp.cull_every = 30\n"
        "c.SliceServiceApp.concurrency = 3\n"
        'c.JupyterHub.spawner_class = "ignored.by.the.Service"\n'
    )
    app = SliceServiceApp()
    app.initialize([f"--config-dir={tmp_path}", "--concurrency=7"])
    assert app.cull_every == 30 and app.concurrency == 7
    assert app.load_policy().group("analysts").kernel_idle_timeout == 1200


def test_missing_hub_credentials_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("JUPYTERHUB_API_URL", raising=False)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    app = SliceServiceApp(check_gpus=False)
    with pytest.raises(ValueError, match="run the service from JupyterHub"):
        app.make_sweeper(ServiceMetrics())


async def test_the_holder_stop_grace_is_a_setting_the_sweeper_uses(tmp_path):
    (tmp_path / "30-service.py").write_text("c.SliceServiceApp.holder_stop_grace = 12.5\n")
    app = SliceServiceApp(hub_api_url="http://127.0.0.1:1/hub/api", api_token="t",
                          check_gpus=False)
    app.initialize([f"--config-dir={tmp_path}",
                    f"--ledger-url=sqlite:///{tmp_path}/ledger.sqlite"])
    sweeper = app.make_sweeper(ServiceMetrics())
    try:
        assert sweeper.holder_grace == 12.5
    finally:
        await sweeper.close()
    assert SliceServiceApp().holder_stop_grace == holder.STOP_GRACE
    with pytest.raises(ValueError, match="holder_stop_grace must be 0 seconds or more"):
        SliceServiceApp(holder_stop_grace=-1)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('c.JupyterHub.db_url = "sqlite:////srv/hub/jupyterhub.sqlite"\n',
         "sqlite:////srv/hub/mig_spawner_ledger.sqlite"),
        ('c.JupyterHub.db_url = "sqlite:////srv/hub/jupyterhub.sqlite"\n'
         'c.MIGSettings.ledger_url = "postgresql://mig@db/leases"\n',
         "postgresql://mig@db/leases"),
        # Not a SQLite hub database: the ledger file goes in the working directory.
        ('c.JupyterHub.db_url = "postgresql://hub@db/hub"\n',
         "sqlite:///{cwd}/mig_spawner_ledger.sqlite"),
    ],
)
def test_the_service_finds_the_spawners_ledger_in_the_hub_config(
        tmp_path, monkeypatch, config, expected):
    # The working directory is the test's own: the service may create the ledger there.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "00-hub.py").write_text(config)
    app = SliceServiceApp()
    app.initialize([f"--config-dir={tmp_path}"])
    assert app.ledger_url == expected.format(cwd=Path.cwd())


def test_the_service_finds_the_spawners_simulated_gpus_in_the_hub_config(tmp_path):
    (tmp_path / "10-spawner.py").write_text(
        'c.MIGSettings.simulate = "h200x1:layout=1g.18gb*7"\n'
        f'c.MIGSettings.sim_state_file = "{tmp_path}/sim.json"\n'
    )
    app = SliceServiceApp()
    app.initialize([f"--config-dir={tmp_path}"])
    assert app.shared.simulate == "h200x1:layout=1g.18gb*7"
    assert app.shared.sim_state_file == f"{tmp_path}/sim.json"
    gpus = app.connect_gpus()  # the spawner's simulated host, not the real driver
    try:
        assert len(gpus.inventory().mig_devices) == 7
    finally:
        gpus.close()
    # Set for the service itself, its own setting wins.
    app = SliceServiceApp()
    app.initialize([f"--config-dir={tmp_path}", "--simulate=h200x2"])
    assert app.shared.simulate == "h200x2"


def test_missing_scopes_are_named_and_a_filtered_grant_counts():
    granted = {"list:users", "read:users:groups", "read:users:activity",
               "read:servers!group=gpu", "access:servers!group=gpu", "read:users:name"}
    assert missing_scopes(granted) == ["delete:servers"]


async def test_dynamic_orphan_instance_is_destroyed_only_once_its_processes_are_gone(
    standin, ledger, tmp_path
):
    _, base = standin
    gpus = connect(simulate="h200x1", state_file=str(tmp_path / "sim.json"))
    sim = SimulatedHost.open(tmp_path / "sim.json")
    device = gpus.create_instance(0, "1g.18gb", start=0)
    lease = claim(ledger, "ghost", 0, mode="dynamic", gpu_uuid=device.gpu_uuid,
                  mig_uuid=device.uuid, gi_id=device.gi_id, ci_id=device.ci_id)
    sim.set_processes(device.uuid, [(4242, 1000)])
    sweeper = sweeper_for(base, ledger=ledger, gpus=gpus, orphan_grace=0)
    try:
        report = await sweeper.sweep()
        # Someone still computes on it: nothing is killed, the slice stays held.
        assert report.orphans_released == []
        assert ledger.leases.get(lease).state == "releasing"
        assert mig_device(gpus.inventory(), device.uuid) is not None

        sim.set_processes(device.uuid, [])
        report = await sweeper.sweep()
        assert [x.id for x in report.orphans_released] == [lease]
        assert mig_device(gpus.inventory(), device.uuid) is None
    finally:
        gpus.close()


async def test_busy_slice_without_a_lease_is_reported_never_killed(standin, ledger, tmp_path):
    _, base = standin
    gpus = connect(simulate="h200x1:layout=1g.18gb*2", state_file=str(tmp_path / "sim.json"))
    sim = SimulatedHost.open(tmp_path / "sim.json")
    leased, stray = sim.device_uuids()
    claim(ledger, "user00001", 0, mig_uuid=leased)
    sim.set_processes(leased, [(11, 100)])
    sim.set_processes(stray, [(12, 100)])
    sweeper = sweeper_for(base, ledger=ledger, gpus=gpus)
    try:
        report = await sweeper.sweep()
        assert report.unleased_devices == [stray]
        assert sample(sweeper.metrics, "mig_spawner_service_unleased_busy_devices") == 1
        assert mig_device(gpus.inventory(), stray).pids == (12,)  # still running
    finally:
        gpus.close()


def test_no_gpu_on_this_host_is_logged_and_the_service_runs_on(tmp_path, capsys):
    app = SliceServiceApp(config=Config(
        {"MIGSettings": {"sim_state_file": str(tmp_path / "missing.json")}}))
    assert app.connect_gpus() is None
    logged = capsys.readouterr().err
    assert "missing.json does not exist" in logged and "check_gpus = False" in logged
    assert SliceServiceApp(check_gpus=False).connect_gpus() is None


KERNEL_POLICY = MIGPolicyConfig(group_policies={
    "analysts": {"allowed": ["1g.18gb"], "server_idle_timeout": "1h",
                 "kernel_idle_timeout": "1h"},
}).build()


async def test_kernel_level_sweep_shuts_down_idle_kernels_and_stops_idle_servers():
    state = StandinState.build(30, idle_every=3, kernels_per_server=2)
    server, port = listen(state)
    base = f"http://127.0.0.1:{port}"
    client = HubClient(f"{base}/hub/api", "t", proxy_url=base)
    try:
        report = await Sweeper(client, KERNEL_POLICY, ServiceMetrics()).sweep()
    finally:
        server.stop()
    # Idle servers (every third) are stopped whole; on the others, the kernel idle
    # for two hours goes and the one active a moment ago stays.
    assert len(state.stopped) == 10
    assert [k["id"] for k in state.kernels["user00001"]] == ["user00001-k1"]
    assert len([d for d in report.carried_out if not d.stops_server]) == 20


async def test_unreachable_servers_are_not_stopped_for_idleness(standin):
    state, base = standin
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{s.getsockname()[1]}"  # no proxy listens here
    client = HubClient(f"{base}/hub/api", "t", proxy_url=nowhere, retries=0)
    sweeper = Sweeper(client, POLICY, ServiceMetrics(), probe_servers=True)
    report = await sweeper.sweep()
    # The hub says 100 servers are idle, but none could be looked at: none is stopped.
    assert report.complete and report.decisions == [] and state.stopped == []
    assert sample(sweeper.metrics, "mig_spawner_service_errors_total",
                  kind="server_unreachable") == 100


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_hubs_stop_signal_ends_the_service_cleanly_even_with_sigint_ignored(
    tmp_path, signum
):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{s.getsockname()[1]}/hub/api"
    log = tmp_path / "service.log"
    env = {**os.environ, "JUPYTERHUB_API_URL": nowhere, "JUPYTERHUB_API_TOKEN": "t"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mig_spawner.service", "--ledger-url=",
             "--SliceServiceApp.check_gpus=False", "--cull-every=1"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
            cwd=tmp_path,  # where a ledger with no URL of its own is made
            # As a hub started in the background (nohup, &) passes it on.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    try:
        until(lambda: "sweeping every" in log.read_text(), 30, "the service sweeping",
              show=log, every=0.1)
        proc.send_signal(signum)
        assert proc.wait(10) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "mig-spawner-service stopped" in log.read_text()


def test_a_managed_service_exits_when_the_hub_that_started_it_is_gone(tmp_path):
    # A hub killed outright cannot stop its services; its service must not keep culling
    # beside the one a restarted hub starts. The "hub" here starts the service, then dies.
    hub = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = dict(os.environ, JUPYTERHUB_SERVICE_NAME="mig-slices",
                   JUPYTERHUB_API_URL="http://127.0.0.1:{unused_port()}/hub/api",
                   JUPYTERHUB_API_TOKEN="t" * 32)
        service = subprocess.Popen(
            [sys.executable, "-m", "mig_spawner.service", "--config-dir={tmp_path}",
             "--cull-every=1"], env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=open({str(tmp_path / "service.log")!r}, "w"))
        # The hub lives until the service runs, then dies without stopping it.
        log = {str(tmp_path / "service.log")!r}
        while "sweeping every" not in open(log).read():
            time.sleep(0.1)
        print(service.pid, flush=True)
        """
    )
    (tmp_path / "00-hub.py").write_text("c.SliceServiceApp.check_gpus = False\n")
    out = subprocess.run([sys.executable, "-c", hub], capture_output=True, text=True,
                         timeout=60, check=True, cwd=tmp_path)
    pid = int(out.stdout)
    until(lambda: not _alive(pid), 30, "the orphaned service gone",
          show=tmp_path / "service.log")
    assert "the hub that started this service is gone" in (tmp_path / "service.log").read_text()


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running (not a zombie: its new parent, init, may not have reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_the_idle_limit_follows_the_wait_list(tmp_path):
    from mig_spawner.hub.models import HubUser
    from mig_spawner.ledger import WaitRequest

    policy = MIGPolicyConfig(group_policies={"analysts": {
        "allowed": ["1g.18gb"], "server_idle_timeout": "1h", "queue": True,
        "server_idle_timeout_when_waited": "15m",
        "server_idle_timeout_when_unwaited": "2h"}}).build()
    ledger = Ledger.open(f"sqlite:///{tmp_path}/l.sqlite")
    client = HubClient("http://127.0.0.1:9/hub/api", "t")
    sweeper = Sweeper(client, policy, ServiceMetrics(), ledger=ledger, probe_servers=False)
    claim(ledger, "ana", 0)
    lease = ledger.leases.active()[0]
    user = HubUser(name="ana", groups=("analysts",), servers=())
    await sweeper._leases()
    assert sweeper.limits_for(user, lease).server_idle_timeout == 7200  # nobody waits
    ledger.waits.join(WaitRequest("bob", "", "analysts", 0, "1g.18gb", 600))
    await sweeper._leases()
    assert sweeper.limits_for(user, lease).server_idle_timeout == 900
    ledger.close()
