"""The slice service end to end: a real JupyterHub with the MIG spawner on a simulated
H200, real single-user servers and kernels, and ``mig-spawner-service`` in its own
process reading the same config directory as the hub, with limits shortened to seconds.

One hub and one service for the module. Each user belongs to a group whose limits make
one rule fire; the tests watch what a user and an admin would see: kernels and servers
gone or still there, leases released, metrics counted, the service alive.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests

from mig_spawner.config import MIGPolicyConfig, load_config_files
from mig_spawner.core import budget
from mig_spawner.ledger import Ledger
from tests.support.hub_harness import (
    REPO,
    HubProcess,
    execute,
    free_port,
    simulated_spawner,
)
from tests.support.polling import until
from tests.support.slice_service import (
    SCOPES,
    SERVICE_CONFIG,
    Service,
    end_lease_at,
    kernels,
    new_kernel,
)

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*7"
WEEK = 7 * 86400
AGE = 3600
MANAGED = "mig-slices-managed"
#: What the service logs for a sweep the hub was not there for.
HUB_GONE = "hub unavailable, sweep cut short"
# Who is in which group, and the one limit each group sets (seconds).
GROUPS = {
    "ana": ("kernel-quick", {"kernel_idle_timeout": 3}),
    # Limits of seconds, unwarned: a warn_before (default 10 min) must be shorter.
    "bob": ("server-short", {"server_idle_timeout": 4, "warn_before": None}),
    # An hour: once cy's kernel is busy the test moves the lease's end to seconds ahead
    # (as an extension moves it), so that no start on a loaded machine outlasts it.
    "cy": ("age-capped", {"max_session_age": AGE, "warn_before": None}),
    "ghost": ("analysts", {}),
    # A budget scaled from the shipped defaults (window 7d, minimum hold 30m, warned at
    # 80% used or 10m ahead) to a 50 s window: 35 compute-slice-seconds (118h a week),
    # long enough for the server to be up before it is warned on a loaded machine.
    "dee": ("budgeted", {"budget": 35,
                         "budget_window": 50, "budget_min_hold": 50 * 1800 / WEEK,
                         "warn_before": 50 * 600 / WEEK, "budget_warn_share": 0.8}),
}


def write_config_dir(workdir: Path) -> Path:
    """The repo's spawner and group snippets plus this test's overrides, as one
    jupyterhub_config.d that both the hub and the service load."""
    config_d = workdir / "jupyterhub_config.d"
    config_d.mkdir()
    for name in ("10-spawner.py", "20-groups.py"):
        (config_d / name).symlink_to(REPO / "jupyterhub_config.d" / name)
    policies = {group: {"allowed": ["small"], **limits} for group, limits in GROUPS.values()
                if group != "analysts"}
    (config_d / "90-test.py").write_text(textwrap.dedent(f"""
        c = get_config()  # noqa: F821
{textwrap.indent(simulated_spawner(workdir, SIM), ' ' * 8)}
        c.Spawner.poll_interval = 1
        c.Spawner.start_timeout = 120
        c.Spawner.http_timeout = 120
        c.JupyterHub.tornado_settings = {{"slow_spawn_timeout": 0}}
        c.MIGPolicyConfig.group_policies.update({policies!r})
{textwrap.indent(SERVICE_CONFIG, ' ' * 8)}

        # ghost's server never comes up: a spawn the hub can be killed in the middle of.
        def _slow_ghost(spawner):
            if spawner.user.name == "ghost":
                spawner.cmd = ["sleep", "60"]
        c.Spawner.pre_spawn_hook = _slow_ghost

        # The documented way to run it: managed by the hub (here in dry-run, so that
        # it only watches while the service under test acts).
        c.JupyterHub.services.append({{
            "name": "{MANAGED}",
            "command": ["{Path(sys.executable).parent / 'mig-spawner-service'}",
                        "--config-dir={workdir / 'harness_config.py'}", "--dry-run"],
            "url": "http://127.0.0.1:{free_port()}",
        }})
        c.JupyterHub.load_roles.append(
            {{"name": "{MANAGED}", "services": ["{MANAGED}"], "scopes": {SCOPES!r}}})

        c.SliceServiceApp.cull_every = 1
        c.SliceServiceApp.orphan_grace = 3
        c.SliceServiceApp.retries = 1
        # No c.SliceServiceApp.simulate: the service takes the spawner's simulated GPU.
    """))
    return config_d


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slicehub")
    config_d = write_config_dir(workdir)
    hub = HubProcess.start(workdir, sorted(config_d.glob("*.py")), timeout=120)
    for user, (group, _) in GROUPS.items():
        hub.create_user(user, groups=[group])
    service = Service(hub, config_d)
    service.wait_up()
    with Ledger(f"sqlite:///{workdir}/mig_spawner_ledger.sqlite") as ledger:
        yield hub, service, ledger
    service.close()
    hub.close()


def start(hub: HubProcess, user: str) -> None:
    r = hub.spawn(user, {"profile": "small"})
    assert r.status_code in (201, 202), r.text


def run_without_waiting(hub: HubProcess, user: str, kernel_id: str, code: str):
    """Send ``code`` to a kernel and return the open websocket (the kernel stays busy)."""
    ws = hub.open_kernel(user, kernel_id, 30)
    execute(ws, code)
    return ws


def test_runs_as_a_hub_managed_service_reading_the_hub_config(env):
    hub, _, _ = env
    base = f"{hub.url}/services/{MANAGED}"
    until(lambda: requests.get(f"{base}/health", timeout=5).ok, 30,
          "the hub-managed service up", show=hub.log_path)
    assert requests.get(f"{base}/health", timeout=5).json() == {"status": "ok"}
    metrics = hub.session.get(f"{base}/metrics", timeout=5).text
    assert "mig_spawner_service_sweep_duration_seconds_count" in metrics


def test_idle_kernel_is_shut_down_while_a_busy_one_survives(env):
    hub, service, ledger = env
    start(hub, "ana")
    hub.wait_ready("ana")
    idle = new_kernel(hub, "ana")
    busy = new_kernel(hub, "ana")
    ws = run_without_waiting(hub, "ana", busy, "import time; time.sleep(600)")
    busy_since = datetime.now(UTC)
    try:
        until(lambda: idle not in kernels(hub, "ana"), 30, "idle kernel shut down",
              show=service.log)
        # Sweeps that all began past the busy kernel's 3 s limit left it alone.
        service.swept(after=busy_since + timedelta(seconds=3), times=3)
        assert kernels(hub, "ana") == {busy: "busy"}
        assert hub.server_model("ana")["ready"]  # the server and its slice stay
        assert ledger.leases.active_for_server("ana") is not None
        assert service.counted("mig_spawner_service_culls_total", 1, kind="kernel",
                               reason="kernel_idle", group="kernel-quick") == 1
    finally:
        ws.close()


def test_idle_server_is_stopped_and_its_slice_is_free_again_other_group_untouched(env):
    hub, service, ledger = env
    start(hub, "bob")
    until(lambda: ledger.leases.active_for_server("bob") is not None, 30, "bob's lease",
          show=service.log)
    slice_uuid = ledger.leases.active_for_server("bob").mig_uuid
    until(lambda: hub.server_model("bob") is None, 60, "bob's idle server stopped",
          show=service.log)
    until(lambda: ledger.leases.active_for_server("bob") is None, 15, "bob's lease released",
          show=service.log)
    assert slice_uuid not in {lease.mig_uuid for lease in ledger.leases.active()}
    assert service.counted("mig_spawner_service_culls_total", 1, kind="server",
                           reason="server_idle", group="server-short") == 1
    assert service.counted("mig_spawner_service_slices_reclaimed_total", 1,
                           reason="server_idle", group="server-short") == 1
    # ana's group has no server idle limit: her server, idle just as long, still runs.
    assert hub.server_model("ana")["ready"]


def test_max_session_age_stops_a_busy_server(env):
    hub, service, ledger = env
    start(hub, "cy")
    hub.wait_ready("cy")
    lease = ledger.leases.active_for_server("cy")
    assert lease.expires_at == lease.claimed_at + timedelta(seconds=AGE)
    kernel = new_kernel(hub, "cy")
    ws = run_without_waiting(hub, "cy", kernel, "import time; time.sleep(600)")
    try:
        until(lambda: kernels(hub, "cy") == {kernel: "busy"}, 10, "busy kernel", show=service.log)
        end_lease_at(hub, lease.id, datetime.now(UTC) + timedelta(seconds=2))
        until(lambda: hub.server_model("cy") is None, 60, "cy's server stopped", show=service.log)
    finally:
        ws.close()
    assert service.counted("mig_spawner_service_culls_total", 1, kind="server",
                           reason="max_session_age", group="age-capped") == 1
    until(lambda: ledger.leases.active_for_server("cy") is None, 15, "cy's lease released",
          show=service.log)


def test_a_spent_budget_warns_stops_and_refuses_until_its_retry_time(env):
    hub, service, ledger = env
    policies = MIGPolicyConfig(config=load_config_files(hub.workdir / "jupyterhub_config.d")
                               ).build()
    group = policies.group("budgeted")
    start(hub, "dee")
    hub.wait_ready("dee")
    lease = ledger.leases.active_for_server("dee")
    # Warned at 80% used (28 s in), then stopped when all 35 s are spent.
    until(lambda: any(e.kind == "warned" and e.rule == "budget"
                      for e in ledger.warnings.events(lease.id)), 45, "budget warning",
          show=service.log)
    warned = next(e for e in ledger.warnings.events(lease.id) if e.kind == "warned")
    assert (warned.at - lease.claimed_at).total_seconds() >= 0.8 * 35 - 1
    # Keep cannot pass a budget.
    answer = hub.request("POST", "/mig-spawner/keep/", headers={
        "Authorization": f"token {hub.user_token('dee')}"}).json()
    assert answer["outcome"] == "refused", answer
    until(lambda: hub.server_model("dee") is None, 30, "dee's server stopped", show=service.log)
    until(lambda: ledger.leases.get(lease.id).state == "released", 15, "lease released",
          show=service.log)
    ended = ledger.leases.get(lease.id)
    assert ended.release_code == "budget", ended
    assert (ended.released_at - lease.claimed_at).total_seconds() >= 35
    assert service.counted("mig_spawner_service_culls_total", 1, kind="server",
                           reason="budget", group="budgeted") == 1
    # The next spawn is refused with the time it can succeed.
    held, extras = ledger.usage.budget(ended.claimed_at)
    retry = budget.retry_at(group, "dee", 1, budget.spans_of([], held), extras,
                            datetime.now(UTC))
    _, events = hub.spawn_and_follow("dee", {"profile": "small"})
    failed = events[-1]["message"]
    assert "GPU budget" in failed and f"Retry at {budget.when_text(retry)}" in failed, failed
    # At that time it succeeds: the budget's window is the wall clock under test, so the
    # test lets it pass (to the second it names) rather than wait on an event.
    time.sleep(max(0.0, (retry - datetime.now(UTC)).total_seconds()) + 0.2)  # a real clock
    start(hub, "dee")
    hub.wait_ready("dee")
    hub.stop_server("dee")


def test_hub_going_away_does_not_crash_the_service(env):
    hub, service, _ = env
    errors_before = service.metric("mig_spawner_service_errors_total", kind="hub")
    hub.stop_hub()
    try:
        until(lambda: service.get("/health").status_code == 503, 30,
                 "health failing while the hub is down", show=service.log)
        assert service.get("/health").json()["status"] == "failing"
        # Sweeps that met the hub gone, and the service still there after them.
        cut_short = service.logged(HUB_GONE)
        until(lambda: service.logged(HUB_GONE) >= cut_short + 3, 30,
              "three sweeps without the hub", show=service.log)
        assert service.proc.poll() is None, service.log()
    finally:
        hub.restart_hub()
    until(lambda: service.get("/health").status_code == 200, 30,
             "health ok once the hub is back", show=service.log)
    assert service.metric("mig_spawner_service_errors_total", kind="hub") > errors_before


def forget_spawn(hub: HubProcess, user: str) -> None:
    """Make the hub's database hold no trace of ``user``'s spawn, as when the hub dies
    after the slice was leased but before it recorded the server."""
    with sqlite3.connect(hub.workdir / "jupyterhub.sqlite") as db:
        db.execute(
            "UPDATE spawners SET server_id = NULL, state = '{}' "
            "WHERE user_id = (SELECT id FROM users WHERE name = ?)", (user,),
        )


def test_orphan_lease_left_by_a_killed_hub_is_released(env):
    hub, service, ledger = env
    start(hub, "ghost")  # its server never answers: the spawn stays pending
    until(lambda: ledger.leases.active_for_server("ghost") is not None, 30, "ghost's lease",
          show=service.log)
    lease = ledger.leases.active_for_server("ghost")
    os.killpg(hub.proc.pid, signal.SIGKILL)  # the hub (and its proxy) die mid-spawn
    hub.proc.wait(10)
    forget_spawn(hub, "ghost")
    hub.restart_hub()
    until(lambda: ledger.leases.active_for_server("ghost") is None, 60, "orphan lease released",
          show=service.log)
    released = ledger.leases.get(lease.id)
    assert released.state == "released"
    assert released.release_code == "orphan", released
    assert service.metric("mig_spawner_service_orphans_repaired_total", group="analysts") == 1
