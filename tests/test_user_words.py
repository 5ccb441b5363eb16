"""What a user reads, in-process: sizes by the names the form's headings give them, the
pending page's headline with its "free instead" link (the purpose kept), an admin's
re-cut said as maintenance, and no "Keep my server" where Keep can only refuse.

The same in Chromium, on a real hub: tests/browser/test_waiting_words.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest

from mig_spawner.core.catalog import model
from mig_spawner.core.policy import build_policy
from mig_spawner.core.refusal import Refused
from mig_spawner.ledger import Grant, LeaseRequest, Ledger
from mig_spawner.spawner import LocalMIGSpawner, form, waiting
from mig_spawner.spawner.options import requested_offer
from mig_spawner.spawner.warnings import notice
from tests.support.spawners import make_spawner, mig_config

CLASSES = {
    "small": {"display_name": "Small: 1 of 7 compute slices", "profiles": {"h200": "1g.18gb"}},
    "large": {"display_name": "Large: 3 of 7 compute slices", "profiles": {"h200": "3g.71gb"}},
    "full": {"display_name": "Whole GPU (one MIG instance)", "profiles": {"h200": "7g.141gb"}},
}
GROUPS = {"crowd": {"allowed": ["small", "large"], "queue": True, "purpose_free_text": True},
          "others": {"allowed": ["full"]}}
SMALL = "\u201cSmall: 1 of 7 compute slices\u201d"
LARGE = "\u201cLarge: 3 of 7 compute slices\u201d"


@pytest.fixture
def bea(tmp_path) -> LocalMIGSpawner:
    config = mig_config(f"sqlite:///{tmp_path / 'ledger.sqlite'}", sim="h200x1",
                        policies=GROUPS)
    config.MIGPolicyConfig.slice_classes = CLASSES
    spawner = make_spawner(config, "bea", ["crowd"])
    spawner.user_options = {"profile": "large", "purpose": "thesis: chapter 3"}
    return spawner


def ticket(spawner: LocalMIGSpawner, **news) -> SimpleNamespace:
    mine = spawner.user_policy(spawner.policies())
    told = {"position": 1, "budget": None, "estimate": None, "free": (mine.offer("small"),),
            "recut": False, **news}
    return SimpleNamespace(offer=mine.offer("large"), **told)


def test_the_waiting_headline_names_sizes_and_links_the_free_one_keeping_the_purpose(bea):
    text, html = waiting._place_message(bea, ticket(bea))
    assert text == (f"1st in line for {LARGE}; no estimate yet. {SMALL} is free now: stop "
                    "this wait and start with it instead")
    assert "large" not in text and "small" not in text  # no class keys
    link = html.split('<a class="mig-instead" href="', 1)[1].split('"', 1)[0]
    url = urlsplit(link.replace("&amp;", "&"))
    assert url.path == "/hub/spawn/bea"
    # The form's own query: the free size, and what the server is for, kept.
    assert parse_qs(url.query) == {"opt-profile": ["small"], "opt-purpose": ["thesis: chapter 3"]}
    assert html.endswith(">stop this wait and start with it instead</a>")


def test_a_recut_is_said_as_maintenance_on_the_pending_page_and_the_form(bea):
    text, _ = waiting._place_message(bea, ticket(bea, recut=True, free=()))
    assert text == (f"1st in line for {LARGE}; not free for a while: an admin is re-cutting "
                    "its GPU (no estimate yet)")
    # The form: the large slice is free but held by the re-cut, and the group may wait.
    mine = bea.user_policy(bea.policies())
    choices = {c.key: c for c in form.build_choices(
        mine, [model("h200")], {"h200": {"1g.18gb": 2, "3g.71gb": 0}}, lambda o, c: None,
        waits={"large": "0 waiting, no estimate yet"}, recut={"3g.71gb": 1})}
    assert choices["large"].wait == ("Not free for a while: an admin is re-cutting its GPU "
                                     "\u2014 join the wait list (0 waiting, no estimate yet)")


def test_refusals_on_the_form_name_sizes_as_its_headings_do(bea):
    policies = bea.policies()
    mine = bea.user_policy(policies)
    with pytest.raises(Refused) as refused:
        requested_offer({"profile": "full"}, mine, policies, for_form=True)
    assert refused.value.message == (
        "Your groups (crowd) are not allowed \u201cWhole GPU (one MIG instance)\u201d. "
        f"Choose one of: {SMALL}, {LARGE}.")
    # A script is told the keys it must send.
    with pytest.raises(Refused) as api:
        requested_offer({"profile": "full"}, mine, policies)
    assert "allowed: small, large" in api.value.message


@pytest.mark.parametrize(("rule", "extend_by", "extensions", "keep"), [
    ("server_idle", None, 0, True), ("max_session_age", 1800, 1, True),
    ("max_session_age", 1800, 0, False), ("max_session_age", None, 0, False),
    ("drain", 1800, 1, False), ("budget", 1800, 1, False)])
def test_keep_is_offered_only_where_it_can_put_the_stop_off(tmp_path, rule, extend_by,
                                                            extensions, keep):
    """No button that can only be refused: a re-cut, a spent budget, a session with no
    extension left (the earlier round's leftover: the age warning showed one)."""
    now = datetime.now(UTC)
    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        lease = ledger.leases.claim(LeaseRequest("ana"), lambda view: Grant(
            group="crowd", profile="1g.18gb", compute_slices=1, mode="pool", host="h",
            gpu_uuid="GPU-0", gpu_index=0, start=0, size=1, mig_uuid="MIG-0",
            expires_at=now + timedelta(minutes=5)))
        warned = ledger.warnings.warn(lease.id, rule, now + timedelta(minutes=5), "test")
    shown = notice(warned, now, extend_by=extend_by, max_extensions=extensions)
    assert shown["keep"] is keep
    if rule == "drain":
        assert "cannot be put off" in shown["message"]


def test_the_shipped_display_names_read_in_a_sentence():
    policies = build_policy(None, CLASSES, GROUPS)
    assert [o.named for o in policies.for_user(["crowd"]).offers] == [SMALL, LARGE]


def test_a_kernel_warning_says_a_kernel_goes_and_the_server_stays(tmp_path):
    with Ledger.open(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        lease = ledger.leases.claim(LeaseRequest("ana", "train"), lambda view: Grant(
            group="crowd", profile="1g.18gb", compute_slices=1, mode="pool", host="h",
            gpu_uuid="GPU-0", gpu_index=0, start=0, size=1, mig_uuid="MIG-0"))
        now = datetime.now(UTC)
        warned = ledger.warnings.warn(lease.id, "kernel_idle", now + timedelta(seconds=61), "test")
    shown = notice(warned, now, extend_by=None, max_extensions=0)
    assert shown["message"] == (
        "A kernel of your server train is shut down in about 1m: unused for a while; its "
        "variables are lost, the server stays. Use it or keep it.")
    assert shown["keep"] and len(shown["message"]) <= 140  # JupyterLab cuts it there
