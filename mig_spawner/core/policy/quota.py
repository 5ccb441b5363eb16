"""The quota check a claim runs inside the ledger's transaction.

Pure: the ledger reads the user's active leases and each group's usage in the same
transaction that inserts the new lease, and calls :func:`check_claim` in between, so
two concurrent spawns cannot both squeeze under one quota. Import through
:mod:`mig_spawner.core.policy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from mig_spawner.core.refusal import Reason, Refused

from .model import GroupPolicy, UserPolicy, offer_key


@dataclass(frozen=True)
class Holding:
    """One active lease of the user who is claiming."""

    server_name: str
    profile: str
    compute_slices: int
    group: str


@dataclass(frozen=True)
class GroupTally:
    """What the active leases charged to one group add up to."""

    slices: int = 0
    compute_slices: int = 0


def tally(holdings: Iterable[Holding]) -> dict[str, GroupTally]:
    """Usage per charged group of a set of active leases."""
    usage: dict[str, GroupTally] = {}
    for h in holdings:
        before = usage.get(h.group, GroupTally())
        usage[h.group] = GroupTally(before.slices + 1, before.compute_slices + h.compute_slices)
    return usage


def check_claim(
    user_policy: UserPolicy,
    offer: str,
    profile_compute_slices: int,
    user_active: Sequence[Holding],
    group_active: Mapping[str, GroupTally],
    afford: Callable[[GroupPolicy], Refused | None] | None = None,
) -> GroupPolicy:
    """The group a new lease of ``offer`` is charged to; else raises ``Refused``.

    ``profile_compute_slices``: compute slices of the profile the allocator picked (a
    class means different profiles on different GPUs). ``user_active``: the user's active
    leases. ``group_active``: usage per group of all active leases (groups missing from
    it hold nothing). Checks, in order: GPU access at all, the offer, the user's limit,
    then the quotas of the groups that allow the offer, in ``charge_candidates`` order;
    the first group with room is charged. ``afford(group)``: why that group's budgets
    cannot pay for the lease (a ``budget`` refusal), or ``None``; a group with room but
    no budget left is passed over like a full one, and when no group is full the
    budget refusal with the earliest retry is raised.
    """
    if not user_policy.has_gpu_access:
        raise Refused(
            Reason.NO_GPU_ACCESS,
            "your groups allow no GPU slices; ask an admin to add you to a group",
            "a hub admin can add you to a JupyterHub group that has a GPU policy",
        )
    key = offer_key(offer)
    if not user_policy.allows(key):
        raise Refused(
            Reason.NOT_ALLOWED,
            f"{key!r} is not allowed for {_your_groups(user_policy)}; "
            f"allowed: {', '.join(user_policy.offer_keys)}",
            "pick one of the allowed sizes, or ask an admin for a bigger one",
        )
    if len(user_active) >= user_policy.max_slices:
        raise Refused(
            Reason.USER_LIMIT,
            f"you already hold {len(user_active)} of {user_policy.max_slices} slices "
            f"({_servers(user_active)})",
            "stop one of your GPU servers to start another",
        )
    candidates = user_policy.charge_candidates(key)
    full = []
    spent: list[Refused] = []
    for group in candidates:
        shortfall = _shortfall(
            group, group_active.get(group.name, GroupTally()), profile_compute_slices, key
        )
        if shortfall is None:
            broke = afford(group) if afford is not None else None
            if broke is None:
                return group
            spent.append(broke)
            continue
        full.append(shortfall)
    if spent and not full:
        raise min(spent, key=lambda r: (r.retry_at is None, r.retry_at or 0))
    if len(full) == 1:
        # Only the default policy applies alone without being one of "your" groups.
        message = full[0] if candidates[0].is_default else f"your {full[0]}"
    else:
        message = f"every group of yours that allows {key!r} is full: " + "; ".join(full)
    raise Refused(
        Reason.GROUP_QUOTA,
        message,
        "wait for a colleague to stop a server, or pick a smaller size",
    )


def _shortfall(group: GroupPolicy, usage: GroupTally, compute: int, key: str) -> str | None:
    """``None`` when the group has room for one more lease; else why not, in words."""
    if group.is_default:
        who, holds, uses, its = "users outside the GPU groups", "hold", "use", "their"
    else:
        who, holds, uses, its = f"group {group.name!r}", "holds", "uses", "its"
    if group.quota_slices is not None and usage.slices + 1 > group.quota_slices:
        return f"{who} {holds} {usage.slices} of {its} {group.quota_slices} slices"
    quota = group.quota_compute_slices
    if quota is not None and usage.compute_slices + compute > quota:
        return (
            f"{who} {uses} {usage.compute_slices} of {its} {quota} compute slices "
            f"and {key!r} needs {compute}"
        )
    return None


def _your_groups(user_policy: UserPolicy) -> str:
    if any(g.is_default for g in user_policy.groups):
        return "users outside the GPU groups"
    return f"your groups ({', '.join(user_policy.group_names)})"


def _servers(holdings: Sequence[Holding]) -> str:
    """``server 'gpu'``, ``your default server`` or ``servers default, 'big'``."""
    # JupyterHub's default server has the empty name; unquoted "default" tells it apart
    # from a named server called 'default'.
    names = [repr(h.server_name) if h.server_name else "default" for h in holdings]
    if len(names) == 1:
        return f"server {names[0]}" if holdings[0].server_name else "your default server"
    return f"servers {', '.join(names)}"
