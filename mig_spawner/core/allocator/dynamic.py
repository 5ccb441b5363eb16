"""Dynamic mode: where a NEW GPU instance goes, chosen to keep future requests placeable.

A GPU's state is its taken memory slices and instance counts (existing instances plus
the ledger's reservations); :func:`pick_among` chooses, over the distinct states, the GPU
and the placement ``{start, size}`` that loses the least future capacity, within
NVIDIA's rules (:mod:`.tables`). :class:`DynamicView` keeps the states of a
:class:`~.index.SliceIndex`'s GPUs as leases come and go; :class:`Occupancy` is an
immutable view for searches that try a placement and come back. Import through
:mod:`mig_spawner.core.allocator`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from mig_spawner.core.catalog import normalize_profile_name
from mig_spawner.core.inventory import Gpu, Inventory
from mig_spawner.core.refusal import Refused

from .minset import MinSet
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
    mig_state,
    prepare,
)
from .tables import table


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
        return cls(_rows=tuple((g.index, g.uuid, gpu_state(g, pending.get(g.uuid, ())))
                               for g in inventory.gpus))

    def place(self, p: Placement) -> Occupancy:
        """A copy with ``p`` taken (as a reservation would be)."""
        return self._update(p, +1)

    def release(self, p: Placement) -> Occupancy:
        """A copy with ``p`` given back."""
        return self._update(p, -1)

    def _first_of_each_state(self) -> dict[_State, tuple[int, int, str]]:
        """The lowest-index GPU of each distinct state (GPUs in one state rank the same),
        as (index, row, uuid)."""
        if self._firsts is None:
            firsts: dict[_State, tuple[int, int, str]] = {}
            for n, (index, uuid, state) in enumerate(self._rows):
                seen = firsts.get(state)
                if seen is None or index < seen[0]:
                    firsts[state] = (index, n, uuid)
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

    def _counted(self) -> list[tuple[_State, int]]:
        return list(Counter(row[2] for row in self._rows).items())

    def free_counts(self) -> dict[str, int]:
        """Per profile: how many more could be created right now, each counted alone."""
        return free_among(self._counted())

    def pick_dynamic(
        self,
        wanted: Wanted,
        strategy: PlacementStrategy = "pack",
        demand: Mapping[str, float] | None = None,
    ) -> Placement | Refused:
        """Where a new instance of ``wanted`` should go; see :func:`pick_dynamic`."""
        wants = prepare(wanted, strategy)
        firsts = ((state, *first) for state, first in self._first_of_each_state().items())
        placed = pick_among(firsts, wants, strategy, demand)
        if placed is not None:
            return placed
        return refuse_among(self._counted(), wants, lambda: [
            GpuView(g.index, g.model_key, g.mig) for g in self.gpus])


def gpu_state(g: Gpu, reserved: Iterable[Placement] = ()) -> _State:
    """One GPU's state: its instances plus the ``reserved`` placements on it whose
    instance does not exist yet."""
    key = g.model_key
    mig = mig_state(g)
    if key not in KNOWN_KEYS or not g.mig_supported:
        return (None, mig, 0, 0)
    t = table(key)
    inc = t.pack_by_id
    used = code = 0
    for gi in g.gpu_instances:
        used |= ((1 << gi.size) - 1) << gi.start
        code += inc.get(gi.profile_id, 0)
    for r in reserved:
        if any(gi.start == r.start and gi.size == r.size for gi in g.gpu_instances):
            continue
        used |= ((1 << r.size) - 1) << r.start
        slot = t.by_name.get(normalize_profile_name(r.profile))
        if slot is not None:
            code += t.pack_one[slot.index]
    return (key, mig, used, code)


def pick_among(
    firsts: Iterable[tuple[_State, int, int, str]],
    wants: Mapping[str, str],
    strategy: PlacementStrategy,
    demand: Mapping[str, float] | None,
) -> Placement | None:
    """The best placement of ``wants`` over distinct GPU states, each given with its
    first GPU as ``(state, index, tiebreak, uuid)``; ``None`` when nothing fits.

    GPUs in one state rank the same, so only the first of each is scored: the cost is
    per distinct state, not per GPU.
    """
    shares = _shares(demand)
    spread = strategy == "spread"
    slots = {key: table(key).by_name[name] for key, name in wants.items()}
    weights = {key: table(key).weights(shares) for key in wants}
    best: tuple[tuple[object, ...], str, int, str, int] | None = None
    for (key, mig, used, code), index, tiebreak, uuid in firsts:
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
        rank = ((busy, loss, index, tiebreak) if spread
                else (busy == 0, loss, -busy, index, tiebreak))
        if best is None or rank < best[0]:
            best = (rank, key, index, uuid, start)
    if best is None:
        return None
    _, key, index, uuid, start = best
    p = slots[key]
    return Placement(index, uuid, p.name, start, p.size)


def free_among(counted: Iterable[tuple[_State, int]]) -> dict[str, int]:
    """Per profile: how many more could be created on GPUs in these states (with how
    many GPUs are in each), each profile counted alone."""
    free: Counter[str] = Counter()
    for (key, mig, used, code), n in counted:
        if key is not None and mig == "on":
            t = table(key)
            counts = t.unpack(code)
            for p in t.profiles:
                free[p.name] += n * t.room(p, used, counts)
    return dict(free)


def refuse_among(
    counted: list[tuple[_State, int]],
    wants: Mapping[str, str],
    views: Callable[[], Iterable[GpuView]],
) -> Refused:
    """Why no GPU in these states can take ``wants``. ``views`` (every GPU, read only
    when no GPU of a wanted model has MIG on) names the GPUs in that refusal."""
    free = free_among(counted)
    usable = eligible = 0
    whys: Counter[str] = Counter()
    for (key, mig, used, code), n in counted:
        if key is None or key not in wants:
            continue
        eligible += n
        if mig == "on":
            usable += n
            t = table(key)
            whys[str(t.choose(t.by_name[wants[key]], used, t.unpack(code), t.uniform))] += n
    if not usable:
        _, refusal = precheck(views(), wants, free)
        assert refusal is not None  # precheck refuses whenever no GPU is usable
        return refusal
    return no_capacity(wants, usable, eligible, whys, free)


class DynamicView:
    """The dynamic states of a :class:`~.index.SliceIndex`'s GPUs, kept as leases come
    and go: GPUs per distinct state, the lowest index first. A GPU a layout change holds
    offers nothing and is left out."""

    def __init__(self, size: int) -> None:
        self.states: dict[_State, MinSet[tuple[int, int]]] = {}
        self._records: list[tuple[_State, tuple[int, int]] | None] = [None] * size

    def add(self, n: int, gpu: Gpu, reserved: Iterable[Placement], held: bool) -> None:
        """Count GPU ``n`` (``held``: a layout change holds some of its slices)."""
        if held:
            return
        state = gpu_state(gpu, reserved)
        member = (gpu.index, n)
        self._records[n] = (state, member)
        members = self.states.get(state)
        if members is None:
            members = self.states[state] = MinSet()
        members.add(member)

    def remove(self, n: int) -> None:
        """Stop counting GPU ``n`` (as :meth:`add` counted it)."""
        record = self._records[n]
        if record is None:
            return
        self._records[n] = None
        state, member = record
        members = self.states[state]
        members.discard(member)
        if not members:
            del self.states[state]

    def counted(self) -> list[tuple[_State, int]]:
        """Each distinct state, with how many GPUs are in it."""
        return [(state, len(members)) for state, members in self.states.items()]

    def pick(self, wants: Mapping[str, str], strategy: PlacementStrategy,
             demand: Mapping[str, float] | None, gpus: Sequence[Gpu]) -> Placement | Refused:
        """As :meth:`Occupancy.pick_dynamic`, over the GPUs counted (``gpus``: the
        inventory's, by position)."""
        firsts = ((state, index, n, gpus[n].uuid)
                  for state, members in self.states.items()
                  for index, n in (members.least(),))
        placed = pick_among(firsts, wants, strategy, demand)
        if placed is not None:
            return placed
        return refuse_among(self.counted(), wants, lambda: [
            GpuView(gpus[n].index, record[0][0], record[0][1])
            for n, record in enumerate(self._records) if record is not None])

    def free(self) -> dict[str | None, dict[str, int]]:
        """Per model key, per profile: how many more could be created, each alone."""
        per_key: dict[str | None, list[tuple[_State, int]]] = defaultdict(list)
        for state, n in self.counted():
            per_key[state[0]].append((state, n))
        return {key: free_among(counted) for key, counted in per_key.items()}


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

