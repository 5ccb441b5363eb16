"""Drain and apply a layout change on this host, one step at a time (docs/layout.md).

:func:`begin` opens a change per GPU in the ledger: from that commit on, the placements
that will change are held from new grants (every claim and grant pass reads the holds
in its transaction). :class:`LayoutApplier.step` then, each time it runs (``mig-spawner
layout apply``, the slice service's sweep):

1. takes each open change as its one stepper (``ledger.holds.take_change``; a change
   another live stepper has is left for this pass), then reads its GPU;
2. plans the change again from its target (:func:`mig_spawner.core.layout.plan_gpu`)
   under the claim lock, from the leases read there, and holds what that plan changes
   before the lock is let go (``ledger.holds.replan``): what a step or a crash already
   did is simply no longer to do, so a change resumes wherever it stopped, and a slice
   the plan destroys is never granted in between;
3. warns the holders of instances that must go (a whole GPU held by a server too)
   through the warning flow (rule ``drain``, deadline: the group's ``drain_notice`` from
   the warning; Keep cannot pass it), and returns the leases whose notice has ended, for
   the caller to stop through the hub with ``ReleaseCode.DRAIN`` recorded first (the
   slice service's ``Sweeper.stop_server``);
4. runs the steps that wait for nobody, one instance at a time, each checked against
   the hold and the leases under the claim lock just before it runs
   (``ledger.holds.check_step``): destroys a free instance, creates one at its planned
   placement, switches MIG mode once nothing on the GPU is held or busy. An instance
   that is held or runs processes is never touched. A GPU error stops that GPU's step
   with the reason (``in use``: it waits for the next pass; anything else: the change
   puts back the layout it began from where it can, then ``failed``), and the other
   GPUs go on;
5. records each GPU's state: ``draining`` while a step waits for a holder, ``applying``
   while steps run, ``done`` (the hold ends) or ``failed`` (the hold ends, the reason
   kept), and lets the change go.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol
from uuid import uuid4

from mig_spawner.core.catalog import model
from mig_spawner.core.clock import utcnow
from mig_spawner.core.durations import format_duration
from mig_spawner.core.inventory import Gpu, Inventory, MigDevice
from mig_spawner.core.layout import (
    GpuPlan,
    Holder,
    LayoutPlan,
    PlanState,
    Step,
    StepKind,
    Target,
    TargetEntry,
    instances_of,
    plan_gpu,
)
from mig_spawner.core.lifecycle import StopRule, WarningState
from mig_spawner.gpu.errors import GpuError, InstanceInUse
from mig_spawner.holder import start_time, this_host
from mig_spawner.ledger import KUBE_NODE, LayoutChange, Lease, Ledger
from mig_spawner.ledger.holds import Replan

#: The node label MIG Manager applies, and the one it reports on (mig-parted config names).
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
#: What a maintenance drain asks for: the GPU emptied, its layout left as it is.
DRAIN_TARGET: Mapping[str, Any] = {"drain": True}

log = logging.getLogger(__name__)


class LayoutGpus(Protocol):
    """What applying needs of the GPU adapter (:class:`mig_spawner.gpu.GpuAdapter`)."""

    def inventory(self) -> Inventory: ...

    def create_instance(self, gpu_index: int, profile_name: str, start: int) -> MigDevice: ...

    def destroy_instance(self, gpu_index: int, gi_id: int) -> None: ...

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> bool: ...

    def reset_gpu(self, gpu_index: int) -> None: ...


def holders_of(leases: Iterable[Lease]) -> list[Holder]:
    """The held leases that sit on a placement of this host's GPUs, as the plan reads them
    (a whole-GPU lease starts at 0: it holds the whole GPU of a MIG-off GPU)."""
    return [Holder(x.id, x.user, x.server_name, x.group, x.profile, x.gpu_uuid, x.start,
                   x.expires_at)
            for x in leases if x.gpu_uuid and x.start is not None]


def target_json(entry: TargetEntry, before: TargetEntry | None = None) -> dict[str, Any]:
    """One GPU's target as the ledger keeps it; ``before``: the layout it had when the
    change began, which a change that fails midway puts back where it can."""
    data: dict[str, Any] = {"mig_enabled": entry.mig_enabled,
                            "counts": dict(sorted(entry.counts.items()))}
    if before is not None:
        data["before"] = target_json(before)
    return data


def entry_of(target: Mapping[str, Any]) -> TargetEntry:
    """The ledger's target of one GPU as a target entry."""
    return TargetEntry((), bool(target.get("mig_enabled", True)), dict(target.get("counts", {})))


def layout_before(plan: GpuPlan) -> TargetEntry:
    """What ``plan``'s GPU carries now, as a target: MIG off (the whole GPU), or its
    instances per profile."""
    instances = (*plan.keep, *plan.destroy)
    if any(i.whole for i in instances):
        return TargetEntry((), False, {})
    return TargetEntry((), True, dict(Counter(i.profile for i in instances)))


def begin(ledger: Ledger, host: str, plan: LayoutPlan, target: Target) -> list[LayoutChange]:
    """Open a change for every GPU of ``plan`` that changes (and can): its changing
    slices (every slice, for a MIG mode change) are held from new grants from now on."""
    opened = []
    for g in plan.changing:
        entry = target.for_gpu(g.index)
        assert entry is not None  # the plan covers only GPUs the target names
        opened.append(ledger.holds.open_change(host, g.uuid, g.index,
                                         target_json(entry, layout_before(g)),
                                         g.changing_slices, whole_gpu=g.mode_change))
    return opened


def drain(ledger: Ledger, host: str, gpu: Gpu) -> LayoutChange:
    """Hold every slice of ``gpu`` from new grants and drain its holders (maintenance,
    or a MIG mode change in dynamic mode): the change stays ``draining`` until an admin
    ends it (``mig-spawner layout end``)."""
    return ledger.holds.open_change(host, gpu.uuid, gpu.index, DRAIN_TARGET, (), whole_gpu=True,
                              state=PlanState.DRAINING)


# --- who steps a change ------------------------------------------------------------------

#: How long a stepper whose process cannot be looked up from here (another PID
#: namespace: the slice service in a container beside the host) may go without taking
#: or checking a step before another stepper takes its change over. Far above one NVML
#: call; a stepper checks in before each step.
STEPPER_SILENCE = timedelta(minutes=10)
_STEPPER = re.compile(r"^(?P<host>\S+) pid (?P<pid>\d+) start (?P<start>\d+) "
                      r"ns (?P<ns>\d+) (?P<token>\w+)$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def this_stepper() -> str:
    """A new stepper's name in this process: host, PID, the process's start time, its PID
    namespace and a token of its own (two appliers in one process exclude each other)."""
    pid = os.getpid()
    return (f"{this_host()} pid {pid} start {start_time(pid) or 0} ns {_pid_namespace()} "
            f"{uuid4().hex[:12]}")


def stepper_gone(change: LayoutChange, now: datetime) -> bool:
    """Whether the stepper that has ``change`` is provably gone: its process (same PID and
    start time) no longer runs on this host (kill -9 included); or, when it cannot be
    looked up from here, it has not checked in for :data:`STEPPER_SILENCE`."""
    found = _STEPPER.match(change.stepper or "")
    if found and found["host"] == this_host() and int(found["ns"]) == _pid_namespace():
        return start_time(int(found["pid"])) != int(found["start"])
    return change.stepper_seen is None or now - change.stepper_seen > STEPPER_SILENCE


@dataclass
class GpuOutcome:
    """What one pass did on one GPU: the steps done, the state it left, why it stopped."""

    gpu_index: int
    state: PlanState
    done: list[str] = field(default_factory=list)
    why: str | None = None
    #: Holders warned in this pass (lease ids).
    warned: list[str] = field(default_factory=list)


@dataclass
class Pass:
    """One :meth:`LayoutApplier.step`: per GPU what happened, and the leases whose drain
    notice has ended (the caller stops their servers and releases them, code ``drain``)."""

    gpus: list[GpuOutcome] = field(default_factory=list)
    due: list[Lease] = field(default_factory=list)


class LayoutApplier:
    """Drains and applies this host's open layout changes (see the module docstring).

    ``notice_for(group)``: that group's ``drain_notice`` in seconds (None: its servers
    are never stopped, the change waits). ``allow_reset``: a MIG mode change on a GPU
    that needs a reset (Ampere) may reset it. Blocking: run it off an event loop.
    """

    def __init__(self, ledger: Ledger, gpus: LayoutGpus,
                 notice_for: Callable[[str], float | None], *, allow_reset: bool = False,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.ledger = ledger
        self.gpus = gpus
        self.notice_for = notice_for
        self.allow_reset = allow_reset
        self.clock = clock
        #: This applier's name as the stepper of a change (the ledger records it).
        self.stepper = this_stepper()

    def step(self) -> Pass:
        """One pass over every open change of this host that no other stepper has."""
        result = Pass()
        if not self.ledger.holds.changes():
            return result  # the common case: one indexed read, no GPU read
        host = self.gpus.inventory().host
        for change in self.ledger.holds.changes(host):
            if change.gpu_uuid == KUBE_NODE:
                continue
            mine = self.ledger.holds.take_change(change.id, self.stepper,
                                           lambda c: stepper_gone(c, self.clock()))
            if mine is None:
                result.gpus.append(GpuOutcome(change.gpu_index, change.state,
                                              why="another process is applying it"))
                continue
            try:
                result.gpus.append(self._one(mine, result))
            finally:
                self.ledger.holds.let_go(change.id, self.stepper)
        return result

    def _one(self, change: LayoutChange, result: Pass) -> GpuOutcome:
        inventory = self.gpus.inventory()  # read once this change is ours alone
        gpu = inventory.gpu_by_uuid(change.gpu_uuid)
        if gpu is None:
            return self._end(change, PlanState.FAILED, "the GPU is no longer on this host")
        if change.target.get("drain"):
            on_gpu = [x for x in self.ledger.leases.active(inventory.host)
                      if x.gpu_uuid == gpu.uuid]
            return self._drain_only(change, gpu, on_gpu, result)
        planned = self._replan(change, gpu, entry_of(change.target))
        if planned is None:
            return GpuOutcome(gpu.index, change.state, why="another process took it over")
        change, on_gpu, plan = planned
        if plan.problem is not None:
            return self._fail(change, plan.problem)
        if not plan.steps:
            return self._end(change, PlanState.DONE, f"GPU {gpu.index} is {plan.target}")
        outcome = GpuOutcome(gpu.index, change.state)
        change = self._warn(change, plan_holders(plan), on_gpu, outcome, result)
        if plan.needs_reset and not self.allow_reset:
            switch = "on" if entry_of(change.target).mig_enabled else "off"
            return self._fail(change, f"turning MIG {switch} on GPU {gpu.index} needs a GPU "
                                      "reset (Ampere); apply with --allow-reset once nothing "
                                      "else runs on it")
        error = self._run_steps(change, gpu, plan, outcome)
        if error is not None:
            return self._fail(change, error, outcome)
        waiting = [s for s in plan.steps if s.waits_for or
                   (s.instance is not None and not s.instance.free)]
        if not waiting and not outcome.why and len(outcome.done) == len(plan.steps):
            return self._end(change, PlanState.DONE, f"GPU {gpu.index} is {plan.target}",
                             outcome)
        state = PlanState.DRAINING if waiting else PlanState.APPLYING
        detail = outcome.why or (f"waits for {', '.join(waiting_for(waiting))}" if waiting
                                 else f"{len(outcome.done)} step(s) done")
        moved = self.ledger.holds.move_change(change.id, state, detail=detail)
        outcome.state = moved.state if moved else state
        return outcome

    def _replan(self, change: LayoutChange, gpu: Gpu, entry: TargetEntry) -> Replan | None:
        """``gpu``'s plan towards ``entry`` against the leases as of the claim lock, its
        changing slices held before that lock is let go (``ledger.holds.replan``)."""
        def plan(leases: list[Lease]) -> GpuPlan:
            holders = {(h.gpu_uuid, h.start): h for h in holders_of(leases)}
            return plan_gpu(gpu, entry, instances_of(gpu, holders))

        return self.ledger.holds.replan(change.id, self.stepper, plan)

    def _run_steps(self, change: LayoutChange, gpu: Gpu, plan: GpuPlan,
                   outcome: GpuOutcome, *, keep_going: bool = False) -> str | None:
        """Run, one at a time, every step of ``plan`` that waits for nobody, each checked
        against the hold under the claim lock just before it runs. Returns why the change
        must fail (an NVML error other than *in use*), else None; ``outcome`` says what was
        done and why a step stopped the pass. ``keep_going``: an NVML error skips that
        step only (putting back, every step that can be done is)."""
        failed: list[str] = []
        blocked = False
        kept: set[int] = set()  # slices of the instances that cannot go yet
        every_slice = range(model(gpu.model_key).memory_slices) if gpu.model_key else range(0)
        for s in plan.steps:
            if s.waits_for or (s.instance is not None and not s.instance.free):
                blocked = True
                kept.update(s.instance.slices if s.instance is not None else ())
                continue  # the drain's: it runs once the holder or the process is gone
            if s.new is not None and kept.intersection(s.new.slices):
                continue  # its room is still taken (processes without a lease there)
            if s.kind in (StepKind.MIG_ON, StepKind.MIG_OFF) and blocked:
                continue  # MIG mode changes only once nothing is held or busy on the GPU
            on = (s.instance.slices if s.kind is StepKind.DESTROY and s.instance is not None
                  else s.new.slices if s.new is not None else every_slice)
            why = self.ledger.holds.check_step(change.id, self.stepper, on)
            if why is not None:
                # Never touch what the hold does not cover: the next pass plans again.
                outcome.why = f"{s.describe()}: not now: {why}"
                return None
            if change.state is not PlanState.APPLYING:
                change = self.ledger.holds.move_change(change.id, PlanState.APPLYING) or change
            try:
                self._run(s)
            except InstanceInUse as e:
                # A process came between the read and the step: the next pass retries.
                outcome.why = f"{s.describe()}: {e}"
                return None
            except GpuError as e:
                if not keep_going:
                    return f"{s.describe()}: {e}"
                failed.append(f"{s.describe()}: {e}")
                if s.instance is not None:
                    kept.update(s.instance.slices)  # still there: nothing goes in its room
                continue
            outcome.done.append(s.describe())
            log.info("layout: GPU %d: %s", gpu.index, s.describe())
        return "; ".join(failed) or None

    def _fail(self, change: LayoutChange, why: str, outcome: GpuOutcome | None = None
              ) -> GpuOutcome:
        """End ``change`` failed, having first put back what it destroyed where it can
        (the layout it began from): every step of that way back that waits for nobody,
        each checked against the hold as any step is. What cannot be put back is logged
        and said in the change's detail; the hold ends."""
        before = change.target.get("before")
        if before is None:
            return self._end(change, PlanState.FAILED, why, outcome)
        entry = entry_of(before)
        back = GpuOutcome(change.gpu_index, change.state)
        error: str | None = None
        inventory = self.gpus.inventory()
        gpu = inventory.gpu_by_uuid(change.gpu_uuid)
        if gpu is not None:
            planned = self._replan(change, gpu, entry)
            if planned is not None and planned.plan.problem is None:
                error = self._run_steps(planned.change, gpu, planned.plan, back,
                                        keep_going=True)
                gpu = self.gpus.inventory().gpu_by_uuid(change.gpu_uuid)
        missing = _missing(gpu, entry)
        said = [f"put back {len(back.done)} step(s)"] if back.done else []
        if missing:
            log.warning("layout: GPU %d: could not put back %s after the change failed (%s)%s",
                        change.gpu_index, missing, why, f"; {error}" if error else "")
            said.append(f"could not put back {missing}")
        outcome = outcome or GpuOutcome(change.gpu_index, change.state)
        outcome.done += [f"put back: {d}" for d in back.done]
        # The detail column is short: what was put back comes first, the error after it.
        detail = f"{'; '.join(said)}: {why}" if said else why
        return self._end(change, PlanState.FAILED, detail, outcome)

    def _drain_only(self, change: LayoutChange, gpu: Gpu, on_gpu: Sequence[Lease],
                    result: Pass) -> GpuOutcome:
        outcome = GpuOutcome(gpu.index, change.state)
        holders = holders_of(on_gpu)
        self._warn(change, holders, on_gpu, outcome, result)
        busy = [d for d in gpu.mig_devices if d.busy]
        detail = ("empty: ready for maintenance" if not on_gpu and not busy
                  else f"waits for {len(on_gpu)} server(s)"
                  + (f" and processes on {len(busy)} instance(s)" if busy else ""))
        if detail != change.detail:
            self.ledger.holds.move_change(change.id, PlanState.DRAINING, detail=detail)
        outcome.why = detail
        return outcome

    def _warn(self, change: LayoutChange, holders: Sequence[Holder], on_gpu: Sequence[Lease],
              outcome: GpuOutcome, result: Pass) -> LayoutChange:
        return warn_holders(self.ledger, change, holders, on_gpu, self.notice_for,
                            self.clock(), outcome, result)

    def _run(self, s: Step) -> None:
        if s.kind is StepKind.DESTROY:
            assert s.instance is not None
            self.gpus.destroy_instance(s.gpu_index, s.instance.gi_id)
        elif s.kind is StepKind.CREATE:
            assert s.new is not None
            self.gpus.create_instance(s.gpu_index, s.new.profile, s.new.start)
        else:
            needs_reset = self.gpus.set_mig_mode(s.gpu_index, s.kind is StepKind.MIG_ON)
            if needs_reset:
                self.gpus.reset_gpu(s.gpu_index)

    def _end(self, change: LayoutChange, state: PlanState, detail: str,
             outcome: GpuOutcome | None = None) -> GpuOutcome:
        end_change(self.ledger, change, state, detail)
        (log.info if state is PlanState.DONE else log.warning)(
            "layout: GPU %d %s: %s", change.gpu_index, state.value, detail)
        outcome = outcome or GpuOutcome(change.gpu_index, state)
        outcome.state = state
        outcome.why = outcome.why or detail
        return outcome


def _missing(gpu: Gpu | None, entry: TargetEntry) -> str:
    """What of ``entry`` (the layout a change began from) ``gpu`` lacks now, in words."""
    if gpu is None:
        return "the GPU"
    if not entry.mig_enabled:
        return "MIG off" if gpu.mig_current else ""
    if not gpu.mig_current:
        return "MIG on"
    have = Counter(gi.profile for gi in gpu.gpu_instances)
    lacking = Counter(entry.counts) - have
    return ", ".join(f"{n}x {p}" for p, n in sorted(lacking.items()))


def end_change(ledger: Ledger, change: LayoutChange, state: PlanState, detail: str) -> None:
    """End ``change`` (done or failed): its hold ends, and a drain warning it gave a
    server that still runs there is withdrawn (that stop is no longer due)."""
    ledger.holds.move_change(change.id, state, detail=detail)
    kube = change.gpu_uuid == KUBE_NODE  # its leases record the node, not a host
    for lease in ledger.leases.active(None if kube else change.host):
        on_it = lease.node == change.host if kube else lease.gpu_uuid == change.gpu_uuid
        if on_it and lease.pending_stop(StopRule.DRAIN) is not None:
            ledger.warnings.withdraw(lease.id, StopRule.DRAIN)


def warn_holders(ledger: Ledger, change: LayoutChange, holders: Sequence[Holder],
                 leases: Sequence[Lease], notice_for: Callable[[str], float | None],
                 now: datetime, outcome: GpuOutcome, result: Pass) -> LayoutChange:
    """Warn each holder once (rule ``drain``, deadline: its group's notice from now, the
    same for a holder a later plan reaches as for the first ones); put those whose
    deadline has passed in ``result.due``."""
    if not holders:
        return change
    if change.notice_from is None:
        change = ledger.holds.move_change(change.id, PlanState.DRAINING, notice_from=now) or change
    by_id = {x.id: x for x in leases}
    for h in holders:
        lease = by_id.get(h.lease_id)
        notice = notice_for(h.group)
        if lease is None or notice is None:
            continue  # no notice in the group's policy: the change waits for it
        if lease.warning_state is WarningState.CARRIED_OUT:
            # A stop already carried out is not due again while the hub is slow to
            # finish it: asking twice would count one reclaimed slice twice.
            continue
        drain = lease.pending_stop(StopRule.DRAIN)
        if drain is None:
            # Users may read it: the node's name stays out (no host in their messages).
            where = "its node" if change.gpu_uuid == KUBE_NODE else f"GPU {change.gpu_index}"
            detail = (f"{where} is re-cut by an admin: the server stops within "
                      f"{format_duration(notice)}")
            if ledger.warnings.warn(lease.id, StopRule.DRAIN, now + timedelta(seconds=notice),
                           detail) is not None:
                outcome.warned.append(lease.id)
        elif drain.deadline <= now:
            result.due.append(lease)
    return change


def plan_holders(plan: GpuPlan) -> list[Holder]:
    """The holders of the instances ``plan`` must destroy (the whole GPU's too)."""
    return [i.holder for i in plan.destroy if i.holder is not None]


def waiting_for(steps: Iterable[Step]) -> list[str]:
    """Who the waiting steps wait for, in words (servers, or processes without a lease)."""
    found: dict[str, None] = {}
    for s in steps:
        for h in s.waits_for:
            found[h.server] = None
        if s.instance is not None and s.instance.holder is None and s.instance.busy:
            found[f"processes on {s.instance.describe()}"] = None
    return list(found)


# --- Kubernetes: the node's label and NVIDIA's MIG Manager -------------------------------


def begin_kube(ledger: Ledger, node: str, config: str) -> LayoutChange:
    """Hold every slice of ``node`` from new grants, to re-cut it to the mig-parted
    config ``config`` (MIG Manager re-cuts every GPU whose layout changes whole, and
    resets all the node's GPUs for a MIG mode change: the node is held whole)."""
    return ledger.holds.open_change(node, KUBE_NODE, 0, {"mig_config": config}, (), whole_gpu=True)


def _mig_pods(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """``namespace/name`` of the pods that hold a MIG device of the node now."""
    from mig_spawner.kube.cluster import pod_requests
    from mig_spawner.kube.resources import MIG_RESOURCE_PREFIX

    held = []
    for pod in pods:
        phase = (pod.get("status") or {}).get("phase")
        wants = pod_requests(pod)
        if phase not in ("Succeeded", "Failed") and any(
                r.startswith(MIG_RESOURCE_PREFIX) or r == "nvidia.com/gpu" for r in wants):
            meta = pod.get("metadata") or {}
            held.append(f"{meta.get('namespace')}/{meta.get('name')}")
    return held


class KubeLayout:
    """Carries a Kubernetes node's layout change on, one pass at a time: hold the node
    (:func:`begin_kube`), warn the servers whose pods hold its slices and hand those
    whose notice ended to the caller (released with code ``drain``, their pods deleted),
    then, once no pod holds a MIG device there, set the node's ``nvidia.com/mig.config``
    label and wait for MIG Manager's ``nvidia.com/mig.config.state``: ``success`` ends
    the change (the hold with it), ``failed`` fails it with the reason.

    ``api``: an async callable that returns a connected ``CoreV1Api``.
    """

    def __init__(self, ledger: Ledger | Callable[[], Ledger], api: Callable[[], Any],
                 notice_for: Callable[[str], float | None], *,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self._ledger = ledger
        self.api = api
        self.notice_for = notice_for
        self.clock = clock

    @property
    def ledger(self) -> Ledger:
        """The ledger (the slice service hands a callable: it may reconnect)."""
        return self._ledger if isinstance(self._ledger, Ledger) else self._ledger()

    async def step(self) -> Pass:
        import asyncio

        result = Pass()
        changes = [c for c in await asyncio.to_thread(self.ledger.holds.changes)
                   if c.gpu_uuid == KUBE_NODE]
        if not changes:
            return result
        core = await self.api()
        leases = await asyncio.to_thread(self.ledger.leases.active)
        for change in changes:
            result.gpus.append(await self._one(core, change, leases, result))
        return result

    async def _one(self, core: Any, change: LayoutChange, leases: Sequence[Lease],
                   result: Pass) -> GpuOutcome:
        import asyncio

        from mig_spawner.kube.resources import (
            CONFIG_FAILED,
            CONFIG_PENDING,
            CONFIG_STATE_LABEL,
            CONFIG_SUCCESS,
        )

        ledger, node, config = self.ledger, change.host, change.target["mig_config"]
        outcome = GpuOutcome(change.gpu_index, change.state)

        def move(state: PlanState, detail: str) -> GpuOutcome:
            if state in (PlanState.DONE, PlanState.FAILED):
                end_change(ledger, change, state, detail)
            else:
                ledger.holds.move_change(change.id, state, detail=detail)
            outcome.state, outcome.why = state, detail
            return outcome

        found = await core.read_node(node, _preload_content=False)
        labels = ((await found.json()).get("metadata") or {}).get("labels") or {}
        if change.state is PlanState.APPLYING:
            reported = labels.get(CONFIG_STATE_LABEL)
            if labels.get(MIG_CONFIG_LABEL) == config and reported == CONFIG_SUCCESS:
                return await asyncio.to_thread(move, PlanState.DONE,
                                               f"node {node} is re-cut to {config}")
            if reported == CONFIG_FAILED:
                return await asyncio.to_thread(
                    move, PlanState.FAILED, f"MIG Manager reported {CONFIG_STATE_LABEL}="
                    f"failed on node {node}; see its logs (kubectl -n gpu-operator logs "
                    "-l app=nvidia-mig-manager)")
            outcome.why = f"waits for MIG Manager ({CONFIG_STATE_LABEL}={reported})"
            return outcome
        on_node = [x for x in leases if x.node == node]
        holders = [Holder(x.id, x.user, x.server_name, x.group, x.profile, KUBE_NODE, 0,
                          x.expires_at) for x in on_node]
        listed = await core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _preload_content=False)
        busy = _mig_pods((await listed.json()).get("items") or [])
        change = await asyncio.to_thread(warn_holders, ledger, change, holders, on_node,
                                         self.notice_for, self.clock(), outcome, result)
        if busy:
            return await asyncio.to_thread(
                move, PlanState.DRAINING, f"waits for {len(busy)} pod(s) holding MIG devices")
        # The state label too, as MIG Manager sets it when it starts: a "success" left
        # from the last layout must not pass for this one's.
        await core.patch_node(node, {"metadata": {"labels": {
            MIG_CONFIG_LABEL: config, CONFIG_STATE_LABEL: CONFIG_PENDING}}})
        outcome.done.append(f"set {MIG_CONFIG_LABEL}={config}")
        return await asyncio.to_thread(move, PlanState.APPLYING,
                                       f"{MIG_CONFIG_LABEL}={config} set; waits for MIG Manager")
