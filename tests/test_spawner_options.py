"""Server-side validation of user_options and the spawn form, without a hub.

The policy is the repository's own jupyterhub_config.d/20-groups.py, so these tests
also say what an analyst of the shipped config may and may not ask for.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from mig_spawner.config import MIGPolicyConfig, load_config_files
from mig_spawner.core.catalog import model
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.gpu import connect
from mig_spawner.spawner import form
from mig_spawner.spawner.decide import free_now
from mig_spawner.spawner.options import named_offer, options_from_form, requested_offer

GROUPS = Path(__file__).resolve().parents[1] / "jupyterhub_config.d" / "20-groups.py"


@pytest.fixture(scope="module")
def policies():
    return MIGPolicyConfig(config=load_config_files(GROUPS)).build()


@pytest.fixture(scope="module")
def analyst(policies):
    return policies.for_user(["analysts"])


def test_form_data_becomes_one_value_per_key():
    assert options_from_form({"profile": ["small"]}) == {"profile": "small"}
    # Two values for one key stay a list, so that validation can name the mistake.
    assert options_from_form({"profile": ["a", "b"]}) == {"profile": ["a", "b"]}


def test_an_allowed_offer_is_granted(analyst, policies):
    assert requested_offer({"profile": "small"}, analyst, policies).key == "small"
    ml = policies.for_user(["ml-team"])
    assert requested_offer({"profile": "1g.35gb"}, ml, policies).key == "1g.35gb"


@pytest.mark.parametrize(
    ("group", "sent", "name"),
    [("analysts", " small", "small"), ("analysts", "small ", "small"),
     ("ml-team", "MIG 1G.35GB", "1g.35gb"), ("ml-team", "1g.35gb\n", "1g.35gb")],
)
def test_a_name_is_matched_exactly_and_a_near_one_is_refused_with_the_name_to_send(
        policies, group, sent, name):
    with pytest.raises(Refused) as e:
        requested_offer({"profile": sent}, policies.for_user([group]), policies)
    assert e.value.reason == Reason.INVALID_OPTIONS
    assert f"names are matched exactly; send {name!r}" in str(e.value)
    assert named_offer({"profile": sent}, policies) is None  # it names no offer either


@pytest.mark.parametrize(
    ("user_options", "reason", "words"),
    [
        (["small"], Reason.INVALID_OPTIONS, "must be a JSON object"),
        ({"profile": "small", "gpu": 0}, Reason.INVALID_OPTIONS, "unknown option(s) 'gpu'"),
        ({"profile": "small", "x" * 500: 1}, Reason.INVALID_OPTIONS,
         "the options are 'profile'"),
        ({}, Reason.INVALID_OPTIONS, "choose a GPU slice"),
        ({"profile": ["small", "medium"]}, Reason.INVALID_OPTIONS, "must be one name"),
        ({"profile": 3}, Reason.INVALID_OPTIONS, "not int"),
        ({"profile": "s" * 5000}, Reason.INVALID_OPTIONS, "5000 characters long"),
        ({"profile": "large"}, "not_allowed", "not allowed for your groups (analysts)"),
        ({"profile": "5g.999gb"}, Reason.UNKNOWN_PROFILE, "not a MIG profile offered on this hub"),
        ({"profile": "huge"}, Reason.UNKNOWN_PROFILE, "not a slice offered on this hub"),
    ],
)
def test_bad_options_are_refused_with_what_to_send(analyst, policies, user_options, reason,
                                                   words):
    with pytest.raises(Refused) as e:
        requested_offer(user_options, analyst, policies)
    assert e.value.reason == reason
    assert words in str(e.value)
    # Every refusal says what the user may send instead.
    assert "small, medium" in str(e.value) or '{"profile": "small"}' in str(e.value)
    assert len(str(e.value)) < 400  # an oversize value is never echoed back whole


def test_user_in_no_gpu_group_is_told_to_ask_an_admin(policies):
    nobody = policies.for_user(["marketing"])
    with pytest.raises(Refused, match="ask a hub admin") as e:
        requested_offer({"profile": "small"}, nobody, policies)
    assert e.value.reason == "no_gpu_access"


# --- the form ---------------------------------------------------------------------------


class _Radios(HTMLParser):
    """Collects the radio inputs and the labels of a rendered form."""

    def __init__(self) -> None:
        super().__init__()
        self.radios: list[dict] = []
        self.labels: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "input" and a.get("type") == "radio":
            self.radios.append(a)
        if tag == "label":
            self.labels.add(a.get("for", ""))


def _parse(html: str) -> _Radios:
    p = _Radios()
    p.feed(html)
    return p


def test_form_shows_only_allowed_offers_with_free_counts_and_reasons(analyst):
    free = {"h200": {"1g.18gb": 3, "2g.35gb": 0, "3g.71gb": 2}}
    choices = form.build_choices(analyst, [model("h200")], free, lambda offer, c: None,
                                 in_use={"2g.35gb": 1})
    assert [c.key for c in choices] == ["small", "medium"]  # not "large": not allowed
    small, medium = choices
    assert small.free == 3 and small.available
    assert small.facts[0].compute_text == "1/7 of the GPU's compute"
    assert medium.unavailable == "the only one is in use right now"
    html = form.render_form(choices, last="medium")
    radios = _parse(html).radios
    assert [r["value"] for r in radios] == ["small", "medium"]
    # The last choice is not available now, so the first available one is preselected.
    assert "checked" in radios[0] and "disabled" not in radios[0]
    assert "disabled" in radios[1] and "checked" not in radios[1]
    # Every radio has a label (keyboard and screen readers) and posts as "profile".
    assert {r["id"] for r in radios} <= _parse(html).labels
    assert {r["name"] for r in radios} == {"profile"}
    assert "3 free now" in html and "the only one is in use right now" in html


def test_form_says_when_a_quota_is_used_up(analyst):
    choices = form.build_choices(
        analyst, [model("h200")], {"h200": {"1g.18gb": 3, "2g.35gb": 1}},
        lambda offer, c: "you already hold 1 of 1 slices",
    )
    assert all(c.unavailable == "you already hold 1 of 1 slices" for c in choices)
    html = form.render_form(choices, last="small")
    assert all("disabled" in r and "checked" not in r for r in _parse(html).radios)


def test_form_keeps_the_last_choice_and_escapes_admin_text(policies):
    ml = policies.for_user(["ml-team"])
    choices = form.build_choices(ml, [model("h200")], {"h200": {"3g.71gb": 1, "2g.35gb": 1}},
                                 lambda offer, c: None)
    html = form.render_form(choices, last="large")
    checked = [r["value"] for r in _parse(html).radios if "checked" in r]
    assert checked == ["large"]
    assert "<script" not in form.render_form(
        [form.Choice("x", "<script>alert(1)</script>", "d", (), 1, None)]
    )


@pytest.mark.parametrize("mode", ["pool", "dynamic"])
def test_a_class_on_two_models_counts_each_gpus_slices_once(analyst, mode):
    """'small' is 1g.10gb on both the A100 80GB and the H100: a mixed host must show the
    sum of both GPUs' free 1g.10gb, not that sum once per model."""
    spec = ("a100-80gbx1:layout=1g.10gb*7+h100x1:layout=1g.10gb*4,3g.40gb" if mode == "pool"
            else "a100-80gbx1+h100x1")
    with connect(simulate=spec) as gpus:
        inventory = gpus.inventory()
    free = free_now(inventory, [], mode)
    models = [model(g.model_key) for g in inventory.gpus]
    small, medium = form.build_choices(analyst, models, free, lambda offer, c: None)
    assert small.free == (11 if mode == "pool" else 14)
    assert [f.gpu for f in small.facts] == ["A100 80GB", "H100 80GB"]
    assert medium.free == (0 if mode == "pool" else 6)


def test_a_size_no_gpu_has_says_where_it_looked(analyst):
    on_a30 = form.build_choices(analyst, [model("a30")], {}, lambda o, c: None,
                                 scope="in the cluster")
    assert {c.unavailable for c in on_a30} == {"no GPU in the cluster has this size"}


def test_form_without_any_offer_explains_instead_of_showing_radios(policies):
    html = form.render_form(form.build_choices(policies.for_user([]), [model("h200")], {},
                                               lambda o, c: None))
    assert not _parse(html).radios
    assert form.NO_ACCESS_MESSAGE in html


# --- the spawner's own settings ----------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "trait", "value", "words"),
    [
        ("LocalMIGSpawner", "mig_mode", "elastic", "mig_mode"),
        ("LocalMIGSpawner", "strategy", "random", "strategy"),
        ("MIGSettings", "ledger_url", "not a url", "not a SQLAlchemy URL"),
        ("MIGSettings", "simulate", "h999x2", "simulate:"),
        ("MIGSettings", "sim_state_file", "/no/such/folder/sim.json", "does not exist"),
    ],
)
def test_bad_settings_are_refused_when_the_hub_reads_its_config(cls, trait, value, words):
    from traitlets import TraitError

    from mig_spawner import config
    from mig_spawner.spawner import local

    with pytest.raises(TraitError, match=re.escape(words)):
        (getattr(local, cls, None) or getattr(config, cls))(**{trait: value})


def test_settings_have_help_and_the_form_is_built_per_user():
    from mig_spawner.config import MIGSettings
    from mig_spawner.spawner import LocalMIGSpawner

    traits = LocalMIGSpawner.class_traits(config=True)
    for name in ("mig_mode", "strategy", "isolation"):
        assert traits[name].help.strip(), name
    for name, trait in MIGSettings.class_traits(config=True).items():
        assert trait.help.strip(), name
    assert callable(LocalMIGSpawner().options_form)


def test_form_on_a_simulated_h200_shows_gib_beside_the_profile_names():
    """The driver's figures, in the one memory format: 16.0 / 32.2 / 69.5 / 139.8 GiB."""
    from mig_spawner.core.policy import build_policy
    from mig_spawner.gpu import connect

    adapter = connect("h200x1")
    try:
        h200 = adapter.inventory().model("h200")
    finally:
        adapter.close()
    shown = {"1g.18gb": "16.0 GiB", "1g.35gb": "32.2 GiB", "3g.71gb": "69.5 GiB",
             "7g.141gb": "139.8 GiB"}
    everyone = build_policy(offers=None, classes=None, groups={
        "all": {"allowed": list(shown), "quota_slices": 4}}).for_user(["all"])
    free = {"h200": {name: 1 for name in shown}}
    html = form.render_form(form.build_choices(everyone, [h200], free, lambda o, c: None))
    for name, gib in shown.items():
        assert f"{name}: {gib} memory" in html


def test_form_tells_no_such_slice_from_all_in_use_and_offers_the_wait_list(analyst):
    free = {"h200": {"1g.18gb": 0, "2g.35gb": 0}}
    plain = form.build_choices(analyst, [model("h200")], free, lambda offer, c: None,
                               in_use={"1g.18gb": 6})
    assert [c.unavailable for c in plain] == [
        "all 6 in use right now", "no such slice on this host (ask a hub admin)"]
    queued = form.build_choices(analyst, [model("h200")], free, lambda offer, c: None,
                                in_use={"1g.18gb": 6},
                                waits={"small": "2 waiting, usually 5-15 min"})
    small = queued[0]
    assert small.available and small.wait == (
        "All 6 in use \u2014 join the wait list (2 waiting, usually 5-15 min)")
    html = form.render_form(queued)
    radio = _parse(html).radios[0]
    assert "checked" in radio and "disabled" not in radio  # choosing it joins the line
    assert "join the wait list (2 waiting, usually 5-15 min)" in html
    # The only slice of a size is "the only one", not "all 1".
    only = form.build_choices(analyst, [model("h200")], free, lambda offer, c: None,
                              in_use={"1g.18gb": 1}, waits={"small": "0 waiting"})
    assert only[0].wait == "The only one is in use \u2014 join the wait list (0 waiting)"
    # A quota refusal is never a wait.
    full = form.build_choices(analyst, [model("h200")], free, lambda offer, c: "quota full",
                              in_use={"1g.18gb": 6}, waits={"small": "0 waiting"})
    assert full[0].unavailable == "quota full" and full[0].wait is None


def test_places_in_line_read_as_ordinals():
    from mig_spawner.spawner.waiting import ordinal

    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"]


def test_an_offer_with_no_slice_anywhere_is_hidden_unless_the_admin_shows_it(analyst):
    free = {"h200": {"1g.18gb": 2, "2g.35gb": 0}}  # pool: no 2g.35gb instance at all

    def build(**kw):
        return form.build_choices(analyst, [model("h200")], free, lambda offer, c: None, **kw)

    assert [c.key for c in build(hide_absent=True)] == ["small"]
    (_, medium) = build(hide_absent=False)
    assert medium.unavailable == "no such slice on this host (ask a hub admin)"
    # Dynamic mode: nothing held of it, yet other sizes may fill the GPU: shown, true.
    (_, medium) = build(hide_absent=True, fixed_layout=False)
    assert medium.unavailable == "none free right now: other sizes fill the GPUs"
    # The only offers all absent: the form keeps them, saying why.
    none = {"h200": {"1g.18gb": 0, "2g.35gb": 0}}
    kept = form.build_choices(analyst, [model("h200")], none, lambda o, c: None,
                              hide_absent=True)
    assert [c.key for c in kept] == ["small", "medium"]
