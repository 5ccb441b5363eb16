"""Every kind of group policy config mistake, and the message that names it."""

from __future__ import annotations

import pytest

from mig_spawner.core.catalog import model
from mig_spawner.core.policy import GROUP_KEYS, PolicyError, build_policy

H200 = model("h200")

H200_VALID = "1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb"
ONLY_SMALL = {"small": {"profiles": {"h200": "1g.18gb"}}}
KNOWN_KEYS = ", ".join(GROUP_KEYS)
LISTED = "MIG profiles such as '1g.18gb' may be listed directly"
NO_LIMIT = "(or None for no limit)"


def only_problem(offers: dict, classes: dict, groups: object, default: dict | None) -> str:
    with pytest.raises(PolicyError) as err:
        build_policy(offers, classes, groups, default, [H200])
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0] in str(err.value)
    return err.value.problems[0]


# Settings of group 'a' (merged over {"allowed": ["small"]}) -> the problem reported.
# fmt: off
GROUP_MISTAKES = [
    ({"max_slice_per_user": 2},
     "unknown key 'max_slice_per_user'; did you mean 'max_slices_per_user'?"),
    ({"colour": "red"}, f"unknown key 'colour' (known keys: {KNOWN_KEYS})"),
    ({"allowed": ["3g.40gb"]},
     f"allowed: profile '3g.40gb' exists on no GPU in this fleet (H200 141GB); "
     f"valid: {H200_VALID}"),
    ({"allowed": ["smal"]},
     f"allowed: unknown class 'smal'; did you mean 'small'? (classes: small; {LISTED})"),
    ({"allowed": "small"},
     "allowed must be a list of profile or class names (e.g. ['small', '2g.35gb']), "
     "got str 'small'"),
    ({"allowed": [7]}, "allowed: entries must be strings, got int 7"),
    ({"max_slices_per_user": -1}, "max_slices_per_user must be a whole number, 1 or more, "
                                  "got -1"),
    ({"max_slices_per_user": 0}, "max_slices_per_user must be a whole number, 1 or more, "
                                 "got 0"),
    ({"max_slices_per_user": 1.5}, "max_slices_per_user must be a whole number, 1 or more, "
                                   "got float 1.5"),
    ({"quota_slices": -2}, f"quota_slices must be a whole number, 0 or more {NO_LIMIT}, got -2"),
    ({"quota_compute_slices": "7"},
     f"quota_compute_slices must be a whole number, 0 or more {NO_LIMIT}, got str '7'"),
    ({"priority": True}, "priority must be a whole number, got bool True"),
    ({"server_idle_timeout": "30x"}, "server_idle_timeout: '30x': unknown unit 'x'; use "),
    ({"max_session_age": "-1h"}, "max_session_age: '-1h' is negative; a duration must be "),
    ({"kernel_idle_timeout": [5]}, "kernel_idle_timeout: a duration must be a string or a "
                                   "number, got list [5]"),
    ({"cull_busy_kernels": "yes"}, "cull_busy_kernels must be True or False, got 'yes'"),
    ({"cull_connected_kernels": "no"},
     "cull_connected_kernels must be True or False, got 'no'"),
    ({"queue": 1}, "queue must be True or False, got 1"),
    ({"max_wait": "30 mins later"}, "max_wait: '30 mins later' is not a duration"),
    ({"max_waiting_per_user": 0}, "max_waiting_per_user must be a whole number, 1 or more, "
                                  "got 0"),
    ({"server_idle_timeout_when_waited": "-5m"},
     "server_idle_timeout_when_waited: '-5m' is negative"),
    # Each valid alone, contradictory together (docs/policies.md).
    ({"max_slices_per_user": 3, "quota_slices": 1},
     "max_slices_per_user 3 can never be reached, the whole group's quota_slices is 1; "
     "lower max_slices_per_user to 1 or raise quota_slices"),
    ({"allowed": ["small", "3g.71gb"], "quota_compute_slices": 2},
     "allowed: '3g.71gb' needs more compute slices than the group's quota_compute_slices 2, "
     "so nobody can get one; raise quota_compute_slices or remove it from allowed"),
    ({"allowed": ["2g.35gb", "3g.71gb"], "max_slices_per_user": 3, "quota_compute_slices": 5},
     "max_slices_per_user 3 can never be reached, the group's quota_compute_slices 5 holds "
     "at most 2 of its smallest offer; lower max_slices_per_user to 2 or raise "
     "quota_compute_slices"),
    ({"server_idle_timeout": "30m", "server_idle_timeout_when_waited": "1h"},
     "server_idle_timeout_when_waited (1h) must be shorter than server_idle_timeout (30m): "
     "it is the shorter idle limit used while someone waits"),
    # What the demo shipped (a 10 min limit, warn_before's default 10 min): every server
    # was warned as it started.
    ({"server_idle_timeout": "10m"},
     "warn_before 10m is not shorter than server_idle_timeout 10m: every server would "
     "be warned as soon as it starts; make warn_before shorter than 10m"),
    ({"server_idle_timeout": "1h", "server_idle_timeout_when_waited": "5m",
      "warn_before": "5m"},
     "warn_before 5m is not shorter than server_idle_timeout_when_waited 5m"),
    ({"max_session_age": "8h", "warn_before": "9h"},
     "warn_before 9h is not shorter than max_session_age 8h"),
    ({"open_tab_counts": "no"}, "open_tab_counts must be True or False, got 'no'"),
]
# fmt: on


@pytest.mark.parametrize(("settings", "problem"), GROUP_MISTAKES)
def test_group_mistakes_name_the_group_and_the_key(settings: dict, problem: str) -> None:
    groups = {"a": {"allowed": ["small"], **settings}}
    assert only_problem({}, ONLY_SMALL, groups, None).startswith(f"group 'a': {problem}")


# The spec of class 'small' -> the problem reported.
# fmt: off
CLASS_MISTAKES = [
    ({"profiles": {"h2000": "1g.18gb"}},
     "profiles: unknown GPU model 'h2000'; known: a100-40gb, a100-80gb, a30, h100, h100-pcie, "
     "h100-96gb, h100-nvl, h20, gh200, gh200-144gb, h200, b200, gb200, b300, rtx-pro-6000, "
     "rtx-pro-5000; "
     "did you mean 'h200'?"),
    ({"profiles": {"h200": "1g.10gb"}},
     f"profiles['h200']: '1g.10gb' is not a MIG profile of the H200 141GB; "
     f"valid profiles: {H200_VALID}"),
    ({"profiles": {"a100-80gb": "1g.10gb"}},
     "no profile for any GPU in this fleet (h200); add one, e.g. profiles['h200']"),
    ({"display_name": "Small"}, "missing key 'profiles' (GPU model key -> profile, "),
    ({"profiles": {}}, "profiles must be a non-empty dict of GPU model key -> profile, got {}"),
    ({"profiles": {"h200": "1g.18gb"}, "description": None},
     "description must be a string, got NoneType None"),
    ("1g.18gb", "settings must be a dict, got str '1g.18gb'"),
]
# fmt: on


@pytest.mark.parametrize(("spec", "problem"), CLASS_MISTAKES)
def test_class_mistakes_name_the_class_and_the_key(spec: object, problem: str) -> None:
    assert only_problem({}, {"small": spec}, {}, None).startswith(f"class 'small': {problem}")


# Whole config -> the problem reported, for mistakes outside one group or class.
# fmt: off
OTHER_MISTAKES = [
    ({}, {}, {"a": {"allowed": ["tiny"]}}, None,
     f"group 'a': allowed: unknown class 'tiny' (no classes are defined; {LISTED})"),
    ({}, {}, {"a": ["1g.18gb"]}, None, "group 'a': settings must be a dict, got list "),
    ({}, {}, {"default": {"allowed": ["1g.18gb"]}}, None,
     "group 'default': the name 'default' is kept for users in no listed group; set "
     "default_policy for them, or rename the JupyterHub group"),
    ({}, {}, [], None, "group_policies must be a dict, got list []"),
    ({}, {}, {}, {"allowed": ["1g.18gb"], "kernel_idle_timeout": "soon"},
     "default_policy: kernel_idle_timeout: 'soon' is not a duration"),
    ({}, {"1g.18gb": {"profiles": {"h200": "1g.18gb"}}}, {}, None,
     "class '1g.18gb': a class name must not look like a MIG profile"),
    ({"small": {}}, {}, {}, None,
     "offer 'small': offers are keyed by MIG profile name (e.g. '1g.18gb'); put named "
     "sizes such as 'small' in slice_classes"),
    ({"1g.18gb": {"display_name": 18}}, {}, {}, None,
     "offer '1g.18gb': display_name must be a string, got int 18"),
    ({"1g.18gb": {"title": "x"}}, {}, {}, None,
     "offer '1g.18gb': unknown key 'title' (known keys: display_name, description)"),
    ({"1g.10gb": {}}, {}, {}, None,
     "offer '1g.10gb': profile '1g.10gb' exists on no GPU in this fleet (H200 141GB)"),
]
# fmt: on


@pytest.mark.parametrize(("offers", "classes", "groups", "default", "problem"), OTHER_MISTAKES)
def test_other_config_mistakes(
    offers: dict, classes: dict, groups: object, default: dict | None, problem: str
) -> None:
    assert only_problem(offers, classes, groups, default).startswith(problem)


def test_a_misspelt_profiles_key_is_named_with_its_fix() -> None:
    with pytest.raises(PolicyError) as err:
        build_policy({}, {"small": {"profile": {"h200": "1g.18gb"}}}, {}, None, [H200])
    assert err.value.problems == [
        "class 'small': unknown key 'profile'; did you mean 'profiles'?",
        "class 'small': missing key 'profiles' (GPU model key -> profile, "
        "e.g. {'h200': '1g.18gb', 'a100-80gb': '1g.10gb'})",
    ]


def test_every_mistake_is_reported_at_once() -> None:
    groups = {
        "a": {"allowed": ["smal"], "quota_slices": -1},
        "b": {"allowed": ["small", "1g.18gb"], "server_idle_timeout": "5 parsecs", "prio": 1},
    }
    with pytest.raises(PolicyError) as err:
        build_policy({}, {"small": {"profiles": {"h200": "9g.1gb"}}}, groups, None, [H200])
    problems = err.value.problems
    assert len(problems) == 5, problems
    assert str(err.value).startswith("5 problems in the MIG group policy config:\n  - class")
    # Class 'small' has a bad profile but still exists: group 'b', which allows it, gets
    # no second error for it.
    assert [p.split(":")[0] for p in problems] == [
        "class 'small'",
        "group 'a'",
        "group 'a'",
        "group 'b'",
        "group 'b'",
    ]
