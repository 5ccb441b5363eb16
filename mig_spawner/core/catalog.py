"""The MIG catalog: GPU models, their MIG profiles and the placement rules.

Pure data and parsing. Every number that comes from NVIDIA's tables lives in
the tables near the top of this file, so a correction is made in one place.
Values marked ``verified=False`` are leads, not facts (see docs/gpus.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_EVEN, Decimal

# NVML_GPU_INSTANCE_PROFILE_* enum indexes (what nvmlDeviceGetGpuInstanceProfileInfo takes).
GI_PROFILE_1_SLICE = 0
GI_PROFILE_2_SLICE = 1
GI_PROFILE_3_SLICE = 2
GI_PROFILE_4_SLICE = 3
GI_PROFILE_7_SLICE = 4
GI_PROFILE_8_SLICE = 5
GI_PROFILE_6_SLICE = 6
GI_PROFILE_1_SLICE_REV1 = 7
GI_PROFILE_2_SLICE_REV1 = 8
GI_PROFILE_1_SLICE_REV2 = 9
GI_PROFILE_1_SLICE_GFX = 0xA
GI_PROFILE_2_SLICE_GFX = 0xB
GI_PROFILE_4_SLICE_GFX = 0xC
GI_PROFILE_1_SLICE_NO_ME = 0xD
GI_PROFILE_2_SLICE_NO_ME = 0xE
GI_PROFILE_1_SLICE_ALL_ME = 0xF
GI_PROFILE_2_SLICE_ALL_ME = 0x10
GI_PROFILE_3_SLICE_GFX = 0x11
GI_PROFILE_COUNT = 0x12

# NVML_COMPUTE_INSTANCE_PROFILE_* enum indexes (what a GPU instance's compute-instance
# profile info call takes).
CI_PROFILE_1_SLICE = 0
CI_PROFILE_2_SLICE = 1
CI_PROFILE_3_SLICE = 2
CI_PROFILE_4_SLICE = 3
CI_PROFILE_7_SLICE = 4
CI_PROFILE_8_SLICE = 5
CI_PROFILE_6_SLICE = 6
CI_PROFILE_1_SLICE_REV1 = 7
#: Compute slices of each compute-instance profile enum.
CI_PROFILE_SLICES = {
    CI_PROFILE_1_SLICE: 1, CI_PROFILE_2_SLICE: 2, CI_PROFILE_3_SLICE: 3,
    CI_PROFILE_4_SLICE: 4, CI_PROFILE_7_SLICE: 7, CI_PROFILE_8_SLICE: 8,
    CI_PROFILE_6_SLICE: 6, CI_PROFILE_1_SLICE_REV1: 1,
}
# The smaller compute instances a GPU instance of N compute slices offers beside its
# full-size one, as `nvidia-smi mig -lcip` lists them (docs/mig-facts.md, "Compute
# instances"): a 2g offers 1c; a 3g 1c and 2c; a 4g 1c and 2c but no 3c; a 7g 1c to 4c.
_SMALLER_CI_PROFILES = {
    1: (),
    2: (CI_PROFILE_1_SLICE,),
    3: (CI_PROFILE_1_SLICE, CI_PROFILE_2_SLICE),
    4: (CI_PROFILE_1_SLICE, CI_PROFILE_2_SLICE),
    7: (CI_PROFILE_1_SLICE, CI_PROFILE_2_SLICE, CI_PROFILE_3_SLICE, CI_PROFILE_4_SLICE),
}

# Every suffix NVIDIA uses: +me (one media engine set), +me.all (all of them), -me (none,
# where the plain profile carries one), +gfx (graphics-capable; RTX PRO).
VARIANTS = ("", "+me", "+me.all", "-me", "+gfx")
_NAME_RE = re.compile(r"^(?P<g>[1-8])g\.(?P<gb>\d+)gb(?P<variant>\+me\.all|\+me|-me|\+gfx)?$")
#: The name a whole GPU (MIG off, every compute and memory slice) goes by where a
#: profile name would: in ``allowed``, in a lease's ``profile``, on the spawn form.
WHOLE_GPU = "gpu"


def is_whole_gpu(name: str) -> bool:
    """Whether the profile (or offer key) ``name`` is a whole GPU (:data:`WHOLE_GPU`), not
    a MIG slice: the one place outside the kinds modules that compares with its name."""
    return name == WHOLE_GPU

_MIB_PER_GIB = Decimal(1024)
_TENTH = Decimal("0.1")


class CatalogError(ValueError):
    """A GPU model or profile name that the catalog does not know."""


@dataclass(frozen=True)
class Profile:
    """One MIG GPU-instance profile of one GPU model (e.g. ``3g.71gb`` on an H200)."""

    name: str
    enum_index: int
    profile_id: int
    compute_slices: int
    memory_slices: int
    memory_mib: int
    sm_count: int
    copy_engines: int
    max_instances: int
    placement_starts: tuple[int, ...]
    ci_profile_index: int
    variant: str = ""  # one of VARIANTS
    source: str = ""  # where the figures come from (docs/gpus.md shows it)
    verified: bool = True  # False: a lead that no source confirms
    # Media engines the instance owns (NVML's decoderCount, encoderCount, jpegCount,
    # ofaCount): NVDEC video decoders, NVENC encoders, NVJPG JPEG decoders, optical flow.
    decoders: int = 0
    encoders: int = 0
    jpeg: int = 0
    ofa: int = 0

    @property
    def media_extensions(self) -> bool:
        """Carries media engines of its own (at most one such instance per GPU)."""
        return self.variant in ("+me", "+me.all")

    @property
    def media(self) -> tuple[int, int, int, int]:
        """(decoders, encoders, JPEG, OFA) in NVML's order."""
        return (self.decoders, self.encoders, self.jpeg, self.ofa)

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    @property
    def memory_text(self) -> str:
        """``"32.2 GiB"``: the one way memory is shown (see :func:`format_gib`)."""
        return format_gib(self.memory_mib)

    @property
    def placement_size(self) -> int:
        """Memory slices a placement of this profile covers (NVML's ``placement.size``)."""
        return self.memory_slices

    @property
    def compute_profiles(self) -> dict[int, int]:
        """The compute-instance profiles a GPU instance of this profile offers, as the
        driver answers its compute-instance profile info call (enum -> compute slices):
        the smaller ones and the full-size one (:attr:`ci_profile_index`), which on
        Hopper and Blackwell's double-memory 1g is ``1_SLICE_REV1``, not ``1_SLICE``."""
        offered = {ci: CI_PROFILE_SLICES[ci]
                   for ci in _SMALLER_CI_PROFILES.get(self.compute_slices, ())}
        if self.ci_profile_index >= 0:
            offered[self.ci_profile_index] = self.compute_slices
        return offered


@dataclass(frozen=True)
class GpuModel:
    """A MIG-capable GPU model and its profile table."""

    key: str
    display_name: str
    product_names: tuple[str, ...]
    architecture: str
    memory_mib: int
    memory_slices: int
    compute_slices: int
    min_driver_major: int
    profiles: tuple[Profile, ...]
    verified: bool = True
    # Start order the driver uses when no placement is given, per placement size.
    driver_start_order: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def profile_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.profiles)

    @property
    def whole(self) -> Profile:
        """The whole GPU with MIG off, in a profile's terms: every compute and memory
        slice, the whole memory, one per GPU (:data:`WHOLE_GPU`; no NVML profile)."""
        return Profile(
            name=WHOLE_GPU, enum_index=-1, profile_id=-1, compute_slices=self.compute_slices,
            memory_slices=self.memory_slices, memory_mib=self.memory_mib,
            sm_count=max((p.sm_count for p in self.profiles), default=0),
            copy_engines=max((p.copy_engines for p in self.profiles), default=0),
            max_instances=1, placement_starts=(0,), ci_profile_index=-1,
            source="the whole GPU (MIG off)",
        )

    def profile(self, name: str) -> Profile:
        """Return the profile called ``name`` (``"1g.18gb"``, ``"MIG 1g.18gb"``; ``"gpu"``:
        :attr:`whole`), or explain."""
        wanted = normalize_profile_name(name)
        if wanted == WHOLE_GPU:
            return self.whole
        for p in self.profiles:
            if p.name == wanted:
                return p
        raise CatalogError(
            f"{name!r} is not a MIG profile of the {self.display_name}; "
            f"valid profiles: {', '.join(self.profile_names)}"
        )

    def has_profile(self, name: str) -> bool:
        try:
            self.profile(name)
        except CatalogError:
            return False
        return True

    def profile_by_id(self, profile_id: int) -> Profile:
        for p in self.profiles:
            if p.profile_id == profile_id:
                return p
        raise CatalogError(f"profile ID {profile_id} is not known on the {self.display_name}")

    def profile_by_enum(self, enum_index: int) -> Profile:
        for p in self.profiles:
            if p.enum_index == enum_index:
                return p
        raise CatalogError(f"profile enum {enum_index} is not supported on the {self.display_name}")

    def with_driver_figures(self, driver: Iterable[Profile]) -> GpuModel:
        """This model with the memory, SMs, copy engines, media engines and instance counts
        the driver reports for its profiles (matched by name); profiles the driver did not
        report keep the catalog's figures. The driver wins: it knows its own board."""
        by_name = {p.name: p for p in driver}
        if not by_name:
            return self
        profiles = tuple(
            replace(p, memory_mib=d.memory_mib, sm_count=d.sm_count,
                    copy_engines=d.copy_engines, max_instances=d.max_instances,
                    decoders=d.decoders, encoders=d.encoders, jpeg=d.jpeg, ofa=d.ofa)
            if (d := by_name.get(p.name)) is not None else p
            for p in self.profiles
        )
        return replace(self, profiles=profiles)

    def driver_starts(self, profile: Profile) -> tuple[int, ...]:
        """Placement starts in the order the driver tries them when none is given."""
        order = self.driver_start_order.get(profile.placement_size)
        if order is None:
            return profile.placement_starts
        return tuple(s for s in order if s in profile.placement_starts)


def capability_minors(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """Minor numbers of a MIG device's GI and CI access capability nodes.

    ``/dev/nvidia-caps/nvidia-cap<minor>``: GI access ``3 + 135*gpu_minor + 9*gi``,
    CI access ``4 + 135*gpu_minor + 9*gi + ci`` (gpu0 gi1 -> 12, ci0 -> 13).
    """
    gi_minor = 3 + 135 * gpu_minor + 9 * gi_id
    return gi_minor, gi_minor + 1 + ci_id


def normalize_profile_name(name: str) -> str:
    """``"MIG 1g.18gb"``, ``" 1G.18GB "`` and ``"mig-1g.18gb"`` all become ``"1g.18gb"``."""
    text = str(name).strip().lower()
    for prefix in ("mig ", "mig-", "nvidia.com/mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def parse_profile_name(name: str) -> tuple[int, int, str]:
    """Split ``"1g.24gb+me.all"`` into (compute slices, nominal GB, variant suffix)."""
    m = _NAME_RE.match(normalize_profile_name(name))
    if not m:
        raise CatalogError(
            f"{name!r} is not a MIG profile name; expected e.g. '1g.18gb', '3g.71gb', "
            "'1g.18gb+me', '1g.24gb+me.all', '1g.24gb-me' or '1g.24gb+gfx'"
        )
    return int(m["g"]), int(m["gb"]), m["variant"] or ""


def format_gib(mib: int | float) -> str:
    """Memory as every screen shows it: GiB with one decimal (``33024`` -> ``"32.2 GiB"``).

    Rounded half-to-even on the exact GiB value, so the driver's quarter-GiB figures come
    out the same everywhere: 32.25 -> 32.2, 69.50 -> 69.5, 139.75 -> 139.8.
    """
    gib = (Decimal(str(mib)) / _MIB_PER_GIB).quantize(_TENTH, rounding=ROUND_HALF_EVEN)
    return f"{gib} GiB"


def profile_rows(profiles: Iterable[Profile]) -> list[dict[str, object]]:
    """The columns ``nvidia-smi mig -lgip`` and the catalog share, one dict per profile
    (what ``mig-spawner catalog`` prints and what doctor compares)."""
    return [
        {"profile": p.name, "id": p.profile_id, "compute_slices": p.compute_slices,
         "memory_slices": p.memory_slices, "memory_mib": p.memory_mib,
         "sm_count": p.sm_count, "copy_engines": p.copy_engines,
         "decoders": p.decoders, "encoders": p.encoders, "jpeg": p.jpeg, "ofa": p.ofa,
         "max_instances": p.max_instances, "placement_starts": list(p.placement_starts)}
        for p in profiles
    ]


def compare_profiles(catalog_profiles: Iterable[Profile], driver_profiles: Iterable[Profile]
                     ) -> list[str]:
    """Each row where the driver and the catalog differ, in words (empty: they agree)."""
    ours = {r["profile"]: r for r in profile_rows(catalog_profiles)}
    theirs = {r["profile"]: r for r in profile_rows(driver_profiles)}
    out = []
    for name in sorted(set(ours) | set(theirs), key=profile_sort_key):
        a, b = ours.get(name), theirs.get(name)
        if a is None:
            out.append(f"{name}: reported by the driver, not in the catalog")
        elif b is None:
            out.append(f"{name}: in the catalog, not reported by the driver")
        else:
            diffs = [f"{k} catalog {_show(k, a[k])} driver {_show(k, b[k])}"
                     for k in a if k != "profile" and a[k] != b[k]]
            if diffs:
                out.append(f"{name}: " + "; ".join(diffs))
    return out


def _show(key: str, value: object) -> str:
    return format_gib(value) if key == "memory_mib" else str(value)  # type: ignore[arg-type]


def profile_sort_key(name: str) -> tuple[int, int, str]:
    """Order profiles small to big, plain before its variants (names NVIDIA would not
    use sort last)."""
    if name == WHOLE_GPU:
        return (98, 0, name)  # after every slice: it is all of them
    try:
        return parse_profile_name(name)
    except CatalogError:
        return (99, 0, name)


# --- tables ---------------------------------------------------------------------------
# Sources (docs/gpus.md names one per row): "guide" is NVIDIA's MIG User Guide
# (supported-profiles tables); "#N" entries are public threads that carry real
# `nvidia-smi mig -lgip` output. A row no source confirms has verified=False.

# Per kind on 8-memory-slice GPUs: enum, ID, compute slices, memory slices, instances,
# placement starts, CI profile. Same on A100, H100, H200, B200 (guide, -lgip outputs).
_EIGHT_SLICE_KINDS = {
    "1g": (GI_PROFILE_1_SLICE, 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), CI_PROFILE_1_SLICE),
    "1g+me": (GI_PROFILE_1_SLICE_REV1, 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), CI_PROFILE_1_SLICE),
    "1g2m": (GI_PROFILE_1_SLICE_REV2, 15, 1, 2, 4, (0, 2, 4, 6), CI_PROFILE_1_SLICE),
    "2g": (GI_PROFILE_2_SLICE, 14, 2, 2, 3, (0, 2, 4), CI_PROFILE_2_SLICE),
    "3g": (GI_PROFILE_3_SLICE, 9, 3, 4, 2, (0, 4), CI_PROFILE_3_SLICE),
    "4g": (GI_PROFILE_4_SLICE, 5, 4, 4, 1, (0,), CI_PROFILE_4_SLICE),
    "7g": (GI_PROFILE_7_SLICE, 0, 7, 8, 1, (0,), CI_PROFILE_7_SLICE),
}
_KINDS = tuple(_EIGHT_SLICE_KINDS)
_ALL_KINDS = frozenset(_KINDS)
Media = tuple[int, int, int, int]  # decoders, encoders, JPEG, OFA (NVML's order)


def _per_kind(one: int, two_mem: int, two: int, three: int, four: int, seven: int
              ) -> dict[str, int]:
    return {"1g": one, "1g+me": one, "1g2m": two_mem, "2g": two, "3g": three, "4g": four,
            "7g": seven}


_AMPERE_SM = _per_kind(14, 14, 28, 42, 56, 98)
_HOPPER_SM = _per_kind(16, 26, 32, 60, 64, 132)
# H100 PCIe has 114 SMs, not SXM's 132: -lgip on driver 570.169 (a Scaleway H100 PCIe).
_H100_PCIE_SM = _per_kind(14, 14, 30, 46, 62, 114)
_AMPERE_CE = _per_kind(1, 1, 2, 3, 4, 7)
_HOPPER_CE = _per_kind(1, 1, 2, 3, 4, 8)
# B200: 1g/1g.45gb/2g from real -lgip (NVIDIA/mig-parted#166, #187, gpu-operator#1242);
# 3g/4g/7g copy engines 6/8/16 from the same outputs; their SMs are not confirmed.
# 2g.45gb: the real output says 4 copy engines, the guide 3; the driver's 4 is used
# (it is what NVML answers, and 2 x the 1g's 2).
_BLACKWELL_SM = _per_kind(18, 30, 36, 60, 72, 148)
_BLACKWELL_CE = _per_kind(2, 2, 4, 6, 8, 16)
# GB200 differs from B200 in its 2-slice SMs (NVIDIA/gpu-operator#1303, mig-parted#227).
_GB200_SM = _per_kind(18, 32, 38, 60, 72, 148)
# Media engines (decoders, encoders, JPEG, OFA) per kind. The guide's tables and the
# real -lgip outputs agree on A100 and Hopper (H100, H100 NVL, GH200, H200: the plain 1g
# already has a decoder and a JPEG decoder; +me adds the OFA).
_AMPERE_MEDIA: dict[str, Media] = {
    "1g": (0, 0, 0, 0), "1g+me": (1, 0, 1, 1), "1g2m": (1, 0, 0, 0), "2g": (1, 0, 0, 0),
    "3g": (2, 0, 0, 0), "4g": (2, 0, 0, 0), "7g": (5, 0, 1, 1)}
_HOPPER_MEDIA: dict[str, Media] = {
    "1g": (1, 0, 1, 0), "1g+me": (1, 0, 1, 1), "1g2m": (1, 0, 1, 0), "2g": (2, 0, 2, 0),
    "3g": (3, 0, 3, 0), "4g": (4, 0, 4, 0), "7g": (7, 0, 7, 1)}
# B200: 1g, 1g+me, 1g.45gb and 2g from real -lgip (2g.45gb has 2 decoders and 2 JPEG
# there, where the guide says 1 and 1); 3g/4g/7g from the guide (1/1/0, 1/1/0, 1/1/1):
# leads, since the one row both give disagrees.
_BLACKWELL_MEDIA: dict[str, Media] = {
    "1g": (1, 0, 1, 0), "1g+me": (1, 0, 1, 1), "1g2m": (1, 0, 1, 0), "2g": (2, 0, 2, 0),
    "3g": (1, 0, 1, 0), "4g": (1, 0, 1, 0), "7g": (1, 0, 1, 1)}
# Seen on A100/H100 when creating without a placement.
_EIGHT_SLICE_DRIVER_ORDER = {1: (6, 4, 5, 0, 1, 2, 3), 2: (4, 0, 2, 6), 4: (4, 0), 8: (0,)}
# Drivers size MIG memory in 64 MiB steps (1/16 GiB): real MIG devices report 4864,
# 9984, 19968, 24192 MiB (A100, H100 PCIe, RTX PRO 6000), so the two decimals that
# `nvidia-smi mig -lgip` prints (MiB / 1024, rounded half to even) name one exact value.
_MIB_STEP = 64


def _gib(value: float) -> int:
    """A whole GPU's memory in MiB from its GiB (no MIG rounding applies)."""
    return round(value * 1024)


def printed_mib(gib: float) -> int:
    """The exact MiB of a profile whose memory ``nvidia-smi mig -lgip`` prints as ``gib``:
    19.62 is 20096 MiB (19.625 GiB), not 20091 (19.62 x 1024); 5.81 is 5952."""
    return round(gib * 1024 / _MIB_STEP) * _MIB_STEP


def _eight_slice_model(
    key: str,
    display: str,
    products: tuple[str, ...],
    arch: str,
    memory_gib: float,
    gb: tuple[int, int, int, int],
    gib: tuple[float, float, float, float],
    min_driver: int,
    source: str,
    *,
    sm: dict[str, int] | None = None,
    ce: dict[str, int] | None = None,
    media: dict[str, Media] | None = None,
    confirmed: frozenset[str] = _ALL_KINDS,
    lead: str = "",
) -> GpuModel:
    """An 8-slice GPU from its nominal GB and printed GiB at 1, 2, 4 and 8 memory slices.

    ``source`` confirms the kinds in ``confirmed``; the others carry ``lead`` (where
    their names come from) and ``verified=False``.
    """
    hopper = arch in ("Hopper", "Blackwell")
    sm = sm or (_HOPPER_SM if hopper else _AMPERE_SM)
    ce = ce or (_HOPPER_CE if hopper else _AMPERE_CE)
    media = media or (_HOPPER_MEDIA if hopper else _AMPERE_MEDIA)
    one, two, four, eight = gb
    names = {"1g": f"1g.{one}gb", "1g+me": f"1g.{one}gb+me", "1g2m": f"1g.{two}gb",
             "2g": f"2g.{two}gb", "3g": f"3g.{four}gb", "4g": f"4g.{four}gb",
             "7g": f"7g.{eight}gb"}
    memory = dict(zip(_KINDS, (gib[0], gib[0], gib[1], gib[1], gib[2], gib[2], gib[3]),
                      strict=True))
    profiles = []
    for kind in _KINDS:
        enum, pid, g, mem, count, starts, ci = _EIGHT_SLICE_KINDS[kind]
        if kind == "1g2m" and hopper:
            # Hopper's double-memory 1g has more SMs, and its own full-size CI profile.
            ci = CI_PROFILE_1_SLICE_REV1
        ok = kind in confirmed
        decoders, encoders, jpeg, ofa = media[kind]
        profiles.append(Profile(
            name=names[kind], enum_index=enum, profile_id=pid, compute_slices=g,
            memory_slices=mem, memory_mib=printed_mib(memory[kind]), sm_count=sm[kind],
            copy_engines=ce[kind], max_instances=count, placement_starts=starts,
            ci_profile_index=ci, variant="+me" if kind == "1g+me" else "",
            source=source if ok else lead, verified=ok,
            decoders=decoders, encoders=encoders, jpeg=jpeg, ofa=ofa,
        ))
    return GpuModel(
        key=key, display_name=display, product_names=products, architecture=arch,
        memory_mib=_gib(memory_gib), memory_slices=8, compute_slices=7,
        min_driver_major=min_driver, profiles=tuple(profiles),
        verified=confirmed == _ALL_KINDS, driver_start_order=_EIGHT_SLICE_DRIVER_ORDER,
    )


# One row of a table written out in full: name, enum, ID, compute slices, placement size,
# printed GiB, SMs, copy engines, (decoders, encoders, JPEG, OFA), instances, starts.
Row = tuple[str, int, int, int, int, float, int, int, Media, int, tuple[int, ...]]
_CI_BY_SLICES = {1: CI_PROFILE_1_SLICE, 2: CI_PROFILE_2_SLICE, 4: CI_PROFILE_4_SLICE}


def _table_model(key: str, display: str, products: tuple[str, ...], memory_gib: float,
                 placement_units: int, compute_slices: int, min_driver: int,
                 rows: Iterable[Row], source: str, lead: str = "") -> GpuModel:
    """A GPU whose table does not follow the 8-slice pattern (A30, RTX PRO), written out
    row by row. ``source`` confirms every row; without one, ``lead`` says where the rows
    come from and they are unverified. The driver creates without a placement at the
    lowest free start (seen on A30 and RTX PRO 6000)."""
    profiles = tuple(
        Profile(name=name, enum_index=enum, profile_id=pid, compute_slices=g,
                memory_slices=size, memory_mib=printed_mib(gib), sm_count=sm,
                copy_engines=ce, max_instances=count, placement_starts=starts,
                ci_profile_index=_CI_BY_SLICES[g], variant=parse_profile_name(name)[2],
                source=source or lead, verified=bool(source),
                decoders=media[0], encoders=media[1], jpeg=media[2], ofa=media[3])
        for name, enum, pid, g, size, gib, sm, ce, media, count, starts in rows
    )
    sizes = sorted({p.placement_size for p in profiles})
    return GpuModel(
        key=key, display_name=display, product_names=products, architecture=(
            "Ampere" if key == "a30" else "Blackwell"),
        memory_mib=_gib(memory_gib), memory_slices=placement_units,
        compute_slices=compute_slices, min_driver_major=min_driver, profiles=profiles,
        verified=bool(source),
        driver_start_order={s: tuple(range(0, placement_units, s)) for s in sizes},
    )


_A30 = _table_model(
    "a30", "A30 24GB", ("NVIDIA A30",), 24, 4, 4, 460, [
        ("1g.6gb", GI_PROFILE_1_SLICE, 14, 1, 1, 5.81, 14, 1, (0, 0, 0, 0), 4, (0, 1, 2, 3)),
        ("1g.6gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, 1, 5.81, 14, 1, (1, 0, 1, 1), 1,
         (0, 1, 2, 3)),
        ("2g.12gb", GI_PROFILE_2_SLICE, 5, 2, 2, 11.69, 28, 2, (2, 0, 0, 0), 2, (0, 2)),
        ("2g.12gb+me", GI_PROFILE_2_SLICE_REV1, 6, 2, 2, 11.69, 28, 2, (2, 0, 1, 1), 1,
         (0, 2)),
        ("4g.24gb", GI_PROFILE_4_SLICE, 0, 4, 4, 23.44, 56, 4, (4, 0, 1, 1), 1, (0,)),
    ], "guide (A30 table); -lgip in NVIDIA/DCGM#138",
)

# RTX PRO 6000 Blackwell: the whole table from one real `nvidia-smi mig -lgip`/`-lgipp`
# (driver 610.43.02, in the post "Slicing GPUs in Kubernetes with NVIDIA MIG"); the 1g
# rows agree with GoogleCloudPlatform/container-engine-accelerators#564 and
# bottlerocket-os/bottlerocket-kernel-kit#300 (bigstack-oss/cubecos#312 saw 23.12 GiB
# per 1g on another driver). The driver places instances on a grid of 12 units, 3 per
# memory slice ({0,3,6,9}:3, {0,6}:6, {0}:12), and the guide's media engines match.
_RTX_PRO_6000_SOURCE = ("-lgip/-lgipp on 610.43.02 ('Slicing GPUs in Kubernetes with "
                        "NVIDIA MIG'); container-engine-accelerators#564; guide")
_Q = (0, 3, 6, 9)  # the four 1g starts on the 12-unit grid
_RTX_PRO_6000 = _table_model(
    "rtx-pro-6000", "RTX PRO 6000 Blackwell 96GB",
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition",
     "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
     "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition"),
    95.59, 12, 4, 575, [
        ("1g.24gb", GI_PROFILE_1_SLICE, 14, 1, 3, 23.62, 46, 1, (1, 1, 1, 0), 4, _Q),
        ("1g.24gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, 3, 23.62, 46, 1, (1, 1, 1, 1), 1, _Q),
        ("1g.24gb+gfx", GI_PROFILE_1_SLICE_GFX, 47, 1, 3, 23.62, 46, 1, (1, 1, 1, 0), 4, _Q),
        ("1g.24gb+me.all", GI_PROFILE_1_SLICE_ALL_ME, 65, 1, 3, 23.62, 46, 1, (4, 4, 4, 1), 1,
         _Q),
        ("1g.24gb-me", GI_PROFILE_1_SLICE_NO_ME, 67, 1, 3, 23.62, 46, 1, (0, 0, 0, 0), 4, _Q),
        ("2g.48gb", GI_PROFILE_2_SLICE, 5, 2, 6, 47.38, 94, 2, (2, 2, 2, 0), 2, (0, 6)),
        ("2g.48gb+gfx", GI_PROFILE_2_SLICE_GFX, 35, 2, 6, 47.38, 94, 2, (2, 2, 2, 0), 2,
         (0, 6)),
        ("2g.48gb+me.all", GI_PROFILE_2_SLICE_ALL_ME, 64, 2, 6, 47.38, 94, 2, (4, 4, 4, 1), 1,
         (0, 6)),
        ("2g.48gb-me", GI_PROFILE_2_SLICE_NO_ME, 66, 2, 6, 47.38, 94, 2, (0, 0, 0, 0), 2,
         (0, 6)),
        ("4g.96gb", GI_PROFILE_4_SLICE, 0, 4, 12, 95.12, 188, 4, (4, 4, 4, 1), 1, (0,)),
        ("4g.96gb+gfx", GI_PROFILE_4_SLICE_GFX, 32, 4, 12, 95.12, 188, 4, (4, 4, 4, 1), 1,
         (0,)),
    ], _RTX_PRO_6000_SOURCE,
)

# RTX PRO 5000 Blackwell 48GB: two revisions of the guide disagree. The R580 page has
# four memory slices (1g.12gb x1, 1g.12gb-me x3, 2g.24gb-me, 4g.48gb ...); the later
# revision (the one that adds RTX PRO 4500 and Thor) has two (1g.24gb x2 ... 2g.48gb),
# the same shape as the RTX PRO 4500 beside it. The later revision is used: it is the
# newer statement of the same table. No real output confirms either, so every row is a
# lead; IDs follow the RTX PRO 6000's, SMs and GiB are estimates.
_RTX_PRO_5000_LEAD = ("guide (later revision; the R580 page has a 4-slice 1g.12gb table); "
                      "IDs as on RTX PRO 6000; SMs and GiB estimated")
_RTX_PRO_5000 = _table_model(
    "rtx-pro-5000", "RTX PRO 5000 Blackwell 48GB", ("NVIDIA RTX PRO 5000 Blackwell",),
    47.79, 2, 2, 575, [
        ("1g.24gb", GI_PROFILE_1_SLICE, 14, 1, 1, 23.62, 46, 1, (1, 1, 0, 0), 2, (0, 1)),
        ("1g.24gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, 1, 23.62, 46, 1, (1, 1, 1, 1), 1,
         (0, 1)),
        ("1g.24gb+gfx", GI_PROFILE_1_SLICE_GFX, 47, 1, 1, 23.62, 46, 1, (1, 1, 0, 0), 2,
         (0, 1)),
        ("1g.24gb+me.all", GI_PROFILE_1_SLICE_ALL_ME, 65, 1, 1, 23.62, 46, 1, (3, 3, 1, 1), 1,
         (0, 1)),
        ("1g.24gb-me", GI_PROFILE_1_SLICE_NO_ME, 67, 1, 1, 23.62, 46, 1, (0, 0, 0, 0), 2,
         (0, 1)),
        ("2g.48gb", GI_PROFILE_2_SLICE, 5, 2, 2, 47.25, 92, 4, (3, 3, 1, 1), 1, (0,)),
        ("2g.48gb+gfx", GI_PROFILE_2_SLICE_GFX, 35, 2, 2, 47.25, 92, 4, (3, 3, 1, 1), 1, (0,)),
    ], "", _RTX_PRO_5000_LEAD,
)

_GH200_144_CONFIRMED = frozenset({"1g", "1g+me", "1g2m", "2g"})
_B_CONFIRMED = frozenset({"1g", "1g+me", "1g2m", "2g"})

MODELS: tuple[GpuModel, ...] = (
    _eight_slice_model(
        "a100-40gb", "A100 40GB", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), "Ampere",
        40, (5, 10, 20, 40), (4.75, 9.62, 19.50, 39.25), 450, "guide (A100 table)",
    ),
    _eight_slice_model(
        "a100-80gb", "A100 80GB", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), "Ampere",
        80, (10, 20, 40, 80), (9.50, 19.50, 39.50, 79.25), 450, "guide (A100 table)",
    ),
    _A30,
    _eight_slice_model(
        "h100", "H100 80GB", ("NVIDIA H100 80GB HBM3",), "Hopper",
        79.65, (10, 20, 40, 80), (9.75, 19.62, 39.50, 79.25), 525, "guide (H100 table)",
    ),
    # The PCIe board shares the SXM's names, memory and media engines, not its SMs.
    _eight_slice_model(
        "h100-pcie", "H100 PCIe 80GB", ("NVIDIA H100 PCIe",), "Hopper",
        81559 / 1024, (10, 20, 40, 80), (9.75, 19.62, 39.50, 79.25), 525,
        "-lgip on 570.169 (a Scaleway H100 PCIe: 1g.10gb devices of 9984 MiB); guide",
        sm=_H100_PCIE_SM,
    ),
    _eight_slice_model(
        "h100-96gb", "H100 96GB", ("NVIDIA H100 96GB HBM3",), "Hopper",
        95.58, (12, 24, 48, 96), (11.00, 23.00, 46.50, 93.00), 525, "",
        confirmed=frozenset(),
        lead="names from NVIDIA/gpu-operator (H100-96GB shares GH200 96GB's configs); "
             "GiB copied from GH200 96GB",
    ),
    _eight_slice_model(
        "h100-nvl", "H100 NVL 94GB", ("NVIDIA H100 NVL",), "Hopper",
        93.58, (12, 24, 47, 94), (10.75, 21.62, 46.38, 93.12), 525,
        "-lgip in NVIDIA/mig-parted#101, gpu-operator#903",
    ),
    _eight_slice_model(
        "h20", "H20 96GB", ("NVIDIA H20",), "Hopper",
        95.58, (12, 24, 48, 96), (11.00, 23.00, 46.50, 93.00), 535, "",
        confirmed=frozenset(),
        lead="GPU listed in the guide; names from NVIDIA/gpu-operator#741; GiB and SMs "
             "copied from GH200 96GB (an H20 has fewer SMs)",
    ),
    _eight_slice_model(
        "gh200", "GH200 H100 96GB", ("NVIDIA GH200 480GB", "NVIDIA GH200 96GB HBM3"), "Hopper",
        95.58, (12, 24, 48, 96), (11.00, 23.00, 46.50, 93.00), 525, "guide (GH200 table)",
    ),
    _eight_slice_model(
        "gh200-144gb", "GH200 144GB", ("NVIDIA GH200 144G HBM3e",), "Hopper",
        143.0, (18, 36, 72, 144), (17.50, 35.25, 70.75, 141.50), 550,
        "-lgip in NVIDIA/mig-parted#139", confirmed=_GH200_144_CONFIRMED,
        lead="name from NVIDIA/mig-parted#139; GiB estimated from the 2-slice figure",
    ),
    _eight_slice_model(
        "h200", "H200 141GB", ("NVIDIA H200", "NVIDIA H200 NVL"), "Hopper",
        140.40, (18, 35, 71, 141), (16.00, 32.25, 69.50, 139.75), 550,
        "-lgip in NVIDIA/mig-parted#120; guide (H200 table)",
    ),
    # Memory per driver: R570 reports 22.00 GiB per 1g, later drivers 20.50; the table
    # holds R570's (the driver's own figures win at run time).
    _eight_slice_model(
        "b200", "B200 180GB", ("NVIDIA B200",), "Blackwell",
        179.06, (23, 45, 90, 180), (22.00, 44.25, 88.75, 178.75), 570,
        "-lgip in NVIDIA/mig-parted#166, #187, gpu-operator#1242 (R570)",
        sm=_BLACKWELL_SM, ce=_BLACKWELL_CE, media=_BLACKWELL_MEDIA, confirmed=_B_CONFIRMED,
        lead="name and media engines from the guide; copy engines from the -lgip outputs; "
             "SMs and GiB estimated",
    ),
    _eight_slice_model(
        "gb200", "GB200 186GB", ("NVIDIA GB200",), "Blackwell",
        184.0, (23, 47, 93, 186), (22.00, 45.50, 91.00, 182.00), 570,
        "-lgip in NVIDIA/mig-parted#227 (production GB200)",
        sm=_GB200_SM, ce=_BLACKWELL_CE, media=_BLACKWELL_MEDIA, confirmed=_B_CONFIRMED,
        lead="3g/4g/7g names and figures estimated from the 2-slice row",
    ),
    _eight_slice_model(
        "b300", "B300 288GB", ("NVIDIA B300 SXM6 AC", "NVIDIA B300"), "Blackwell",
        269.0, (34, 67, 135, 269), (33.00, 65.50, 131.50, 263.50), 580, "",
        sm=_BLACKWELL_SM, ce=_BLACKWELL_CE, media=_BLACKWELL_MEDIA, confirmed=frozenset(),
        lead="names from the GPU Operator config quoted in aws/sagemaker-hyperpod-cli#403 "
             "and NVIDIA/gpu-operator#1759; figures estimated",
    ),
    _RTX_PRO_6000,
    _RTX_PRO_5000,
)

_BY_KEY = {m.key: m for m in MODELS}


def _product_key(name: str) -> str:
    """R450-R470 drivers report ``A100-SXM4-40GB`` where later ones say
    ``NVIDIA A100-SXM4-40GB``: look products up without the vendor prefix."""
    text = " ".join(str(name).split()).lower()
    return text[len("nvidia "):] if text.startswith("nvidia ") else text


_BY_PRODUCT = {_product_key(name): m for m in MODELS for name in m.product_names}


def model(key: str) -> GpuModel:
    """The GPU model with catalog key ``key`` (``"h200"``, ``"a100-80gb"`` ...)."""
    try:
        return _BY_KEY[key.strip().lower()]
    except KeyError:
        raise CatalogError(
            f"unknown GPU model {key!r}; known: {', '.join(_BY_KEY)}"
        ) from None


def model_for_product(product_name: str) -> GpuModel:
    """The model for the product name NVML reports (``"NVIDIA H200"``)."""
    found = _BY_PRODUCT.get(_product_key(product_name))
    if found is None:
        known = ", ".join(n for m in MODELS for n in m.product_names)
        raise CatalogError(
            f"{product_name!r} is not a MIG-capable GPU this catalog knows; known: {known}"
        )
    return found


def find_model_for_product(product_name: str) -> GpuModel | None:
    """Like :func:`model_for_product`, but ``None`` for a GPU without MIG or not in the catalog."""
    return _BY_PRODUCT.get(_product_key(product_name))
