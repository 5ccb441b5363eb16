"""Why a choice cannot be picked, as the spawn page shows it in a real browser.

One hub on one simulated H200 with two 1g.18gb and one 2g.35gb (no 3g.71gb), and one
group per reason: "busy" finds both small slices held by other users' running servers
(and "queued", allowed to wait, is offered the wait list instead); "lab" is allowed a
size this host lacks, shown because ``show_unavailable_offers`` is on; "capped" has
its one-slice quota used by a member; and anyone's form, while the GPU cannot be read.
Each case reads its choice in Chromium: the reason shown, that no other reason is, and
whether the radio can be picked.
"""

from __future__ import annotations

import pytest

from mig_spawner.gpu.simulator import SimulatedHost
from tests.support.browser import sign_in
from tests.support.hub_harness import start_mig_hub
from tests.support.system_deps import require_chromium

pytestmark = [pytest.mark.hub, pytest.mark.browser]

playwright = pytest.importorskip("playwright.sync_api")

SIM = "h200x1:layout=1g.18gb*2,2g.35gb"
EXTRA = """
c.Spawner.poll_interval = 1
c.LocalMIGSpawner.show_unavailable_offers = True
c.MIGPolicyConfig.group_policies = {
    "busy": {"allowed": ["small"]},
    "queued": {"allowed": ["small"], "queue": True, "max_wait": "10m"},
    "lab": {"allowed": ["medium", "large"]},
    "capped": {"allowed": ["small", "medium"], "quota_slices": 1},
}
"""
#: One phrase per reason the form can give; each choice must show exactly its own.
REASONS = {
    "in_use": "all 2 in use right now",
    "wait_list": "join the wait list",
    "absent": "no such slice on this host (ask a hub admin)",
    "quota": "your group 'capped' holds 1 of its 1 slices",
    "unreadable": "cannot be checked right now",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    require_chromium()
    hub = start_mig_hub(tmp_path_factory.mktemp("reasonshub"), SIM, EXTRA)
    for user, group in [("bo", "busy"), ("bea", "busy"), ("quinn", "queued"),
                        ("lou", "lab"), ("cam", "capped"), ("cy", "capped")]:
        hub.create_user(user, groups=[group])
    # Both small slices held by running servers: one of "busy", one of "capped" (its quota).
    for holder in ("bea", "cy"):
        assert hub.spawn(holder, {"profile": "small"}).status_code in (201, 202)
    for holder in ("bea", "cy"):
        hub.wait_ready(holder)
    yield hub
    hub.close()


def read_form(chromium, hub, user: str) -> tuple[str, dict[str, tuple[str, bool]]]:
    """The form's alert text, and offer -> (its choice's visible text, can be picked)."""
    context = chromium.new_context()
    try:
        page = sign_in(context.new_page(), hub.url, user)
        page.goto(f"{hub.url}/hub/spawn")
        form = page.locator("#spawn_form")
        form.wait_for()
        alerts = " ".join(form.get_by_role("alert").all_inner_texts())
        choices = {}
        for block in form.locator(".form-check").all():
            radio = block.get_by_role("radio")
            choices[radio.get_attribute("value")] = (block.inner_text(), radio.is_enabled())
        return alerts, choices
    finally:
        context.close()


def shows_only(text: str, reason: str) -> None:
    assert REASONS[reason] in text, text
    others = [r for key, r in REASONS.items() if key != reason and r in text]
    assert not others, (reason, others, text)


@pytest.mark.parametrize(
    ("user", "offer", "reason", "selectable"),
    [
        ("bo", "small", "in_use", False),
        ("quinn", "small", "wait_list", True),  # the same exhaustion, for a group that waits
        ("lou", "large", "absent", False),
        ("cam", "medium", "quota", False),  # one 2g.35gb is free: the quota is the reason
    ],
)
def test_each_unavailable_choice_says_why(chromium, hub, user, offer, reason, selectable):
    alerts, choices = read_form(chromium, hub, user)
    text, enabled = choices[offer]
    shows_only(text, reason)
    assert enabled is selectable
    assert ("Unavailable: " in text) is not selectable
    assert "free now" not in text
    assert not alerts  # nothing wrong with the hub itself


def test_an_available_choice_beside_them_keeps_its_free_count(chromium, hub):
    _, choices = read_form(chromium, hub, "lou")
    text, enabled = choices["medium"]
    assert enabled and "1 free now" in text and "Unavailable" not in text


def test_while_the_gpu_cannot_be_read_nothing_can_be_picked(chromium, hub):
    sim = SimulatedHost.from_spec(SIM, hub.workdir / "sim-gpus.json")
    # Unreadable until cleared, so that no other reader can use up the fault first.
    sim.inject_error("nvmlDeviceGetCount_v2", "GPU_IS_LOST", count=1000)
    try:
        alerts, choices = read_form(chromium, hub, "lou")
    finally:
        sim.clear_errors()
    assert "The GPU inventory cannot be read right now. Try again in a minute" in alerts
    assert "GPU is lost" not in alerts  # the driver's words are for the hub log
    assert set(choices) == {"medium", "large"}
    for text, enabled in choices.values():
        shows_only(text, "unreadable")
        assert not enabled
    # Readable again: the next load shows the real state.
    alerts, choices = read_form(chromium, hub, "lou")
    assert not alerts and choices["medium"][1]
