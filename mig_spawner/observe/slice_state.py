"""One row per MIG slice: what the GPU has, what the ledger says, what the policy allows.

:func:`slice_map` joins three snapshots taken at (almost) the same moment, the host's
:class:`~mig_spawner.core.inventory.Inventory`, the ledger's held leases and the
:class:`~mig_spawner.core.policy.PolicySet`, into plain rows that the metrics, the
admin map and the CLI all read. Pure: no I/O, so the same join is tested once and
shown three ways.

A slice is in one of four states:

``free``
    an instance exists, no lease holds it and no process runs on it;
``leased``
    a held lease covers it and its server was active within ``idle_after``
    (a dynamic lease whose instance is not created yet is ``leased`` too);
``idle``
    a held lease covers it but its server has shown no activity for ``idle_after``
    or longer: the slice is a candidate for the culler, or for a talk with its user;
``orphan``
    the GPU and the ledger disagree: processes run on an instance no lease holds
    (someone uses the slice outside mig-spawner), or an active lease names an
    instance that no longer exists (destroyed out of band). ``note`` says which.

Apart from its state, a slice a GPU fault withholds (docs/health.md) carries ``fault``:
why, in words; the map draws it in a colour of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from mig_spawner.core import budget
from mig_spawner.core.budget import Extra
from mig_spawner.core.catalog import WHOLE_GPU, CatalogError, format_gib, model
from mig_spawner.core.durations import format_duration, rounded_duration
from mig_spawner.core.idle import idle_deadline, idle_limit
from mig_spawner.core.inventory import Gpu, Inventory, MigDevice
from mig_spawner.core.keep import keep_can_help
from mig_spawner.core.kinds import offered_whole
from mig_spawner.core.lifecycle import PendingStop, StopRule
from mig_spawner.core.policy import GroupPolicy, PolicySet
from mig_spawner.core.waitlist import group_shares, order, positions
from mig_spawner.ledger import GpuFault, LayoutChange, Lease, LeaseState, WaitEntry

SliceState = Literal["free", "leased", "idle", "orphan"]
SLICE_STATES: tuple[SliceState, ...] = ("free", "leased", "idle", "orphan")

#: Default for ``idle_after``: a leased slice with no activity for this long shows as idle.
DEFAULT_IDLE_AFTER = 15 * 60.0
#: The coarsest step in which the slice service writes a server's activity on its lease.
MAX_ACTIVITY_RESOLUTION = 60.0


def activity_resolution(idle_after: float) -> float:
    """How finely the slice service must write a server's activity on its lease for
    this map: a quarter of ``idle_after``, at most :data:`MAX_ACTIVITY_RESOLUTION`.

    A busy server's activity is written as "now" at each sweep, but only when it moved
    on by the resolution. A resolution coarser than ``idle_after`` (a minute against a
    30 s limit) drew a busy server's slice idle for part of each minute and leased again
    at the next write: a tile flickering between the two.
    """
    return min(MAX_ACTIVITY_RESOLUTION, idle_after / 4)


@dataclass(frozen=True)
class WarningRow:
    """A warning pending for a server: of which stop, in how long it comes (the time its
    user was told), and whether Keep can put it off."""

    rule: StopRule
    #: ``None``: not stopped, only told (a GPU fault where the group lets servers finish).
    stops_in_seconds: float | None
    keep: bool


@dataclass(frozen=True)
class SliceRow:
    """One slice (GPU instance) of one GPU, or a lease that should have one."""

    gpu_index: int
    gpu_uuid: str
    profile: str
    start: int
    size: int
    state: SliceState
    mig_uuid: str | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    memory_total_mib: int = 0
    memory_used_mib: int = 0
    processes: int = 0
    #: The driver would not tell the processes (the slice counts as busy).
    processes_unknown: bool = False
    lease_id: str | None = None
    user: str | None = None
    server_name: str | None = None
    group: str | None = None
    lease_state: str | None = None
    #: Seconds since the server started (since the claim while it starts).
    age_seconds: float | None = None
    #: Seconds since the last activity the ledger recorded for the server.
    idle_seconds: float | None = None
    #: The idle limit in force (None: no idle limit): the charged group's
    #: ``server_idle_timeout_when_waited`` while someone waits for the slice's size
    #: (``idle_limit_waited``), else its ``_when_unwaited`` (either falling back to
    #: ``server_idle_timeout``), as the slice service applies them.
    idle_limit_seconds: float | None = None
    idle_limit_waited: bool | None = None
    #: What comes next if nobody uses the server from now on: the soonest stop's rule
    #: (idle limit, session age, budget, a re-cut's drain), in how long, and why in words
    #: (``idle 5m: someone waits for its size``). Activity puts an idle stop off.
    next_stop: StopRule | None = None
    next_stop_in_seconds: float | None = None
    next_stop_why: str = ""
    #: The warnings its user has now, soonest first (each stop its own).
    warnings: tuple[WarningRow, ...] = ()
    #: Seconds until the lease's ``expires_at`` (max session age; None: no limit):
    #: the same deadline the slice service stops the server at.
    session_left_seconds: float | None = None
    #: Seconds since the slice last did GPU work (None: never, as far as sampled).
    gpu_idle_seconds: float | None = None
    #: Most GPU memory the lease's slice held (MiB), as the slice service sampled it.
    peak_memory_mib: int | None = None
    #: What the server is for, as its user said (never a metrics label).
    purpose: str | None = None
    note: str = ""
    #: Why a GPU fault withholds it, in words (None: no fault; docs/health.md).
    fault: str | None = None

    @property
    def memory_total_text(self) -> str:
        """``"32.2 GiB"`` (empty when no instance shows its memory)."""
        return format_gib(self.memory_total_mib) if self.memory_total_mib else ""

    @property
    def memory_text(self) -> str:
        """``"0.0 GiB / 32.2 GiB"``: used of total, as every screen shows memory."""
        if not self.memory_total_mib:
            return ""
        return f"{format_gib(self.memory_used_mib)} / {format_gib(self.memory_total_mib)}"

    @property
    def next_text(self) -> str:
        """What comes next, in words for every screen: ``server_idle in 4m (idle 5m:
        someone waits for its size)``; empty when no stop is coming."""
        if self.next_stop is None or self.next_stop_in_seconds is None:
            return ""
        return (f"{self.next_stop.value} in {rounded_duration(self.next_stop_in_seconds)} "
                f"({self.next_stop_why})")

    @property
    def warnings_text(self) -> str:
        """The pending warnings in words: ``warned: server_idle in 3m (Keep possible);
        drain in 55m (no Keep)``; empty when none."""
        if not self.warnings:
            return ""
        return "warned: " + "; ".join(
            f"{w.rule.value} "
            + ("(not stopped)" if w.stops_in_seconds is None else
               f"in {rounded_duration(w.stops_in_seconds)} "
               f"({'Keep possible' if w.keep else 'no Keep'})") for w in self.warnings)

    @property
    def memory_slices(self) -> range:
        """The GPU memory slices this slice covers."""
        return range(self.start, self.start + self.size)

    @property
    def server(self) -> str | None:
        """``user/server_name`` of the holder, or None when not leased."""
        return None if self.user is None else f"{self.user}/{self.server_name or ''}"


@dataclass(frozen=True)
class GpuRow:
    """One physical GPU with its slices, in memory-slice order."""

    index: int
    uuid: str
    product: str
    model_key: str | None
    memory_slices: int
    mig_enabled: bool
    slices: tuple[SliceRow, ...]
    #: The layout change under way (docs/layout.md), in words: ``draining: waits for
    #: ana/`` ; None when there is none.
    change: str | None = None
    #: Memory slices that change holds from new grants.
    held_slices: tuple[int, ...] = ()
    #: The GPU faults held on it, in words (None: none; docs/health.md).
    fault: str | None = None
    #: Memory slices those faults withhold from new grants.
    faulty_slices: tuple[int, ...] = ()

    @property
    def free_memory_slices(self) -> tuple[int, ...]:
        """Memory slices no instance (and no pending dynamic lease) covers."""
        taken = {s for row in self.slices for s in row.memory_slices}
        return tuple(s for s in range(self.memory_slices) if s not in taken)


@dataclass(frozen=True)
class GroupRow:
    """What one group holds hub-wide, against its quotas (None: no quota)."""

    name: str
    slices: int
    compute_slices: int
    quota_slices: int | None
    quota_compute_slices: int | None
    configured: bool
    #: Compute-slice-hours used within its budget window, and the budget with extra
    #: hours (``None``: the group has no group budget; docs/policies.md, "Budgets").
    budget_used_hours: float | None = None
    budget_hours: float | None = None
    #: The same in words: ``12 of 40 compute-slice-hours`` (minutes or seconds where
    #: hours would round to 0).
    budget_text: str | None = None

    @property
    def over_budget(self) -> bool:
        """Whether the group has used its whole budget (the map marks it)."""
        return (self.budget_hours is not None and self.budget_used_hours is not None
                and self.budget_used_hours >= self.budget_hours)


@dataclass(frozen=True)
class WaiterRow:
    """A spawn on the wait list: who waits for what (offer key), charged to which
    group, since when, and for how many seconds so far."""

    user: str
    server_name: str
    offer: str
    group: str
    since: datetime
    waited_seconds: float
    #: Place in the line for its offer, by the grant loop's order rule (1: next served).
    place: int = 0

    @property
    def next(self) -> bool:
        """Whether the next slice of its offer that frees goes to this waiter."""
        return self.place == 1


@dataclass(frozen=True)
class SliceMap:
    """The whole picture at ``taken_at``: GPUs of one host, and every group's usage."""

    host: str
    taken_at: datetime
    idle_after: float
    gpus: tuple[GpuRow, ...]
    groups: tuple[GroupRow, ...]
    #: Held leases on a GPU this host no longer shows (fallen off the bus, removed): orphans.
    lost: tuple[SliceRow, ...] = ()
    #: The wait list, in the order the grant loop serves it (:func:`served_order`).
    waiting: tuple[WaiterRow, ...] = ()

    @property
    def slices(self) -> tuple[SliceRow, ...]:
        """Every slice row of every GPU, then the lost ones."""
        return (*(row for gpu in self.gpus for row in gpu.slices), *self.lost)

    def count(self, state: SliceState) -> int:
        """How many slices are in ``state``."""
        return sum(1 for row in self.slices if row.state == state)


def _seconds(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


def _memory_slices(gpu: Gpu) -> int:
    if gpu.model_key is None:
        return 0
    try:
        return model(gpu.model_key).memory_slices
    except CatalogError:
        return 0


class _LeaseIndex:
    """Held leases of one host, findable by MIG UUID or by placement."""

    def __init__(self, leases: Iterable[Lease], host: str) -> None:
        self.unmatched: dict[str, Lease] = {}
        self._by_uuid: dict[str, Lease] = {}
        self._by_place: dict[tuple[str, int, int], Lease] = {}
        for lease in leases:
            if not lease.held or lease.host != host or lease.gpu_uuid is None:
                continue  # another host's, or a Kubernetes lease the device plugin placed
            self.unmatched[lease.id] = lease
            if lease.mig_uuid:
                self._by_uuid[lease.mig_uuid] = lease
            if lease.start is not None and lease.size is not None:
                self._by_place[(lease.gpu_uuid, lease.start, lease.size)] = lease

    def take_whole(self, gpu: Gpu, size: int) -> Lease | None:
        """The lease of the whole ``gpu`` (all ``size`` memory slices), marked as matched."""
        lease = self._by_place.get((gpu.uuid, 0, size))
        if lease is not None:
            self.unmatched.pop(lease.id, None)
        return lease

    def take(self, device: MigDevice) -> Lease | None:
        """The lease of ``device`` (by UUID, else by placement), marked as matched."""
        lease = self._by_uuid.get(device.uuid) or self._by_place.get(
            (device.gpu_uuid, device.start, device.size)
        )
        if lease is not None and lease.mig_uuid not in (None, device.uuid):
            lease = None  # same place, but the lease's own instance was replaced
        if lease is not None:
            self.unmatched.pop(lease.id, None)
        return lease


def _idle_seconds(lease: Lease, now: datetime) -> float:
    # A server that never reported activity has been idle since it started.
    since = lease.last_activity_at or lease.started_at or lease.claimed_at
    return max(0.0, (now - since).total_seconds())


def _lease_fields(lease: Lease, now: datetime) -> dict[str, Any]:
    return {
        "lease_id": lease.id,
        "user": lease.user,
        "server_name": lease.server_name,
        "group": lease.group,
        "lease_state": lease.state,
        "age_seconds": _seconds(now, lease.started_at or lease.claimed_at),
        "idle_seconds": _idle_seconds(lease, now),
        "gpu_idle_seconds": _seconds(now, lease.gpu_active_at),
        "peak_memory_mib": lease.peak_memory_mib,
        "purpose": lease.purpose,
        "session_left_seconds": (
            None if lease.expires_at is None
            else max(0.0, (lease.expires_at - now).total_seconds())
        ),
    }


@dataclass(frozen=True)
class _Next:
    """What :func:`_with_next` reads besides the lease: who waits for what, and when
    each member's budgets run out (``None``: budgets not read)."""

    policy: PolicySet
    now: datetime
    waited: frozenset[str]
    budgets: budget.Exhaustion | None


def _with_next(row: SliceRow, lease: Lease | None, ctx: _Next | None) -> SliceRow:
    """``row`` with the limit in force, the next stop and the pending warnings of its
    lease (the slice service's rules: :func:`idle_limit`, :func:`idle_deadline`)."""
    if lease is None or ctx is None:
        return row
    group, now = ctx.policy.group(lease.group), ctx.now
    warnings = tuple(WarningRow(s.rule, s.deadline and _until(now, s.deadline),
                                _keep(lease, s, group, now)) for s in lease.stops)
    waited = lease.profile in ctx.waited
    limit = idle_limit(group, waited)
    coming: list[tuple[datetime, StopRule, str]] = []
    if limit is not None:
        active = lease.last_activity_at or lease.started_at or lease.claimed_at
        warned = lease.pending_stop(StopRule.SERVER_IDLE)
        at = idle_deadline(now, active, limit, group.warn_before,
                           warned.deadline if warned else None)
        who = "someone waits for its size" if waited else "nobody waits for its size"
        coming.append((at, StopRule.SERVER_IDLE, f"idle {format_duration(limit)}: {who}"))
    if lease.expires_at is not None:
        coming.append((lease.expires_at, StopRule.MAX_SESSION_AGE, "its session's end"))
    if ctx.budgets is not None and group.has_budget and group.budget_action == "stop":
        runs_out = ctx.budgets.at(group, lease.user)
        if runs_out is not None:
            coming.append((runs_out, StopRule.BUDGET, "its GPU-hour budget runs out"))
    for rule, why in ((StopRule.DRAIN, "its GPU is re-cut: the drain notice ends"),
                      (StopRule.GPU_FAULT, "its GPU reported a fault")):
        told = lease.pending_stop(rule)
        if told is not None and told.deadline is not None:
            coming.append((told.deadline, rule, why))
    first = min(coming, key=lambda c: c[0], default=None)
    return replace(row, idle_limit_seconds=limit,
                   idle_limit_waited=None if limit is None else waited, warnings=warnings,
                   **({} if first is None else {
                       "next_stop": first[1], "next_stop_in_seconds": _until(now, first[0]),
                       "next_stop_why": first[2]}))


def _until(now: datetime, when: datetime) -> float:
    return max(0.0, (when - now).total_seconds())


def _keep(lease: Lease, stop: PendingStop, group: GroupPolicy, now: datetime) -> bool:
    """Whether Keep would put ``stop`` off (the Keep rule itself, on that warning)."""
    return keep_can_help(replace(lease, warning=stop.rule, warning_deadline=stop.deadline),
                         now, extend_by=group.extend_by, max_extensions=group.max_extensions)


def _device_row(device: MigDevice, lease: Lease | None, now: datetime, idle_after: float,
                ) -> SliceRow:
    base: dict[str, Any] = {
        "gpu_index": device.gpu_index,
        "gpu_uuid": device.gpu_uuid,
        "profile": device.profile,
        "start": device.start,
        "size": device.size,
        "mig_uuid": device.uuid,
        "gi_id": device.gi_id,
        "ci_id": device.ci_id,
        "memory_total_mib": device.memory_total_mib,
        "memory_used_mib": device.memory_used_mib,
        "processes": len(device.processes),
        "processes_unknown": device.processes_unknown,
    }
    if lease is None:
        if device.processes:
            pids = ", ".join(str(p) for p in device.pids)
            return SliceRow(
                **base, state="orphan",
                note=f"processes {pids} run on it but no lease holds it",
            )
        note = "the driver does not tell its processes" if device.processes_unknown else ""
        return SliceRow(**base, state="free", note=note)
    state: SliceState = "idle" if _idle_seconds(lease, now) >= idle_after else "leased"
    return SliceRow(**base, **_lease_fields(lease, now), state=state)


def _whole_row(gpu: Gpu, size: int, lease: Lease | None, now: datetime, idle_after: float,
               ) -> SliceRow:
    """A GPU with MIG off, offered whole: one slice across all its memory slices."""
    base: dict[str, Any] = {"gpu_index": gpu.index, "gpu_uuid": gpu.uuid,
                            "profile": WHOLE_GPU, "start": 0, "size": size,
                            "memory_total_mib": gpu.memory_total_mib}
    if lease is None:
        return SliceRow(**base, state="free", note="a whole GPU (MIG off)")
    state: SliceState = "idle" if _idle_seconds(lease, now) >= idle_after else "leased"
    return SliceRow(**base, **_lease_fields(lease, now), state=state,
                    note="a whole GPU (MIG off)")


def _missing_row(lease: Lease, gpu: Gpu | None, now: datetime) -> SliceRow:
    """A held lease whose instance ``gpu`` does not show (``gpu`` None: nor the GPU)."""
    if gpu is None:
        state: SliceState = "orphan"
        note = (f"the lease's GPU {lease.gpu_index} ({lease.gpu_uuid}) is not on this host "
                "any more: check nvidia-smi and the kernel log for Xid errors")
    elif lease.state == LeaseState.CLAIMED:
        state = "leased"
        note = "instance being created for a starting server"
    elif lease.state == LeaseState.RELEASING:
        state, note = "leased", f"being released ({_release_note(lease)})"
    else:
        state = "orphan"
        note = "the lease is active but its instance is gone (destroyed out of band?)"
    return SliceRow(
        gpu_index=gpu.index if gpu else (lease.gpu_index if lease.gpu_index is not None else -1),
        gpu_uuid=lease.gpu_uuid or "",
        profile=lease.profile,
        start=lease.start if lease.start is not None else -1,
        size=lease.size or 0,
        state=state,
        mig_uuid=lease.mig_uuid,
        gi_id=lease.gi_id,
        ci_id=lease.ci_id,
        note=note,
        **_lease_fields(lease, now),
    )


def _groups(leases: Iterable[Lease], policy: PolicySet | None, now: datetime,
            budgets: tuple[list[Lease], list[Extra]] | None = None) -> tuple[GroupRow, ...]:
    held: dict[str, list[int]] = {}
    for lease in leases:
        if lease.held:
            totals = held.setdefault(lease.group, [0, 0])
            totals[0] += 1
            totals[1] += lease.compute_slices
    names: set[str] = set(held)
    if policy is not None:
        names.update(policy.groups)
    rows = []
    for name in sorted(names):
        group = policy.group(name) if policy is not None else None
        slices, compute = held.get(name, (0, 0))
        rows.append(GroupRow(
            name=name,
            slices=slices,
            compute_slices=compute,
            quota_slices=group.quota_slices if group else None,
            quota_compute_slices=group.quota_compute_slices if group else None,
            configured=policy is not None and name in policy.groups,
            **_budget_fields(group, now, budgets),
        ))
    return tuple(rows)


def _budget_fields(group: GroupPolicy | None, now: datetime,
                   budgets: tuple[list[Lease], list[Extra]] | None) -> dict[str, Any]:
    """The group budget's use and size in compute-slice-hours, where it has one."""
    if group is None or group.budget is None or budgets is None:
        return {}
    leases, extras = budgets
    spans = budget.spans_of([x for x in leases if x.held], [x for x in leases if not x.held])
    standing = budget.standings(group, "", spans, extras, now)[0]
    total = standing.amount + standing.extra
    used, size = budget.slice_amounts(standing.used, total, unit_last=True)
    return {"budget_used_hours": standing.used / 3600, "budget_hours": total / 3600,
            "budget_text": f"{used} of {size}"}


def slice_map(
    inventory: Inventory,
    leases: Iterable[Lease],
    now: datetime,
    policy: PolicySet | None = None,
    *,
    idle_after: float = DEFAULT_IDLE_AFTER,
    waits: Iterable[WaitEntry] = (),
    budgets: tuple[list[Lease], list[Extra]] | None = None,
    changes: Iterable[LayoutChange] = (),
    faults: Iterable[GpuFault] = (),
) -> SliceMap:
    """Join ``inventory``, the held ``leases`` and ``policy`` into a :class:`SliceMap`.

    ``leases``: the ledger's held leases of the whole hub (``ledger.leases.active()``); those of
    other hosts only count towards the group totals. ``now``: an aware datetime (ages
    and idle times are measured to it). ``policy``: adds quotas and limits; None leaves
    them out. ``idle_after``: seconds without activity after which a leased slice is
    shown as idle. ``waits``: the wait list (``ledger.waits.waiting()``). ``budgets``: the
    leases and extra hours of the longest budget window (``ledger.usage.budget``), for
    each group budget's use. ``changes``: the layout changes under way
    (``ledger.holds.changes()``). ``faults``: the GPU faults held
    (``ledger.holds.faults()``).
    """
    if now.utcoffset() is None:
        raise ValueError("now must be a timezone-aware datetime (datetime.now(timezone.utc))")
    if idle_after <= 0:
        raise ValueError(f"idle_after must be a positive number of seconds, got {idle_after}")
    all_leases, waits = list(leases), list(waits)
    index = _LeaseIndex(all_leases, inventory.host)
    by_uuid = {
        gpu.uuid: [_device_row(d, index.take(d), now, idle_after)
                   for d in gpu.mig_devices]
        for gpu in inventory.gpus
    }
    for gpu in inventory.gpus:
        if offered_whole(gpu):
            size = _memory_slices(gpu)
            by_uuid[gpu.uuid].append(
                _whole_row(gpu, size, index.take_whole(gpu, size), now, idle_after))
    by_id = {lease.id: lease for lease in all_leases}
    ctx = None if policy is None else _Next(
        policy, now, policy.profiles_meant(w.offer for w in waits if w.waiting),
        None if budgets is None else budget.Exhaustion(
            budget.spans_of([x for x in budgets[0] if x.held],
                            [x for x in budgets[0] if not x.held]), budgets[1], now))
    lost = []
    for lease in index.unmatched.values():
        gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
        row = _missing_row(lease, gpu, now)
        if gpu is None:
            lost.append(row)
        else:
            by_uuid[gpu.uuid].append(row)
    changing = {c.gpu_uuid: c for c in changes if c.host == inventory.host and c.open}
    faults = [f for f in faults if f.host == inventory.host and f.open]
    gpus = []
    for gpu in inventory.gpus:
        # A lost GPU this process never read has no UUID here: known by its index then.
        on_it = [f for f in faults if f.gpu_uuid == gpu.uuid
                 or (gpu.lost and not gpu.uuid and f.gpu_index == gpu.index)]
        size = _memory_slices(gpu)
        faulty = {s for f in on_it for s in (range(size) if f.whole_gpu else f.held_slices)}
        fault = "; ".join(dict.fromkeys(f"{f.why}: {f.detail}" for f in on_it)) or None
        rows = sorted((_with_next(replace(r, fault=fault) if faulty.intersection(r.memory_slices)
                                  else r, by_id.get(r.lease_id or ""), ctx)
                       for r in by_uuid[gpu.uuid]),
                      key=lambda r: (r.start, r.gi_id or 0, r.ci_id or 0))
        change = changing.get(gpu.uuid)
        gpus.append(GpuRow(
            index=gpu.index,
            uuid=gpu.uuid,
            product=gpu.product,
            model_key=gpu.model_key,
            memory_slices=_memory_slices(gpu),
            mig_enabled=gpu.mig_enabled,
            slices=tuple(rows),
            change=None if change is None else change_words(change),
            held_slices=() if change is None else tuple(sorted(
                range(_memory_slices(gpu)) if change.whole_gpu else change.held_slices)),
            fault=fault,
            faulty_slices=tuple(sorted(faulty)),
        ))
    return SliceMap(
        host=inventory.host,
        taken_at=now,
        idle_after=idle_after,
        gpus=tuple(gpus),
        groups=_groups(all_leases, policy, now, budgets),
        lost=tuple(_with_next(r, by_id.get(r.lease_id or ""), ctx) for r in lost),
        waiting=served_order(waits, all_leases, policy, now,
                             capacity=sum(len(gpu.slices) for gpu in gpus) + len(lost)),
    )


def served_order(
    waits: Iterable[WaitEntry], leases: Iterable[Lease], policy: PolicySet | None,
    now: datetime, capacity: int,
) -> tuple[WaiterRow, ...]:
    """The waiting entries in the order the grant loop serves them: the same pure rule
    (:func:`mig_spawner.core.waitlist.order`: priority, the group's share of what it
    may hold, first come) on the held ``leases``, the groups' ``quota_slices`` and
    ``capacity`` (the slices here, the share of a group without a quota), each with
    its place in its offer's line (1: next)."""
    waiting = [w for w in waits if w.waiting]
    quotas = {} if policy is None else {n: g.quota_slices for n, g in policy.groups.items()}
    held = Counter(lease.group for lease in leases if lease.held)
    shares = group_shares(held, quotas, capacity)
    places = positions(waiting, shares)
    return tuple(
        WaiterRow(w.user, w.server_name, w.offer, w.group, w.joined_at,
                  _seconds(now, w.joined_at) or 0.0, place=places[w.id])
        for w in order(waiting, shares)
    )


def change_words(change: LayoutChange) -> str:
    """A layout change in words for the map and ``status``: what and where it stands."""
    what = ("drained for maintenance" if change.target.get("drain")
            else "being re-cut")
    return f"{what} ({change.state.value})" + (f": {change.detail}" if change.detail else "")


def counts_by(rows: Iterable[SliceRow], *keys: str) -> Mapping[tuple[object, ...], int]:
    """How many rows share each combination of the given attributes (for metrics)."""
    counts: dict[tuple[object, ...], int] = {}
    for row in rows:
        key = tuple(getattr(row, k) for k in keys)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _release_note(lease: Lease) -> str:
    """Why a releasing lease ends and what still holds it, for the slice map."""
    why = lease.release_code.words if lease.release_code else "no reason recorded"
    if lease.release_detail:
        why += f": {lease.release_detail}"
    return f"{why}; held by {lease.held_by}" if lease.held_by else why
