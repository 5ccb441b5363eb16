"""The claim decision on Kubernetes: quota from the ledger, capacity from the cluster.

The device plugin, not mig-spawner, hands a pod its MIG device, so a Kubernetes
lease records no GPU placement: the ledger's transaction guards the quotas, and
capacity comes from the cluster snapshot (node allocatable minus the requests of
running pods) less the leases whose pods that snapshot does not show yet.
Pure functions; :mod:`mig_spawner.spawner.kube` wires them into the spawner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

from mig_spawner.core.catalog import model
from mig_spawner.core.kinds import Kind, rules_of
from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.kube import ClusterSlices
from mig_spawner.kube.cluster import Target
from mig_spawner.ledger import KUBE_NODE, Decide, Grant, Lease, LedgerView

from .decide import charge

#: Why a size whose only slices the device plugin left out of allocatable, or the DRA
#: driver tainted or took out of its ResourceSlice, cannot be had (the form's words).
CLUSTER_UNHEALTHY = "the cluster reports its GPU unhealthy"


def wanted_on_cluster(offer: Offer, slices: ClusterSlices) -> dict[str, str]:
    """GPU model key -> the profile ``offer`` means there, for the models the cluster
    offers now."""
    return {
        key: name for key in slices.model_keys() if (name := offer.profile_for(key)) is not None
    }


def in_flight(leases: Iterable[Lease], slices: ClusterSlices) -> Counter[str]:
    """Held Kubernetes leases per profile whose pod the snapshot did not count: claimed a
    moment ago (pod not created or not yet bound to a node), so the slice they will
    take still looks free in the cluster."""
    return Counter(
        lease.profile
        for lease in leases
        if not rules_of(lease.mode).placed and lease.held
        and lease.pod not in slices.counted_pods
    )


def free_by_model(slices: ClusterSlices, leases: Iterable[Lease]) -> dict[str, dict[str, int]]:
    """Free count per GPU model key, then per profile, as the spawn form shows it, with
    the in-flight leases taken off.

    A lease records its profile, not the GPU model its pod will land on, so a profile
    that two models share has its in-flight leases taken off the models in key order:
    each model's count may be off by those, their sum is exact.
    """
    pending = in_flight(leases, slices)
    out: dict[str, dict[str, int]] = {}
    for key, per_profile in sorted(slices.free().items()):
        out[key] = {}
        for name, count in per_profile.items():
            taken = min(count, pending[name])
            pending[name] -= taken
            out[key][name] = count - taken
    return out


@dataclass
class ClaimTarget:
    """Where the decision sent the claim; filled in by ``decide`` for the pod manifest."""

    target: Target | None = None




def _nothing_here(offer: Offer, slices: ClusterSlices) -> Refused:
    name = offer.display_name or offer.key
    left_out = (
        " GPU nodes not offered now: "
        + "; ".join(f"{s.name}: {s.reason}" for s in slices.skipped)
        + "."
        if slices.skipped
        else ""
    )
    return Refused(
        Reason.NO_GPU_FOR_PROFILE,
        f"No schedulable GPU node of the cluster offers {name!r} now.{left_out}",
    )


def without_held_nodes(slices: ClusterSlices, holds: Mapping[tuple[str, str], frozenset[int]]
                       ) -> ClusterSlices:
    """``slices`` less the nodes a layout change holds (docs/layout.md): a node being
    drained for MIG Manager gets no new pod."""
    held = {node for node, what in holds if what == KUBE_NODE}
    if not held:
        return slices
    return replace(slices, nodes=tuple(n for n in slices.nodes if n.name not in held))


def make_kube_decide(
    policy: UserPolicy, offer: Offer, slices: ClusterSlices, pod: str, choice: ClaimTarget
) -> Decide:
    """The ``decide(view)`` callback for one Kubernetes spawn of ``offer`` as pod ``pod``
    (``namespace/name``). It records the chosen :class:`Target` in ``choice``."""
    wants = wanted_on_cluster(offer, slices)

    def decide(view: LedgerView) -> Grant:
        if not wants:
            raise _nothing_here(offer, slices)
        # Quota first with the smallest size the offer can mean: a user at their limit
        # hears about the limit, not about what happens to be free.
        smallest = min(model(k).profile(p).compute_slices for k, p in wants.items())
        charge(policy, offer, smallest, view)
        pending = in_flight(view.leases, slices)
        targets = without_held_nodes(slices, view.holds).targets(wants)
        target = next((t for t in targets if t.free - pending[t.profile] > 0), None)
        if target is None and any(t.free - pending[t.profile] > 0
                                  for t in slices.targets(wants)):
            raise Refused(Reason.GPU_RECUT, f"No {offer.display_name or offer.key!r} is "
                          "free right now: the node that has one is being re-cut by an admin",
                          "try again later or pick another size")
        bad, used = slices.withheld(wants)
        starting = sum(pending[p] for p in set(wants.values()))
        if target is None and bad and not used and not starting:
            raise Refused(Reason.GPU_UNHEALTHY, f"No {offer.display_name or offer.key!r} can be "
                          f"started now: {CLUSTER_UNHEALTHY}",
                          "pick another size, or tell a hub admin")
        if target is None:
            total = sum(t.free for t in targets)
            raise Refused(
                Reason.NONE_FREE,
                f"All {offer.display_name or offer.key!r} slices of the cluster are in use "
                f"({len(targets)} kind(s) of node looked at, {total} free before the "
                f"{sum(pending.values())} being started). Try again later or pick another size.",
            )
        profile = model(target.model_key).profile(target.profile)
        group = charge(policy, offer, profile.compute_slices, view)
        choice.target = target
        return Grant(
            group=group.name,
            profile=profile.name,
            compute_slices=profile.compute_slices,
            mode=Kind.KUBE,
            pod=pod,
            expires_at=(
                view.now + timedelta(seconds=group.max_session_age)
                if group.max_session_age
                else None
            ),
        )

    return decide
