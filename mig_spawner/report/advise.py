"""Propose a MIG layout per GPU that would have served the observed demand with fewer refusals.

The search works on per-profile capacities: in pool mode a request is granted exactly
when some instance of its profile is free, so a fleet's refusals depend only on how
many instances of each profile it has. That makes trying a layout cheap
(:func:`count_refusals`), so the search can try every maximal layout of the demanded
profiles on every GPU. The figures it reports, before and after, come from a full
replay through the allocator (:mod:`.replay`), not from the shortcut.

Search: start from the current layout and from every "all GPUs alike" layout; from
each, repeatedly make the single-GPU change that removes the most refusals (ties: the
one that keeps more capacity for the demanded profiles) until none helps; keep the
best result, preferring fewer changed GPUs among equals.

Guards, so that the advice is worth following: below ``min_requests`` (default
:data:`MIN_REQUESTS`) it proposes nothing and says the sample is too small; a profile
the current layout has and someone asked for in the window keeps at least one instance;
a profile it drops is named with the groups whose policy allows it (who lose it); GPUs
that change while leases hold slices on them are marked as needing a drain; and the
refusals before and after come with a range from resampling the sample's days
(:mod:`.sample`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

from mig_spawner.core.allocator import Occupancy, Placement
from mig_spawner.core.catalog import model
from mig_spawner.report.demand import Request
from mig_spawner.report.replay import (
    Fleet,
    GpuLayout,
    ReplayResult,
    layout_inventory,
    replay_dynamic,
    replay_pool,
)
from mig_spawner.report.sample import Ranges, Sample, plural, refusal_ranges

#: Name of the advised layout in the mig-parted config (``nvidia.com/mig.config`` label).
ADVISED_CONFIG = "mig-spawner-advised"
CURRENT_CONFIG = "mig-spawner-current"
#: Fewest requests the advice proposes a change from (``--min-requests``): below it a
#: handful of spawns would decide how every slice is cut.
MIN_REQUESTS = 50
#: A sample shorter than this many days gets a caution: a weekly cycle is not in it.
CAUTION_DAYS = 7


@dataclass(frozen=True)
class Advice:
    """The current layout, the proposed one, and how each fared in the replay."""

    current: Fleet
    proposed: Fleet
    before: ReplayResult
    after: ReplayResult
    dynamic: ReplayResult  # the same history in dynamic mode, for comparison
    sample: Sample
    ranges: Ranges
    min_requests: int = MIN_REQUESTS
    #: Profile the proposal no longer has -> groups whose policy allows it (sorted).
    dropped: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: GPU index -> leases holding a slice on it now.
    held: Mapping[int, int] = field(default_factory=dict)

    @property
    def too_small(self) -> bool:
        """True when the sample is below ``min_requests``: nothing is proposed."""
        return self.sample.requests < self.min_requests

    @property
    def to_drain(self) -> tuple[int, ...]:
        """Changed GPUs on which leases hold slices: stop those servers first."""
        return tuple(i for i in self.changed if self.held.get(i))

    def cautions(self) -> list[str]:
        """What the reader should weigh before applying the proposal."""
        found = []
        if self.sample.days < CAUTION_DAYS and not self.too_small:
            found.append(f"the sample covers {plural(self.sample.days, 'day')}, fewer than "
                         f"{CAUTION_DAYS}: a weekly pattern is not in it")
        if self.changed and self.ranges.gain.low <= 0:
            found.append(f"the gain ranges {self.ranges.gain} over resampled days: on some "
                         "of them the proposal does no better than the current layout")
        for profile, groups in sorted(self.dropped.items()):
            who = (f"groups allowed it: {', '.join(groups)}" if groups
                   else "no group named it in the policy given")
            found.append(f"the proposal has no {profile} any more (nobody asked for it in "
                         f"the window; {who})")
        for index in self.to_drain:
            found.append(f"GPU {index} changes but has {plural(self.held[index], 'lease')} "
                         "holding slices on it: drain it (stop those servers) before "
                         "re-cutting")
        return found

    @property
    def changed(self) -> tuple[int, ...]:
        """GPU indexes whose layout changes."""
        return tuple(a.gpu_index for a, b in zip(self.current, self.proposed, strict=True)
                     if a.key() != b.key())

    @property
    def fewer_refusals(self) -> int:
        """How many refusals the proposed layout avoids in the replay."""
        return self.before.refused - self.after.refused

    def summary(self) -> str:
        """One paragraph for people."""
        if self.too_small:
            return (f"no advice: the sample is too small ({self.sample.describe()}); a "
                    f"proposal needs at least {self.min_requests} requests (--min-requests). "
                    "Report over a longer window (--since) once more history is recorded")
        if not self.changed:
            return (f"keep the current layout: no other layout of the demanded profiles "
                    f"refuses fewer than its {self.before.refused} of "
                    f"{self.before.requests} replayed requests")
        share = (f" ({self.fewer_refusals / self.before.refused:.0%} fewer)"
                 if self.before.refused else "")
        return (f"the proposed layout refuses {self.after.refused} of {self.after.requests} "
                f"replayed requests instead of {self.before.refused}: "
                f"{self.fewer_refusals} fewer{share}; it changes GPU(s) "
                f"{', '.join(map(str, self.changed))}. Dynamic mode would have refused "
                f"{self.dynamic.refused}.")


@cache
def candidate_layouts(model_key: str, profiles: frozenset[str]) -> tuple[GpuLayout, ...]:
    """Every maximal layout of ``profiles`` on one GPU of ``model_key`` (no profile of
    ``profiles`` could still be added), each laid out by the allocator's placement."""
    gpu = model(model_key)
    names = sorted((p for p in profiles if gpu.has_profile(p)),
                   key=lambda p: (-gpu.profile(p).placement_size, p))
    empty = layout_inventory((GpuLayout(0, gpu.key),))
    found: dict[tuple, GpuLayout] = {}

    def grow(occupancy: Occupancy, counts: Counter[str], first: int) -> None:
        grown = False
        for n in range(first, len(names)):
            choice = occupancy.pick_dynamic(names[n])
            if isinstance(choice, Placement):
                grown = True
                counts[names[n]] += 1
                grow(occupancy.place(choice), counts, n)
                counts[names[n]] -= 1
        # Maximal: nothing of any demanded profile fits any more (checked over all names,
        # since one added later in the order may still fit).
        if not grown and not any(isinstance(occupancy.pick_dynamic(p), Placement)
                                 for p in names):
            layout = GpuLayout(0, gpu.key, +counts)
            found.setdefault(layout.key(), layout)

    if names:
        grow(Occupancy.of(empty), Counter(), 0)
    return tuple(found.values())


def capacity(fleet: Iterable[GpuLayout]) -> Counter[str]:
    """Instances per profile over the whole fleet."""
    total: Counter[str] = Counter()
    for layout in fleet:
        total.update(layout.devices)
    return total


class _Demand:
    """The request history, split per profile, for fast what-ifs.

    In pool mode profiles do not compete: a request is refused exactly when every
    instance of its own profile is held. So a fleet's refusals are the sum over profiles
    of ``R_p(capacity of p)``, and each ``R_p(c)`` is one sweep of that profile's
    requests, computed once and remembered: trying a layout then costs a few lookups.
    """

    def __init__(self, requests: Sequence[Request]) -> None:
        events: dict[str, list[tuple[object, int, int]]] = {}
        for n, q in enumerate(requests):
            # Leaving at t frees the slice before an arrival at t takes it (0 sorts first).
            events.setdefault(q.profile, []).extend(((q.arrive, 1, n), (q.leave, 0, n)))
        self._events = {p: [(kind == 1, n) for _, kind, n in sorted(e, key=lambda x: x[:2])]
                        for p, e in events.items()}
        self._memo: dict[tuple[str, int], int] = {}
        self.profiles = frozenset(events)

    def refused(self, profile: str, capacity: int) -> int:
        """Refusals of ``profile``'s requests with ``capacity`` instances of it."""
        key = (profile, capacity)
        found = self._memo.get(key)
        if found is None:
            free, found = capacity, 0
            granted: set[int] = set()
            for arriving, n in self._events.get(profile, ()):
                if not arriving:
                    if n in granted:
                        granted.discard(n)
                        free += 1
                elif free > 0:
                    free -= 1
                    granted.add(n)
                else:
                    found += 1
            self._memo[key] = found
        return found

    def refusals(self, capacity: Mapping[str, int]) -> int:
        return sum(self.refused(p, capacity.get(p, 0)) for p in self.profiles)


def count_refusals(fleet: Fleet, requests: Sequence[Request]) -> int:
    """Refusals of ``requests`` on ``fleet`` in pool mode, by counting free instances."""
    return _Demand(requests).refusals(capacity(fleet))


def _score(demand: _Demand, fleet: Fleet, current: Fleet,
           keep: frozenset[str]) -> tuple[int, int, int] | None:
    """(refusals, changed GPUs, -useful capacity); ``None`` when ``fleet`` loses the
    last instance of a profile in ``keep``."""
    held = capacity(fleet)
    if any(not held[p] for p in keep):
        return None
    changes = sum(1 for a, b in zip(fleet, current, strict=True) if a.key() != b.key())
    useful = sum(n * model(f.model_key).profile(p).compute_slices
                 for f in fleet for p, n in f.devices.items() if p in demand.profiles)
    return demand.refusals(held), changes, -useful


def _descend(demand: _Demand, start: tuple[tuple[int, int, int], Fleet], current: Fleet,
             keep: frozenset[str], options: Sequence[tuple[GpuLayout, ...]]
             ) -> tuple[tuple[int, int, int], Fleet]:
    """Best single-GPU changes from ``start`` (a score and its fleet) while one helps."""
    score, fleet = start
    while True:
        best = (score, fleet)
        for i, choices in enumerate(options):
            for choice in choices:
                if choice.key() == fleet[i].key():
                    continue
                trial = (*fleet[:i], fleet[i].with_devices(choice.devices), *fleet[i + 1:])
                trial_score = _score(demand, trial, current, keep)
                # Fewer refusals first; then more useful capacity, fewer changes.
                if trial_score is not None and (trial_score[0], trial_score[2], trial_score[1]) < (
                        best[0][0], best[0][2], best[0][1]):
                    best = (trial_score, trial)
        if best[1] is fleet:
            return score, fleet
        score, fleet = best


def advise(current: Fleet, requests: Sequence[Request], *,
           min_requests: int = MIN_REQUESTS,
           allowed_by: Mapping[str, Iterable[str]] | None = None,
           held: Mapping[int, int] | None = None, seed: int = 0) -> Advice:
    """The layout that would have refused fewest of ``requests``, and the replayed figures.

    ``current``: the host's layout now (:func:`~.replay.fleet_of`). Requests for profiles
    that no GPU of the fleet offers stay refused whatever the layout. Below
    ``min_requests`` requests nothing is proposed. ``allowed_by``: profile -> groups
    whose policy allows it (to say who loses a dropped profile); ``held``: GPU index ->
    leases holding slices on it now (to mark drains); ``seed``: of the day resampling.
    """
    sample = Sample.of(requests)
    proposed = current
    if sample.requests >= min_requests:
        proposed = _search(current, requests)
    before = replay_pool(layout_inventory(current), requests)
    after = replay_pool(layout_inventory(proposed), requests)
    now, then = capacity(current), capacity(proposed)
    return Advice(
        current=current,
        proposed=proposed,
        before=before,
        after=after,
        dynamic=replay_dynamic([g.model_key for g in current], requests),
        sample=sample,
        ranges=refusal_ranges(requests, before.refused_requests, after.refused_requests,
                              seed=seed),
        min_requests=min_requests,
        dropped={p: tuple(sorted(set((allowed_by or {}).get(p, ()))))
                 for p in sorted(now) if now[p] and not then[p]},
        held=dict(held or {}),
    )


def _search(current: Fleet, requests: Sequence[Request]) -> Fleet:
    """The layout of least refusals that keeps every requested profile ``current`` has."""
    demand = _Demand(requests)
    now = capacity(current)
    keep = frozenset(p for p in demand.profiles if now[p])
    options = [candidate_layouts(g.model_key, demand.profiles) or (g,) for g in current]
    fleets = [current]
    for model_key in sorted({g.model_key for g in current}):
        fleets.extend(tuple(g.with_devices(layout.devices) if g.model_key == model_key
                            else g for g in current)
                      for layout in candidate_layouts(model_key, demand.profiles))
    # Starts that drop a profile in ``keep`` are left out (the current layout never does).
    starts = [(score, fleet) for fleet in fleets
              if (score := _score(demand, fleet, current, keep)) is not None]
    results = [_descend(demand, s, current, keep, options) for s in starts]
    # Fewest refusals; among equals the fewest changed GPUs, then most useful capacity.
    _, proposed = min(results, key=lambda r: (r[0][0], r[0][1], r[0][2]))
    if count_refusals(proposed, requests) >= count_refusals(current, requests):
        return current
    return proposed


def mig_parted_config(fleet: Fleet, name: str = ADVISED_CONFIG) -> dict:
    """``fleet`` as an NVIDIA mig-parted config (``version: v1``), one entry per distinct
    layout: ``devices: all`` when every GPU is alike, else the GPU indexes."""
    groups: dict[tuple, list[GpuLayout]] = {}
    for layout in fleet:
        groups.setdefault(layout.key(), []).append(layout)
    entries = []
    for layouts in groups.values():
        devices: str | list[int] = (
            "all" if len(groups) == 1 else sorted(g.gpu_index for g in layouts))
        entries.append({
            "devices": devices,
            "mig-enabled": True,
            "mig-devices": dict(sorted(
                ((p, n) for p, n in layouts[0].devices.items() if n),
                key=lambda item: (-model(layouts[0].model_key).profile(item[0]).placement_size,
                                  item[0]))),
        })
    return {"version": "v1", "mig-configs": {name: entries}}

