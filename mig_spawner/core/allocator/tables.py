"""Per-model placement tables for the allocator, computed once per GPU model.

A GPU's memory slices are a bitmask (bit ``s`` = memory slice ``s`` taken). Every
placement of every profile is precomputed as a mask, so "does it fit" is one AND.

The value of a GPU state is a pair, compared in order:

1. **usable slices**: the most free memory slices that some set of further
   instances could still cover. A placement that strands a slice (on 8-slice GPUs,
   slice 7 can only be used by ``1g`` double-memory at 6, ``3g`` at 4 or ``7g``)
   loses more than its own size.
2. **room**: the placement masks still free, each counted once (3g and 4g at start 0
   are one block) and weighted by the most wanted profile that could take it (all
   profiles weigh the same unless the caller knows the demand).

The allocator takes the placement that loses the least value. Decisions depend only
on ``(profile, used mask, per-profile counts, weights)``, so they are memoised.
Why this value and not another: see docs/allocator.md (measured against the exact
best online policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from mig_spawner.core.catalog import GpuModel, model

# Why no placement fits on one GPU (for refusal messages).
WHY_SLICES = "slices"
WHY_LIMIT = "limit"
WHY_MEDIA = "media"

# Memoised decisions per model; cleared past this size so odd demand vectors cannot grow
# memory without bound (a model has ~2,000 reachable states per demand vector).
_MAX_MEMO = 200_000

# Bits per profile in a packed count: no GPU holds 2**6 instances of one profile.
_COUNT_BITS = 6

Weights = tuple[int, ...]
Value = tuple[int, int]


@dataclass(frozen=True)
class ProfileSlots:
    """Where one profile of one model may go, in mask form."""

    index: int
    name: str
    size: int
    cap: int
    media_extensions: bool
    starts: tuple[int, ...]
    masks: tuple[int, ...]


class ModelTable:
    """Placement masks and memoised decisions for one :class:`GpuModel`."""

    def __init__(self, gpu_model: GpuModel) -> None:
        self.model = gpu_model
        self.profiles = tuple(
            ProfileSlots(
                index=i,
                name=p.name,
                size=p.placement_size,
                cap=p.max_instances,
                media_extensions=p.media_extensions,
                starts=p.placement_starts,
                masks=tuple(((1 << p.placement_size) - 1) << s for s in p.placement_starts),
            )
            for i, p in enumerate(gpu_model.profiles)
        )
        self.by_name = {p.name: p for p in self.profiles}
        # Each distinct placement mask once, with the profiles that can use it: room is
        # counted per mask so that e.g. 3g and 4g at start 0 (one block) count once.
        groups: dict[int, list[int]] = {}
        for p in self.profiles:
            for m in p.masks:
                groups.setdefault(m, []).append(p.index)
        self.mask_groups = tuple((m, tuple(ix)) for m, ix in sorted(groups.items()))
        self.index_by_id = {p.profile_id: i for i, p in enumerate(gpu_model.profiles)}
        self.media_indexes = tuple(p.index for p in self.profiles if p.media_extensions)
        self.zero_counts = (0,) * len(self.profiles)
        # Counts packed into one int, _COUNT_BITS per profile: cheap to add up per GPU.
        self.pack_one = tuple(1 << (_COUNT_BITS * p.index) for p in self.profiles)
        self.pack_by_id = {p.profile_id: self.pack_one[i] for i, p in enumerate(gpu_model.profiles)}
        self._unpacked: dict[int, tuple[int, ...]] = {}
        self.uniform: Weights = (1,) * len(self.profiles)
        self._usable: dict[frozenset[int], tuple[int, ...]] = {}
        self._choices: dict[tuple[Weights, int, int, tuple[int, ...]], tuple[Value, int] | str] = {}

    def pack(self, counts: tuple[int, ...]) -> int:
        """Per-profile counts as one int (the inverse of :meth:`unpack`)."""
        return sum(c << (_COUNT_BITS * i) for i, c in enumerate(counts))

    def unpack(self, code: int) -> tuple[int, ...]:
        """Per-profile counts from :meth:`pack`'s int (memoised: few distinct values)."""
        found = self._unpacked.get(code)
        if found is None:
            mask = (1 << _COUNT_BITS) - 1
            found = tuple((code >> (_COUNT_BITS * i)) & mask for i in range(len(self.profiles)))
            self._unpacked[code] = found
        return found

    def weights(self, demand: dict[str, int] | None) -> Weights:
        """Per-profile weights from ``demand`` (name -> share); uniform when it names none."""
        if not demand:
            return self.uniform
        found = tuple(demand.get(p.name, 0) for p in self.profiles)
        return found if any(found) else self.uniform

    def media_used(self, counts: tuple[int, ...]) -> bool:
        """True when the GPU already has its one media-extension (+me) instance."""
        return any(counts[i] for i in self.media_indexes)

    def blocked(self, p: ProfileSlots, counts: tuple[int, ...]) -> str | None:
        """Why no instance of ``p`` may be added whatever the slices, or ``None``."""
        if p.media_extensions and self.media_used(counts):
            return WHY_MEDIA
        # With today's catalog only the +me profiles have fewer instances than starts, so
        # this is the safety net for a model whose table says otherwise.
        if counts[p.index] >= p.cap:
            return WHY_LIMIT
        return None

    def room(self, p: ProfileSlots, used: int, counts: tuple[int, ...]) -> int:
        """How many more ``p`` instances fit on a GPU in this state, ``p`` counted alone."""
        if self.blocked(p, counts):
            return 0
        free = sum(1 for m in p.masks if not used & m)
        return min(free, p.cap - counts[p.index])

    def usable(self, used: int, weights: Weights) -> int:
        """Most free slices that instances of wanted profiles could still cover."""
        wanted = frozenset(p.index for p in self.profiles if weights[p.index])
        table = self._usable.get(wanted)
        if table is None:
            table = self._usable_table(wanted)
            self._usable[wanted] = table
        return table[used]

    def _usable_table(self, wanted: frozenset[int]) -> tuple[int, ...]:
        # Profiles whose instance limit is below their number of starts (the +me ones) are
        # left out: a plain profile with the same placements covers the same slices.
        masks = sorted({(m, p.size) for p in self.profiles if p.index in wanted
                        and p.cap >= len(p.starts) for m in p.masks})
        full = (1 << self.model.memory_slices) - 1
        best = [0] * (full + 1)
        # A bigger mask has fewer free slices, so fill from the full mask down.
        for used in range(full, -1, -1):
            best[used] = max((size + best[used | m] for m, size in masks if not used & m),
                             default=0)
        return tuple(best)

    def value(self, used: int, counts: tuple[int, ...], weights: Weights) -> Value:
        """(usable slices, weighted room) of a GPU state: higher keeps more placeable.

        Room = the free placement masks, each weighted by the most wanted profile that
        could still take it.
        """
        open_ = [w if w and not self.blocked(p, counts) else 0
                 for p, w in zip(self.profiles, weights, strict=True)]
        room = sum(max(open_[i] for i in members)
                   for mask, members in self.mask_groups if not used & mask)
        return self.usable(used, weights), room

    def choose(
        self, p: ProfileSlots, used: int, counts: tuple[int, ...], weights: Weights
    ) -> tuple[Value, int] | str:
        """Best ``(loss, start)`` for a new ``p`` on a GPU in this state, or why none fits.

        Ties go to the lowest start. Memoised: a model has few distinct states.
        """
        key = (weights, p.index, used, counts)
        found = self._choices.get(key)
        if found is None:
            if len(self._choices) >= _MAX_MEMO:
                self._choices.clear()
            found = self._choose(p, used, counts, weights)
            self._choices[key] = found
        return found

    def _choose(
        self, p: ProfileSlots, used: int, counts: tuple[int, ...], weights: Weights
    ) -> tuple[Value, int] | str:
        why = self.blocked(p, counts)
        if why:
            return why
        b_usable, b_room = self.value(used, counts, weights)
        after_counts = (*counts[: p.index], counts[p.index] + 1, *counts[p.index + 1 :])
        best: tuple[Value, int] | None = None
        for start, mask in zip(p.starts, p.masks, strict=True):
            if used & mask:
                continue
            a_usable, a_room = self.value(used | mask, after_counts, weights)
            loss = (b_usable - a_usable, b_room - a_room)
            if best is None or loss < best[0]:
                best = (loss, start)
        return best if best is not None else WHY_SLICES


@cache
def table(model_key: str) -> ModelTable:
    """The (cached) table of the catalog model ``model_key``."""
    return ModelTable(model(model_key))
