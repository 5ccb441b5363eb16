"""NVIDIA's MIG rules, applied to the simulated state.

Each operation either changes a :class:`SimGpu` or raises :class:`SimError` carrying the
NVML return code the real driver gives in that situation (see docs/mig-facts.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pynvml

from mig_spawner.core import catalog

from .spec import NON_MIG_MODELS
from .state import SimComputeInstance, SimGpu, SimGpuInstance


class SimError(Exception):
    """An NVML return code to hand back to pynvml."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def mig_model(gpu: SimGpu) -> catalog.GpuModel:
    """The GPU's catalog model; NOT_SUPPORTED for a GPU without MIG."""
    model = gpu.model
    if model is None:
        raise SimError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return model


def require_mig_on(gpu: SimGpu) -> catalog.GpuModel:
    """Instance calls need MIG enabled now (NVML answers NOT_SUPPORTED otherwise)."""
    model = mig_model(gpu)
    if not gpu.mig_current:
        raise SimError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return model


# Where a real driver's table differs from the catalog (which holds one driver's
# figures): (model key, first driver branch) -> profile -> GiB. B200's 1g shrank from
# 22.00 GiB on R570 to 20.50 on a later driver (NVIDIA/mig-parted#166 vs #187); the
# branch it changed in is not published, 575 is assumed.
_DRIVER_GIB = {("b200", 575): {"1g.23gb": 20.50, "1g.23gb+me": 20.50}}


def as_driver_reports(profile: catalog.Profile, model_key: str, driver_version: str
                      ) -> catalog.Profile:
    """``profile`` with the figures this driver version reports for it."""
    try:
        branch = int(driver_version.split(".")[0])
    except ValueError:
        return profile
    for (key, first), table in _DRIVER_GIB.items():
        if key == model_key and branch >= first and profile.name in table:
            return replace(profile, memory_mib=catalog.printed_mib(table[profile.name]))
    return profile


# Profiles a driver lists only from some branch on (NVIDIA's MIG User Guide, "Supported
# MIG Profiles": the A30's 1g.6gb+me from R470 and 2g.12gb+me from R525; the A100's 1g
# with two memory slices from R525): (model key, profile) -> first branch.
_DRIVER_FIRST = {("a30", "1g.6gb+me"): 470, ("a30", "2g.12gb+me"): 525,
                 ("a100-40gb", "1g.10gb"): 525, ("a100-80gb", "1g.20gb"): 525}


def offered_by_driver(profile: catalog.Profile, model_key: str, driver_version: str) -> bool:
    """Whether this driver version lists ``profile`` at all (older ones answer its profile
    info NOT_SUPPORTED and refuse to create it)."""
    first = _DRIVER_FIRST.get((model_key, profile.name))
    try:
        return first is None or int(driver_version.split(".")[0]) >= first
    except ValueError:
        return True


def profile_by_enum(gpu: SimGpu, enum_index: int) -> catalog.Profile:
    model = mig_model(gpu)
    if not 0 <= enum_index < catalog.GI_PROFILE_COUNT:
        raise SimError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    try:
        return model.profile_by_enum(enum_index)
    except catalog.CatalogError:
        raise SimError(pynvml.NVML_ERROR_NOT_SUPPORTED) from None


def profile_by_id(gpu: SimGpu, profile_id: int, *, mig_off_ok: bool = False
                  ) -> catalog.Profile:
    """The profile with chip ID ``profile_id``; instance calls need MIG on, while
    possible placements are answered whatever the mode (``mig_off_ok``, per nvml.h)."""
    model = mig_model(gpu) if mig_off_ok else require_mig_on(gpu)
    try:
        return model.profile_by_id(profile_id)
    except catalog.CatalogError:
        raise SimError(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None


def _used_slices(gpu: SimGpu) -> set[int]:
    return {s for gi in gpu.gis.values() for s in range(gi.start, gi.start + gi.size)}


def _headroom(gpu: SimGpu, model: catalog.GpuModel, profile: catalog.Profile) -> int:
    """How many more of ``profile`` the per-profile cap, the one-``+me`` rule and the
    compute slices allow, ignoring where memory slices are free."""
    profiles = [model.profile_by_id(gi.profile_id) for gi in gpu.gis.values()]
    if profile.media_extensions and any(p.media_extensions for p in profiles):
        return 0
    same = sum(1 for p in profiles if p.profile_id == profile.profile_id)
    spare_compute = model.compute_slices - sum(p.compute_slices for p in profiles)
    return min(profile.max_instances - same, spare_compute // profile.compute_slices)


def _free(used: set[int], start: int, size: int) -> bool:
    return not used.intersection(range(start, start + size))


def remaining_capacity(gpu: SimGpu, profile_id: int) -> int:
    """How many more instances of this profile fit now (caps and free slices)."""
    model = require_mig_on(gpu)
    profile = profile_by_id(gpu, profile_id)
    used = _used_slices(gpu)
    free = sum(1 for s in profile.placement_starts if _free(used, s, profile.placement_size))
    return max(0, min(free, _headroom(gpu, model, profile)))


def create_gpu_instance(gpu: SimGpu, profile_id: int, start: int | None,
                        size: int | None = None) -> SimGpuInstance:
    """Create a GI at ``start`` (or where the driver would put it when ``start`` is None)."""
    model = require_mig_on(gpu)
    profile = profile_by_id(gpu, profile_id)
    if start is not None and (start not in profile.placement_starts
                              or size != profile.placement_size):
        raise SimError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if _headroom(gpu, model, profile) <= 0:
        raise SimError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    used = _used_slices(gpu)
    if start is None:
        # The driver walks its own start order; naive creation fragments the GPU
        # (docs/mig-facts.md).
        start = next((s for s in model.driver_starts(profile)
                      if _free(used, s, profile.placement_size)), None)
        if start is None:
            raise SimError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    elif not _free(used, start, profile.placement_size):
        raise SimError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    gi = SimGpuInstance(gi_id_for(gpu, model, start, profile.placement_size),
                        profile.profile_id, start, profile.placement_size)
    gpu.gis[gi.gi_id] = gi
    return gi


# How a board numbers its GPU instances; the driver does not promise any formula, and
# boards differ (docs/simulator.md lists what each scheme models).
ID_SCHEMES = ("forward", "reverse", "sequential")


def gi_id_for(gpu: SimGpu, model: catalog.GpuModel, start: int, size: int) -> int:
    """The GI ID this GPU's driver gives a new instance at ``start`` of ``size`` slices.

    ``forward``: one ID block per size, biggest first, ascending start (8 slices: size 8
    -> 0, size 4 at 0/4 -> 1/2, size 2 at s -> 3 + s/2, size 1 at s -> 7 + s).
    ``reverse``: the same blocks, descending start (A100s in NVIDIA/DCGM#138 and the
    guide's example: size 4 at 4 -> 1, at 0 -> 2). ``sequential``: the lowest free ID
    from 1 in creation order (the full GPU is 0), which no placement formula predicts.
    """
    if gpu.id_scheme == "sequential":
        if size == model.memory_slices:
            return 0
        return next(i for i in range(1, 64) if i not in gpu.gis)
    base = model.memory_slices // size - 1
    starts = sorted({s for p in model.profiles if p.placement_size == size
                     for s in p.placement_starts})
    slot = starts.index(start)
    if gpu.id_scheme == "reverse":
        slot = len(starts) - 1 - slot
    return base + slot


def ci_profile_slices(gpu: SimGpu, gi: SimGpuInstance, ci_profile: int) -> int:
    """Compute slices of a CI profile inside ``gi``: the catalog's table of what the real
    driver offers in a GPU instance of that profile (:attr:`catalog.Profile.compute_profiles`);
    NOT_SUPPORTED for one it does not offer, as the driver answers."""
    if ci_profile < 0 or ci_profile >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise SimError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    slices = mig_model(gpu).profile_by_id(gi.profile_id).compute_profiles.get(ci_profile)
    if slices is None:
        raise SimError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return slices


def create_compute_instance(gpu: SimGpu, gi: SimGpuInstance,
                            ci_profile: int) -> SimComputeInstance:
    """Create the full-size CI of ``gi`` (the only CI shape the simulator models)."""
    slices = ci_profile_slices(gpu, gi, ci_profile)
    full = mig_model(gpu).profile_by_id(gi.profile_id)
    if ci_profile != full.ci_profile_index:
        # Smaller CIs (several per GI) are real but out of the simulator's scope.
        raise SimError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    if gi.cis:
        raise SimError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    ci = SimComputeInstance(0, ci_profile, slices)
    gi.cis[ci.ci_id] = ci
    return ci


def destroy_compute_instance(gi: SimGpuInstance, ci_id: int) -> None:
    if gi.cis[ci_id].processes:
        raise SimError(pynvml.NVML_ERROR_IN_USE)
    del gi.cis[ci_id]


def destroy_gpu_instance(gpu: SimGpu, gi_id: int) -> None:
    if gpu.gis[gi_id].cis:
        raise SimError(pynvml.NVML_ERROR_IN_USE)
    del gpu.gis[gi_id]


def set_mig_mode(gpu: SimGpu, mode: int) -> int:
    """Request a MIG mode; returns the activation status (SUCCESS or RESET_REQUIRED)."""
    model = mig_model(gpu)
    if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
        raise SimError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if gpu.gis or gpu.processes:  # instances, or processes on the whole GPU
        raise SimError(pynvml.NVML_ERROR_IN_USE)
    gpu.mig_pending = mode
    # Ampere needs a GPU reset before the new mode is live; Hopper and later switch at once.
    if model.architecture == "Ampere" and gpu.mig_current != mode:
        return pynvml.NVML_ERROR_RESET_REQUIRED
    gpu.mig_current = mode
    return pynvml.NVML_SUCCESS


def reset_gpu(gpu: SimGpu) -> None:
    """A GPU reset: the pending MIG mode takes effect and every instance is gone; a lost
    GPU answers again, the volatile ECC counters restart, a pending row remap or page
    retirement takes effect (a failed remap stays: the GPU needs service)."""
    gpu.mig_current = gpu.mig_pending
    gpu.gis.clear()
    gpu.processes.clear()
    gpu.memory_used_mib = None
    gpu.lost = False
    gpu.ecc_uncorrected[0] = 0
    gpu.remapped_rows[2] = 0
    gpu.pages_pending = False


def remaps_rows(gpu: SimGpu) -> bool:
    """Row remapping replaced page retirement from Ampere on (NVIDIA, "A100 GPU Memory
    Error Management": GA100, GA10x, AD10x, GH100); of the simulated GPUs only the T4
    (Turing) retires pages. Each answers NOT_SUPPORTED for the other's call."""
    return gpu.product != NON_MIG_MODELS["t4"][0]


def mig_devices(gpu: SimGpu) -> list[tuple[SimGpuInstance, SimComputeInstance]]:
    """The GPU's MIG devices in enumeration order (by GI ID, then CI ID)."""
    if not gpu.mig_current:
        return []
    return [(gi, gi.cis[c]) for g in sorted(gpu.gis) for gi in (gpu.gis[g],)
            for c in sorted(gi.cis)]


def apply_layout(gpu: SimGpu, names: tuple[str, ...]) -> None:
    """Create ``names`` (GI + full-size CI each) at dense, deterministic placements.

    Biggest profiles first, each at the highest free start, with backtracking, so any
    layout the placement rules allow is found (1g*2,2g,3g on an H100 fits this way).
    """
    model = mig_model(gpu)
    profiles = sorted((model.profile(n) for n in names),
                      key=lambda p: (-p.placement_size, len(p.placement_starts), p.name))
    starts = _pack(gpu, model, profiles, 0)
    if starts is None:
        counts = Counter(names)
        shown = ",".join(f"{n}*{k}" if k > 1 else n for n, k in counts.items())
        raise ValueError(f"layout {shown} cannot be made on one {model.display_name}: "
                         f"{why_not_fit(model, profiles)}")
    for profile, start in zip(profiles, starts, strict=True):
        gi = create_gpu_instance(gpu, profile.profile_id, start, profile.placement_size)
        create_compute_instance(gpu, gi, profile.ci_profile_index)


def _in_words(n: int) -> str:
    words = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
             "ten", "eleven", "twelve")
    return words[n] if 0 <= n < len(words) else str(n)


def why_not_fit(model: catalog.GpuModel, profiles: list[catalog.Profile]) -> str:
    """Why ``profiles`` cannot all be instances on one GPU of ``model``, in words: the
    first of NVIDIA's rules (docs/mig-facts.md) they break, else their placements."""
    for profile, count in Counter(profiles).items():
        if count > profile.max_instances:
            return (f"{_in_words(count)} {profile.name} instances do not fit, at most "
                    f"{_in_words(profile.max_instances)}")
    media = [p.name for p in profiles if p.media_extensions]
    if len(media) > 1:
        return (f"{_in_words(len(media))} instances with media engines ({', '.join(media)}) "
                "do not fit, at most one")
    for what, need, has in (
        ("compute", sum(p.compute_slices for p in profiles), model.compute_slices),
        ("memory", sum(p.memory_slices for p in profiles), model.memory_slices),
    ):
        if need > has:
            return f"together they need {need} {what} slices, the GPU has {has}"
    return "no placement holds them all (each profile starts only at certain memory slices)"


def _pack(gpu: SimGpu, model: catalog.GpuModel, profiles: list[catalog.Profile],
          at: int) -> list[int] | None:
    if at == len(profiles):
        return []
    profile = profiles[at]
    for start in sorted(profile.placement_starts, reverse=True):
        try:
            gi = create_gpu_instance(gpu, profile.profile_id, start, profile.placement_size)
        except SimError:
            continue
        rest = _pack(gpu, model, profiles, at + 1)
        del gpu.gis[gi.gi_id]  # trial only; apply_layout creates the real instances
        if rest is not None:
            return [start, *rest]
    return None
