"""Idle servers are stopped at their limit, not kept alive by the slice service's own reads.

A real JupyterHub + configurable-http-proxy + jupyter_server, the slice service in its
own process sweeping every second, and every limit shortened by the same factor (60)
from the shipped ones: a group's server limit of 30 min is 30 s, its kernel limit of
15 min is 15 s, the service's sweep of 1 min is 1 s, and the hub's
``last_activity_interval`` (and the single-user server's activity report) of 5 min
is 5 s. Read through the proxy, each sweep would mark the server's route active and
the hub would copy that onto its ``last_activity`` every 5 s: never idle.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from mig_spawner.core.lifecycle import StopRule
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.ledger import Ledger
from tests.support.browser import launch_chromium, sign_in
from tests.support.hub_harness import STARTED, STOP_TIMEOUT, start_mig_hub
from tests.support.polling import until
from tests.support.slice_service import SERVICE_CONFIG, Service, end_lease_at, new_kernel
from tests.support.system_deps import require_chromium

pytestmark = pytest.mark.hub

SIM = "h200x1:layout=1g.18gb*7"
SERVER_IDLE, KERNEL_IDLE, SWEEP, HUB_INTERVAL = 30, 15, 1, 5
WARN = 10  # the shipped warn_before of 10 min against a 30 min limit
#: The group's session age: an hour, which no start outlasts; the test moves the lease's
#: end to seconds ahead.
MAX_AGE = 3600
CONFIG = f"""
c.JupyterHub.last_activity_interval = {HUB_INTERVAL}
c.Spawner.environment = {{"JUPYTERHUB_ACTIVITY_INTERVAL": "{HUB_INTERVAL}"}}
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.MIGPolicyConfig.group_policies.update({{"idle-test": {{
    "allowed": ["small"], "server_idle_timeout": {SERVER_IDLE},
    "kernel_idle_timeout": {KERNEL_IDLE}, "warn_before": {WARN}}},
    "age-test": {{"allowed": ["small"], "max_session_age": {MAX_AGE}, "warn_before": None}}}})
{SERVICE_CONFIG}c.SliceServiceApp.cull_every = {SWEEP}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("idlehub")
    # A Hopper GPU with GPM, so that SM activity per slice is known.
    SimulatedHost.from_spec(SIM, workdir / "sim-gpus.json").set_gpm(True)
    hub = start_mig_hub(workdir, SIM, CONFIG)
    for user in ("ana", "mia", "gus"):
        hub.create_user(user, groups=["idle-test"])
    hub.create_user("cy", groups=["age-test"])
    service = Service(hub, hub.config_path)
    service.wait_up()
    with Ledger(f"sqlite:///{workdir}/mig_spawner_ledger.sqlite") as ledger:
        yield hub, service, ledger
    service.close()
    hub.close()


def start(hub, user: str) -> None:
    hub.spawn(user, {"profile": "small"}, expect=STARTED)
    hub.wait_ready(user, timeout=120)


def gpus(hub) -> SimulatedHost:
    return SimulatedHost.open(hub.workdir / "sim-gpus.json")


def test_a_server_nobody_touches_is_stopped_one_sweep_after_its_limit(env):
    hub, service, ledger = env
    start(hub, "ana")
    new_kernel(hub, "ana", booted=True)  # the user's last act, through the proxy
    touched_at = datetime.now(UTC)
    lease = ledger.leases.active_for_server("ana")
    assert lease.server_url and lease.server_url.endswith("/user/ana/")
    # Her dead kernel's memory stays held: no process, no SM activity, not work.
    gpus(hub).set_memory_used(lease.mig_uuid, 15000)

    # Warned warn_before ahead of the limit: by the first whole sweep past that time,
    # and not before it; the stop is not before the limit either.
    service.swept(after=touched_at + timedelta(seconds=SERVER_IDLE - WARN))
    warned_lease = ledger.leases.get(lease.id)
    assert warned_lease.warning == "server_idle", service.log()
    deadline = warned_lease.warning_deadline
    assert (deadline - touched_at).total_seconds() >= SERVER_IDLE - 1, deadline
    assert not hub.stopping("ana") or datetime.now(UTC) >= deadline, service.log()
    # Its stop began at the warned time: by the first whole sweep past it.
    service.swept(after=deadline)
    assert hub.stopping("ana"), service.log()
    # The stop itself is JupyterHub's and jupyter_server's (STOP_TIMEOUT before a kill).
    until(lambda: hub.server_model("ana") is None, STOP_TIMEOUT + 5, "ana's server gone",
          show=service.log)
    until(lambda: ledger.leases.active_for_server("ana") is None, 15, "ana's lease released",
          show=service.log)
    assert lease.mig_uuid not in {held.mig_uuid for held in ledger.leases.active()}
    # Warned once, warn_before ahead of the stop.
    warnings = [e for e in ledger.warnings.events(lease.id) if e.kind == "warned"]
    assert len(warnings) == 1, service.log()
    [warned] = warnings
    assert (warned.at - touched_at).total_seconds() >= SERVER_IDLE - WARN - 1, warned
    assert warned.rule == "server_idle"
    released = ledger.leases.get(lease.id)
    assert released.released_at >= deadline
    assert released.peak_memory_mib == 15000 and released.gpu_active_at is None
    gpus(hub).set_memory_used(lease.mig_uuid, None)
    assert service.counted("mig_spawner_service_culls_total", 1, kind="kernel",
                           reason="kernel_idle", group="idle-test") >= 1
    assert service.counted("mig_spawner_service_culls_total", 1, kind="server",
                           reason="server_idle", group="idle-test") == 1


def test_a_user_working_in_jupyterlab_keeps_the_server(env):
    require_chromium()
    pytest.importorskip("playwright.sync_api")
    hub, service, ledger = env
    start(hub, "mia")
    with launch_chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        sign_in(page, hub.url, "mia", "/user/mia/lab")
        page.locator('.jp-LauncherCard[data-category="Notebook"]').first.click(
            timeout=120_000)
        # Her idle limit, were her use not counted, is past by then: the server started,
        # and her page opened, before this.
        limit = time.monotonic() + SERVER_IDLE
        wanted = None
        # Run a cell every few seconds until the service has swept twice past that
        # limit (the event that shows it looked): the user's traffic goes through the
        # proxy and counts, as real use must.
        while wanted is None or service.sweeps() < wanted:
            cell = time.monotonic()
            page.locator(".jp-Notebook .jp-Cell .cm-content").last.click(timeout=60_000)
            page.keyboard.type("1 + 1")
            page.keyboard.press("Shift+Enter")
            # A person's pace: a cell every 3 s (3 min shipped), however long the
            # browser took to run the last one.
            time.sleep(max(0.0, 3 - (time.monotonic() - cell)))  # a user's pace
            assert hub.server_model("mia") is not None, service.log()
            if wanted is None and time.monotonic() >= limit:
                wanted = service.sweeps() + 3  # the sweep under way may have begun before
    assert hub.server_model("mia")["ready"]
    lease = ledger.leases.active_for_server("mia")
    # A server in use has no idle deadline: never warned of one. Its kernel may be,
    # where a busy machine held the browser past the kernel's warning lead (5 s here,
    # 5 min shipped): that warning is the kernel's, and the next cell withdraws it.
    server_warnings = [e.kind for e in ledger.warnings.events(lease.id)
                       if e.rule is not StopRule.KERNEL_IDLE]
    assert server_warnings == [], service.log()


def test_a_slice_doing_gpu_work_keeps_its_server_though_no_kernel_is_busy(env):
    hub, service, ledger = env
    start(hub, "gus")
    started = datetime.now(UTC)  # after the server's last request through the proxy
    lease = ledger.leases.active_for_server("gus")
    # A training script started from a terminal: a process on the slice, SMs busy.
    gpus(hub).set_processes(lease.mig_uuid, [(4242, 30000)])
    gpus(hub).set_sm_activity(lease.mig_uuid, 70)
    try:
        # Sweeps past its idle limit, with none of its kernels busy, left it running.
        service.swept(after=started + timedelta(seconds=SERVER_IDLE), times=3)
        assert hub.server_model("gus")["ready"], service.log()
        assert ledger.warnings.events(lease.id) == [], service.log()
        assert ledger.leases.get(lease.id).gpu_active_at is not None
        assert service.metric("mig_spawner_service_slices_gpu_working_total",
                              group="idle-test") > 0
    finally:
        gpus(hub).set_processes(lease.mig_uuid, [])
        gpus(hub).set_sm_activity(lease.mig_uuid, 0)
    hub.stop_server("gus")


def test_a_lease_stops_at_its_expires_at_across_a_hub_restart(env):
    hub, service, ledger = env
    start(hub, "cy")
    lease = ledger.leases.active_for_server("cy")
    assert lease.expires_at == lease.claimed_at + timedelta(seconds=MAX_AGE)
    hub.stop_hub()
    hub.restart_hub()
    # Move the deadline (as an extension does) to a time the hub knows nothing about:
    # the stop must follow the lease, not the hub's own record of when it started.
    deadline = datetime.now(UTC) + timedelta(seconds=8)
    end_lease_at(hub, lease.id, deadline)
    # The stop began (the hub shows it pending, or already done) by the first whole
    # sweep past the lease's deadline; how long the server then takes to exit depends
    # on the machine's load, not on the service. The slice was held until then.
    service.swept(after=deadline)
    assert hub.stopping("cy"), service.log()
    until(lambda: hub.server_model("cy") is None, 60, "cy's server stopped", show=service.log)
    until(lambda: ledger.leases.get(lease.id).state == "released", 15, "cy's lease released",
          show=service.log)
    assert ledger.leases.get(lease.id).released_at >= deadline
    assert service.counted("mig_spawner_service_culls_total", 1, kind="server",
                           reason="max_session_age", group="age-test") == 1
