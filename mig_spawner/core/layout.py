"""Changing a GPU's MIG layout: the target an admin asks for, and the plan to reach it.

A **target** says, per GPU (by index, or all of them), whether MIG is on and how many
instances of each profile the GPU should carry: the mig-parted config that
``mig-spawner report --advise --write-config`` writes, or a spec string
(:func:`parse_spec`). :func:`plan_layout` compares it with a snapshot of the host
(:class:`~mig_spawner.core.inventory.Inventory`) and the leases that hold its slices,
and says per GPU which instances stay, which go, which are created where, in which
order, and which of the instances that go are held (by whom, until when at the latest).

The plan keeps what it can: an instance of a profile the target still has stays where
it is (held ones first), so a held slice is destroyed only when no layout of the target
can keep it. New instances go at placements the catalog allows, clear of the instances
that stay. Free instances go first, then what fits in the room they leave is created;
only the steps that need a held instance's room wait for its holder (the drain). Pure:
no I/O. The apply, the drain and the holds live in the ledger, the GPU adapter and the
slice service (docs/layout.md).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from .catalog import (
    WHOLE_GPU,
    CatalogError,
    GpuModel,
    is_whole_gpu,
    model,
    normalize_profile_name,
    profile_sort_key,
)
from .inventory import Gpu, Inventory

#: What a GPU that the target does not name gets.
UNCHANGED = "(not in the target: left as it is)"
#: The config the advice writes (``report --advise --write-config``); the default to apply.
ADVISED_CONFIG = "mig-spawner-advised"


class LayoutError(ValueError):
    """A target that cannot be read or cannot be laid out; the message says what to fix."""


class StepKind(StrEnum):
    """One change to one GPU, applied one at a time."""

    DESTROY = "destroy"
    CREATE = "create"
    MIG_ON = "mig_on"
    MIG_OFF = "mig_off"


class PlanState(StrEnum):
    """Where a GPU's change stands (stored in the ledger; like MIG Manager's
    ``nvidia.com/mig.config.state``)."""

    PENDING = "pending"
    DRAINING = "draining"
    APPLYING = "applying"
    DONE = "done"
    FAILED = "failed"


#: How long the holder of a group is given before its server is stopped (group name ->
#: the policy's ``drain_notice``; None: never stopped).
NoticeFor = Callable[[str], "timedelta | None"]

#: States in which a GPU's changing placements are held from new grants.
HOLDING_STATES = (PlanState.PENDING, PlanState.DRAINING, PlanState.APPLYING)


# --- the target ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetEntry:
    """The layout for some GPUs: ``gpus`` (indexes; empty = every GPU), MIG on or off,
    and instances per profile."""

    gpus: tuple[int, ...]
    mig_enabled: bool
    counts: Mapping[str, int] = field(default_factory=dict, hash=False)

    def describe(self) -> str:
        """``3g.71gb + 2x 1g.18gb`` (or ``MIG off``)."""
        if not self.mig_enabled:
            return "MIG off"
        items = sorted(((p, n) for p, n in self.counts.items() if n),
                       key=lambda item: profile_sort_key(item[0]))
        return " + ".join(p if n == 1 else f"{n}x {p}" for p, n in items) or "(empty)"


@dataclass(frozen=True)
class Target:
    """The layout asked for: entries in order; a GPU takes the first entry naming it,
    else the first entry for every GPU."""

    entries: tuple[TargetEntry, ...]

    def for_gpu(self, index: int) -> TargetEntry | None:
        """The entry for GPU ``index``, or None when the target leaves it alone."""
        named = next((e for e in self.entries if index in e.gpus), None)
        return named or next((e for e in self.entries if not e.gpus), None)


def parse_mig_parted(data: Any, config: str | None = None) -> Target:
    """A mig-parted config (``version: v1``, ``mig-configs: {name: [entries]}``) as a
    target: the config called ``config``, else ``mig-spawner-advised`` when present,
    else the only one."""
    if not isinstance(data, Mapping) or not isinstance(data.get("mig-configs"), Mapping):
        raise LayoutError("not a mig-parted config: it needs 'version: v1' and 'mig-configs'")
    configs = data["mig-configs"]
    if config is None:
        if ADVISED_CONFIG in configs:
            config = ADVISED_CONFIG
        elif len(configs) == 1:
            config = next(iter(configs))
        else:
            raise LayoutError(f"the file has several configs ({', '.join(map(str, configs))});"
                              " name one with --config")
    if config not in configs:
        raise LayoutError(f"the file has no config {config!r}; it has "
                          f"{', '.join(map(str, configs)) or 'none'}")
    entries = configs[config]
    if not isinstance(entries, list) or not entries:
        raise LayoutError(f"config {config!r} must be a list of entries with 'devices'")
    return Target(tuple(_entry(e, n) for n, e in enumerate(entries, 1)))


def _entry(raw: Any, number: int) -> TargetEntry:
    where = f"entry {number}"
    if not isinstance(raw, Mapping):
        raise LayoutError(f"{where} must be a mapping with 'devices' and 'mig-enabled'")
    devices = raw.get("devices", "all")
    if devices == "all":
        gpus: tuple[int, ...] = ()
    elif isinstance(devices, list) and devices and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in devices):
        gpus = tuple(devices)
    else:
        raise LayoutError(f"{where}: 'devices' must be 'all' or a list of GPU indexes")
    enabled = raw.get("mig-enabled", True)
    if not isinstance(enabled, bool):
        raise LayoutError(f"{where}: 'mig-enabled' must be true or false")
    counts = raw.get("mig-devices") or {}
    if not isinstance(counts, Mapping):
        raise LayoutError(f"{where}: 'mig-devices' must map profiles to counts")
    return TargetEntry(gpus, enabled, _counts(counts.items(), where) if enabled else {})


def _counts(items: Iterable[tuple[Any, Any]], where: str) -> dict[str, int]:
    found: Counter[str] = Counter()
    for name, count in items:
        if not isinstance(name, str) or not name.strip():
            raise LayoutError(f"{where}: {name!r} is not a profile name")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise LayoutError(f"{where}: the count of {name} must be a whole number >= 0, "
                              f"not {count!r}")
        found[normalize_profile_name(name)] += count
    return {p: n for p, n in found.items() if n}


_SPEC_ITEM = re.compile(r"^(?P<profile>[^*]+?)\s*(?:\*\s*(?P<count>\d+))?$")


def parse_spec(text: str) -> Target:
    """A target written on one line: ``[GPUS=]LAYOUT`` parts joined by ``;``, GPUS being
    GPU indexes joined by ``,`` (no GPUS: every GPU), LAYOUT ``profile[*n]`` items joined
    by ``,`` or ``off`` (MIG off). ``0=3g.71gb,2g.35gb*2;1=1g.18gb*7``."""
    entries = []
    for number, part in enumerate((p.strip() for p in text.split(";") if p.strip()), 1):
        where = f"part {number} ({part!r})"
        gpus: tuple[int, ...] = ()
        if "=" in part:
            head, part = (s.strip() for s in part.split("=", 1))
            try:
                gpus = tuple(int(i) for i in head.split(","))
            except ValueError:
                raise LayoutError(f"{where}: GPUs must be indexes like '0,1'") from None
            if any(i < 0 for i in gpus):
                raise LayoutError(f"{where}: GPU indexes are 0 or more")
        if part.lower() == "off":
            entries.append(TargetEntry(gpus, False, {}))
            continue
        items = []
        for item in (i.strip() for i in part.split(",") if i.strip()):
            match = _SPEC_ITEM.match(item)
            if match is None:
                raise LayoutError(f"{where}: {item!r} is not 'profile' or 'profile*n'")
            items.append((match["profile"], int(match["count"] or 1)))
        entries.append(TargetEntry(gpus, True, _counts(items, where)))
    if not entries:
        raise LayoutError("the layout is empty: give e.g. '3g.71gb,2g.35gb*2' or a file")
    return Target(tuple(entries))


# --- what is there now -------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Who holds an instance: a lease's user, server, group and profile, and when its
    session ends at the latest (max session age; None: no limit)."""

    lease_id: str
    user: str
    server_name: str
    group: str
    profile: str
    gpu_uuid: str
    start: int
    expires_at: datetime | None = None

    @property
    def server(self) -> str:
        return f"{self.user}/{self.server_name}" if self.server_name else self.user


#: The GPU-instance id of :attr:`Instance.whole`: a GPU with MIG off has none.
WHOLE_GI = -1


@dataclass(frozen=True)
class Instance:
    """A GPU instance that exists now: where it lies, its MIG device, whether a lease
    holds it and whether processes run on it."""

    gi_id: int
    profile: str
    start: int
    size: int
    mig_uuid: str | None = None
    holder: Holder | None = None
    busy: bool = False

    @property
    def free(self) -> bool:
        return self.holder is None and not self.busy

    @property
    def whole(self) -> bool:
        """The whole GPU with MIG off (no GPU instance): capacity like any slice, which a
        MIG mode change takes away from its holder."""
        return self.gi_id == WHOLE_GI

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)

    def describe(self) -> str:
        if self.whole:
            return "the whole GPU (MIG off)"
        return f"{self.profile} at {self.start} (GI {self.gi_id})"


@dataclass(frozen=True)
class NewInstance:
    """An instance the plan creates: its profile and placement."""

    profile: str
    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)

    def describe(self) -> str:
        return f"{self.profile} at {self.start}"


@dataclass(frozen=True)
class Step:
    """One change: destroy ``instance``, create ``new``, or switch MIG. ``waits_for``:
    the leases whose holders must be gone first (empty: it can run now)."""

    kind: StepKind
    gpu_index: int
    instance: Instance | None = None
    new: NewInstance | None = None
    waits_for: tuple[Holder, ...] = ()

    def describe(self) -> str:
        what = {StepKind.DESTROY: lambda: f"destroy {self.instance.describe()}",  # type: ignore[union-attr]
                StepKind.CREATE: lambda: f"create {self.new.describe()}",  # type: ignore[union-attr]
                StepKind.MIG_ON: lambda: "turn MIG on",
                StepKind.MIG_OFF: lambda: "turn MIG off"}[self.kind]()
        if self.waits_for:
            what += " once " + ", ".join(h.server for h in self.waits_for) + " ended"
        return what

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind.value, "gpu": self.gpu_index}
        if self.instance is not None:
            data.update(profile=self.instance.profile, start=self.instance.start,
                        size=self.instance.size, gi_id=self.instance.gi_id)
        if self.new is not None:
            data.update(profile=self.new.profile, start=self.new.start, size=self.new.size)
        data["waits_for"] = [h.lease_id for h in self.waits_for]
        return data


@dataclass(frozen=True)
class GpuPlan:
    """The change for one GPU; ``problem`` says why it cannot be made (nothing is)."""

    index: int
    uuid: str
    model_key: str | None
    target: str
    keep: tuple[Instance, ...] = ()
    destroy: tuple[Instance, ...] = ()
    create: tuple[NewInstance, ...] = ()
    steps: tuple[Step, ...] = ()
    problem: str | None = None
    mode_change: bool = False
    needs_reset: bool = False

    @property
    def changes(self) -> bool:
        return bool(self.steps)

    @property
    def held(self) -> tuple[Instance, ...]:
        """Instances that must go and are held or busy now: the drain waits for them."""
        return tuple(i for i in self.destroy if not i.free)

    @property
    def changing_slices(self) -> frozenset[int]:
        """Memory slices that will change: no new grant may land on them meanwhile."""
        if self.mode_change:
            return frozenset(range(model(self.model_key).memory_slices)) if self.model_key \
                else frozenset()
        return frozenset(s for i in (*self.destroy, *self.create) for s in i.slices)

    def meanwhile(self) -> Counter[str]:
        """Instances a user can still get on this GPU during the change: the free ones
        that stay, and those created before any holder must leave."""
        got = Counter(i.profile for i in self.keep if i.free)
        if self.problem is None and not self.mode_change:
            got.update(s.new.profile for s in self.steps
                       if s.kind is StepKind.CREATE and not s.waits_for and s.new)
        return got

    def to_json(self, now: datetime | None = None, notice: NoticeFor | None = None
                ) -> dict[str, Any]:
        return {
            "gpu": self.index, "uuid": self.uuid, "model": self.model_key,
            "target": self.target, "changes": self.changes, "problem": self.problem,
            "mode_change": self.mode_change, "needs_reset": self.needs_reset,
            "keep": [_instance_json(i) for i in self.keep],
            "destroy": [_instance_json(i, now, notice) for i in self.destroy],
            "create": [{"profile": n.profile, "start": n.start, "size": n.size}
                       for n in self.create],
            "steps": [s.to_json() for s in self.steps],
            "meanwhile": dict(sorted(self.meanwhile().items())),
        }


def latest_end(holder: Holder, now: datetime | None, notice: NoticeFor | None
               ) -> datetime | None:
    """When ``holder``'s session ends at the latest: its max session age, or the drain's
    notice of its group from ``now`` when that comes first."""
    span = notice(holder.group) if notice else None
    ends = [t for t in (holder.expires_at, now + span if now and span else None) if t]
    return min(ends) if ends else None


def _instance_json(i: Instance, now: datetime | None = None,
                   notice: NoticeFor | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"profile": i.profile, "start": i.start, "size": i.size,
                            "gi_id": i.gi_id, "mig_uuid": i.mig_uuid, "free": i.free,
                            "busy": i.busy}
    if i.holder is not None:
        until = latest_end(i.holder, now, notice)
        data["held_by"] = {"user": i.holder.user, "server": i.holder.server_name,
                           "group": i.holder.group, "profile": i.holder.profile,
                           "lease": i.holder.lease_id,
                           "until": until.isoformat() if until else None}
    return data


@dataclass(frozen=True)
class LayoutPlan:
    """The change for every GPU the target names, in GPU order."""

    gpus: tuple[GpuPlan, ...]

    @property
    def changing(self) -> tuple[GpuPlan, ...]:
        return tuple(g for g in self.gpus if g.changes and g.problem is None)

    @property
    def problems(self) -> tuple[GpuPlan, ...]:
        return tuple(g for g in self.gpus if g.problem is not None)

    def meanwhile(self) -> Counter[str]:
        """What users can get on the whole host while the plan runs, per profile."""
        total: Counter[str] = Counter()
        for g in self.gpus:
            total.update(g.meanwhile())
        return total

    def meanwhile_by_group(self, allowed: Mapping[str, Iterable[str]]) -> dict[str, dict[str, int]]:
        """Per group (``allowed``: group -> profiles its policy allows), what it can still
        get while the plan runs."""
        total = self.meanwhile()
        return {group: {p: total[p] for p in sorted(set(profiles)) if total[p]}
                for group, profiles in sorted(allowed.items())}


# --- planning ----------------------------------------------------------------------------


def instances_of(gpu: Gpu, holders: Mapping[tuple[str, int], Holder]) -> tuple[Instance, ...]:
    """``gpu``'s GPU instances, with their MIG device, holder (``holders`` keyed by
    ``(gpu_uuid, start)``) and whether processes run on them. A MIG-capable GPU with MIG
    off is one instance, the whole GPU, held by a whole-GPU lease (which starts at 0)."""
    if not gpu.mig_current:
        if gpu.model_key is None or not gpu.mig_supported:
            return ()
        return (Instance(WHOLE_GI, WHOLE_GPU, 0, model(gpu.model_key).memory_slices, None,
                         holders.get((gpu.uuid, 0)),
                         bool(gpu.processes) or gpu.processes_unknown),)
    devices = {d.gi_id: d for d in gpu.mig_devices}
    out = []
    for gi in sorted(gpu.gpu_instances, key=lambda g: g.start):
        device = devices.get(gi.gi_id)
        out.append(Instance(gi.gi_id, gi.profile, gi.start, gi.size,
                            device.uuid if device else None,
                            holders.get((gpu.uuid, gi.start)),
                            bool(device and device.busy)))
    return tuple(out)


def plan_layout(inventory: Inventory, target: Target,
                holders: Mapping[tuple[str, int], Holder] | Iterable[Holder] = (),
                ) -> LayoutPlan:
    """The plan that takes ``inventory`` to ``target``; ``holders``: the leases that hold
    slices now (keyed by ``(gpu_uuid, start)``, or a list of them)."""
    if not isinstance(holders, Mapping):
        holders = {(h.gpu_uuid, h.start): h for h in holders}
    plans = []
    named = {i for e in target.entries for i in e.gpus}
    present = {g.index for g in inventory.gpus}
    for missing in sorted(named - present):
        plans.append(GpuPlan(missing, "", None, "", problem=f"this host has no GPU {missing}"))
    for gpu in inventory.gpus:
        entry = target.for_gpu(gpu.index)
        instances = instances_of(gpu, holders)
        if entry is None:
            # Left as it is; its free instances still count for what users can get.
            plans.append(GpuPlan(gpu.index, gpu.uuid, gpu.model_key, UNCHANGED,
                                 keep=instances))
        else:
            plans.append(plan_gpu(gpu, entry, instances))
    return LayoutPlan(tuple(sorted(plans, key=lambda p: p.index)))


def plan_gpu(gpu: Gpu, entry: TargetEntry, instances: Sequence[Instance]) -> GpuPlan:
    """The change for one GPU (see :func:`plan_layout`)."""
    base = GpuPlan(gpu.index, gpu.uuid, gpu.model_key, entry.describe())
    if gpu.model_key is None or not gpu.mig_supported:
        return _problem(base, f"GPU {gpu.index} ({gpu.product}) has no MIG")
    gpu_model = gpu.catalog_model() or model(gpu.model_key)
    reset = gpu_model.architecture == "Ampere"
    on_now = gpu.mig_current
    if not entry.mig_enabled:
        if not on_now:
            return base
        held = tuple(i for i in instances if not i.free)
        steps = [*(_destroy(gpu.index, i) for i in instances),
                 Step(StepKind.MIG_OFF, gpu.index, waits_for=_holders(held))]
        return _with_steps(base, destroy=tuple(instances), steps=steps, mode_change=True,
                           needs_reset=reset)
    try:
        wanted = _wanted(gpu_model, entry.counts, {p.name for p in gpu.driver_profiles})
    except LayoutError as e:
        return _problem(base, f"GPU {gpu.index}: {e}")
    if not on_now:
        placed = _place(gpu_model, wanted, 0)
        if placed is None:
            return _problem(base, f"GPU {gpu.index}: {entry.describe()} does not fit on a "
                                  f"{gpu_model.display_name}")
        # The whole GPU goes as an instance would: MIG goes on, and every instance is
        # created, only once its holder (a whole-GPU lease) or its processes are gone.
        whole = tuple(i for i in instances if i.whole)
        waits = _holders(whole)
        steps = [*(Step(StepKind.MIG_ON, gpu.index, instance=i, waits_for=waits)
                   for i in whole or (None,)),
                 *(Step(StepKind.CREATE, gpu.index, new=n, waits_for=waits) for n in placed)]
        return _with_steps(base, destroy=whole, create=placed, steps=steps, mode_change=True,
                           needs_reset=reset)
    choice = _keep_and_place(gpu_model, wanted, instances)
    if choice is None:
        return _problem(base, f"GPU {gpu.index}: {entry.describe()} does not fit on a "
                              f"{gpu_model.display_name}")
    keep, create = choice
    destroy = tuple(i for i in instances if i not in keep)
    return _with_steps(base, keep=keep, destroy=destroy, create=create,
                       steps=_order(gpu.index, destroy, create))


def _problem(base: GpuPlan, why: str) -> GpuPlan:
    return GpuPlan(base.index, base.uuid, base.model_key, base.target, problem=why)


def _with_steps(base: GpuPlan, **parts: Any) -> GpuPlan:
    return GpuPlan(base.index, base.uuid, base.model_key, base.target,
                   **{**parts, "steps": tuple(parts.get("steps", ()))})


def _holders(instances: Iterable[Instance]) -> tuple[Holder, ...]:
    return tuple(i.holder for i in instances if i.holder is not None)


def _destroy(gpu_index: int, i: Instance) -> Step:
    return Step(StepKind.DESTROY, gpu_index, instance=i, waits_for=_holders([i]))


def _order(gpu_index: int, destroy: Sequence[Instance], create: Sequence[NewInstance]
           ) -> list[Step]:
    """Free instances go first, then every creation clear of the held ones; then each
    held instance once its holder is gone, and what its room was kept for."""
    free = [i for i in destroy if i.free]
    held = [i for i in destroy if not i.free]
    blocked = {s for i in held for s in i.slices}
    now = [n for n in create if not blocked.intersection(n.slices)]
    later = [n for n in create if n not in now]
    steps = [_destroy(gpu_index, i) for i in sorted(free, key=lambda i: i.start)]
    steps += [Step(StepKind.CREATE, gpu_index, new=n) for n in now]
    steps += [_destroy(gpu_index, i) for i in sorted(held, key=lambda i: i.start)]
    for n in later:
        waits = _holders(i for i in held if set(i.slices) & set(n.slices))
        steps.append(Step(StepKind.CREATE, gpu_index, new=n, waits_for=waits))
    return steps


def _wanted(gpu_model: GpuModel, counts: Mapping[str, int],
            offered: Collection[str] = ()) -> list[str]:
    """The target's instances as profile names, biggest first; checked against the model
    and, where the GPU's driver reported its profile table (``offered``: MIG is on), the
    driver's: a profile it does not list cannot be created, so nothing is changed for it
    (a dry check before any instance is destroyed)."""
    names: list[str] = []
    for name, count in counts.items():
        try:
            profile = gpu_model.profile(name)
        except CatalogError as e:
            raise LayoutError(str(e)) from None
        if is_whole_gpu(profile.name):
            raise LayoutError(f"{name!r} is a whole GPU, not a MIG instance: ask for 'off'")
        if offered and profile.name not in offered:
            raise LayoutError(f"this GPU's driver does not offer {profile.name} (it offers "
                              f"{', '.join(sorted(offered, key=profile_sort_key))}); a newer "
                              "driver may")
        if count > profile.max_instances:
            raise LayoutError(f"at most {profile.max_instances} {profile.name} fit on a "
                              f"{gpu_model.display_name}, not {count}")
        names += [profile.name] * count
    if sum(1 for n in names if gpu_model.profile(n).media_extensions) > 1:
        raise LayoutError("a GPU carries at most one instance with media extensions (+me)")
    return sorted(names, key=lambda n: (-gpu_model.profile(n).placement_size, n))


def _place(gpu_model: GpuModel, names: Sequence[str], taken: int
           ) -> tuple[NewInstance, ...] | None:
    """Placements for ``names`` (biggest first) clear of ``taken`` (a bit per memory
    slice), each at a start the catalog allows; None when they do not fit."""
    if not names:
        return ()
    profile = gpu_model.profile(names[0])
    size = profile.placement_size
    for start in profile.placement_starts:
        mask = ((1 << size) - 1) << start
        if start + size > gpu_model.memory_slices or taken & mask:
            continue
        rest = _place(gpu_model, names[1:], taken | mask)
        if rest is not None:
            return (NewInstance(profile.name, start, size), *rest)
    return None


def _keep_and_place(gpu_model: GpuModel, wanted: Sequence[str], instances: Sequence[Instance]
                    ) -> tuple[tuple[Instance, ...], tuple[NewInstance, ...]] | None:
    """Which instances stay and where the rest of ``wanted`` goes: the choice that keeps
    the most held instances, then the most instances; None when ``wanted`` does not fit
    even on an empty GPU."""
    # An instance without a MIG device (a GPU instance whose compute instance was never
    # made: a crash between the two) serves nobody: it goes.
    candidates = [i for i in instances if i.profile in wanted and i.mig_uuid is not None]
    # Held first, then by start: the first subsets tried are the ones that keep most.
    candidates.sort(key=lambda i: (i.free, i.start))
    subsets = (c for r in range(len(candidates), -1, -1)
               for c in itertools.combinations(candidates, r))
    best: tuple[tuple[int, int], tuple[Instance, ...], tuple[NewInstance, ...]] | None = None
    for keep in subsets:
        rank = (sum(not i.free for i in keep), len(keep))
        if best is not None and rank <= best[0]:
            continue
        rest = Counter(wanted)
        rest.subtract(i.profile for i in keep)
        if any(n < 0 for n in rest.values()):
            continue
        taken = 0
        for i in keep:
            taken |= ((1 << i.size) - 1) << i.start
        names = sorted(rest.elements(), key=lambda n: (-gpu_model.profile(n).placement_size, n))
        placed = _place(gpu_model, names, taken)
        if placed is not None:
            best = (rank, tuple(sorted(keep, key=lambda i: i.start)), placed)
    return None if best is None else (best[1], best[2])
