"""Advice on a valid policy that still misleads: the start-up warnings of the wording,
of offers a pool cannot serve, and of settings that another one keeps from acting.

Pure: the callers (the hub's start-up check, ``mig-spawner doctor``) read the GPUs and
print the warnings. Import through :mod:`mig_spawner.core.policy`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation

from mig_spawner.core.catalog import MODELS, WHOLE_GPU, is_whole_gpu, model
from mig_spawner.core.durations import format_duration

from .model import GroupPolicy, Offer, PolicySet

#: A memory size in wording: "35 GB", "32.2 GiB", "16gb". Not the "35gb" inside a
#: profile name such as "1g.35gb" (preceded by a dot), which names a profile, not a size.
_MEMORY_RE = re.compile(
    r"(?<![\w.])(?P<number>\d+(?:[.,]\d+)?)\s*(?P<unit>[KMGT]i?B)\b", re.IGNORECASE
)


def _offer_models(offer: Offer, model_keys: Iterable[str] | None) -> dict[str, str]:
    """GPU model key -> the profile ``offer`` means there, on ``model_keys`` (None: on
    every catalog model the offer can mean)."""
    keys = [m.key for m in MODELS] if model_keys is None else list(model_keys)
    return {key: profile for key in keys if (profile := offer.profile_for(key))}


def _what(offer: Offer) -> str:
    return f"slice class {offer.key!r}" if offer.is_class else f"offer {offer.key!r}"


def _stated_right(number: str, unit: str, sizes: set[str]) -> bool:
    """Whether "<number> <unit>" is written as the slice's memory is shown: GiB with
    one decimal, equal to one of ``sizes`` (``format_gib`` texts)."""
    try:
        value = Decimal(number.replace(",", "."))
    except InvalidOperation:
        return False
    if unit.lower() != "gib" or "." not in number.replace(",", "."):
        return False
    return any(value == Decimal(size.split()[0]) for size in sizes)


def memory_wording_warnings(
    policies: PolicySet, model_keys: Iterable[str] | None = None
) -> list[str]:
    """Display names and descriptions that state a memory size the slice does not have.

    Every screen shows a slice's memory as GiB with one decimal (``Profile.memory_text``,
    :func:`~mig_spawner.core.catalog.format_gib`): an
    offer worded "35 GB" over a 32.2 GiB slice, or "32 GiB", reads as another size than
    the form, the map and the report show. A size matches when it equals, so written,
    the slice's memory on one of the GPU models it is offered on (``model_keys``: the
    fleet; None: every model the offer names). One warning per stated size that does
    not, with the size to write.
    """
    keys = None if model_keys is None else tuple(model_keys)
    warnings = []
    for offer in policies.offers.values():
        profiles = _offer_models(offer, keys)
        if not profiles:
            continue
        memory = {key: model(key).profile(p).memory_text for key, p in profiles.items()}
        sizes = set(memory.values())
        for field, text in (("display_name", offer.display_name),
                            ("description", offer.description)):
            for found in _MEMORY_RE.finditer(text or ""):
                if _stated_right(found["number"], found["unit"], sizes):
                    continue
                has = ", ".join(f"{size} on {model(key).display_name}"
                                for key, size in sorted(memory.items()))
                write = f"; write {next(iter(sizes))!r}" if len(sizes) == 1 else ""
                warnings.append(
                    f"the {_what(offer)} says {found[0]!r} in its {field}, but the slice "
                    f"has {has}: mig-spawner shows memory as GiB with one decimal{write}"
                )
    return warnings


def unserved_offers(
    policies: PolicySet, model_keys: Iterable[str], devices: Iterable[tuple[str, str]]
) -> list[str]:
    """Offers some group may pick that no MIG device on this host can serve (pool mode).

    ``model_keys``: the host's GPU models; ``devices``: ``(model key, profile)`` of each
    MIG device it has. One warning per such offer, naming the groups that allow it.
    """
    keys = tuple(model_keys)
    present = set(devices)
    granting: dict[str, list[str]] = {}
    for group in (*policies.groups.values(), policies.default):
        for key in group.allowed:
            granting.setdefault(key, []).append(group.name)
    warnings = []
    for key, offer in policies.offers.items():
        profiles = _offer_models(offer, keys)
        if key not in granting or offer.whole or not profiles or any(
            (m, p) in present for m, p in profiles.items()
        ):
            continue
        names = ", ".join(sorted(set(profiles.values())))
        what = names if names == key else f"{key!r} ({names})"
        warnings.append(
            f"pool mode offers {what} to {', '.join(sorted(granting[key]))} but no such "
            "MIG device exists on this host: create it (nvidia-smi mig -cgi ... -C) or "
            "remove it from those groups' allowed lists"
        )
    return warnings



def unserved_whole_gpus(policies: PolicySet, whole_gpus: int) -> list[str]:
    """A warning when some group may pick a whole GPU (``catalog.WHOLE_GPU``) on a host
    with ``whole_gpus`` == 0 GPUs offered whole (none has MIG off)."""
    groups = sorted(g.name for g in (*policies.groups.values(), policies.default)
                    if any(map(is_whole_gpu, g.allowed)))
    if whole_gpus or not groups:
        return []
    return [
        f"{', '.join(groups)} may pick {WHOLE_GPU!r} (a whole GPU) but no GPU on this host "
        "has MIG off: turn it off on the GPUs to offer whole (nvidia-smi -i <index> -mig 0, "
        f"then reset the GPU) or remove {WHOLE_GPU!r} from those groups' allowed lists"
    ]


#: What a group's settings are when the admin leaves them out.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GroupPolicy)}


def contradiction_warnings(policies: PolicySet) -> list[str]:
    """Settings that another setting of the same group keeps from ever acting, where
    that may be on purpose (a group closed for now, waiting switched off for a while).
    Contradictions that cannot be on purpose are refused by ``build_policy`` instead;
    docs/policies.md lists both."""
    warnings = []
    for group in (*policies.groups.values(), policies.default):
        if not group.allowed:
            continue  # nothing to get: the "allowed = []" warning says so
        who = "default_policy" if group.is_default else f"group {group.name!r}"
        for quota in ("quota_slices", "quota_compute_slices"):
            if getattr(group, quota) == 0:
                warnings.append(
                    f"{who} has {quota} = 0: no slice is ever charged to it, so its "
                    "members get one only through another group"
                )
        if not group.queue:
            unused = [k for k in ("max_wait", "max_waiting_per_user")
                      if getattr(group, k) != _DEFAULTS[k]]
            if unused:
                warnings.append(
                    f"{who} sets {' and '.join(unused)} but not queue = True: its members "
                    "never wait, so these have no effect"
                )
        if group.cull_busy_kernels and group.server_idle_timeout is None \
                and group.kernel_idle_timeout is None:
            warnings.append(
                f"{who} has cull_busy_kernels = True but no server_idle_timeout or "
                "kernel_idle_timeout: nothing is culled for idleness, busy or not"
            )
        if not group.cull_connected_kernels and group.kernel_idle_timeout is None:
            warnings.append(
                f"{who} has cull_connected_kernels = False but no kernel_idle_timeout: no "
                "kernel is shut down for idleness anyway"
            )
        warnings += _idle_beyond_age(group, who)
    return warnings


def _idle_beyond_age(group: GroupPolicy, who: str) -> list[str]:
    """Idle limits no server lives long enough to reach: a server is never idle for
    longer than it has run, and it runs at most ``max_session_age`` (plus every
    extension)."""
    if group.max_session_age is None:
        return []
    longest = group.max_session_age + (group.extend_by or 0) * group.max_extensions
    age = "max_session_age" if longest == group.max_session_age else \
        "max_session_age with every extension"
    return [
        f"{who} has {key} {format_duration(limit)}, but no server runs longer than "
        f"{format_duration(longest)} ({age}): the age limit always stops it first, so "
        "this idle limit never acts"
        for key in ("server_idle_timeout", "kernel_idle_timeout")
        if (limit := getattr(group, key)) is not None and limit >= longest
    ]
