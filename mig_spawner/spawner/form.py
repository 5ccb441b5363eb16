"""The spawn form: what a user may pick, what each choice gives, and what is free now.

:func:`build_choices` turns the user's policy, the GPU models present and the
free counts into :class:`Choice` rows; :func:`render_form` renders them with
``templates/spawn_form.html``. No JupyterHub import: the mixin feeds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache

import jinja2

from mig_spawner.core.catalog import GpuModel, Profile
from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.core.purpose import MAX_PURPOSE_LENGTH, PurposeRule

NO_ACCESS_MESSAGE = (
    "Your groups are not allowed any GPU slice on this hub. "
    "Ask a hub admin to add you to a group with GPU access."
)

# What each size is for, by compute slices: start small for notebooks and debugging,
# measure before fine-tuning, whole GPU only when needed (docs/analyst-guide.md,
# "Choosing a size").
# An admin's ``description`` on the offer replaces these.
_NEED_BY_COMPUTE = {
    1: "Notebooks, debugging, small models, checking that a model loads and that the "
    "data pipeline is right.",
    2: "Larger batches and inference of mid-size models. For inference, check latency "
    "and batch size on the slice before relying on it.",
    3: "Fine-tuning and heavier experiments. Measure memory in a short test run first: "
    "peaks grow with batch size and context length.",
    4: "Fine-tuning and heavier experiments that need more compute. Measure memory in a "
    "short test run first.",
    7: "Almost the whole GPU: for models that need nearly all of its memory. If a small "
    "slice is enough, leave this one to colleagues who need it.",
}
#: The advice for a whole GPU (MIG off).
_NEED_WHOLE = ("The whole GPU, MIG off: for work that needs all of its memory and compute "
               "at once. If a slice is enough, leave it to colleagues who need it.")


@dataclass(frozen=True)
class Facts:
    """What one profile gives on one GPU model, in words."""

    gpu: str
    profile: str
    memory_text: str
    compute_text: str


@dataclass(frozen=True)
class Choice:
    """One radio button: an offer the user's groups allow."""

    key: str
    title: str
    description: str
    facts: tuple[Facts, ...]
    free: int
    unavailable: str | None
    #: For an exhausted choice the user may wait for: what joining the wait list means.
    wait: str | None = None
    #: Where the GPU-hour budget this size would spend stands (``None``: no budget).
    budget: str | None = None

    @property
    def available(self) -> bool:
        return self.unavailable is None


def facts(gpu: GpuModel, profile: Profile) -> Facts:
    """``"71 GB memory"``, ``"3/7 of the GPU's compute"`` for one profile."""
    return Facts(
        gpu=gpu.display_name,
        profile=profile.name,
        memory_text=profile.memory_text,
        compute_text=f"{profile.compute_slices}/{gpu.compute_slices} of the GPU's compute",
    )


def need_text(offer: Offer, compute_slices: int) -> str:
    """The offer's own description, else the advice for its size."""
    if offer.description:
        return offer.description
    if offer.whole:
        return _NEED_WHOLE
    return _NEED_BY_COMPUTE.get(compute_slices, _NEED_BY_COMPUTE[7])


def build_choices(
    policy: UserPolicy,
    models: Iterable[GpuModel],
    free: Mapping[str, Mapping[str, int]],
    quota_problem: Callable[[Offer, int], str | None],
    scope: str = "on this host",
    waits: Mapping[str, str] | None = None,
    in_use: Mapping[str, int] | None = None,
    fixed_layout: bool = True,
    hide_absent: bool = False,
    budget_line: Callable[[Offer, int], str | None] | None = None,
    recut: Mapping[str, int] | None = None,
    unhealthy: Mapping[str, str] | None = None,
) -> list[Choice]:
    """One :class:`Choice` per offer of ``policy``, in the policy's order.

    ``models``: the MIG GPU models present (what the offer means here). ``free``: free
    count per GPU model key, then per profile name; an offer's count adds up the profile
    it means on each model. ``quota_problem(offer, compute_slices)``: why the user's or
    group's quota forbids one more of it, or ``None``. ``scope``: where the GPUs are, in
    words (``"on this host"``, ``"in the cluster"``). ``in_use``: held slices per
    profile name. ``waits``: offer key -> the wait list's state (``"2 waiting, usually
    5-15 min"``) for the offers the user may wait for: exhausted, they stay selectable
    and starting one joins the wait list. ``fixed_layout``: slices exist beforehand
    (pool, Kubernetes), so none free and none held means there is no such slice.
    ``hide_absent``: leave out the offers that have no slice at all (nobody can get
    them, waiting or not). ``budget_line(offer, compute_slices)``: where the budget
    a lease of it would spend stands, in words, or ``None``. ``recut``: slices per
    profile name that an admin's layout change holds from new servers (docs/layout.md).
    ``unhealthy``: GPU model key -> why its faulty slices are withheld, in words
    (``GPU 1 reported a hardware fault``; docs/health.md): a size with none free says
    it is unavailable for that.
    """
    waits, in_use, recut, unhealthy = waits or {}, in_use or {}, recut or {}, unhealthy or {}
    present = list({m.key: m for m in models}.values())
    choices, absent_keys = [], set()
    for offer in policy.offers:
        served = [
            (gpu, gpu.profile(name))
            for gpu in present
            if (name := offer.profile_for(gpu.key)) is not None
        ]
        count = sum(free.get(gpu.key, {}).get(profile.name, 0) for gpu, profile in served)
        compute = min((p.compute_slices for _, p in served), default=0)
        held = sum(in_use.get(profile.name, 0) for _, profile in served)
        changing = sum(recut.get(profile.name, 0) for _, profile in served)
        faulty = ", ".join(unhealthy[gpu.key] for gpu, _ in served if gpu.key in unhealthy)
        # Whole GPUs are there or not whatever the layout: MIG is off on them beforehand.
        absent = not served or ((fixed_layout or offer.whole) and not held and not count
                                and not changing and not faulty)
        if absent:
            absent_keys.add(offer.key)
        wait = None
        if not served:
            why = f"no GPU {scope} has this size"
        elif (why := quota_problem(offer, compute)) is None and not count:
            if absent:
                why = f"no such slice {scope} (ask a hub admin)"
            elif changing:
                why = RECUT
            elif faulty:
                # The form shows it after its own "Unavailable:". A size that is also
                # full says so first: one faulty GPU of a model does not explain the rest.
                why = f"{in_use_text(held)}; {faulty}" if held else faulty
            elif not held:
                why = "none free right now: other sizes fill the GPUs"
            else:
                why = f"{in_use_text(held)} right now"
            if not absent and offer.key in waits:
                # An admin's re-cut first: waiting then lasts until it is done.
                busy = (RECUT if changing else f"{UNAVAILABLE}{faulty}" if faulty
                        else in_use_text(held) if held else "none free")
                wait = f"{busy[0].upper()}{busy[1:]} \u2014 join the wait list ({waits[offer.key]})"
                why = None
        choices.append(
            Choice(
                key=offer.key,
                title=offer.display_name or offer.key,
                description=need_text(offer, compute),
                facts=tuple(facts(gpu, profile) for gpu, profile in served),
                free=count,
                unavailable=why,
                wait=wait,
                budget=budget_line(offer, compute) if budget_line and served else None,
            )
        )
    if hide_absent and len(absent_keys) < len(choices):
        # Nobody can get these, waiting or not (a form left with no choice at all
        # keeps them, so that it says why instead of "no GPU access").
        return [c for c in choices if c.key not in absent_keys]
    return choices


#: Before why a size is withheld for its GPU's health (docs/health.md).
UNAVAILABLE = "unavailable: "
#: A size whose slices an admin's layout change holds (docs/layout.md).
RECUT = "not free for a while: an admin is re-cutting its GPU"


def in_use_text(held: int) -> str:
    """``"the only one is in use"``, ``"all 6 in use"``: ``held`` slices of a size, all
    of them held (said under the size's own heading, which names it)."""
    return "the only one is in use" if held == 1 else f"all {held} in use"


def blocked_choices(policy: UserPolicy) -> list[Choice]:
    """The user's offers, none of them selectable: for a form shown while the GPUs or
    the ledger cannot be read (the form's ``problem`` says why)."""
    return [
        Choice(
            key=offer.key,
            title=offer.display_name or offer.key,
            description=offer.description,
            facts=(),
            free=0,
            unavailable="cannot be checked right now",
        )
        for offer in policy.offers
    ]


def preselect(choices: Iterable[Choice], last: str | None) -> str | None:
    """The user's last choice when it is available now, else the first available one
    (free ones before wait-list ones)."""
    choices = list(choices)
    # A choice free now before one that joins the wait list.
    free = [c.key for c in choices if c.available and not c.wait]
    queued = [c.key for c in choices if c.available and c.wait]
    for keys in (free, queued):
        if last in keys:
            return last
    return (free or queued or [None])[0]


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("mig_spawner", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template("spawn_form.html")


#: Shown when no choice can be picked: the Start button is off, and this says why.
NOTHING_TO_START = (
    "No GPU slice can be chosen right now, so Start is off; each size below says why."
)


def render_form(
    choices: list[Choice], last: str | None = None, problem: str | None = None,
    notice: str | None = None, purpose: PurposeRule | None = None,
    last_purpose: str | None = None, hint: str | None = None,
) -> str:
    """The HTML fragment JupyterHub puts inside its spawn ``<form>``; ``problem``: why
    nothing can be picked now, shown above the choices; ``notice``: news for the user
    (a wait that ended while they were away). ``purpose``: what to ask about the
    server's purpose (None: nothing), prefilled with ``last_purpose``; ``hint``: advice
    on the size from the user's measured sessions. With no choice that can be picked,
    the page's Start button is turned off (the server refuses such a post anyway)."""
    selected = preselect(choices, last)
    return _template().render(
        notice=notice,
        choices=choices,
        selected=selected,
        no_access_message=NO_ACCESS_MESSAGE,
        nothing_to_start=NOTHING_TO_START if choices and selected is None and not problem
        else None,
        problem=problem,
        purpose=purpose if purpose is not None and purpose.asked else None,
        last_purpose=last_purpose or "",
        max_purpose=MAX_PURPOSE_LENGTH,
        hint=hint,
    )
