"""The one list of refusal reasons: stable values, the status the hub answers with."""

from __future__ import annotations

from mig_spawner.core.refusal import Reason, Refused

# The ledger's refusals table stores these values and metrics label with them: a change
# here splits every report and dashboard in two.
STATUS = {
    "invalid_options": 400,
    "unknown_profile": 400,
    "not_allowed": 403,
    "no_gpu_access": 403,
    "user_limit": 409,
    "group_quota": 409,
    "previous_lease": 409,
    "none_free": 503,
    "no_capacity": 503,
    "mig_disabled": 503,
    "no_gpu_for_profile": 503,
    "budget_spent": 429,
    "gpu_recut": 503,
    "gpu_unhealthy": 503,
    "lease_ended": 409,
    "mig_create": 503,
    "mig_backend": 503,
    "mig_config": 500,
    "policy_config": 500,
    "isolation": 500,
    "server_start": 503,
}


def test_reasons_keep_their_values_and_statuses():
    assert {r.value: r.status for r in Reason} == STATUS
    assert all(Reason(value) == value == str(Reason(value)) for value in STATUS)


def test_refused_says_its_message_and_joins_the_hint_on_request():
    refused = Refused(Reason.USER_LIMIT, "you already hold 1 of 1 slices", "stop one")
    assert str(refused) == refused.message == "you already hold 1 of 1 slices"
    assert refused.sentence == "you already hold 1 of 1 slices. stop one."
    assert Refused(Reason.NONE_FREE, "no 1g.18gb free").sentence == "no 1g.18gb free"
    # The same question gets an equal refusal (the allocator's decisions are compared).
    assert refused == Refused(Reason.USER_LIMIT, "you already hold 1 of 1 slices", "stop one")
    assert len({refused, Refused(Reason.USER_LIMIT, "you already hold 1 of 1 slices",
                                 "stop one")}) == 1


def test_no_reason_is_spelt_as_a_string_outside_the_one_list():
    """Every refusal reason is named through ``Reason``; the migrations keep history."""
    import re
    from pathlib import Path

    import mig_spawner
    from mig_spawner.core.refusal import Reason

    package = Path(mig_spawner.__file__).parent
    # The simulator's state has a "mig_config" field (the NVML capability), and doctor
    # and the spawner's start-up check name the "isolation" setting, and a layout change on
    # Kubernetes sets the node label nvidia.com/mig.config: names, no reasons.
    not_reasons = {("gpu/simulator/state.py", "mig_config"),
                   ("gpu/simulator/library.py", "mig_config"),
                   ("cli/layout.py", "mig_config"),
                   ("layout.py", "mig_config"),
                   ("cli/doctor.py", "isolation"),
                   ("spawner/local.py", "isolation")}
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where == "core/refusal.py" or where.startswith("ledger/migrations/versions/"):
            continue
        text = path.read_text()
        for reason in Reason:
            if (where, reason.value) in not_reasons:
                continue
            if re.search(rf"[\"']{reason.value}[\"']", text):
                found.append(f"{where}: {reason.value!r}")
    assert found == []
