"""Dynamic mode: where a NEW GPU instance goes, chosen to keep future requests placeable.

:class:`Occupancy` is every GPU's taken memory slices and instance counts (existing
instances plus the ledger's reservations); :func:`pick_dynamic` chooses the GPU and the
placement ``{start, size}`` that loses the least future capacity, within NVIDIA's rules
(:mod:`.tables`). Import through :mod:`mig_spawner.core.allocator`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from mig_spawner.core.catalog import normalize_profile_name
from mig_spawner.core.inventory import Gpu, Inventory
from mig_spawner.core.refusal import Refused

from .refusals import (
    GpuView,
    MigState,
    no_capacity,
    precheck,
)
from .request import (
    KNOWN_KEYS,
    Placement,
    PlacementStrategy,
    Wanted,
    key_of,
    mig_state,
    prepare,
)
from .tables import ModelTable, table

_UNSEEN: Any = object()


class GpuSlots(NamedTuple):
    """What is taken on one GPU: instances that exist plus reservations not yet created."""

    index: int
    uuid: str
    model_key: str | None  # None: not a MIG GPU the catalog knows
    mig: MigState
    used: int  # bit s set = memory slice s taken
    counts: tuple[int, ...]  # instances per profile, in the model's catalog order

    @property
    def media_used(self) -> bool:
        """The GPU's one ``+me`` instance exists or is reserved."""
        return self.model_key is not None and table(self.model_key).media_used(self.counts)


# One GPU, compactly: index, uuid and its state = (model key, MIG state, used-slices mask,
# per-profile instance counts packed into one int, see ModelTable.pack). Plain tuples keep
# building an Occupancy for thousands of GPUs cheap, and decisions depend on the state only.
_State = tuple[str | None, MigState, int, int]
_Row = tuple[int, str, _State]


class Occupancy:
    """Every GPU's taken memory slices and instance counts, for dynamic decisions.

    Build it with :meth:`of`; :meth:`place` and :meth:`release` return updated copies,
    so a caller (or a simulation) can make several decisions in a row.
    """

    __slots__ = ("_firsts", "_gpus", "_rows")

    def __init__(self, gpus: Iterable[GpuSlots] = (), *, _rows: tuple[_Row, ...] = ()) -> None:
        given = tuple(gpus)
        self._rows = _rows or tuple(
            (g.index, g.uuid, (g.model_key, g.mig, g.used,
                               table(g.model_key).pack(g.counts) if g.model_key else 0))
            for g in given
        )
        self._gpus = given or None
        self._firsts: dict[_State, _Row] | None = None

    @property
    def gpus(self) -> tuple[GpuSlots, ...]:
        """Per GPU: what is taken (instances plus reservations)."""
        if self._gpus is None:
            self._gpus = tuple(
                GpuSlots(i, u, k, mig, used, table(k).unpack(code) if k else ())
                for i, u, (k, mig, used, code) in self._rows
            )
        return self._gpus

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Occupancy) and self._rows == other._rows

    def __hash__(self) -> int:
        return hash(self._rows)

    def __repr__(self) -> str:
        return f"Occupancy({self.gpus!r})"

    @classmethod
    def of(cls, inventory: Inventory, reserved: Iterable[Placement] = ()) -> Occupancy:
        """Occupancy of ``inventory`` plus ``reserved`` placements (claims not yet created).

        A reservation on a GPU that is gone is ignored; one whose instance already
        exists at the same placement is counted once.
        """
        pending: dict[str, list[Placement]] = defaultdict(list)
        for r in reserved:
            pending[r.gpu_uuid].append(r)
        rows: list[_Row] = []
        append = rows.append
        # Local lookups: this loop runs once per GPU per decision.
        tables: dict[str | None, ModelTable | None] = {}
        for g in inventory.gpus:
            key = g.model_key
            t = tables.get(key, _UNSEEN)
            if t is _UNSEEN:
                t = tables[key] = table(key) if key in KNOWN_KEYS else None
            mig = mig_state(g)
            if t is None or not g.mig_supported:
                append((g.index, g.uuid, (None, mig, 0, 0)))
                continue
            inc = t.pack_by_id
            used = code = 0
            for gi in g.gpu_instances:
                used |= ((1 << gi.size) - 1) << gi.start
                code += inc.get(gi.profile_id, 0)
            if pending and g.uuid in pending:
                used, code = _reserve(t, g, pending[g.uuid], used, code)
            append((g.index, g.uuid, (key, mig, used, code)))
        return cls(_rows=tuple(rows))

    def place(self, p: Placement) -> Occupancy:
        """A copy with ``p`` taken (as a reservation would be)."""
        return self._update(p, +1)

    def release(self, p: Placement) -> Occupancy:
        """A copy with ``p`` given back."""
        return self._update(p, -1)

    def _first_of_each_state(self) -> dict[_State, _Row]:
        """The lowest-index GPU of each distinct state (GPUs in one state rank the same)."""
        if self._firsts is None:
            firsts: dict[_State, _Row] = {}
            for row in self._rows:
                seen = firsts.get(row[2])
                if seen is None or row[0] < seen[0]:
                    firsts[row[2]] = row
            self._firsts = firsts
        return self._firsts

    def _update(self, p: Placement, sign: int) -> Occupancy:
        rows = list(self._rows)
        for n, (index, uuid, (key, mig, used, code)) in enumerate(rows):
            if uuid == p.gpu_uuid and key is not None:
                t = table(key)
                mask = ((1 << p.size) - 1) << p.start
                used = used | mask if sign > 0 else used & ~mask
                slot = t.by_name.get(normalize_profile_name(p.profile))
                if slot is not None:
                    code += sign * t.pack_one[slot.index]
                rows[n] = (index, uuid, (key, mig, used, code))
                return Occupancy(_rows=tuple(rows))
        raise ValueError(f"no GPU {p.gpu_uuid} (index {p.gpu_index}) in this occupancy")

    def free_counts(self) -> dict[str, int]:
        """Per profile: how many more could be created right now, each counted alone."""
        free: Counter[str] = Counter()
        for g in self.gpus:
            if g.model_key is not None and g.mig == "on":
                t = table(g.model_key)
                for p in t.profiles:
                    free[p.name] += t.room(p, g.used, g.counts)
        return dict(free)

    def pick_dynamic(
        self,
        wanted: Wanted,
        strategy: PlacementStrategy = "pack",
        demand: Mapping[str, float] | None = None,
    ) -> Placement | Refused:
        """Where a new instance of ``wanted`` should go; see :func:`pick_dynamic`."""
        wants = prepare(wanted, strategy)
        shares = _shares(demand)
        spread = strategy == "spread"
        slots = {key: table(key).by_name[name] for key, name in wants.items()}
        weights = {key: table(key).weights(shares) for key in wants}
        best: tuple[tuple[object, ...], _Row, int] | None = None
        for (key, mig, used, code), row in self._first_of_each_state().items():
            if key is None or key not in slots or mig != "on":
                continue
            t = table(key)
            choice = t.choose(slots[key], used, t.unpack(code), weights[key])
            if isinstance(choice, str):
                continue
            loss, start = choice
            busy = used.bit_count()
            # pack never opens an empty GPU while a used one has room: a whole GPU is
            # worth more than any slice that a placement on a used GPU could strand.
            # The GPU index last: among equals the lowest wins, whatever the inventory order.
            rank = (busy, loss, row[0]) if spread else (busy == 0, loss, -busy, row[0])
            if best is None or rank < best[0]:
                best = (rank, row, start)
        if best is not None:
            _, row, start = best
            p = slots[str(row[2][0])]
            return Placement(row[0], row[1], p.name, start, p.size)
        return self._refuse(wants)

    def _refuse(self, wants: Mapping[str, str]) -> Refused:
        free = self.free_counts()
        views = [GpuView(g.index, g.model_key, g.mig) for g in self.gpus]
        usable, refusal = precheck(views, wants, free)
        if refusal is not None:
            return refusal
        whys: Counter[str] = Counter()
        for g in self.gpus:
            if g.model_key in wants and g.mig == "on":
                t = table(key_of(g))
                choice = t.choose(t.by_name[wants[key_of(g)]], g.used, g.counts, t.uniform)
                whys[str(choice)] += 1
        eligible = sum(1 for v in views if v.model_key in wants)
        return no_capacity(wants, len(usable), eligible, whys, free)


def _shares(demand: Mapping[str, float] | None) -> dict[str, int] | None:
    """Demand (profile name -> requests, or any relative weight) as integer percentages.

    Rounding to whole percent keeps the number of distinct weight vectors, and so the
    memo of decisions, small; every profile asked for at all keeps a weight of at least 1.
    """
    if not demand:
        return None
    bad = {name: w for name, w in demand.items()
           if isinstance(w, bool) or not isinstance(w, int | float) or not w >= 0}
    if bad:
        raise ValueError(f"demand weights must be numbers >= 0; got {bad}")
    total = sum(demand.values())
    if total <= 0:
        return None
    return {normalize_profile_name(name): max(1, round(100 * w / total))
            for name, w in demand.items() if w > 0}


def _reserve(
    t: ModelTable, g: Gpu, reserved: list[Placement], used: int, code: int
) -> tuple[int, int]:
    """Add the reservations on ``g`` whose instance does not exist yet."""
    for r in reserved:
        if any(gi.start == r.start and gi.size == r.size for gi in g.gpu_instances):
            continue
        used |= ((1 << r.size) - 1) << r.start
        slot = t.by_name.get(normalize_profile_name(r.profile))
        if slot is not None:
            code += t.pack_one[slot.index]
    return used, code


def pick_dynamic(
    inventory: Inventory,
    reserved: Iterable[Placement],
    wanted: Wanted,
    strategy: PlacementStrategy = "pack",
    demand: Mapping[str, float] | None = None,
) -> Placement | Refused:
    """GPU and placement for a NEW instance of ``wanted``, or why there is none.

    ``reserved`` are the ledger's dynamic claims (those whose instance exists are
    recognised and counted once). ``pack`` (default) takes the placement that loses
    the least future capacity, preferring GPUs already in use; ``spread`` takes the
    least used GPU first, then the best placement on it. Ties go to the lowest GPU
    index, then the lowest start. ``demand`` (profile name -> how often it is asked
    for, e.g. recent request counts) tells which future requests matter most; without
    it every profile counts the same.
    """
    return Occupancy.of(inventory, reserved).pick_dynamic(wanted, strategy, demand)
