"""What a backend hands the MIG spawner mixin: the slices it can offer and how to claim one.

:class:`~mig_spawner.spawner.mixin.MIGSpawnerMixin` does the form, the validation,
the claim in the ledger, the give-back and the records; a backend (this host's GPUs
in ``local.py``, the cluster in ``kube.py``) only answers its hooks with these
values. No JupyterHub import.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mig_spawner.core.catalog import GpuModel
from mig_spawner.core.policy import Offer
from mig_spawner.core.waitlist import contends
from mig_spawner.ledger import Decide, Lease

#: Free slices per GPU model key, then per profile name.
FreeByModel = Mapping[str, Mapping[str, int]]


def held_back(before: FreeByModel, after: FreeByModel) -> dict[str, int]:
    """Slices per profile name free in ``before`` (no layout hold counted) but not in
    ``after`` (holds counted): what :attr:`SliceSupply.recut` shows."""
    recut: Counter[str] = Counter()
    for key, counts in before.items():
        for name, count in counts.items():
            recut[name] += count - after.get(key, {}).get(name, 0)
    return dict(+recut)


@dataclass(frozen=True)
class SliceSupply:
    """What the spawn form shows: the GPU models present, what is free, what is held.

    ``fixed_layout``: the slices exist beforehand (pool mode, Kubernetes nodes), so a
    profile with none free and none held has no instance at all; False in dynamic mode,
    where other sizes may fill the room it would be made from."""

    models: tuple[GpuModel, ...]
    free: FreeByModel
    held: tuple[Lease, ...]
    fixed_layout: bool = True
    #: Slices per profile name that would be free but a layout change holds (an admin
    #: re-cuts their GPU, docs/layout.md): the form says so.
    recut: Mapping[str, int] = field(default_factory=dict)
    #: GPU model key -> why slices of it are withheld for their health, in words the
    #: form puts after "Unavailable: " (``GPU 1 reported a hardware fault``; on
    #: Kubernetes, what the cluster reports). docs/health.md.
    unhealthy: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClaimPlan:
    """How to claim one slice of an offer on this backend.

    ``decide``: the callback ``ledger.leases.claim`` runs in its transaction. ``granted``:
    called once, after the claim was granted; returns where the slice is, in words
    (``"GPU 0 (NVIDIA H200)"``) for the progress page and the log. ``wants``: GPU
    model key -> the profile the offer means there (recorded with a refusal).
    ``host``: the host that was asked, when the backend is one host. ``memory``: the
    granted slice's memory in words (``"16.8 GiB"``), when the backend knows it.
    """

    decide: Decide
    granted: Callable[[Lease], str]
    wants: Mapping[str, str]
    host: str | None = None
    memory: Callable[[Lease], str | None] = lambda lease: None
    #: The slice is carved from room other sizes share (dynamic mode), so a waiter for
    #: any size of the same GPU models competes with it (``core.waitlist.contends``).
    carved: bool = False

    def contends(self, offer: Offer | None) -> bool:
        """Whether this claim could take what a waiter for ``offer`` could be served
        (``None``: an offer the policies no longer have, which may)."""
        return contends(self.wants, offer.profile_for if offer else None, self.carved)

    @property
    def profile(self) -> str | None:
        """The one concrete profile the offer means here, or None when it means several
        (a slice class on a mixed fleet) or none."""
        names = set(self.wants.values())
        return names.pop() if len(names) == 1 else None
