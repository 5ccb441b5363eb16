"""A purpose for every slice, the right-sizing hint and admin starts, in Chromium.

One real hub (shipped snippets, the slice service with its map) on a simulated H200
with two small, one medium and one large slice, shared by every case:

* a student says on the spawn form what her server is for; the admin's slice map shows
  it beside her slice;
* a student whose past sessions on *medium* (seeded in the ledger with usage samples)
  peaked at 9 GiB is told on the form that *small* would do; a user with nothing to
  choose finds Start turned off;
* an admin's "Start Server" on /hub/admin starts a student's server on the group's
  ``default_offer``; a group without one is refused with the missing choice named, on
  the admin page too, and without a traceback in the hub's log.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import pytest
import requests

from mig_spawner.ledger import Ledger
from tests.support.browser import sign_in
from tests.support.hub_harness import MIG_SNIPPETS, REPO, HubProcess, free_port, simulated_spawner
from tests.support.polling import until
from tests.support.system_deps import require_chromium
from tests.support.usage import seed_sessions

pytestmark = [pytest.mark.hub, pytest.mark.browser]

playwright = pytest.importorskip("playwright.sync_api")

SIM = "h200x1:layout=1g.18gb*2,2g.35gb,3g.71gb"
SERVICE = "mig-slices"
SNIPPET = REPO / "jupyterhub_config.d" / "30-slice-service.py"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    require_chromium()
    workdir = tmp_path_factory.mktemp("purposehub")
    ledger_url = f"sqlite:///{workdir}/ledger.sqlite"
    extra = textwrap.dedent(f"""
        c.Spawner.poll_interval = 1
        c.MIGPolicyConfig.group_policies = {{
            "students": {{"allowed": ["small", "medium"], "default_offer": "small",
                          "purpose_choices": ["course exercises", "thesis"]}},
            "guests": {{"allowed": ["medium"]}},
            "admins": {{"allowed": ["large"]}},
        }}
        c.MIGSettings.ledger_url = {ledger_url!r}
        c.Authenticator.admin_users = {{"boss"}}
        c.JupyterHub.load_groups = {{"admins": {{"users": ["boss"]}}}}
        c.SliceServiceApp.release_orphans = False
        c.SliceServiceApp.slicemap_refresh = 1
        from mig_spawner.cli.demo import point_service
        point_service(c, "{SERVICE}", "http://127.0.0.1:{free_port()}", __file__)
    """)
    hub = HubProcess.start(workdir, [*MIG_SNIPPETS, SNIPPET],
                           simulated_spawner(workdir, SIM) + extra, timeout=120)
    for user, groups in [("ann", ["students"]), ("bea", ["students"]), ("cam", ["students"]),
                         ("gil", ["guests"]), ("zed", [])]:
        hub.create_user(user, groups=groups)
    # bea's last three sessions on medium, two days ago, each sampled 20 times.
    with Ledger.open(ledger_url) as ledger:
        seed_sessions(ledger, lambda: None, "bea", "students", "2g.35gb", 0, [9, 7, 8],
                      host="elsewhere", now=lambda: datetime.now(UTC) - timedelta(days=2))
    hub.ledger_url = ledger_url
    yield hub
    hub.close()


@contextlib.contextmanager
def signed_in(chromium, hub, user: str, next_url: str = "") -> Iterator:
    """A page of a fresh browser context with ``user`` signed in; closed afterwards."""
    context = chromium.new_context(viewport={"width": 1500, "height": 900})
    try:
        yield sign_in(context.new_page(), hub.url, user, next_url)
    finally:
        context.close()


def lease_of(hub, user: str):
    with Ledger.open(hub.ledger_url) as ledger:
        return ledger.leases.active_for_server(user)


def test_the_purpose_is_asked_and_shown_on_the_slice_map(chromium, hub):
    with signed_in(chromium, hub, "ann") as page:
        page.goto(f"{hub.url}/hub/spawn")
        page.get_by_label("What is this server for?").fill("thesis")
        page.locator('input[name="profile"][value="small"]').check()
        page.get_by_role("button", name="Start").click()
        hub.wait_ready("ann", timeout=90)
    assert lease_of(hub, "ann").purpose == "thesis"

    url = f"{hub.url}/services/{SERVICE}/slices"
    until(lambda: _reachable(url), 30, "the slice map up", show=hub.log_path)
    with signed_in(chromium, hub, "boss", next_url=quote(url)) as page:
        slice_ = page.locator('.slice[data-user="ann"]')
        slice_.wait_for(timeout=30_000)
        assert "for: thesis" in slice_.inner_text()


def _reachable(url: str) -> bool:
    try:
        return requests.get(url, timeout=2, allow_redirects=False).status_code in (302, 403)
    except requests.ConnectionError:
        return False


def test_a_returning_user_is_told_a_smaller_size_would_do(chromium, hub):
    with signed_in(chromium, hub, "bea") as page:
        page.goto(f"{hub.url}/hub/spawn")
        hint = page.locator(".mig-rightsize")
        assert hint.inner_text() == (
            "Your last 3 sessions on \u201cMedium: 2 of 7 compute slices\u201d peaked at "
            "9.0 GiB: \u201cSmall: 1 of 7 compute slices\u201d (16.0 GiB) would do.")
        assert page.locator("#spawn_form [type=submit]").is_enabled()
    # Someone with nothing to choose: Start is off, and the form says why.
    with signed_in(chromium, hub, "zed") as page:
        page.goto(f"{hub.url}/hub/spawn")
        assert "not allowed any GPU slice" in page.locator("#spawn_form").inner_text()
        assert page.locator("#spawn_form [type=submit]").is_disabled()


def test_an_admins_start_server_gets_the_groups_default_offer(chromium, hub):
    with signed_in(chromium, hub, "boss", next_url="/hub/admin") as page:
        row = page.get_by_role("row").filter(has_text="cam")
        row.get_by_role("button", name="Start Server").click()
        hub.wait_ready("cam", timeout=90)
    assert lease_of(hub, "cam").profile == "1g.18gb"  # students' default: small
    # A group without a default: the same start is refused, and the admin page says why
    # (JupyterHub's own alert says only "Failed to start server."), the missing choice
    # named; the hub logs it in one line, as the refusal it is, with no traceback.
    with signed_in(chromium, hub, "boss", next_url="/hub/admin") as page:
        row = page.get_by_role("row").filter(has_text="gil")
        row.get_by_role("button", name="Start Server").click()
        reason = page.locator(".mig-admin-refusal")
        reason.wait_for(timeout=30_000)
        assert reason.inner_text().startswith(
            "Could not start gil's server: no GPU slice size was chosen")
        assert "default_offer" in reason.inner_text()
    log = hub.log_tail(10**7)
    assert "Not starting gil's server" in log
    assert "Exception applying user_options" not in log and "Traceback" not in log
    refused = hub.spawn("gil")
    assert refused.status_code == 400
    message = refused.json()["message"]
    assert '"Start Server" and "Start All" on the admin page send none' in message
    assert '"Spawn Page"' in message and "default_offer" in message
