"""An analyst's path through the spawn page in a real browser (headless Chromium).

Log in, see only the slices one's groups allow with what is free now and an
exhausted one disabled, pick one with the keyboard, watch the progress, land in the
server. Takes the form's screenshot for the docs (spawn-form.png; docs/img with
MIG_SPAWNER_SCREENSHOTS=docs).
"""

from __future__ import annotations

import re

import pytest

from tests.support.browser import launch_chromium, screenshot_path, sign_in
from tests.support.hub_harness import PAUSE_BEFORE_SPAWN, REPO, start_mig_hub
from tests.support.system_deps import require_chromium

pytestmark = [pytest.mark.hub, pytest.mark.browser]

playwright = pytest.importorskip("playwright.sync_api")

# The demo's mixed 2 x H200: two 2g.35gb, one 3g.71gb, one 1g.35gb, six 1g.18gb; and a
# third H200 with MIG off, offered whole to the group of jupyterhub_config.d/25-whole-gpus.py.
SIM = ("h200x1:layout=1g.18gb*4,2g.35gb,1g.35gb+h200x1:layout=3g.71gb,2g.35gb,1g.18gb*2"
       "+h200x1:mig=off")
WHOLE_GPUS = (REPO / "jupyterhub_config.d" / "25-whole-gpus.py").read_text()
# Each text the pending page's headline takes, recorded from before the hub's script runs.
RECORD_HEADLINES = """
window.migHeadlines = [];
document.addEventListener("DOMContentLoaded", () => {
  const headline = document.getElementById("mig-progress-headline");
  if (!headline) return;
  window.migHeadlines.push(headline.textContent);
  new MutationObserver(() => window.migHeadlines.push(headline.textContent))
    .observe(headline, {childList: true, characterData: true, subtree: true});
});
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    require_chromium()
    workdir = tmp_path_factory.mktemp("browserhub")
    # A start waits after its claim while the file "pause" exists (a slow start).
    hub = start_mig_hub(workdir, SIM, 'c.Spawner.default_url = "/tree"\n' + PAUSE_BEFORE_SPAWN
                        + WHOLE_GPUS)
    hub.create_user("mia", groups=["ml-team"])
    hub.create_user("max", groups=["ml-team"])
    hub.create_user("ana", groups=["analysts"])
    hub.create_user("gia", groups=["gpu-users"])
    yield hub
    hub.close()


def test_analyst_picks_a_slice_and_lands_in_the_server(hub):
    # A colleague holds the only 3g.71gb, so "large" must show as unavailable.
    assert hub.spawn("max", {"profile": "large"}).status_code in (201, 202)
    hub.wait_ready("max")
    with launch_chromium() as browser:
        page = browser.new_page(viewport={"width": 900, "height": 1000})
        sign_in(page, hub.url, "mia")
        page.goto(f"{hub.url}/hub/spawn")

        radios = page.get_by_role("radio")
        labels = [radios.nth(i).get_attribute("value") for i in range(radios.count())]
        assert labels == ["medium", "large", "1g.35gb"]  # ml-team's offers, nothing else
        medium = page.get_by_role("radio", name=re.compile("Medium"))
        large = page.get_by_role("radio", name=re.compile("Large"))
        assert medium.is_enabled() and medium.is_checked()
        assert large.is_disabled()
        text = page.locator("#spawn_form").inner_text()
        assert "2 free now" in text and "the only one is in use right now" in text
        assert "2/7 of the GPU's compute" in text
        page.locator("#spawn_form").screenshot(path=str(screenshot_path("spawn-form.png")))

        # Keyboard only: move to the next enabled choice, then submit with Enter.
        medium.focus()
        page.keyboard.press("ArrowDown")  # skips the disabled "large"
        memory_heavy = page.get_by_role("radio", name=re.compile("Memory-heavy"))
        assert memory_heavy.is_checked()
        page.keyboard.press("Enter")

        page.wait_for_url(re.compile(r"/hub/spawn-pending/mia"), timeout=30_000)
        log = page.locator("#progress-log")
        log.locator("text=/Reserved 1g.35gb .*GiB.* on GPU/").wait_for(
            state="attached", timeout=60_000
        )
        page.wait_for_url(re.compile(r"/user/mia/tree"), timeout=120_000)
    model = hub.server_model("mia")
    assert model is not None and model["ready"]
    assert model["user_options"] == {"profile": "1g.35gb"}


def test_the_pending_page_headline_follows_the_steps(hub):
    pause = hub.workdir / "pause"
    pause.touch()  # the start stops after its claim, as a slow device preparation would
    with launch_chromium() as browser:
        try:
            page = browser.new_page(viewport={"width": 900, "height": 600})
            page.add_init_script(RECORD_HEADLINES)
            page.goto(f"{hub.url}/hub/login")
            page.get_by_label("Username").fill("ana")
            page.get_by_label("Password").fill("any password")
            page.get_by_role("button", name="Sign in").click()
            page.goto(f"{hub.url}/hub/spawn")
            page.get_by_role("radio", name=re.compile("Small")).check()
            page.get_by_role("button", name="Start").click()

            page.wait_for_url(re.compile(r"/hub/spawn-pending/ana"), timeout=30_000)
            headline = page.locator("#mig-progress-headline")
            reserved = re.compile(r"^Reserved 1g\.18gb \(\d+\.\d GiB\) on GPU \d \(NVIDIA H200")
            page.wait_for_function(
                "() => /^Reserved /.test("
                "document.getElementById('mig-progress-headline').textContent)",
                timeout=60_000,
            )
            assert reserved.match(headline.inner_text()), headline.inner_text()
            seen = [t.strip() for t in page.evaluate("window.migHeadlines")]
            assert seen[0] == "Your server is starting up."
            # The hub's own "Server requested" first, then each of the spawner's steps.
            steps = list(dict.fromkeys(seen[1:]))
            assert steps[-2] == "Reserving \u201cSmall: 1 of 7 compute slices\u201d", seen
            assert reserved.match(steps[-1]), seen
            assert page.locator("#progress-message").is_hidden()  # no second copy
            page.locator("main, #main, body").first.screenshot(
                path=str(screenshot_path("spawn-pending.png")))

            pause.unlink()
            page.wait_for_url(re.compile(r"/user/ana/tree"), timeout=120_000)
        finally:
            pause.unlink(missing_ok=True)
    hub.stop_server("ana")


def test_a_group_allowed_a_whole_gpu_sees_and_gets_one_beside_the_slices(hub):
    """On a host with GPUs in MIG mode and one with MIG off, the whole GPU is a choice
    of its own for its group, and the server gets it (docs/policies.md, "Whole GPUs")."""
    with launch_chromium() as browser:
        page = browser.new_page(viewport={"width": 900, "height": 800})
        sign_in(page, hub.url, "gia")
        page.goto(f"{hub.url}/hub/spawn")
        whole = page.get_by_role("radio", name=re.compile("Whole GPU"))
        assert page.get_by_role("radio").count() == 1
        assert whole.is_enabled() and whole.is_checked()
        text = page.locator("#spawn_form").inner_text()
        assert "1 free now" in text and "7/7 of the GPU's compute" in text
        assert "140.4 GiB" in text
        page.get_by_role("button", name="Start").click()
        page.wait_for_url(re.compile(r"/hub/spawn-pending/gia"), timeout=30_000)
        page.locator("#progress-log").locator(
            "text=/Reserved a whole GPU .*GiB.* on GPU 2/").wait_for(
            state="attached", timeout=60_000)
        page.wait_for_url(re.compile(r"/user/gia/tree"), timeout=120_000)
    model = hub.server_model("gia")
    assert model is not None and model["ready"]
    assert model["user_options"] == {"profile": "gpu"}
    hub.stop_server("gia")
