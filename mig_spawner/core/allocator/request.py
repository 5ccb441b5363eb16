"""What a spawn asks the allocator for, and the small rules pool and dynamic mode share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Literal, Protocol

from mig_spawner.core.catalog import MODELS, CatalogError, model, normalize_profile_name
from mig_spawner.core.inventory import Gpu

from .refusals import GpuView, MigState

PlacementStrategy = Literal["pack", "spread"]
# A profile name for every model that has it ("2g.35gb"), or one per model key
# ({"h200": "2g.35gb", "h100": "2g.20gb"}), since a slice class maps to a different
# profile on each GPU model.
Wanted = str | Mapping[str, str]
KNOWN_KEYS = frozenset(m.key for m in MODELS)


@dataclass(frozen=True)
class Placement:
    """A GPU instance placement: ``size`` memory slices from ``start`` on one GPU.

    Held slices are matched by ``(gpu_uuid, start, size)``; ``gpu_index`` is what NVML
    calls take and may change across reboots, so it is never used for matching.
    """

    gpu_index: int
    gpu_uuid: str
    profile: str
    start: int
    size: int


class _HasModelKey(Protocol):
    """A Gpu or a GpuSlots: anything with an index and a model key."""

    index: int
    model_key: str | None


def key_of(gpu: _HasModelKey) -> str:
    """The catalog model key of a GPU already known to be a catalog MIG GPU."""
    if gpu.model_key is None:
        raise ValueError(f"GPU {gpu.index} is not a MIG GPU the catalog knows")
    return gpu.model_key


def mig_state(gpu: Gpu) -> MigState:
    """``on``, ``off``, or ``pending`` (a mode change waits for a GPU reset)."""
    cur = gpu.mig_current
    return ("on" if cur else "off") if cur == gpu.mig_pending else "pending"


def gpu_view(gpu: Gpu) -> GpuView:
    """What a refusal needs of one GPU: its index, catalog model (None: unknown), MIG state."""
    return GpuView(gpu.index, gpu.model_key if gpu.model_key in KNOWN_KEYS else None,
                   mig_state(gpu))


def prepare(wanted: Wanted, strategy: str) -> dict[str, str]:
    """What both pickers do first: refuse a strategy other than ``pack`` or ``spread``
    (``ValueError``), then :func:`resolve` ``wanted``."""
    if strategy not in ("pack", "spread"):
        raise ValueError(f"strategy must be 'pack' or 'spread', not {strategy!r}")
    return resolve(wanted)


def resolve(wanted: Wanted) -> dict[str, str]:
    """Model key -> normalised profile name, for every catalog model the request covers.

    Raises :class:`CatalogError` for a model key or profile that the catalog does not
    know: that is a configuration mistake, not a busy GPU.
    """
    if isinstance(wanted, str):
        return dict(resolve_name(wanted))
    return {model(key).key: model(key).profile(name).name for key, name in wanted.items()}


@cache
def resolve_name(wanted: str) -> tuple[tuple[str, str], ...]:
    """(model key, profile) for every catalog model that has profile ``wanted``."""
    name = normalize_profile_name(wanted)
    wants = tuple((m.key, name) for m in MODELS if m.has_profile(name))
    if not wants:
        raise CatalogError(f"{wanted!r} is not a MIG profile of any GPU model in the catalog")
    return wants
