"""The allocator's refusals: why it could not give a slice, in words a user can act on.

Every message names the slice that was asked for, how many GPUs were looked at,
what stood in the way, and what *is* free right now, so the user can pick
something else from the spawn form.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from mig_spawner.core.catalog import MODELS, model
from mig_spawner.core.refusal import Reason, Refused

from .tables import WHY_LIMIT, WHY_MEDIA, WHY_SLICES

# MIG state of one GPU as the allocator sees it.
MigState = Literal["on", "off", "pending"]

_PROFILE_ORDER = {p.name: (p.placement_size, p.compute_slices, p.media_extensions)
                  for m in MODELS for p in m.profiles}


@dataclass(frozen=True)
class GpuView:
    """The little the refusal logic needs to know about one GPU."""

    index: int
    model_key: str | None
    mig: MigState


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _indexes(gpus: Iterable[GpuView]) -> str:
    return ",".join(str(i) for i in sorted(g.index for g in gpus))


def free_text(free: Mapping[str, int], leaving_out: Iterable[str] = ()) -> str:
    """``"free now: 1g.18gb: 3, 3g.71gb: 1"``, smallest profile first, zeros left out."""
    skip = set(leaving_out)
    items = sorted(
        ((n, c) for n, c in free.items() if c and n not in skip),
        key=lambda item: (_PROFILE_ORDER.get(item[0], (99, 99, True)), item[0]),
    )
    if not items:
        return "nothing else is free either"
    return "free now: " + ", ".join(f"{n}: {c}" for n, c in items)


def wanted_text(wants: Mapping[str, str]) -> str:
    """``"2g.35gb"`` or, when the slice class differs by model, ``"2g.35gb (H200) or ..."``."""
    names = sorted(set(wants.values()))
    if len(names) == 1:
        return names[0]
    return " or ".join(f"{name} ({model(key).display_name})" for key, name in sorted(wants.items()))


def precheck(
    gpus: Iterable[GpuView], wants: Mapping[str, str], free: Mapping[str, int]
) -> tuple[list[GpuView], Refused | None]:
    """GPUs that may hold the wanted slice (MIG on), or the refusal when there are none."""
    all_gpus = list(gpus)
    eligible = [g for g in all_gpus if g.model_key in wants]
    usable = [g for g in eligible if g.mig == "on"]
    what = wanted_text(wants) if wants else "that slice"
    if not eligible:
        kinds = Counter(
            model(g.model_key).display_name if g.model_key else "GPU without MIG"
            for g in all_gpus
        )
        have = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())) or "no GPUs"
        return [], Refused(
            Reason.NO_GPU_FOR_PROFILE,
            f"no GPU here offers {what}; this host has {have}; {free_text(free)}",
            free=free,
        )
    if usable:
        return usable, None
    parts = []
    off = [g for g in eligible if g.mig == "off"]
    pending = [g for g in eligible if g.mig == "pending"]
    if off:
        parts.append(
            f"MIG mode is off on GPU {_indexes(off)}; an admin enables it with "
            f"'nvidia-smi -i {_indexes(off)} -mig 1' (root, GPU idle)"
        )
    if pending:
        parts.append(
            f"GPU {_indexes(pending)} has a MIG mode change waiting for a GPU reset "
            f"('nvidia-smi -i {_indexes(pending)} -r' when idle)"
        )
    return [], Refused(
        Reason.MIG_DISABLED, f"cannot give {what}: {'; '.join(parts)}; {free_text(free)}",
        free=free,
    )


def _elsewhere(all_eligible: int, usable: int) -> str:
    rest = all_eligible - usable
    return f"; {plural(rest, 'more GPU')} with MIG off or pending" if rest else ""


def none_free(
    wants: Mapping[str, str], usable: int, eligible: int, exist: int, leased: int, busy: int,
    free: Mapping[str, int],
) -> Refused:
    """Pool mode: every instance of the profile is taken (or none was ever made)."""
    name = wanted_text(wants)
    on = plural(usable, "GPU")
    if exist == 0:
        detail = (f"no {name} instance exists on the {on} with MIG on; an admin creates them "
                  f"with 'nvidia-smi mig -cgi {name} -C'")
    else:
        taken = [f"{leased} leased"] if leased else []
        if busy:
            taken.append(f"{busy} running processes that no lease accounts for")
        detail = f"no {name} free on {on} ({exist} exist: {', '.join(taken)})"
    detail += _elsewhere(eligible, usable)
    return Refused(Reason.NONE_FREE, f"{detail}; {free_text(free, wants.values())}", free=free)


_WHY_TEXT = {
    WHY_SLICES: "not enough free aligned memory slices",
    WHY_LIMIT: "instance limit for {name} reached",
    WHY_MEDIA: "the one +me (media extensions) instance per GPU is taken",
}


def no_capacity(
    wants: Mapping[str, str], usable: int, eligible: int, whys: Counter[str],
    free: Mapping[str, int],
) -> Refused:
    """Dynamic mode: no GPU has room for a new instance of the profile."""
    name = wanted_text(wants)
    causes = "; ".join(
        f"{_WHY_TEXT[why].format(name=name)} on {plural(n, 'GPU')}"
        for why, n in sorted(whys.items())
    )
    text = f"no room for a new {name} on {plural(usable, 'GPU')} ({causes})"
    text += _elsewhere(eligible, usable)
    return Refused(Reason.NO_CAPACITY, f"{text}; {free_text(free, wants.values())}", free=free)
