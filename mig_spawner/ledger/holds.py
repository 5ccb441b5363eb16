"""The holds store: capacity held from new grants, and the layout changes that hold it.

A **hold** is durable: slices of a GPU (or the whole GPU) that no claim and no grant
pass may take while it stands. Every claim and grant pass reads every hold in its own
transaction (:func:`read_holds`, as :attr:`LedgerView.holds`), and a hold is taken
under the claim lock, so a claim either committed before it (its lease is then a holder
the hold's owner waits for) or sees it. Holds are one idea with several causes, each a
*source* of rows giving ``(host, GPU UUID, held slices, whole GPU)`` for the holds that
stand (:data:`HOLD_SOURCES`); the view is their union.

Two causes today (:class:`HoldCause`): a layout change (``layout_changes``, one row per
GPU: a re-cut or a drain): while it is ``pending``, ``draining`` or ``applying`` its
held slices are held (docs/layout.md tells its whole way); and a GPU fault
(``gpu_faults``: a GPU or one MIG device found faulty, docs/health.md), held until an
admin clears it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, Select, bindparam, insert, select, update

from mig_spawner.core.health import Fault, FaultKind, withheld_words
from mig_spawner.core.layout import HOLDING_STATES, GpuPlan, PlanState

from .models import gpu_faults, layout_changes
from .records import Lease
from .rows import held_on
from .transactions import Transactions

#: The ``gpu_uuid`` of a hold on a whole Kubernetes node (its name is the ``host``):
#: MIG Manager re-cuts a node's GPUs whole, so the node is held whole.
KUBE_NODE = "node"
#: (host, GPU UUID) -> memory slices held from new grants.
HeldSlices = dict[tuple[str, str], frozenset[int]]
_DETAIL_MAX = layout_changes.c.detail.type.length or 255
_FINAL = (PlanState.DONE, PlanState.FAILED)


@dataclass(frozen=True)
class LayoutChange:
    """One GPU's change: where it stands and what it holds."""

    id: int
    host: str
    gpu_uuid: str
    gpu_index: int
    target: Mapping[str, Any]
    state: PlanState
    held_slices: frozenset[int]
    whole_gpu: bool
    created_at: datetime
    updated_at: datetime
    notice_from: datetime | None = None
    detail: str | None = None
    #: The process stepping the change now (None: nobody), and when it last took or
    #: checked a step (see :meth:`Holds.take_change`).
    stepper: str | None = None
    stepper_seen: datetime | None = None

    @property
    def open(self) -> bool:
        """Not done nor failed: its slices are held."""
        return self.state in HOLDING_STATES

    def holds(self, slices: Iterable[int]) -> bool:
        """Whether the change holds every one of ``slices`` from new grants."""
        return self.whole_gpu or set(slices) <= self.held_slices


class Replan(NamedTuple):
    """What :meth:`Holds.replan` read and decided in one transaction: the change
    with its hold as written, the leases held on its GPU, and the plan."""

    change: LayoutChange
    leases: list[Lease]
    plan: GpuPlan


def _mask(slices: Iterable[int]) -> int:
    mask = 0
    for s in slices:
        mask |= 1 << s
    return mask


def _slices(mask: int) -> frozenset[int]:
    return frozenset(s for s in range(mask.bit_length()) if mask >> s & 1)


def _to_change(row: Row[Any]) -> LayoutChange:
    m = row._mapping
    return LayoutChange(
        id=m["id"], host=m["host"], gpu_uuid=m["gpu_uuid"], gpu_index=m["gpu_index"],
        target=json.loads(m["target"]), state=PlanState(m["state"]),
        held_slices=_slices(m["held_slices"]), whole_gpu=bool(m["whole_gpu"]),
        created_at=m["created_at"], updated_at=m["updated_at"],
        notice_from=m["notice_from"], detail=m["detail"], stepper=m["stepper"],
        stepper_seen=m["stepper_seen"])


_LOCK_CHANGE = select(layout_changes).where(
    layout_changes.c.id == bindparam("change_id")).with_for_update()


_OPEN = layout_changes.c.state.in_([s.value for s in HOLDING_STATES])
_FAULT_OPEN = gpu_faults.c.cleared_at.is_(None)


class HoldCause(StrEnum):
    """Why capacity is held from new grants: each cause is one source of holds."""

    #: An admin's layout change (docs/layout.md).
    LAYOUT = "layout"
    #: A fault the driver reported on the GPU or one MIG device of it (docs/health.md).
    FAULT = "fault"


#: Each cause of a hold, as a statement giving ``(host, GPU UUID, held slices as a bit
#: mask, whole GPU)`` for its holds that stand. Built once: every claim and grant pass
#: reads them all.
HOLD_SOURCES: Mapping[HoldCause, Select[Any]] = {
    # A layout change while it is open.
    HoldCause.LAYOUT: select(layout_changes.c.host, layout_changes.c.gpu_uuid,
                             layout_changes.c.held_slices,
                             layout_changes.c.whole_gpu).where(_OPEN),
    # A GPU fault until an admin clears it.
    HoldCause.FAULT: select(gpu_faults.c.host, gpu_faults.c.gpu_uuid, gpu_faults.c.held_slices,
                            gpu_faults.c.whole_gpu).where(_FAULT_OPEN),
}


def read_holds(connection: Connection, causes: Iterable[HoldCause] = HoldCause
               ) -> HeldSlices:
    """The slices every hold of ``causes`` (all, by default) that stands holds, per
    (host, GPU UUID); read in the caller's transaction. A whole-GPU hold is every slice
    (64 bits: more than any GPU has)."""
    return merge_holds(
        {(host, gpu_uuid): frozenset(range(64)) if whole else _slices(mask)}
        for cause in causes
        for host, gpu_uuid, mask, whole in connection.execute(HOLD_SOURCES[cause]))


def merge_holds(parts: Iterable[Mapping[tuple[str, str], frozenset[int]]]) -> HeldSlices:
    """The union of several holds, per (host, GPU UUID)."""
    holds: HeldSlices = {}
    for part in parts:
        for key, held in part.items():
            holds[key] = holds.get(key, frozenset()) | held
    return holds


@dataclass(frozen=True)
class GpuFault:
    """A fault recorded in the ledger: what the driver reported, where, when, and what
    it holds from new grants until an admin clears it."""

    id: int
    host: str
    gpu_uuid: str
    gpu_index: int
    kind: FaultKind
    detail: str
    held_slices: frozenset[int]
    whole_gpu: bool
    seen_at: datetime
    last_seen_at: datetime
    xid: int | None = None
    device_uuid: str | None = None
    cleared_at: datetime | None = None
    cleared_by: str | None = None

    @property
    def open(self) -> bool:
        """Not cleared: its slices are held."""
        return self.cleared_at is None

    def holds(self, slices: Iterable[int]) -> bool:
        """Whether the fault withholds any of ``slices``."""
        return self.whole_gpu or not self.held_slices.isdisjoint(slices)

    @property
    def why(self) -> str:
        """Why its slices are withheld, in an analyst's words (``GPU 1 reported a
        hardware fault``); :attr:`detail` is what the driver said."""
        return withheld_words(self.gpu_index)

    @property
    def where(self) -> str:
        """``GPU 1`` or ``GPU 1, memory slices 2-3``."""
        if self.whole_gpu or not self.held_slices:
            return f"GPU {self.gpu_index}"
        return f"GPU {self.gpu_index}, memory slices {min(self.held_slices)}-" \
               f"{max(self.held_slices)}"


def _to_fault(row: Row[Any]) -> GpuFault:
    m = row._mapping
    return GpuFault(
        id=m["id"], host=m["host"], gpu_uuid=m["gpu_uuid"], gpu_index=m["gpu_index"],
        kind=FaultKind(m["kind"]), detail=m["detail"], held_slices=_slices(m["held_slices"]),
        whole_gpu=bool(m["whole_gpu"]), seen_at=m["seen_at"], last_seen_at=m["last_seen_at"],
        xid=m["xid"], device_uuid=m["device_uuid"], cleared_at=m["cleared_at"],
        cleared_by=m["cleared_by"])


class FaultHold(NamedTuple):
    """A fault to record, and what it withholds (``slices`` None: the whole GPU, whose
    ``gpu_slices`` memory slices are then recorded, 0 where its model is not known;
    :func:`mig_spawner.core.health.fault_slices`)."""

    fault: Fault
    slices: frozenset[int] | None
    gpu_slices: int = 0


class Holds:
    """The ledger's holds store (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self._tx = tx

    def held(self) -> HeldSlices:
        """The slices every hold that stands holds now, per (host, GPU UUID), whatever
        its cause."""
        with self._tx.read() as connection:
            return read_holds(connection)

    # -- GPU faults (docs/health.md) --------------------------------------------------

    def record_faults(self, host: str, found: Iterable[FaultHold]) -> list[GpuFault]:
        """Hold what each fault found on ``host`` withholds, under the claim lock (a claim
        either committed before, and its lease's holder is warned, or sees the hold).
        A fault already held (same GPU, kind and slices, not cleared) is only seen again
        (``last_seen_at``). Returns the faults recorded new; the grant loops are told."""
        found = list(found)
        if not found:
            return []
        recorded = []
        with self._tx.claims() as connection:
            now = self._tx.now()
            # A whole-GPU fault is the same whatever slices its GPU was read to have (a
            # process that never read a lost GPU cannot tell).
            standing = {(f.gpu_uuid, f.kind, None if f.whole_gpu else f.held_slices): f.id
                        for f in map(_to_fault, connection.execute(
                            select(gpu_faults).where(gpu_faults.c.host == host, _FAULT_OPEN)))}
            for fault, slices, gpu_slices in found:
                whole = slices is None
                held = frozenset(range(gpu_slices) if slices is None else slices)
                key = (fault.gpu_uuid, fault.kind, None if whole else held)
                seen = standing.get(key)
                if seen is not None:
                    connection.execute(update(gpu_faults).where(gpu_faults.c.id == seen)
                                       .values(last_seen_at=now))
                    continue
                new_id = connection.execute(insert(gpu_faults).values(
                    host=host, gpu_uuid=fault.gpu_uuid, gpu_index=fault.gpu_index,
                    kind=fault.kind.value, detail=fault.detail[:_DETAIL_MAX], xid=fault.xid,
                    device_uuid=fault.device_uuid, held_slices=_mask(held),
                    whole_gpu=int(whole), seen_at=now, last_seen_at=now,
                )).inserted_primary_key[0]
                standing[key] = new_id
                recorded.append(_to_fault(connection.execute(
                    select(gpu_faults).where(gpu_faults.c.id == new_id)).one()))
            if recorded:
                self._tx.announce(connection)
        return recorded

    def faults(self, host: str | None = None, *, open_only: bool = True) -> list[GpuFault]:
        """Faults (those not cleared, by default), oldest first; on ``host`` when given."""
        query = select(gpu_faults).order_by(gpu_faults.c.id)
        if open_only:
            query = query.where(_FAULT_OPEN)
        if host is not None:
            query = query.where(gpu_faults.c.host == host)
        with self._tx.read() as connection:
            return [_to_fault(r) for r in connection.execute(query)]

    def clear_faults(self, host: str, gpu_uuid: str, by: str) -> list[GpuFault]:
        """Lift every fault hold of one GPU (an admin, once the driver reads it healthy
        again: ``mig-spawner health clear``). The rows stay as history; the grant loops
        are told. Returns the faults cleared."""
        with self._tx.claims() as connection:
            where = (gpu_faults.c.host == host, gpu_faults.c.gpu_uuid == gpu_uuid, _FAULT_OPEN)
            cleared = [_to_fault(r) for r in connection.execute(select(gpu_faults).where(*where))]
            if cleared:
                now = self._tx.now()
                connection.execute(update(gpu_faults).where(*where)
                                   .values(cleared_at=now, cleared_by=by[:255]))
                self._tx.announce(connection)
                cleared = [replace(f, cleared_at=now, cleared_by=by[:255]) for f in cleared]
        return cleared

    # -- layout changes ---------------------------------------------------------------

    def open_change(self, host: str, gpu_uuid: str, gpu_index: int, target: Mapping[str, Any],
                    held_slices: Iterable[int], *, whole_gpu: bool = False,
                    state: PlanState = PlanState.PENDING) -> LayoutChange:
        """Start a change of one GPU, holding ``held_slices`` (or the whole GPU) from new
        grants at once. An open change of that GPU is replaced (it ends ``failed``,
        "replaced by a new plan")."""
        with self._tx.claims() as connection:
            now = self._tx.now()
            connection.execute(
                update(layout_changes)
                .where(layout_changes.c.host == host, layout_changes.c.gpu_uuid == gpu_uuid,
                       _OPEN)
                .values(state=PlanState.FAILED.value, updated_at=now,
                        detail="replaced by a new plan"))
            new_id = connection.execute(insert(layout_changes).values(
                host=host, gpu_uuid=gpu_uuid, gpu_index=gpu_index,
                target=json.dumps(dict(target), sort_keys=True), state=state.value,
                held_slices=_mask(held_slices), whole_gpu=int(whole_gpu),
                created_at=now, updated_at=now)).inserted_primary_key[0]
            row = connection.execute(
                select(layout_changes).where(layout_changes.c.id == new_id)).one()
            return _to_change(row)

    def move_change(self, change_id: int, state: PlanState, *, detail: str | None = None,
                    held_slices: Iterable[int] | None = None,
                    notice_from: datetime | None = None) -> LayoutChange | None:
        """Move a change on; a done or failed one stays as it is (returns None). Ending
        it gives its slices back to the grant loops (they are told)."""
        with self._tx.claims() as connection:
            row = connection.execute(select(layout_changes)
                                     .where(layout_changes.c.id == change_id)).one_or_none()
            if row is None or _to_change(row).state in _FINAL:
                return None
            values: dict[str, Any] = {"state": state.value, "updated_at": self._tx.now()}
            if detail is not None:
                values["detail"] = detail.strip()[:_DETAIL_MAX]
            if held_slices is not None:
                values["held_slices"] = _mask(held_slices)
            if notice_from is not None:
                values["notice_from"] = notice_from
            connection.execute(update(layout_changes)
                               .where(layout_changes.c.id == change_id).values(values))
            if state in _FINAL or held_slices is not None:
                self._tx.announce(connection)
            return _to_change(connection.execute(
                select(layout_changes).where(layout_changes.c.id == change_id)).one())

    def changes(self, host: str | None = None, *, open_only: bool = True
                ) -> list[LayoutChange]:
        """Changes (open ones only, by default), oldest first; on ``host`` when given."""
        query = select(layout_changes).order_by(layout_changes.c.id)
        if open_only:
            query = query.where(_OPEN)
        if host is not None:
            query = query.where(layout_changes.c.host == host)
        with self._tx.read() as connection:
            return [_to_change(r) for r in connection.execute(query)]

    # -- stepping a change: one stepper at a time, each step inside the hold ----------

    def take_change(self, change_id: int, stepper: str,
                    gone: Callable[[LayoutChange], bool]) -> LayoutChange | None:
        """Become the one process that steps change ``change_id`` (the slice service's
        sweep and ``mig-spawner layout apply --wait`` both step changes). None when the
        change has ended, or another stepper has it and ``gone(change)`` does not say
        that stepper is provably gone (a stepper killed with -9 never lets go; the next
        one takes the change over, so a crash never wedges it)."""
        with self._tx.write() as connection:
            row = connection.execute(_LOCK_CHANGE, {"change_id": change_id}).one_or_none()
            if row is None:
                return None
            change = _to_change(row)
            if not change.open or (change.stepper not in (None, stepper) and not gone(change)):
                return None
            now = self._tx.now()
            connection.execute(update(layout_changes).where(layout_changes.c.id == change_id)
                               .values(stepper=stepper, stepper_seen=now))
            return replace(change, stepper=stepper, stepper_seen=now)

    def let_go(self, change_id: int, stepper: str) -> None:
        """Stop stepping change ``change_id`` (when ``stepper`` still has it)."""
        with self._tx.write() as connection:
            connection.execute(
                update(layout_changes)
                .where(layout_changes.c.id == change_id, layout_changes.c.stepper == stepper)
                .values(stepper=None, stepper_seen=None))

    def replan(self, change_id: int, stepper: str, plan: Callable[[list[Lease]], GpuPlan]
               ) -> Replan | None:
        """Plan change ``change_id`` again and hold what the plan changes, in one
        transaction under the claim lock: ``plan(leases)`` gets the leases held on the
        change's GPU as of that lock, and its changing slices become the change's hold
        before the transaction ends. So a claim either committed before (its lease is
        among ``leases``: a holder the plan waits for) or sees the hold; a slice the plan
        destroys is never granted between the read and the destroy. None when
        ``stepper`` no longer steps the change (it ended, or was taken over)."""
        with self._tx.claims() as connection:
            row = connection.execute(_LOCK_CHANGE, {"change_id": change_id}).one_or_none()
            change = None if row is None else _to_change(row)
            if change is None or not change.open or change.stepper != stepper:
                return None
            held = held_on(connection, change.host, change.gpu_uuid)
            planned = plan(held)
            now = self._tx.now()
            values: dict[str, Any] = {"stepper_seen": now}
            if planned.problem is None and planned.steps:
                whole, slices = planned.mode_change, planned.changing_slices
                if (whole, frozenset(slices)) != (change.whole_gpu, change.held_slices):
                    values.update(held_slices=_mask(slices), whole_gpu=int(whole),
                                  updated_at=now)
                    self._tx.announce(connection)  # a hold that shrank frees slices
                    change = replace(change, held_slices=frozenset(slices), whole_gpu=whole)
            connection.execute(update(layout_changes)
                               .where(layout_changes.c.id == change_id).values(values))
            return Replan(replace(change, stepper_seen=now), held, planned)

    def check_step(self, change_id: int, stepper: str, slices: Iterable[int]) -> str | None:
        """Why a step on ``slices`` of the change's GPU may not run now, in words (None:
        it may). Under the claim lock: the change is still open and ``stepper``'s, it
        holds every one of ``slices``, and no lease holds any of them. Read just before
        the step, so nothing granted is ever destroyed or built over."""
        wanted = frozenset(slices)
        with self._tx.claims() as connection:
            row = connection.execute(_LOCK_CHANGE, {"change_id": change_id}).one_or_none()
            change = None if row is None else _to_change(row)
            if change is None or not change.open:
                return "the change has ended"
            if change.stepper != stepper:
                return "another process took the change over"
            if not change.holds(wanted):
                outside = sorted(wanted - change.held_slices)
                return f"memory slices {', '.join(map(str, outside))} are not held by the change"
            leased = [x for x in held_on(connection, change.host, change.gpu_uuid)
                      if wanted.intersection(x.memory_slices)]
            if leased:
                return f"{leased[0].server} holds it"
            connection.execute(update(layout_changes).where(layout_changes.c.id == change_id)
                               .values(stepper_seen=self._tx.now()))
            return None
