"""The MIG catalog: GPU models, their MIG profiles and the placement rules.

Pure data and parsing. Every number that comes from NVIDIA's tables lives in
the tables near the top of this file, so a correction is made in one place.
Values marked ``verified=False`` are leads, not facts (see docs/gpus.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
GI_PROFILE_COUNT = 0x12

# NVML_COMPUTE_INSTANCE_PROFILE_* enum indexes for the full-size compute instance.
CI_PROFILE_1_SLICE = 0
CI_PROFILE_2_SLICE = 1
CI_PROFILE_3_SLICE = 2
CI_PROFILE_4_SLICE = 3
CI_PROFILE_7_SLICE = 4
CI_PROFILE_1_SLICE_REV1 = 7

_NAME_RE = re.compile(r"^(?P<g>[1-8])g\.(?P<gb>\d+)gb(?P<me>\+me)?$")


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
    media_extensions: bool = False

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    @property
    def placement_size(self) -> int:
        """Memory slices a placement of this profile covers (NVML's ``placement.size``)."""
        return self.memory_slices


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

    def profile(self, name: str) -> Profile:
        """Return the profile called ``name`` (``"1g.18gb"``, ``"MIG 1g.18gb"``), or explain."""
        wanted = normalize_profile_name(name)
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

    def gi_id(self, start: int, size: int) -> int:
        """GPU instance ID that the driver gives a placement (IDs follow placement)."""
        return gi_id_for_placement(self.memory_slices, start, size)

    def driver_starts(self, profile: Profile) -> tuple[int, ...]:
        """Placement starts in the order the driver tries them when none is given."""
        order = self.driver_start_order.get(profile.placement_size)
        if order is None:
            return profile.placement_starts
        return tuple(s for s in order if s in profile.placement_starts)


def gi_id_for_placement(memory_slices: int, start: int, size: int) -> int:
    """GI ID from placement: one ID block per size, biggest first.

    8 slices: size 8 -> 0; size 4 at 0/4 -> 1/2; size 2 at s -> 3 + s/2; size 1 at s -> 7 + s.
    4 slices (A30): size 4 -> 0; size 2 at 0/2 -> 1/2; size 1 at s -> 3 + s.
    """
    if size <= 0 or memory_slices % size or start % size or not 0 <= start < memory_slices:
        raise CatalogError(f"placement {{start={start}, size={size}}} is not aligned")
    return memory_slices // size - 1 + start // size


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


def parse_profile_name(name: str) -> tuple[int, int, bool]:
    """Split ``"1g.18gb+me"`` into (compute slices, nominal GB, media extensions)."""
    m = _NAME_RE.match(normalize_profile_name(name))
    if not m:
        raise CatalogError(
            f"{name!r} is not a MIG profile name; "
            "expected e.g. '1g.18gb', '3g.71gb' or '1g.18gb+me'"
        )
    return int(m["g"]), int(m["gb"]), bool(m["me"])


# --- tables ---------------------------------------------------------------------------

# Per kind on 8-memory-slice GPUs: enum, ID, compute slices, memory slices, instances,
# placement starts, CI profile. Same on A100, H100, H200 (MIG.md).
_EIGHT_SLICE_KINDS = {
    "1g": (GI_PROFILE_1_SLICE, 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), CI_PROFILE_1_SLICE),
    "1g+me": (GI_PROFILE_1_SLICE_REV1, 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), CI_PROFILE_1_SLICE),
    "1g2m": (GI_PROFILE_1_SLICE_REV2, 15, 1, 2, 4, (0, 2, 4, 6), CI_PROFILE_1_SLICE),
    "2g": (GI_PROFILE_2_SLICE, 14, 2, 2, 3, (0, 2, 4), CI_PROFILE_2_SLICE),
    "3g": (GI_PROFILE_3_SLICE, 9, 3, 4, 2, (0, 4), CI_PROFILE_3_SLICE),
    "4g": (GI_PROFILE_4_SLICE, 5, 4, 4, 1, (0,), CI_PROFILE_4_SLICE),
    "7g": (GI_PROFILE_7_SLICE, 0, 7, 8, 1, (0,), CI_PROFILE_7_SLICE),
}
_KIND_ORDER = ("1g", "1g+me", "1g2m", "2g", "3g", "4g", "7g")
_AMPERE_SM = {"1g": 14, "1g+me": 14, "1g2m": 14, "2g": 28, "3g": 42, "4g": 56, "7g": 98}
_HOPPER_SM = {"1g": 16, "1g+me": 16, "1g2m": 26, "2g": 32, "3g": 60, "4g": 64, "7g": 132}
_AMPERE_CE = {"1g": 1, "1g+me": 1, "1g2m": 1, "2g": 2, "3g": 3, "4g": 4, "7g": 7}
_HOPPER_CE = {"1g": 1, "1g+me": 1, "1g2m": 1, "2g": 2, "3g": 3, "4g": 4, "7g": 8}
# Seen on A100/H100 when creating without a placement (MIG.md).
_EIGHT_SLICE_DRIVER_ORDER = {1: (6, 4, 5, 0, 1, 2, 3), 2: (4, 0, 2, 6), 4: (4, 0), 8: (0,)}


def _gib(value: float) -> int:
    return round(value * 1024)


def _eight_slice_profiles(
    names: dict[str, str],
    gib: dict[str, float],
    sm: dict[str, int],
    ce: dict[str, int],
    hopper: bool,
) -> tuple[Profile, ...]:
    profiles = []
    for kind in _KIND_ORDER:
        if kind not in names:
            continue
        enum, pid, g, mem, count, starts, ci = _EIGHT_SLICE_KINDS[kind]
        if kind == "1g2m" and hopper:
            # Hopper's double-memory 1g has more SMs, and its own full-size CI profile.
            ci = CI_PROFILE_1_SLICE_REV1
        profiles.append(
            Profile(
                name=names[kind],
                enum_index=enum,
                profile_id=pid,
                compute_slices=g,
                memory_slices=mem,
                memory_mib=_gib(gib[kind]),
                sm_count=sm[kind],
                copy_engines=ce[kind],
                max_instances=count,
                placement_starts=starts,
                ci_profile_index=ci,
                media_extensions=kind.endswith("+me"),
            )
        )
    return tuple(profiles)


def _names(one: int, two: int, three: int, seven: int) -> dict[str, str]:
    """Profile names of an 8-slice GPU from its nominal GB at 1, 2, 4 and 8 memory slices."""
    return {
        "1g": f"1g.{one}gb",
        "1g+me": f"1g.{one}gb+me",
        "1g2m": f"1g.{two}gb",
        "2g": f"2g.{two}gb",
        "3g": f"3g.{three}gb",
        "4g": f"4g.{three}gb",
        "7g": f"7g.{seven}gb",
    }


def _mem(one: float, two: float, four: float, eight: float) -> dict[str, float]:
    return {"1g": one, "1g+me": one, "1g2m": two, "2g": two, "3g": four, "4g": four, "7g": eight}


def _eight_slice_model(
    key: str,
    display: str,
    products: tuple[str, ...],
    arch: str,
    memory_gib: float,
    names: dict[str, str],
    gib: dict[str, float],
    min_driver: int,
    verified: bool = True,
) -> GpuModel:
    hopper = arch in ("Hopper", "Blackwell")
    return GpuModel(
        key=key,
        display_name=display,
        product_names=products,
        architecture=arch,
        memory_mib=_gib(memory_gib),
        memory_slices=8,
        compute_slices=7,
        min_driver_major=min_driver,
        profiles=_eight_slice_profiles(
            names,
            gib,
            _HOPPER_SM if hopper else _AMPERE_SM,
            _HOPPER_CE if hopper else _AMPERE_CE,
            hopper,
        ),
        verified=verified,
        driver_start_order=_EIGHT_SLICE_DRIVER_ORDER,
    )


_A30 = GpuModel(
    key="a30",
    display_name="A30 24GB",
    product_names=("NVIDIA A30",),
    architecture="Ampere",
    memory_mib=24576,
    memory_slices=4,
    compute_slices=4,
    min_driver_major=460,
    profiles=(
        Profile("1g.6gb", GI_PROFILE_1_SLICE, 14, 1, 1, _gib(5.81), 14, 1, 4, (0, 1, 2, 3),
                CI_PROFILE_1_SLICE),
        Profile("1g.6gb+me", GI_PROFILE_1_SLICE_REV1, 21, 1, 1, _gib(5.81), 14, 1, 1,
                (0, 1, 2, 3), CI_PROFILE_1_SLICE, media_extensions=True),
        Profile("2g.12gb", GI_PROFILE_2_SLICE, 5, 2, 2, _gib(11.69), 28, 2, 2, (0, 2),
                CI_PROFILE_2_SLICE),
        Profile("2g.12gb+me", GI_PROFILE_2_SLICE_REV1, 6, 2, 2, _gib(11.69), 28, 2, 1, (0, 2),
                CI_PROFILE_2_SLICE, media_extensions=True),
        Profile("4g.24gb", GI_PROFILE_4_SLICE, 0, 4, 4, _gib(23.44), 56, 4, 1, (0,),
                CI_PROFILE_4_SLICE),
    ),
    # The A30 order without placement is not published; highest start first is assumed.
    driver_start_order={1: (3, 2, 1, 0), 2: (2, 0), 4: (0,)},
)

MODELS: tuple[GpuModel, ...] = (
    _eight_slice_model(
        "a100-40gb", "A100 40GB", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), "Ampere",
        40, _names(5, 10, 20, 40), _mem(4.75, 9.62, 19.50, 39.25), 450,
    ),
    _eight_slice_model(
        "a100-80gb", "A100 80GB", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), "Ampere",
        80, _names(10, 20, 40, 80), _mem(9.50, 19.50, 39.50, 79.25), 450,
    ),
    _A30,
    _eight_slice_model(
        "h100", "H100 80GB", ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"), "Hopper",
        79.65, _names(10, 20, 40, 80), _mem(9.75, 19.62, 39.50, 79.25), 525,
    ),
    _eight_slice_model(
        "h100-nvl", "H100 NVL 94GB", ("NVIDIA H100 NVL",), "Hopper",
        93.58, _names(12, 24, 47, 94), _mem(10.75, 21.62, 46.38, 93.12), 525,
    ),
    _eight_slice_model(
        "gh200", "GH200 H100 96GB", ("NVIDIA GH200 480GB", "NVIDIA GH200 96GB HBM3"), "Hopper",
        95.58, _names(12, 24, 48, 96), _mem(11.00, 23.00, 46.50, 93.00), 525,
    ),
    # H200 names are NVIDIA's; memory in GiB is estimated from the names, and IDs and
    # placements are taken to be Hopper's (unverified until read off a real H200).
    _eight_slice_model(
        "h200", "H200 141GB", ("NVIDIA H200", "NVIDIA H200 NVL"), "Hopper",
        140.40, _names(18, 35, 71, 141), _mem(16.75, 32.50, 66.00, 130.50), 550,
        verified=False,
    ),
    _eight_slice_model(
        "b200", "B200 180GB", ("NVIDIA B200",), "Blackwell",
        179.06, _names(23, 45, 90, 180), _mem(21.25, 42.50, 83.50, 167.50), 570,
        verified=False,
    ),
)

_BY_KEY = {m.key: m for m in MODELS}
_BY_PRODUCT = {name.lower(): m for m in MODELS for name in m.product_names}


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
    found = _BY_PRODUCT.get(product_name.strip().lower())
    if found is None:
        known = ", ".join(n for m in MODELS for n in m.product_names)
        raise CatalogError(
            f"{product_name!r} is not a MIG-capable GPU this catalog knows; known: {known}"
        )
    return found


def find_model_for_product(product_name: str) -> GpuModel | None:
    """Like :func:`model_for_product`, but ``None`` for a GPU without MIG or not in the catalog."""
    return _BY_PRODUCT.get(product_name.strip().lower())
