"""Layout changes in the ledger: each GPU's plan state and the slices it holds from grants.

:class:`LayoutChanges` is a base of :class:`~mig_spawner.ledger.store.Ledger`. A change
is one row per GPU (:data:`~mig_spawner.ledger.models.layout_changes`); while it is
``pending``, ``draining`` or ``applying`` its held slices are part of every claim's and
every grant pass's view (:attr:`LedgerView.holds`, read in their transaction), so no
picker can grant a placement that is about to change. Opening a change takes the claim
lock: a claim either committed before it (its lease is then a holder the drain waits
for) or sees the hold. docs/layout.md tells the whole way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, insert, select, update

from mig_spawner.core.layout import HOLDING_STATES, PlanState

from .changes import announce
from .engine import lock_claims
from .models import layout_changes

#: The ``gpu_uuid`` of a hold on a whole Kubernetes node (its name is the ``host``):
#: MIG Manager re-cuts a node's GPUs whole, so the node is held whole.
KUBE_NODE = "node"
#: (host, GPU UUID) -> memory slices held from new grants.
Holds = Mapping[tuple[str, str], frozenset[int]]
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

    @property
    def open(self) -> bool:
        """Not done nor failed: its slices are held."""
        return self.state in HOLDING_STATES


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
        notice_from=m["notice_from"], detail=m["detail"])


#: What :func:`read_holds` reads, built once: every claim and grant pass reads it.
_HOLDS = select(
    layout_changes.c.host, layout_changes.c.gpu_uuid, layout_changes.c.held_slices,
    layout_changes.c.whole_gpu,
).where(layout_changes.c.state.in_([s.value for s in HOLDING_STATES]))


def read_holds(connection: Connection) -> dict[tuple[str, str], frozenset[int]]:
    """The slices open changes hold, per (host, GPU UUID); read in the caller's
    transaction. A whole-GPU hold is every slice (64 bits: more than any GPU has)."""
    rows = connection.execute(_HOLDS)
    holds: dict[tuple[str, str], frozenset[int]] = {}
    for host, gpu_uuid, mask, whole in rows:
        held = frozenset(range(64)) if whole else _slices(mask)
        holds[(host, gpu_uuid)] = holds.get((host, gpu_uuid), frozenset()) | held
    return holds


class LayoutChanges:
    """The ledger's layout changes (see the module docstring)."""

    # Provided by Ledger.
    _read: Callable[[], AbstractContextManager[Connection]]
    _write: Callable[[], AbstractContextManager[Connection]]
    _now: Callable[[], datetime]
    _origin: str

    def open_change(self, host: str, gpu_uuid: str, gpu_index: int, target: Mapping[str, Any],
                    held_slices: Iterable[int], *, whole_gpu: bool = False,
                    state: PlanState = PlanState.PENDING) -> LayoutChange:
        """Start a change of one GPU, holding ``held_slices`` (or the whole GPU) from new
        grants at once. An open change of that GPU is replaced (it ends ``failed``,
        "replaced by a new plan")."""
        with self._write() as connection:
            lock_claims(connection)
            now = self._now()
            connection.execute(
                update(layout_changes)
                .where(layout_changes.c.host == host, layout_changes.c.gpu_uuid == gpu_uuid,
                       layout_changes.c.state.in_([s.value for s in HOLDING_STATES]))
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
        with self._write() as connection:
            lock_claims(connection)
            row = connection.execute(select(layout_changes)
                                     .where(layout_changes.c.id == change_id)).one_or_none()
            if row is None or _to_change(row).state in _FINAL:
                return None
            values: dict[str, Any] = {"state": state.value, "updated_at": self._now()}
            if detail is not None:
                values["detail"] = detail.strip()[:_DETAIL_MAX]
            if held_slices is not None:
                values["held_slices"] = _mask(held_slices)
            if notice_from is not None:
                values["notice_from"] = notice_from
            connection.execute(update(layout_changes)
                               .where(layout_changes.c.id == change_id).values(values))
            if state in _FINAL or held_slices is not None:
                announce(connection, self._origin)
            return _to_change(connection.execute(
                select(layout_changes).where(layout_changes.c.id == change_id)).one())

    def layout_changes(self, host: str | None = None, *, open_only: bool = True
                       ) -> list[LayoutChange]:
        """Changes (open ones only, by default), oldest first; on ``host`` when given."""
        query = select(layout_changes).order_by(layout_changes.c.id)
        if open_only:
            query = query.where(layout_changes.c.state.in_([s.value for s in HOLDING_STATES]))
        if host is not None:
            query = query.where(layout_changes.c.host == host)
        with self._read() as connection:
            return [_to_change(r) for r in connection.execute(query)]

    def holds(self) -> dict[tuple[str, str], frozenset[int]]:
        """The slices open changes hold now, per (host, GPU UUID)."""
        with self._read() as connection:
            return read_holds(connection)
