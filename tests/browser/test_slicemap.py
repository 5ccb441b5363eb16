"""The admin slice map in a real browser, behind a real hub's OAuth and a custom scope.

A real JupyterHub runs the real slice service as the shipped
``jupyterhub_config.d/30-slice-service.py`` defines it (its custom scope, OAuth client
and viewer role), over a simulated 2x H200 and a SQLite ledger with leases in every
state. An admin (group ``admins``) logs in and sees each GPU as its memory slices with
the instances laid on them; the page redraws itself when a slice changes; a user
without the scope gets 403. Takes the map's screenshot (slice-map.png), and
one of a GPU being re-cut (a layout change draining it, slice-map-drain.png): docs/img with
MIG_SPAWNER_SCREENSHOTS=docs (tests/support/browser.py).
"""

from __future__ import annotations

import socket
import textwrap
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import pytest
import requests

from mig_spawner.core.layout import PlanState, parse_spec, plan_layout
from mig_spawner.gpu import connect
from mig_spawner.gpu.simulator import SimulatedHost
from mig_spawner.layout import LayoutApplier, begin, end_change, holders_of
from mig_spawner.ledger import Ledger
from mig_spawner.observe.slicemap import SLICEMAP_SCOPE
from mig_spawner.service.handlers import METRICS_SCOPE
from tests.support.browser import launch_chromium, screenshot_path
from tests.support.hub_harness import ADMIN_SERVICE, REPO, HubProcess, free_port
from tests.support.observe_world import POLICY, make_world
from tests.support.polling import until
from tests.support.system_deps import require_chromium

pytestmark = [pytest.mark.hub, pytest.mark.browser]

playwright = pytest.importorskip("playwright.sync_api")

SERVICE = "mig-slices"
SNIPPET = REPO / "jupyterhub_config.d" / "30-slice-service.py"
# As the page's own refresh does it: a script fetch needs the XSRF token the page carries.
FETCH_JSON = "fetch('slices.json', {headers: {'X-XSRFToken': XSRF}}).then(r => r.json())"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_chromium()
    workdir = tmp_path_factory.mktemp("slicemap")
    world = make_world(workdir)
    # Leases with real times, since the service measures ages against its own clock.
    world.clock.now = datetime.now(UTC) - timedelta(hours=2, minutes=5)
    big = world.device(0, "3g.71gb")
    world.lease("ada", "research", big, server="llm")
    world.sim.set_processes(big.uuid, [(4242, 52_000)])
    world.lease("bob", "analysts", world.device(1, "1g.18gb"))
    world.clock.now = datetime.now(UTC) - timedelta(minutes=50)
    world.lease("cy", "analysts", world.device(0, "2g.35gb"))
    world.ledger.usage.touch(world.leases["ada"].id, datetime.now(UTC) - timedelta(minutes=1))
    world.ledger.usage.touch(world.leases["cy"].id, datetime.now(UTC) - timedelta(minutes=3))
    world.sim.set_processes(world.device(1, "2g.35gb").uuid, [(9999, 1024)])  # no lease
    ledger_url = world.ledger.url
    state_file = world.state_file
    world.close()

    extra = textwrap.dedent(f"""
        c.MIGPolicyConfig.group_policies = {POLICY!r}
        c.MIGSettings.ledger_url = {ledger_url!r}
        c.MIGSettings.sim_state_file = {state_file!r}
        c.SliceServiceApp.slice_idle_after = "20m"
        c.SliceServiceApp.slicemap_refresh = 1
        c.SliceServiceApp.release_orphans = False  # no hub servers for these leases
        c.SliceServiceApp.apply_layouts = False  # the test steps its layout change itself
        # The hub templates, as the shipped 10-spawner.py adds them (the 403 page).
        from mig_spawner.spawner.warnings import configure_hub
        configure_hub(c)
        c.JupyterHub.load_groups = {{"admins": {{"users": ["boss"]}}}}
        # The harness's own token may read the metrics (private by default).
        c.JupyterHub.load_roles.append({{"name": "metrics-readers",
            "scopes": ["{METRICS_SCOPE}"], "services": ["{ADMIN_SERVICE}"]}})
        # ann may reach the service, but lacks the slice map scope.
        c.JupyterHub.load_roles.append({{
            "name": "mig-slicemap-visitors",
            "scopes": ["access:services!service={SERVICE}"],
            "users": ["ann"],
        }})
        from mig_spawner.cli.demo import point_service
        point_service(c, "{SERVICE}", "http://127.0.0.1:{free_port()}", __file__)
    """)
    hub = HubProcess.start(workdir, [SNIPPET], extra, timeout=120)
    url = f"{hub.url}/services/{SERVICE}/slices"
    until(lambda: _reachable(url), 30, "the slice map up", show=hub.log_path)
    yield hub, url, state_file, ledger_url
    hub.close()


def _reachable(url: str) -> bool:
    try:
        return requests.get(url, timeout=2, allow_redirects=False).status_code in (302, 403)
    except requests.ConnectionError:
        return False


def open_as(browser, hub_url: str, url: str, name: str):
    """Log in to the hub as ``name`` (any password: dummy authenticator) on the way to
    ``url``; returns the page and the response of the final navigation."""
    page = browser.new_context(viewport={"width": 1500, "height": 900}).new_page()
    page.goto(f"{hub_url}/hub/login?next={quote(url)}")
    page.get_by_label("Username").fill(name)
    page.get_by_label("Password").fill("any password")
    with page.expect_navigation(url=lambda u: u.startswith(url)) as navigation:
        page.get_by_role("button", name="Sign in").click()
    return page, navigation.value


def test_admin_sees_every_slice_and_the_map_follows_changes(setup):
    hub, url, state_file, ledger_url = setup
    with launch_chromium() as browser:
        page, _ = open_as(browser, hub.url, url, "boss")  # login, OAuth, then the map
        page.locator("section.gpu").first.wait_for(timeout=30_000)
        assert page.locator("section.gpu").count() == 2
        states = {
            (b.get_attribute("data-state"), b.get_attribute("data-user"))
            for b in page.locator(".slice").all()
        }
        assert ("leased", "ada") in states and ("leased", "cy") in states
        assert ("idle", "bob") in states  # 2 h without activity, idle after 20 min
        assert ("orphan", "") in states  # processes but no lease
        ada = page.locator('.slice[data-user="ada"]')
        text = ada.inner_text()
        assert "3g.71gb" in text and "ada/llm" in text and "group research" in text
        assert "age 2h 0" in text and "idle 1m" in text and "1 proc" in text
        assert "research" in page.locator("#groups").inner_text()
        page.screenshot(path=str(screenshot_path("slice-map.png")), full_page=True)

        # A stray process appears on a free slice: the page redraws it as an orphan.
        free = page.locator('section.gpu[data-gpu="0"] .slice[data-state="free"]')
        assert free.count() == 2
        data = page.evaluate(FETCH_JSON)
        stray = next(s["mig_uuid"] for s in data["gpus"][0]["slices"] if s["state"] == "free")
        SimulatedHost.open(state_file).set_processes(stray, [(31337, 2048)])
        page.wait_for_function(
            "n => document.querySelectorAll("
            "'section.gpu .slice[data-state=\"orphan\"]').length === n", arg=2,
            timeout=15_000)
        assert free.count() == 1

        table = page.context.new_page()  # same cookies: no second OAuth round trip
        table.goto(url + "/table")
        rows = table.locator("#slices tbody tr")
        assert rows.count() == 8
        assert "ada/llm" in table.locator("#slices").inner_text()
        data = page.evaluate(FETCH_JSON)
        assert data["counts"]["orphan"] == 2 and len(data["gpus"]) == 2

        # An admin re-cuts GPU 1 (docs/layout.md): one pass of the change drains it.
        with Ledger.open(ledger_url) as ledger:
            recut_gpu_1(ledger, state_file)
            change = page.locator('section.gpu[data-gpu="1"] .change')
            change.wait_for(timeout=15_000)
            assert "being re-cut (draining): waits for bob" in change.inner_text()
            gpu1 = page.locator('section.gpu[data-gpu="1"]')
            assert gpu1.get_by_text("being re-cut", exact=True).count() >= 1
            page.screenshot(path=str(screenshot_path("slice-map-drain.png")), full_page=True)
            for opened in ledger.holds.changes():
                end_change(ledger, opened, PlanState.FAILED, "the test ends it")


def recut_gpu_1(ledger: Ledger, state_file: str) -> None:
    """Begin re-cutting GPU 1 to a 4g.71gb and three 1g.18gb and take one step, as the
    slice service would: the free instances are re-cut, bob (who holds a 1g.18gb where
    the 4g.71gb goes) is warned, and the 4g.71gb waits for him and a stray process."""
    gpus = connect(state_file=state_file)
    try:
        inventory = gpus.inventory()
        target = parse_spec("1=4g.71gb,1g.18gb*3")
        begin(ledger, inventory.host,
              plan_layout(inventory, target, holders_of(ledger.leases.active())), target)
        LayoutApplier(ledger, gpus, lambda group: 3600.0).step()
    finally:
        gpus.close()


def test_user_without_the_scope_is_refused(setup):
    hub, url, *_ = setup
    with launch_chromium() as browser:
        page, response = open_as(browser, hub.url, url, "ann")
        assert response.status == 403
        assert SLICEMAP_SCOPE in page.inner_text("body")
        assert page.locator("section.gpu").count() == 0
        json_response = page.goto(url + ".json")
        assert json_response is not None and json_response.status == 403


def test_user_the_hub_refuses_at_the_oauth_step_hears_which_scope_to_ask_for(setup):
    """zed lacks even access:services for the service: the hub's own 403 (at the OAuth
    step), which names the scope and who to ask, and shows nothing of the map."""
    hub, url, *_ = setup
    with launch_chromium() as browser:
        page = browser.new_page()
        page.goto(f"{hub.url}/hub/login?next={quote(url)}")
        page.get_by_label("Username").fill("zed")
        page.get_by_label("Password").fill("any password")
        with page.expect_navigation(url=lambda u: "oauth2/authorize" in u) as navigation:
            page.get_by_role("button", name="Sign in").click()
        assert navigation.value.status == 403
        text = page.inner_text("body")
        assert SLICEMAP_SCOPE in text and "Ask a hub admin" in text
        assert page.locator("section.gpu").count() == 0
        # Any other 403 of the hub stays the hub's own page.
        other = page.goto(f"{hub.url}/hub/admin")
        assert other is not None and other.status == 403
        assert SLICEMAP_SCOPE not in page.inner_text("body")


def test_no_token_no_map(setup):
    _, url, *_ = setup
    r = requests.get(url + ".json", timeout=10, allow_redirects=False)
    assert r.status_code == 302 and "oauth2/authorize" in r.headers["Location"]


def test_the_live_service_exports_the_slice_metrics(setup):
    hub, url, *_ = setup
    text = hub.session.get(url.replace("/slices", "/metrics"), timeout=10).text
    host = socket.gethostname()  # the adapter names the host as the machine does
    assert (f'mig_spawner_slices{{gpu="1",host="{host}",profile="1g.18gb",state="idle"}} 1.0'
            in text)
    assert 'mig_spawner_lease_age_seconds{' in text and 'user="ada"' in text
    assert "mig_spawner_slice_collector_up 1.0" in text


def test_a_kubernetes_hubs_map_draws_the_slices_the_cluster_reports_unhealthy(chromium):
    """The page of a Kubernetes hub's service (no GPUs of its own), drawn from its JSON:
    the node's unhealthy profile in the fault colour, with what the device plugin did."""
    from mig_spawner.kube.cluster import ClusterSlices, NodeSlices
    from mig_spawner.observe.slice_state import SLICE_STATES, slice_map
    from mig_spawner.observe.slicemap import _LOADER, _script_json, slicemap_json
    from mig_spawner.observe.source import NO_GPUS

    node = NodeSlices("a1", "a100-80gb", "NVIDIA-A100-SXM4-80GB", "mixed",
                      {"3g.40gb": 0, "1g.10gb": 7}, {}, unhealthy={"3g.40gb": 2})
    data = slicemap_json(slice_map(NO_GPUS, [], datetime.now(UTC)), ClusterSlices((node,)))
    page = chromium.new_page()
    try:
        page.set_content(_LOADER.load("slicemap.html").generate(
            data_json=_script_json(data), refresh=3600, user=None, json_url="slices.json",
            table_url="slices/table", states=SLICE_STATES, xsrf="").decode())
        faulty = page.locator("#nodes tr.faulty")
        playwright.expect(faulty.first).to_contain_text("3g.40gb")
        assert "the device plugin left them out of allocatable" in faulty.last.inner_text()
        assert page.locator("#nodes tbody tr:not(.faulty)").inner_text().split("\t")[2] == "1g.10gb"
        colour = faulty.first.locator("td").first.evaluate(
            "td => getComputedStyle(td).backgroundColor")
        assert colour == "rgb(233, 220, 247)"  # --faulty, as a faulty slice's
    finally:
        page.close()
