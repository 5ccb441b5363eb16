"""The pending page and the form in words, in Chromium, on a real hub.

One hub on a simulated H200 cut into one large, one medium and two small slices; the
group may wait for any of them. hold holds the large slice, bea waits for it having
said what her server is for, and an admin's layout change holds the medium one:

* the medium size reads "Not free for a while: an admin is re-cutting its GPU — join
  the wait list" on cy's form, and cy's pending page says so when he waits for it;
* bea's pending page carries, in its headline, the link to the small size that is free
  (it read as plain text there, linked only in the collapsed event log); one click stops
  her wait and starts her server on a small slice, with the purpose she gave.
"""

from __future__ import annotations

import pytest

from mig_spawner.gpu import connect
from mig_spawner.ledger import Ledger
from tests.support.browser import sign_in
from tests.support.hub_harness import start_mig_hub
from tests.support.system_deps import require_chromium

pytestmark = [pytest.mark.hub, pytest.mark.browser]
playwright = pytest.importorskip("playwright.sync_api")

SIM = "h200x1:layout=3g.71gb,2g.35gb,1g.18gb*2"
EXTRA = """
c.Spawner.poll_interval = 1
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 1}  # POST answers 202 at once
c.MIGPolicyConfig.group_policies = {"crowd": {
    "allowed": ["small", "medium", "large"], "queue": True, "max_wait": "10m"}}
"""
SMALL = "\u201cSmall: 1 of 7 compute slices\u201d"
MEDIUM = "\u201cMedium: 2 of 7 compute slices\u201d"
LARGE = "\u201cLarge: 3 of 7 compute slices\u201d"
RECUT = "not free for a while: an admin is re-cutting its GPU"


def test_the_pending_page_links_the_free_size_and_says_maintenance(tmp_path, chromium):
    require_chromium()
    url = f"sqlite:///{tmp_path}/ledger.sqlite"
    hub = start_mig_hub(tmp_path, SIM, EXTRA + f"\nc.MIGSettings.ledger_url = {url!r}\n")
    try:
        hub.create_users(["hold", "bea", "cy"], groups=["crowd"])
        assert hub.spawn("hold", {"profile": "large"}).status_code in (201, 202)
        hub.wait_ready("hold", timeout=120)
        assert hub.spawn("bea", {"profile": "large", "purpose": "thesis: chapter 3"}
                         ).status_code == 202
        # An admin re-cuts the medium slice's memory slices (held from new servers).
        gpus = connect(simulate=SIM, state_file=str(tmp_path / "sim-gpus.json"))
        inventory = gpus.inventory()
        medium = next(d for d in inventory.mig_devices if d.profile == "2g.35gb")
        with Ledger.open(url) as ledger:
            ledger.holds.open_change(inventory.host, medium.gpu_uuid, medium.gpu_index,
                               {"layout": "test"}, [medium.start, medium.start + 1])

        cy = sign_in(chromium.new_context().new_page(), hub.url, "cy")
        cy.goto(f"{hub.url}/hub/spawn")
        choice = cy.locator(".mig-spawner .form-check", has_text="Medium: 2 of 7 compute slices")
        assert f"{RECUT[0].upper()}{RECUT[1:]} \u2014 join the wait list" in choice.inner_text()
        cy.locator('input[name="profile"][value="medium"]').check()
        cy.get_by_role("button", name="Start").click()
        headline = cy.locator("#mig-progress-headline")
        headline.get_by_text(f"1st in line for {MEDIUM}; {RECUT}").wait_for(timeout=30_000)

        bea = sign_in(chromium.new_context().new_page(), hub.url, "bea")
        bea.goto(f"{hub.url}/hub/spawn-pending/bea")
        headline = bea.locator("#mig-progress-headline")
        headline.get_by_text(f"1st in line for {LARGE}").wait_for(timeout=30_000)
        assert f"{SMALL} is free now" in headline.inner_text()
        link = headline.get_by_role("link", name="stop this wait and start with it instead")
        assert link.is_visible()  # in the headline, not only in the collapsed event log
        link.click()
        # The wait stopped, the spawn on the small size began: she lands in her server.
        bea.wait_for_url(f"{hub.url}/user/bea/**", timeout=120_000)
        hub.wait_ready("bea", timeout=60)
        with Ledger.open(url) as ledger:
            lease = ledger.leases.active_for_server("bea")
        assert (lease.profile, lease.purpose) == ("1g.18gb", "thesis: chapter 3")
    finally:
        hub.close()
