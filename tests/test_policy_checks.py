"""The start-up advice on a valid policy: memory stated in the wording against the
slice's own, offers that no MIG device of a pool serves, and settings that another
setting of the group keeps from acting."""

from __future__ import annotations

from pathlib import Path

import pytest

from mig_spawner.config import MIGPolicyConfig, load_config_files
from mig_spawner.core.policy import (
    build_policy,
    contradiction_warnings,
    memory_wording_warnings,
    unserved_offers,
)

REPO = Path(__file__).resolve().parents[1]


def policy(offers=None, classes=None, allowed=("1g.35gb",)):
    return build_policy(offers, classes, {"team": {"allowed": list(allowed)}})


def test_a_size_in_gb_over_a_gib_slice_is_warned_with_the_size_to_write():
    [warning] = memory_wording_warnings(
        policy({"1g.35gb": {"display_name": "Memory-heavy small (H200, 35 GB)"}}), ["h200"])
    assert "the offer '1g.35gb' says '35 GB' in its display_name" in warning
    assert "32.2 GiB on H200 141GB" in warning and "write '32.2 GiB'" in warning


def test_sizes_written_as_every_screen_shows_them_pass_and_profile_names_are_not_sizes():
    offers = {"1g.35gb": {"display_name": "Memory-heavy small (32.2 GiB)",
                          "description": "a 1g.35gb slice: 1 of 7 compute slices"}}
    assert memory_wording_warnings(policy(offers), ["h200"]) == []


def test_a_rounded_or_wrong_gib_figure_is_warned_in_a_description_too():
    offers = {"1g.35gb": {"display_name": "x", "description": "32 GiB, or 16.0 GiB"}}
    warnings = memory_wording_warnings(policy(offers), ["h200"])
    assert [w.split(" says ")[1].split(" in ")[0] for w in warnings] == ["'32 GiB'", "'16.0 GiB'"]
    assert all("in its description" in w for w in warnings)


def test_a_class_is_checked_on_the_fleet_models_only():
    classes = {"medium": {"display_name": "Medium (32.2 GiB)",
                          "profiles": {"h200": "2g.35gb", "a100-80gb": "2g.20gb"}}}
    built = policy(classes=classes, allowed=["medium"])
    assert memory_wording_warnings(built, ["h200"]) == []
    [warning] = memory_wording_warnings(built, ["a100-80gb"])
    assert "19.5 GiB on A100 80GB" in warning
    # Without a fleet, either model's size is right.
    assert memory_wording_warnings(built) == []


def test_the_shipped_groups_state_memory_as_the_screens_do():
    config = load_config_files(REPO / "jupyterhub_config.d" / "20-groups.py")
    assert memory_wording_warnings(MIGPolicyConfig(config=config).build()) == []


def test_an_allowed_offer_without_a_device_is_named_with_its_groups():
    classes = {"full": {"profiles": {"h200": "7g.141gb"}}}
    built = build_policy(None, classes, {"admins": {"allowed": ["full", "1g.18gb"]},
                                         "research": {"allowed": ["full"]}})
    [warning] = unserved_offers(built, ["h200"], [("h200", "1g.18gb")])
    assert warning.startswith("pool mode offers 'full' (7g.141gb) to admins, research but "
                              "no such MIG device exists on this host")
    assert unserved_offers(built, ["h200"], [("h200", "1g.18gb"), ("h200", "7g.141gb")]) == []


# Settings of a group allowing 1g.18gb -> the warning that it cannot act (may be on purpose).
# fmt: off
MAY_BE_ON_PURPOSE = [
    ({"quota_slices": 0},
     "group 'team' has quota_slices = 0: no slice is ever charged to it, so its members get "
     "one only through another group"),
    ({"quota_compute_slices": 0}, "group 'team' has quota_compute_slices = 0: no slice"),
    ({"max_wait": "1h", "max_waiting_per_user": 2},
     "group 'team' sets max_wait and max_waiting_per_user but not queue = True: its members "
     "never wait, so these have no effect"),
    ({"cull_busy_kernels": True},
     "group 'team' has cull_busy_kernels = True but no server_idle_timeout or "
     "kernel_idle_timeout: nothing is culled for idleness, busy or not"),
    ({"cull_connected_kernels": False},
     "group 'team' has cull_connected_kernels = False but no kernel_idle_timeout: no "
     "kernel is shut down for idleness anyway"),
    ({"server_idle_timeout": "8h", "max_session_age": "8h"},
     "group 'team' has server_idle_timeout 8h, but no server runs longer than 8h "
     "(max_session_age): the age limit always stops it first, so this idle limit never acts"),
    ({"kernel_idle_timeout": "3h", "max_session_age": "1h", "extend_by": "1h",
      "max_extensions": 2},
     "group 'team' has kernel_idle_timeout 3h, but no server runs longer than 3h "
     "(max_session_age with every extension)"),
]
# fmt: on


@pytest.mark.parametrize(("settings", "warning"), MAY_BE_ON_PURPOSE)
def test_a_setting_another_keeps_from_acting_is_warned(settings, warning):
    built = build_policy(None, None, {"team": {"allowed": ["1g.18gb"], **settings}})
    [said] = contradiction_warnings(built)
    assert said.startswith(warning), said


def test_settings_that_all_act_give_no_warning():
    groups = {"team": {"allowed": ["1g.18gb"], "queue": True, "max_wait": "1h",
                       "cull_busy_kernels": True, "kernel_idle_timeout": "1h",
                       "server_idle_timeout": "2h", "max_session_age": "8h",
                       "quota_slices": 3},
              "closed": {"allowed": [], "quota_slices": 0}}  # allowed = [] is warned alone
    assert contradiction_warnings(build_policy(None, None, groups)) == []
    config = load_config_files(REPO / "jupyterhub_config.d" / "20-groups.py")
    assert contradiction_warnings(MIGPolicyConfig(config=config).build()) == []
