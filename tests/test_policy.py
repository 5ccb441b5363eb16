"""Group policies: multi-group resolution, classes on a mixed fleet, quota checks.

Config mistakes and their messages are in test_policy_errors.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mig_spawner.core.catalog import model
from mig_spawner.core.policy import (
    GroupTally,
    Holding,
    PolicyError,
    PolicySet,
    build_policy,
    check_claim,
    tally,
)
from mig_spawner.core.refusal import Reason, Refused

H200 = model("h200")
A100_80 = model("a100-80gb")
MIXED = [A100_80, H200]

CLASSES = {
    "small": {
        "display_name": "Small",
        "description": "debugging and small notebooks",
        "profiles": {"h200": "1g.18gb", "a100-80gb": "1g.10gb"},
    },
    "medium": {
        "description": "inference of a mid-size model",
        "profiles": {"h200": "2g.35gb", "a100-80gb": "2g.20gb"},
    },
    "large": {"profiles": {"h200": "3g.71gb", "a100-80gb": "3g.40gb"}},
}
OFFERS = {"1g.35gb": {"display_name": "Memory-heavy small", "description": "embeddings"}}
GROUPS = {
    "analysts": {
        "allowed": ["small", "medium"],
        "max_slices_per_user": 1,
        "quota_slices": 6,
        "server_idle_timeout": "30m",
        "kernel_idle_timeout": "15m",
        "max_session_age": "8h",
    },
    "ml-team": {
        "allowed": ["medium", "large", "1g.35gb"],
        "max_slices_per_user": 2,
        "quota_compute_slices": 7,
        "priority": 10,
    },
    "admins": {"allowed": ["small", "medium", "large"], "max_slices_per_user": 3, "priority": 100},
    # A configured group that grants nothing: its members get no GPU from it.
    "blocked": {"allowed": [], "max_slices_per_user": 5},
}


def policy(default: dict | None = None, groups: dict | None = None) -> PolicySet:
    return build_policy(OFFERS, CLASSES, GROUPS if groups is None else groups, default, MIXED)


# --- resolution ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user_groups", "offers", "max_slices", "applying"),
    [
        (["analysts"], ["small", "medium"], 1, ["analysts"]),
        (["ml-team"], ["medium", "large", "1g.35gb"], 2, ["ml-team"]),
        # Union of offers, in the policy's order; the largest per-user limit.
        (
            ["analysts", "ml-team"],
            ["small", "medium", "large", "1g.35gb"],
            2,
            ["analysts", "ml-team"],
        ),
        (
            ["ml-team", "analysts", "admins"],
            ["small", "medium", "large", "1g.35gb"],
            3,
            ["admins", "analysts", "ml-team"],
        ),
        # Hub groups without a policy are ignored.
        (["analysts", "students"], ["small", "medium"], 1, ["analysts"]),
        # A group that allows nothing does not raise the per-user limit.
        (["analysts", "blocked"], ["small", "medium"], 1, ["analysts", "blocked"]),
        # In no configured group: the default policy, which grants nothing by default.
        ([], [], 0, ["default"]),
        (["students"], [], 0, ["default"]),
        (["blocked"], [], 0, ["blocked"]),
    ],
)
def test_user_policy_resolution(
    user_groups: list[str], offers: list[str], max_slices: int, applying: list[str]
) -> None:
    user = policy().for_user(user_groups)
    assert list(user.offer_keys) == offers
    assert user.max_slices == max_slices
    assert list(user.group_names) == applying
    assert user.has_gpu_access == bool(offers)


@pytest.mark.parametrize(
    ("user_groups", "offers", "max_slices"),
    [
        ([], ["small"], 1),
        (["students"], ["small"], 1),
        # The default is for users in *no* configured group: a configured group that
        # grants nothing is a way to take GPU access away.
        (["blocked"], [], 0),
        (["analysts"], ["small", "medium"], 1),
    ],
)
def test_configured_default_policy(
    user_groups: list[str], offers: list[str], max_slices: int
) -> None:
    user = policy(default={"allowed": ["small"], "quota_slices": 2}).for_user(user_groups)
    assert list(user.offer_keys) == offers
    assert user.max_slices == max_slices


def test_for_user_refuses_a_bare_string() -> None:
    with pytest.raises(TypeError, match="list of group names, got the string 'analysts'"):
        policy().for_user("analysts")


@pytest.mark.parametrize(
    ("user_groups", "offer", "charged_in_order"),
    [
        (["analysts", "ml-team", "admins"], "medium", ["admins", "ml-team", "analysts"]),
        (["analysts", "ml-team"], "medium", ["ml-team", "analysts"]),
        (["analysts", "ml-team"], "small", ["analysts"]),
        (["analysts", "ml-team"], "1g.35gb", ["ml-team"]),
        (["analysts"], "large", []),
    ],
)
def test_charge_candidates_by_priority(
    user_groups: list[str], offer: str, charged_in_order: list[str]
) -> None:
    user = policy().for_user(user_groups)
    assert [g.name for g in user.charge_candidates(offer)] == charged_in_order


def test_charge_candidates_with_equal_priority_go_by_name() -> None:
    groups = {
        "zeta": {"allowed": ["small"]},
        "alpha": {"allowed": ["small"]},
        "mid": {"allowed": ["small"], "priority": 1},
    }
    user = policy(groups=groups).for_user(["zeta", "alpha", "mid"])
    assert [g.name for g in user.charge_candidates("small")] == ["mid", "alpha", "zeta"]


def test_group_settings_and_defaults() -> None:
    policies = policy(groups={**GROUPS, "plain": {"allowed": ["1g.18gb"]}})
    analysts = policies.group("analysts")
    assert (
        analysts.server_idle_timeout,
        analysts.kernel_idle_timeout,
        analysts.max_session_age,
    ) == (1800, 900, 28800)
    assert analysts.quota_slices == 6
    plain = policies.group("plain")
    assert plain.max_slices_per_user == 1
    assert plain.quota_slices is plain.quota_compute_slices is None
    assert plain.server_idle_timeout is plain.kernel_idle_timeout is plain.max_session_age is None
    assert plain.cull_busy_kernels is False
    assert plain.cull_connected_kernels is True  # an open tab does not keep an idle kernel
    assert plain.priority == 0
    assert (plain.queue, plain.max_wait, plain.max_waiting_per_user) == (False, 1800, 1)
    assert plain.server_idle_timeout_when_waited is None


def test_wait_list_keys() -> None:
    waits = {"allowed": ["1g.18gb"], "queue": True, "max_wait": "45m",
             "max_waiting_per_user": 2, "server_idle_timeout_when_waited": "15m",
             "server_idle_timeout_when_unwaited": "2h"}
    group = policy(groups={"w": waits}).group("w")
    assert (group.queue, group.max_wait, group.max_waiting_per_user) == (True, 2700, 2)
    assert group.server_idle_timeout_when_waited == 900
    assert group.server_idle_timeout_when_unwaited == 7200
    assert policy(groups={"f": {**waits, "max_wait": "never"}}).group("f").max_wait is None


def test_lease_of_a_group_removed_from_config_follows_the_default_limits() -> None:
    policies = policy(default={"allowed": ["small"], "server_idle_timeout": "20m"})
    assert policies.group("gone").name == "default"
    assert policies.group("gone").server_idle_timeout == 1200
    assert "gone" not in policies.groups


def test_profile_names_are_normalised() -> None:
    policies = policy(groups={"g": {"allowed": ["MIG 1G.18GB", " 2g.35gb"]}})
    user = policies.for_user(["g"])
    assert user.offer_keys == ("1g.18gb", "2g.35gb")
    assert user.allows("mig-1g.18gb")
    assert not user.allows("3g.71gb")


# --- classes on a mixed fleet ------------------------------------------------------------


@pytest.mark.parametrize(
    ("offer", "model_key", "profile"),
    [
        ("small", "h200", "1g.18gb"),
        ("small", "a100-80gb", "1g.10gb"),
        ("medium", "a100-80gb", "2g.20gb"),
        ("large", "h200", "3g.71gb"),
        ("small", "h100", None),  # the class names no profile for an H100
        ("1g.35gb", "h200", "1g.35gb"),
        ("1g.35gb", "a100-80gb", None),  # no 35 GB profile on an A100
    ],
)
def test_offer_resolves_one_profile_per_gpu_model(
    offer: str, model_key: str, profile: str | None
) -> None:
    assert policy().offer(offer).profile_for(model_key) == profile


def test_offers_describe_need_and_keep_order() -> None:
    policies = policy()
    assert list(policies.offers) == ["small", "medium", "large", "1g.35gb"]
    small = policies.offer("small")
    assert (small.is_class, small.display_name, small.description) == (
        True,
        "Small",
        "debugging and small notebooks",
    )
    assert policies.offer("large").display_name == "large"
    assert policies.offer("1g.35gb").description == "embeddings"


def test_profile_names_for_a_fleet() -> None:
    policies = policy()
    assert policies.profile_names(["h200"]) == ("1g.18gb", "2g.35gb", "3g.71gb", "1g.35gb")
    assert policies.profile_names(["a100-80gb"]) == ("1g.10gb", "2g.20gb", "3g.40gb")


def test_a_fleet_profile_must_exist_on_some_gpu_of_the_fleet() -> None:
    groups = {"g": {"allowed": ["2g.20gb", "1g.35gb"]}}  # one on each model of MIXED
    # Profiles are offered from small to large, whatever order the admin listed them in.
    assert build_policy({}, {}, groups, None, MIXED).for_user(["g"]).offer_keys == (
        "1g.35gb",
        "2g.20gb",
    )
    with pytest.raises(PolicyError, match=r"profile '2g\.20gb' exists on no GPU in this fleet"):
        build_policy({}, {}, groups, None, [H200])


def test_without_a_fleet_any_well_formed_profile_is_accepted() -> None:
    groups = {"g": {"allowed": ["5g.99gb"]}}
    assert build_policy({}, {}, groups, None, None).for_user(["g"]).offer_keys == ("5g.99gb",)
    assert build_policy({}, {}, groups, None, []).for_user(["g"]).offer_keys == ("5g.99gb",)


# --- check_claim -------------------------------------------------------------------------

GPU = Holding("gpu", "1g.18gb", 1, "analysts")


def refusal(
    user_groups: list[str],
    offer: str,
    compute: int,
    active: list[Holding],
    usage: dict[str, GroupTally],
    policies: PolicySet | None = None,
) -> Refused:
    user = (policies or policy()).for_user(user_groups)
    with pytest.raises(Refused) as err:
        check_claim(user, offer, compute, active, usage)
    assert err.value.hint
    return err.value


NO_ACCESS = "your groups allow no GPU slices; ask an admin to add you to a group"
TWO_HELD = [Holding("", "2g.35gb", 2, "ml-team"), Holding("big", "3g.71gb", 3, "ml-team")]


# fmt: off
REFUSALS = [
    ([], "small", 1, [], {}, Reason.NO_GPU_ACCESS, NO_ACCESS),
    (["blocked"], "small", 1, [], {}, Reason.NO_GPU_ACCESS, NO_ACCESS),
    (["analysts"], "large", 3, [], {}, Reason.NOT_ALLOWED,
     "'large' is not allowed for your groups (analysts); allowed: small, medium"),
    (["analysts", "blocked"], "3g.71gb", 3, [], {}, Reason.NOT_ALLOWED,
     "'3g.71gb' is not allowed for your groups (analysts, blocked); allowed: small, medium"),
    (["analysts"], "small", 1, [GPU], {}, Reason.USER_LIMIT,
     "you already hold 1 of 1 slices (server 'gpu')"),
    (["analysts"], "small", 1, [Holding("", "1g.18gb", 1, "analysts")], {}, Reason.USER_LIMIT,
     "you already hold 1 of 1 slices (your default server)"),
    (["ml-team"], "medium", 2, TWO_HELD, {}, Reason.USER_LIMIT,
     "you already hold 2 of 2 slices (servers default, 'big')"),
    (["analysts"], "small", 1, [], {"analysts": GroupTally(6, 6)}, Reason.GROUP_QUOTA,
     "your group 'analysts' holds 6 of its 6 slices"),
    (["ml-team"], "large", 3, [], {"ml-team": GroupTally(2, 6)}, Reason.GROUP_QUOTA,
     "your group 'ml-team' uses 6 of its 7 compute slices and 'large' needs 3"),
    (["analysts", "ml-team"], "medium", 2, [],
     {"analysts": GroupTally(6, 8), "ml-team": GroupTally(3, 6)}, Reason.GROUP_QUOTA,
     "every group of yours that allows 'medium' is full: group 'ml-team' uses 6 of its 7 "
     "compute slices and 'medium' needs 2; group 'analysts' holds 6 of its 6 slices"),
]
# fmt: on


@pytest.mark.parametrize(
    ("user_groups", "offer", "compute", "active", "usage", "reason", "message"), REFUSALS
)
def test_check_claim_refusals(
    user_groups: list[str],
    offer: str,
    compute: int,
    active: list[Holding],
    usage: dict[str, GroupTally],
    reason: str,
    message: str,
) -> None:
    err = refusal(user_groups, offer, compute, active, usage)
    assert (err.reason, str(err)) == (reason, message)


def test_the_briefs_not_allowed_message_for_a_profile_group() -> None:
    policies = policy(groups={"analysts": {"allowed": ["1g.18gb", "2g.35gb"]}})
    err = refusal(["analysts"], "3g.71gb", 3, [], {}, policies)
    assert str(err) == (
        "'3g.71gb' is not allowed for your groups (analysts); allowed: 1g.18gb, 2g.35gb"
    )


def test_default_policy_refusals_speak_of_users_outside_the_groups() -> None:
    policies = policy(default={"allowed": ["small"], "quota_slices": 2})
    err = refusal([], "large", 3, [], {}, policies)
    assert str(err) == "'large' is not allowed for users outside the GPU groups; allowed: small"
    err = refusal([], "small", 1, [], {"default": GroupTally(2, 2)}, policies)
    assert str(err) == "users outside the GPU groups hold 2 of their 2 slices"
    user = policies.for_user(["students"])
    assert check_claim(user, "small", 1, [], {"default": GroupTally(1, 1)}).name == "default"


@pytest.mark.parametrize(
    ("user_groups", "offer", "compute", "usage", "charged"),
    [
        (["analysts"], "small", 1, {"analysts": GroupTally(5, 5)}, "analysts"),
        (["analysts", "ml-team"], "medium", 2, {}, "ml-team"),
        # ml-team (priority 10) is full in compute slices: the lease falls to analysts.
        (["analysts", "ml-team"], "medium", 2, {"ml-team": GroupTally(3, 6)}, "analysts"),
        # Only 1 compute slice left in ml-team: a 1g still fits there.
        (["analysts", "ml-team"], "1g.35gb", 1, {"ml-team": GroupTally(3, 6)}, "ml-team"),
        (["analysts", "admins"], "small", 1, {"analysts": GroupTally(6, 6)}, "admins"),
    ],
)
def test_check_claim_charges_the_first_group_with_room(
    user_groups: list[str],
    offer: str,
    compute: int,
    usage: dict[str, GroupTally],
    charged: str,
) -> None:
    user = policy().for_user(user_groups)
    assert check_claim(user, offer, compute, [], usage).name == charged


def test_tally_adds_up_leases_per_group() -> None:
    holdings = [GPU, Holding("b", "3g.71gb", 3, "ml-team"), Holding("c", "2g.35gb", 2, "ml-team")]
    assert tally(holdings) == {"analysts": GroupTally(1, 1), "ml-team": GroupTally(2, 5)}


@given(
    quotas=st.lists(
        st.tuples(st.none() | st.integers(0, 4), st.none() | st.integers(0, 8), st.integers(-2, 2)),
        min_size=1,
        max_size=3,
    ),
    used=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10)), min_size=3, max_size=3),
    compute=st.integers(1, 7),
)
def test_a_charged_group_always_has_room_and_a_refusal_means_none_had(
    quotas: list[tuple[int | None, int | None, int]], used: list[tuple[int, int]], compute: int
) -> None:
    names = [f"g{i}" for i in range(len(quotas))]
    groups = {
        name: {
            "allowed": ["small"],
            "quota_slices": slices,
            "quota_compute_slices": cs,
            "priority": prio,
        }
        for name, (slices, cs, prio) in zip(names, quotas, strict=False)
    }
    usage = {name: GroupTally(*u) for name, u in zip(names, used, strict=False)}
    policy_set = policy(groups=groups)
    user = policy_set.for_user(names)

    def has_room(name: str) -> bool:
        g, u = policy_set.group(name), usage[name]
        return (g.quota_slices is None or u.slices < g.quota_slices) and (
            g.quota_compute_slices is None or u.compute_slices + compute <= g.quota_compute_slices
        )

    try:
        charged = check_claim(user, "small", compute, [], usage)
    except Refused as err:
        assert err.reason == Reason.GROUP_QUOTA
        assert not any(has_room(n) for n in names)
    else:
        assert has_room(charged.name)
        # No group tried before it had room.
        order = [g.name for g in user.charge_candidates("small")]
        assert not any(has_room(n) for n in order[: order.index(charged.name)])
