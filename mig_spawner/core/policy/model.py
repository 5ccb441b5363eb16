"""Group policy data: what a user may pick, with which limits, and for whom.

Pure values built by :func:`mig_spawner.core.policy.build_policy`; import them
through :mod:`mig_spawner.core.policy`. Multi-group semantics live in
:meth:`PolicySet.for_user` and are documented in docs/policies.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from mig_spawner.core.catalog import (
    WHOLE_GPU,
    CatalogError,
    is_whole_gpu,
    model,
    normalize_profile_name,
    parse_profile_name,
)
from mig_spawner.core.purpose import PurposeRule

#: What the form calls the whole-GPU offer when ``offers`` gives it no wording.
WHOLE_GPU_NAME = "A whole GPU"

# Name under which leases of users in no configured group are charged. A JupyterHub
# group of that name cannot also get a policy (build_policy says so).
DEFAULT_GROUP = "default"


class PolicyError(ValueError):
    """The policy config is wrong. ``problems`` lists every mistake found, each naming
    the group (or class, or offer) and the key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        count = len(self.problems)
        heading = "1 problem" if count == 1 else f"{count} problems"
        super().__init__(
            f"{heading} in the MIG group policy config:\n"
            + "\n".join(f"  - {p}" for p in self.problems)
        )


def offer_key(text: str) -> str:
    """Canonical key of an offer: profile names normalised (``"MIG 1G.18GB"`` ->
    ``"1g.18gb"``), class names only stripped."""
    stripped = str(text).strip()
    if is_whole_gpu(stripped.lower()):
        return WHOLE_GPU
    return normalize_profile_name(stripped) if is_profile_name(stripped) else stripped


def is_profile_name(text: str) -> bool:
    """True when ``text`` is spelled like a MIG profile (``1g.18gb``, ``1g.10gb+me``)."""
    try:
        parse_profile_name(text)
    except CatalogError:
        return False
    return True


class OfferKind(StrEnum):
    """What an offer is: one MIG profile, a slice class (one profile per GPU model), or
    a whole GPU with MIG off (its value is the whole GPU's profile name)."""

    PROFILE = "profile"
    CLASS = "class"
    WHOLE = WHOLE_GPU


@dataclass(frozen=True)
class Offer:
    """One thing a user can pick on the spawn form.

    Either a concrete MIG profile (``OfferKind.PROFILE``, ``key == "1g.18gb"``) or a
    slice class (``OfferKind.CLASS``, ``key == "small"``) that names one profile per
    GPU model key, so that one choice means "a small slice" on every GPU of a mixed fleet,
    or a whole GPU with MIG off (``OfferKind.WHOLE``, its key ``catalog.WHOLE_GPU``)
    of any model.
    """

    key: str
    kind: OfferKind
    display_name: str
    description: str = ""
    # For a class: GPU model key -> profile name. Empty for a profile offer.
    profiles: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def is_class(self) -> bool:
        return self.kind is OfferKind.CLASS

    @property
    def named(self) -> str:
        """How a sentence a user reads names this offer: its display name, the heading the
        spawn form shows for it, in quotes (``“Large: 3 of 7 compute slices”``), never
        its key."""
        return f"\u201c{self.display_name or self.key}\u201d"

    @property
    def whole(self) -> bool:
        """A whole GPU, not a MIG slice."""
        return self.kind is OfferKind.WHOLE

    def profile_for(self, model_key: str) -> str | None:
        """The profile this offer means on a GPU of model ``model_key``, or ``None`` when
        the offer cannot be served there (class without that model; profile the model
        lacks). Raises :class:`CatalogError` for a model key the catalog does not know."""
        gpu = model(model_key)
        if self.whole:
            return WHOLE_GPU
        if self.is_class:
            return self.profiles.get(gpu.key)
        return self.key if gpu.has_profile(self.key) else None


@dataclass(frozen=True)
class GroupPolicy:
    """What members of one JupyterHub group may use, and the limits of their leases.

    Durations are seconds, ``None`` meaning no limit. Culling semantics (carried out by
    the slice service):

    * ``server_idle_timeout``: stop a server with no activity for this long. Activity is
      what a person does (typing, running cells, editing, saving in JupyterLab; terminal
      input), a busy kernel unless ``cull_busy_kernels``, and GPU work; an open tab is
      not, unless ``open_tab_counts`` (see docs/culling.md). The wait list refines it:
      ``server_idle_timeout_when_unwaited`` applies while nobody waits for the server's
      size, ``server_idle_timeout_when_waited`` while someone does (each ``None``:
      ``server_idle_timeout``);
    * ``open_tab_counts``: when True, any request to the server (an open JupyterLab
      tab's polling included) counts as activity, as jupyterhub-idle-culler judges it;
    * ``kernel_idle_timeout``: shut down an idle kernel after this long (the server and
      its slice stay), one that a notebook tab is connected to as well, after a warning
      (the kernel holds the slice's memory); ``cull_connected_kernels`` False keeps a
      connected kernel however idle;
    * ``max_session_age``: stop the server once its lease is this old, busy or not;
    * ``cull_busy_kernels``: when True, a kernel that has been executing with no output
      for ``kernel_idle_timeout`` is treated as idle; when False busy kernels are never
      ended by the idle limits;
    * ``gpu_activity_counts``: when True (the default), GPU work on the slice (compute
      processes with SM activity, or any compute process where the GPU cannot report
      SM activity) within the idle limit keeps the server from being stopped for
      idleness. Memory held with no process and no SM activity is not work;
    * ``warn_before``: the user is warned this long before the slice service stops the
      server (idle or max session age), with a "Keep my server" button; ``None``: no
      warning. Keep counts as activity for an idle stop; for max session age it moves
      the lease's ``expires_at`` by ``extend_by``, at most ``max_extensions`` times.
    * ``drain_notice``: when the GPU a server's slice lies on is re-cut (docs/layout.md),
      the server is warned and stopped this long after the drain began (default one
      hour); Keep cannot pass it. ``None``: never stopped, the change waits for it.
    * ``fault_grace``, ``fault_action``: when the GPU or MIG device a server's slice
      lies on reports a hardware fault (docs/health.md), the server's user is warned at
      once; with ``fault_action`` ``"stop"`` (the default) the server is stopped
      ``fault_grace`` after the fault was seen (default ten minutes; ``None``: no
      grace, at once), Keep cannot pass it; ``"finish"``: never stopped, left to finish.

    Waiting (docs/policies.md, "Waiting"): with ``queue`` on, a member whose spawn finds
    no slice free may join the wait list for up to ``max_wait`` seconds, with at most
    ``max_waiting_per_user`` waits at once; while anyone waits for a profile, its
    servers charged to this group are culled after ``server_idle_timeout_when_waited``
    of idleness instead of ``server_idle_timeout`` (``None``: no change), and only after
    a warning (``warn_before``) with the stop's time.

    Budgets (docs/policies.md, "Budgets"; :mod:`mig_spawner.core.budget`): ``budget``
    compute-slice-seconds over a rolling ``budget_window`` for all leases charged to the
    group, ``user_budget`` for each member's own within it (``None``: no budget). A
    spawn is covered when every budget pays for ``budget_min_hold`` of its size; when
    one is spent, ``budget_action`` ``"stop"`` stops the servers it pays for,
    ``"refuse_new"`` only refuses new ones. Members are warned once
    ``budget_warn_share`` of a budget is used (``None``: only ``warn_before`` ahead).
    """

    name: str
    allowed: tuple[str, ...] = ()
    max_slices_per_user: int = 1
    quota_slices: int | None = None
    quota_compute_slices: int | None = None
    server_idle_timeout: float | None = None
    kernel_idle_timeout: float | None = None
    max_session_age: float | None = None
    cull_busy_kernels: bool = False
    cull_connected_kernels: bool = True
    gpu_activity_counts: bool = True
    warn_before: float | None = 600.0
    extend_by: float | None = None
    max_extensions: int = 0
    priority: int = 0
    queue: bool = False
    max_wait: float | None = 1800.0
    max_waiting_per_user: int = 1
    server_idle_timeout_when_waited: float | None = None
    server_idle_timeout_when_unwaited: float | None = None
    open_tab_counts: bool = False
    #: The offer an admin's "Start Server" or an API start without options gets
    #: (docs/admin-install.md); ``None``: such a start is refused, naming the choice.
    default_offer: str | None = None
    #: Purposes members pick from on the form (docs/policies.md, "Purpose").
    purpose_choices: tuple[str, ...] = ()
    #: Whether members may describe the purpose in their own short words.
    purpose_free_text: bool = True
    #: Whether a spawn must say what the server is for.
    purpose_required: bool = False

    budget: float | None = None
    user_budget: float | None = None
    budget_window: float = 7 * 86400.0
    budget_min_hold: float = 1800.0
    budget_action: Literal["stop", "refuse_new"] = "stop"
    budget_warn_share: float | None = 0.8
    drain_notice: float | None = 3600.0
    fault_grace: float | None = 600.0
    fault_action: Literal["stop", "finish"] = "stop"

    @property
    def has_budget(self) -> bool:
        """Whether a group or member budget limits this group's leases."""
        return self.budget is not None or self.user_budget is not None

    @property
    def grants_gpu(self) -> bool:
        return bool(self.allowed)

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_GROUP


@dataclass(frozen=True)
class UserPolicy:
    """The policy of one user, resolved from all their groups (see :meth:`PolicySet.for_user`)."""

    groups: tuple[GroupPolicy, ...]
    offers: tuple[Offer, ...]
    max_slices: int

    @property
    def has_gpu_access(self) -> bool:
        return bool(self.offers)

    @property
    def offer_keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.offers)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def allows(self, key: str) -> bool:
        return offer_key(key) in self.offer_keys

    @property
    def default_offer(self) -> str | None:
        """The offer a start without options gets: that of the user's group with the
        highest ``priority`` (ties: by name) that names one; ``None`` when none does."""
        naming = [g for g in self.groups if g.default_offer and g.default_offer in self.offer_keys]
        naming.sort(key=lambda g: (-g.priority, g.name))
        return naming[0].default_offer if naming else None

    @property
    def purpose(self) -> PurposeRule:
        """What the form asks about the server's purpose, over the user's groups that
        allow a GPU: their choices (in group order, without repeats), free text when
        any of them allows it, required when any of them requires it."""
        granting = [g for g in self.groups if g.grants_gpu] or list(self.groups)
        choices = dict.fromkeys(c for g in granting for c in g.purpose_choices)
        return PurposeRule(
            choices=tuple(choices),
            free_text=any(g.purpose_free_text for g in granting),
            required=any(g.purpose_required for g in granting),
        )

    def offer(self, key: str) -> Offer:
        """The allowed offer with this key; ``KeyError`` when it is not allowed."""
        wanted = offer_key(key)
        for o in self.offers:
            if o.key == wanted:
                return o
        raise KeyError(wanted)

    def charge_candidates(self, key: str) -> list[GroupPolicy]:
        """The user's groups that allow ``key``, in the order a claim tries to charge them:
        highest ``priority`` first, then by group name."""
        wanted = offer_key(key)
        allowing = [g for g in self.groups if wanted in g.allowed]
        return sorted(allowing, key=lambda g: (-g.priority, g.name))


@dataclass(frozen=True)
class PolicySet:
    """Every offer and group policy of a hub, validated; build it with ``build_policy``."""

    offers: Mapping[str, Offer]
    groups: Mapping[str, GroupPolicy]
    default: GroupPolicy = field(default_factory=lambda: GroupPolicy(DEFAULT_GROUP))

    def for_user(self, groups: Iterable[str]) -> UserPolicy:
        """Resolve the policy of a user who belongs to the JupyterHub groups ``groups``.

        * Groups without a policy are ignored. A user in none of the configured groups
          gets the default policy; a user in at least one gets only their groups' policies
          (so a configured group with an empty ``allowed`` list denies GPU access).
        * Allowed offers: the union over the user's groups, in the order of ``offers``.
        * ``max_slices``: the largest ``max_slices_per_user`` among the user's groups that
          allow anything (0 when none does).
        * Each lease is charged to one group: see :meth:`UserPolicy.charge_candidates`.
        """
        if isinstance(groups, str):
            # A bare string would be read as a set of one-letter group names.
            raise TypeError(f"for_user() takes a list of group names, got the string {groups!r}")
        mine = sorted(
            (self.groups[g] for g in set(groups) if g in self.groups), key=lambda g: g.name
        )
        applying = tuple(mine) if mine else (self.default,)
        allowed = {key for g in applying for key in g.allowed}
        granting = [g.max_slices_per_user for g in applying if g.grants_gpu]
        return UserPolicy(
            groups=applying,
            offers=tuple(o for key, o in self.offers.items() if key in allowed),
            max_slices=max(granting, default=0),
        )

    def group(self, name: str) -> GroupPolicy:
        """The policy that sets the limits of a lease charged to group ``name``.

        A lease charged to a group that is no longer configured (the config changed
        since it was claimed) follows the default policy's limits; check
        ``name in policy.groups`` to tell the two apart.
        """
        return self.groups.get(name, self.default)

    def offer(self, key: str) -> Offer:
        """The offer with this key (``KeyError`` when none)."""
        return self.offers[offer_key(key)]

    @property
    def budget_horizon(self) -> float | None:
        """The longest budget window of any group (seconds), ``None`` when no group has a
        budget: how far back the ledger must read past leases for budgets."""
        windows = [g.budget_window for g in (*self.groups.values(), self.default)
                   if g.has_budget]
        return max(windows, default=None)

    def profiles_meant(self, offer_keys: Iterable[str]) -> frozenset[str]:
        """The concrete profiles that the offers (profile or class keys) mean: what a
        wait list's entries wait for (an unknown key stands for itself)."""
        out: set[str] = set()
        for key in offer_keys:
            offer = self.offers.get(key)
            out.update(offer.profiles.values() if offer and offer.is_class else [key])
        return frozenset(out)

    def profile_names(self, model_keys: Iterable[str] | None = None) -> tuple[str, ...]:
        """Every concrete profile some group's offer can mean, in offer order, without
        repeats: what a pool layout has to provide. ``model_keys`` limits it to those GPU
        models (the fleet); ``None`` keeps every profile named anywhere."""
        granted = {k for g in (*self.groups.values(), self.default) for k in g.allowed}
        names: dict[str, None] = {}
        for key, offer in self.offers.items():
            if key not in granted or offer.whole:  # a whole GPU is no MIG instance
                continue
            if model_keys is None:
                names.update(dict.fromkeys(offer.profiles.values() if offer.is_class else [key]))
            else:
                names.update(dict.fromkeys(p for m in model_keys if (p := offer.profile_for(m))))
        return tuple(names)
