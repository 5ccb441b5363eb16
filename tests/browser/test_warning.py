"""The warning before a stop, as a user sees it in headless Chromium: a JupyterLab
notification and a notice on the hub's home page, each with "Keep my server".

A real hub + proxy + jupyter_server with JupyterLab, the slice service sweeping every
second, limits shortened keeping the shipped ratio of ``warn_before`` (10 min) to a
30 min limit: warned a third of the limit before the stop. Screenshots go to
docs/img for the analyst guide.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

import pytest
import requests

from mig_spawner.ledger import Ledger
from tests.support.browser import sign_in
from tests.support.hub_harness import REPO, start_mig_hub
from tests.support.slice_service import SERVICE_CONFIG, Service, wait_for
from tests.support.system_deps import CHROMIUM, CHROMIUM_ARGS, require_chromium

pytestmark = [pytest.mark.hub, pytest.mark.browser]
playwright = pytest.importorskip("playwright.sync_api")

SIM = "h200x1:layout=1g.18gb*7"
IMG = REPO / "docs" / "img"
MAX_AGE, AGE_WARN, EXTEND = 60, 20, 30
IDLE, IDLE_WARN = 30, 10
CONFIG = f"""
c.JupyterHub.last_activity_interval = 5
c.Spawner.environment = {{"JUPYTERHUB_ACTIVITY_INTERVAL": "5", "MIG_SPAWNER_NOTICE_POLL": "2"}}
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.MIGPolicyConfig.group_policies.update({{
    "age-warn": {{"allowed": ["small"], "max_session_age": {MAX_AGE},
                  "warn_before": {AGE_WARN}, "extend_by": {EXTEND}, "max_extensions": 1}},
    "idle-warn": {{"allowed": ["small"], "server_idle_timeout": {IDLE},
                   "warn_before": {IDLE_WARN}}},
}})
{SERVICE_CONFIG}c.SliceServiceApp.cull_every = 1
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require_chromium()
    workdir = tmp_path_factory.mktemp("warnhub")
    hub = start_mig_hub(workdir, SIM, CONFIG)
    hub.create_user("lena", groups=["age-warn"])
    hub.create_user("hana", groups=["idle-warn"])
    service = Service(hub, hub.config_path)
    wait_for(lambda: service.up(), 30, "service up", service)
    with Ledger(f"sqlite:///{workdir}/mig_spawner_ledger.sqlite") as ledger, \
            playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield hub, service, ledger, browser
        browser.close()
    service.close()
    hub.close()


def login(browser, hub, user: str, next_url: str):
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    return sign_in(page, hub.url, user, next_url)


def seconds_until(when: datetime) -> float:
    return (when - datetime.now(UTC)).total_seconds()


def test_jupyterlab_notification_keep_extends_then_says_why_not_then_stops(env):
    hub, service, ledger, browser = env
    assert hub.spawn("lena", {"profile": "small"}).status_code in (201, 202)
    hub.wait_ready("lena", timeout=120)
    lease = ledger.active_for_server("lena")
    original = lease.expires_at
    page = login(browser, hub, "lena", "/user/lena/lab")
    page.locator(".jp-LauncherCard").first.wait_for(timeout=120_000)

    toast = page.locator(".Toastify__toast", has_text="longest session")
    toast.wait_for(timeout=(MAX_AGE + 10) * 1000)
    assert re.search(r"stops in about (\d+s|1m)", toast.inner_text()), toast.inner_text()
    page.wait_for_timeout(1000)  # the toast slides in
    page.screenshot(path=str(IMG / "warning-jupyterlab.png"))
    toast.get_by_role("button", name="Keep my server").click()
    page.locator(".Toastify__toast", has_text="Extended by 30s").wait_for(timeout=20_000)
    extended = ledger.get(lease.id).expires_at
    assert (extended - original).total_seconds() == EXTEND

    # Outlives the original deadline.
    time.sleep(max(0.0, seconds_until(original)) + 3)
    assert hub.server_model("lena")["ready"], service.log()

    # Warned again before the new deadline: no extension left, and it says so.
    again = page.locator(".Toastify__toast", has_text="No more extensions")
    again.wait_for(timeout=(EXTEND + 10) * 1000)
    again.get_by_role("button", name="Keep my server").click()
    page.locator(".Toastify__toast", has_text="already extended 1 time").wait_for(
        timeout=20_000)
    page.wait_for_timeout(1000)
    page.screenshot(path=str(IMG / "warning-jupyterlab-no-more.png"))

    # Without another way out, it stops at the (extended) deadline, within a sweep.
    wait_for(lambda: hub.server_model("lena") is None, seconds_until(extended) + 20,
             "lena's server stopped at its deadline", service)
    assert -2 <= -seconds_until(extended) <= 8
    page.close()
    kinds = [e.kind for e in ledger.events(lease.id)]
    assert kinds == ["warned", "extended", "warned", "refused"], kinds
    assert service.metric("mig_spawner_service_warnings_total", reason="max_session_age",
                          group="age-warn") == 2


def test_hub_home_notice_keeps_an_idle_server(env):
    hub, service, ledger, browser = env
    assert hub.spawn("hana", {"profile": "small"}).status_code in (201, 202)
    hub.wait_ready("hana", timeout=120)
    wait_for(lambda: (ledger.active_for_server("hana").warning or "") == "server_idle",
             IDLE + 10, "hana warned", service)
    deadline = ledger.active_for_server("hana").warning_deadline
    page = login(browser, hub, "hana", "/hub/home")
    page.goto(f"{hub.url}/hub/home")
    notice = page.locator(".mig-warning")
    notice.wait_for(timeout=15_000)
    assert "has not been used" in notice.inner_text()
    assert "Keep my server" in notice.inner_text()
    page.screenshot(path=str(IMG / "warning-hub-home.png"))
    notice.get_by_role("button", name="Keep my server").click()
    page.locator(".mig-warning", has_text="Kept").wait_for(timeout=15_000)
    time.sleep(max(0.0, seconds_until(deadline)) + 4)
    assert hub.server_model("hana")["ready"], service.log()
    page.close()


def test_only_a_user_sees_and_keeps_their_own_servers(env):
    hub, _, _, _ = env
    lena = {"Authorization": f"token {hub.user_token('lena')}"}
    api = f"{hub.url}/hub/api/mig-spawner"
    # lena has no server now (hana's, warned, may still run): she sees nothing, and
    # Keep names a server of her own only.
    assert hub.server_model("lena") is None
    assert requests.get(f"{api}/warnings", headers=lena, timeout=10).json() == {"warnings": []}
    assert requests.post(f"{api}/keep/", headers=lena, json={}, timeout=10).status_code == 404
    # A service (here the test's admin) is no user: refused, whatever its scopes.
    assert hub.session.get(f"{api}/warnings", timeout=10).status_code == 403
