"""The decision a claim makes inside the ledger's transaction: policy, then allocator.

:func:`make_decide` returns the pure ``decide(view)`` callback that
``ledger.leases.claim`` runs while it holds the claim lock, so the quota check and the
choice of slice see the same held leases as the insert that follows: two
concurrent spawns cannot both take the last slice or squeeze under one quota.
Refusals are raised as :class:`~mig_spawner.core.refusal.Refused` and nothing is
written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Literal

from mig_spawner.core import budget
from mig_spawner.core.allocator import Holds, SliceIndex
from mig_spawner.core.budget import Extra, Span
from mig_spawner.core.catalog import model
from mig_spawner.core.health import withheld_words
from mig_spawner.core.inventory import Inventory
from mig_spawner.core.kinds import Kind, MigMode, Picked, offer_kind, offered_kinds
from mig_spawner.core.policy import (
    GroupPolicy,
    GroupTally,
    Holding,
    Offer,
    UserPolicy,
    check_claim,
    tally,
)
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.ledger import Decide, GpuFault, Grant, Lease, LedgerView

Mode = MigMode | Kind


#: What a host's decisions read: its allocator index (kept across decisions), or one
#: read of its GPUs (an index is built for it).
Fleet = SliceIndex | Inventory


def index_of(fleet: Fleet) -> SliceIndex:
    """``fleet``'s allocator index: itself, or a new one of an inventory."""
    return fleet if isinstance(fleet, SliceIndex) else SliceIndex(fleet)


def wanted_profiles(offer: Offer, fleet: Fleet) -> dict[str, str]:
    """GPU model key -> profile name that ``offer`` means on each MIG model of the host."""
    keys = fleet.model_keys if isinstance(fleet, SliceIndex) else sorted(
        {g.model_key for g in fleet.gpus if g.model_key})
    return {key: name for key in keys if (name := offer.profile_for(key)) is not None}


def free_now(
    fleet: Fleet, leases: Iterable[Lease], mode: Mode, holds: Holds | None = None,
) -> dict[str, dict[str, int]]:
    """Free count per GPU model key, then per profile name, as the spawn form shows it.

    Counted per model because one profile name can exist on two models (``1g.10gb`` on
    the A100 80GB and the H100): a slice class that means it on both must count each
    GPU's slices once, not the fleet's total once per model.
    """
    index = index_of(fleet)
    with index.lock:
        index.match(leases, holds)
        counted = [kind.free(index) for kind in offered_kinds(mode)]
        keys = index.model_keys
    return {key: {name: n for free in counted for name, n in free.get(key, {}).items()}
            for key in keys}


def faulty_models(index: SliceIndex, faults: Iterable[GpuFault]) -> dict[str, str]:
    """GPU model key -> why slices of it are withheld for the faults held on this host,
    in words (``GPU 1 reported a hardware fault``; :attr:`SliceSupply.unhealthy
    <mig_spawner.spawner.backend.SliceSupply.unhealthy>`). A lost GPU cannot say its
    model (nor, to a process that never read it, its UUID): its words go with every
    model of the host."""
    by_model: dict[str, list[int]] = {}
    for fault in sorted(faults, key=lambda f: f.gpu_index):
        if fault.host != index.inventory.host:
            continue
        gpu = index.gpu(fault.gpu_uuid)
        for key in [gpu.model_key] if gpu and gpu.model_key else index.model_keys:
            if fault.gpu_index not in by_model.setdefault(key, []):
                by_model[key].append(fault.gpu_index)
    return {key: ", ".join(map(withheld_words, found)) for key, found in by_model.items()}


def fault_words(index: SliceIndex, faulty: Holds) -> str:
    """Why a claim finds its slices withheld for faults, in words: the faulty GPUs of
    this host by index (``GPU 1 reported a hardware fault``)."""
    gpus = sorted(gpu.index for (host, uuid) in faulty
                  if host == index.inventory.host and (gpu := index.gpu(uuid)) is not None)
    return ", ".join(map(withheld_words, gpus)) or "a GPU reported a hardware fault"


def holdings(
    leases: Iterable[Lease], user: str
) -> tuple[list[Holding], dict[str, GroupTally]]:
    """The user's held leases and every group's usage, as the quota check reads them."""
    held = [(lease.user, Holding(lease.server_name, lease.profile, lease.compute_slices,
                                 lease.group)) for lease in leases]
    return [h for owner, h in held if owner == user], tally(h for _, h in held)


def budget_check(
    user: str, compute: int, spans: Sequence[Span], extras: Sequence[Extra], now: datetime
) -> Callable[[GroupPolicy], Refused | None]:
    """``afford(group)`` for :func:`check_claim`: why ``group``'s budgets cannot pay for
    a lease of ``compute`` compute slices of ``user`` at ``now``, or ``None``."""

    def afford(group: GroupPolicy) -> Refused | None:
        if not group.has_budget:
            return None
        return budget.refusal(group, user, compute, spans, extras, now)

    return afford


def _check(
    user_policy: UserPolicy, offer: Offer, compute: int, leases: Iterable[Lease], user: str,
    view: LedgerView | None = None,
) -> GroupPolicy:
    leases = list(leases)
    mine, usage = holdings(leases, user)
    afford = None
    if view is not None:
        spans = budget.spans_of(leases, view.past)
        afford = budget_check(user, compute, spans, view.extras, view.now)
    return check_claim(user_policy, offer.key, compute, mine, usage, afford)


def quota_problem(
    user_policy: UserPolicy, offer: Offer, compute_slices: int, view_leases: Iterable[Lease],
    user: str, book: LedgerView | None = None,
) -> Refused | None:
    """Why the quota (or, given the ``book`` of past leases and extra hours, a budget)
    forbids one more lease of ``offer`` now, or ``None``."""
    try:
        _check(user_policy, offer, compute_slices, view_leases, user, book)
    except Refused as refusal:
        return refusal
    return None


def charge(policy: UserPolicy, offer: Offer, compute: int, view: LedgerView) -> GroupPolicy:
    """The group the lease is charged to, checked in the claim's transaction; else raises
    :class:`Refused`, its hint in the message."""
    try:
        return _check(policy, offer, compute, view.leases, view.request.user, view)
    except Refused as refusal:
        # second pass: the mixin reads e.message; once it reads e.sentence, let it pass.
        raise Refused(refusal.reason, refusal.sentence, retry_at=refusal.retry_at) from None


def make_decide(
    user_policy: UserPolicy,
    offer: Offer,
    fleet: Fleet,
    mode: Mode,
    strategy: Literal["pack", "spread"],
    demand: Mapping[str, float] | None = None,
) -> Decide:
    """The ``decide`` callback for one spawn of ``offer`` on this host's ``fleet``.

    Given the host's :class:`SliceIndex`, every decision reads and updates that one
    index (under its lock), so a decision costs the same whatever the fleet's size.

    ``demand`` (profile name -> recent requests) lets dynamic placement keep room for
    the sizes users actually ask for (docs/allocator.md).
    """
    index = index_of(fleet)
    host = index.inventory.host
    wants = wanted_profiles(offer, index)
    kind = offer_kind(offer.whole, mode)

    def decide(view: LedgerView) -> Grant:
        if not wants:
            raise Refused(Reason.NO_GPU_FOR_PROFILE, f"no GPU on this host offers {offer.key!r}")
        # Quota first with the smallest size the offer can mean here: a user at their
        # limit hears about the limit, not about which slices happen to be free.
        smallest = min(model(k).profile(n).compute_slices for k, n in wants.items())
        charge(user_policy, offer, smallest, view)

        def pick(holds: Holds) -> Picked | Refused:
            # The index keeps what the last decision read; only what changed is applied.
            index.match(view.leases, holds)
            return kind.pick(index, wants, strategy, demand)

        with index.lock:
            picked = pick(view.holds)
            if isinstance(picked, Refused):
                if not view.holds:
                    raise picked
                unheld = pick({})
                if isinstance(unheld, Refused):
                    raise unheld  # the holds are not why: say what is
                if view.faulty and isinstance(pick(view.faulty), Refused):
                    # The faults alone keep it from this user: say so, in words.
                    raise Refused(Reason.GPU_UNHEALTHY, f"no {offer.display_name} is free right "
                                  f"now: {fault_words(index, view.faulty)}",
                                  "pick another size or try again later", picked.free)
                raise Refused(Reason.GPU_RECUT, f"no {offer.display_name} is free right now: "
                              "the GPU that has one is being re-cut by an admin",
                              "try again later or pick another size", picked.free)
            gpu = index.gpu(picked.placement.gpu_uuid)
        where, device = picked.placement, picked.device
        assert gpu is not None  # the index picks among its own GPUs
        profile = model(gpu.model_key or "").profile(where.profile)
        group = charge(user_policy, offer, profile.compute_slices, view)
        expires = (
            view.now + timedelta(seconds=group.max_session_age)
            if group.max_session_age
            else None
        )
        return Grant(
            group=group.name,
            profile=profile.name,
            compute_slices=profile.compute_slices,
            mode=kind.rules.kind,
            host=host,
            gpu_uuid=where.gpu_uuid,
            gpu_index=where.gpu_index,
            start=where.start,
            size=where.size,
            mig_uuid=device.uuid if device else None,
            gi_id=device.gi_id if device else None,
            ci_id=device.ci_id if device else None,
            expires_at=expires,
        )

    return decide
