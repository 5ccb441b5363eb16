"""Whole GPUs (MIG off): which are free, kept as leases come and go.

A GPU is offered whole when the catalog knows its model, MIG is off and no change to
that waits for a reset; it is free when no held lease covers any memory slice of it.
Whole GPUs are alike, so the lowest index goes first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from mig_spawner.core.inventory import Gpu

from .minset import MinSet


def offered_whole(gpu: Gpu) -> bool:
    """A GPU offered whole: a catalog model with MIG off, and no change to that waiting
    for a reset."""
    return gpu.model_key is not None and not gpu.mig_current and not gpu.mig_pending


class WholeView:
    """The whole GPUs of a :class:`~.index.SliceIndex`, per model key: how many there
    are, how many have MIG off, and the free ones, lowest index first. A GPU a layout
    change holds offers nothing and is left out."""

    def __init__(self, size: int) -> None:
        self._free: dict[str, MinSet[tuple[int, int]]] = {}
        self._count: Counter[str] = Counter()
        self._off: Counter[str] = Counter()
        self._records: list[tuple[str, bool, bool, tuple[int, int]] | None] = [None] * size

    def add(self, n: int, gpu: Gpu, covered: bool, held: bool) -> None:
        """Count GPU ``n`` (``covered``: a held lease covers a slice of it; ``held``: a
        layout change holds some of its slices)."""
        key = gpu.model_key
        if held or not key:
            return
        off = not gpu.mig_current
        free = offered_whole(gpu) and not covered
        member = (gpu.index, n)
        self._records[n] = (key, off, free, member)
        self._count[key] += 1
        self._off[key] += off
        if free:
            self._free.setdefault(key, MinSet()).add(member)

    def remove(self, n: int) -> None:
        """Stop counting GPU ``n`` (as :meth:`add` counted it)."""
        record = self._records[n]
        if record is None:
            return
        self._records[n] = None
        key, off, free, member = record
        self._count[key] -= 1
        self._off[key] -= off
        if free:
            self._free[key].discard(member)

    def first(self, wants: Mapping[str, str]) -> int | None:
        """The position of the free GPU of a wanted model with the lowest index, or
        ``None``."""
        found = min((members.least() for key in wants
                     if (members := self._free.get(key))), default=None)
        return None if found is None else found[1]

    def counts(self, wants: Mapping[str, str]) -> tuple[int, int]:
        """GPUs of the wanted models, and how many of them have MIG off."""
        return sum(self._count[k] for k in wants), sum(self._off[k] for k in wants)

    def free(self) -> dict[str, int | None]:
        """Free whole GPUs per model key; ``None`` for a model none of whose GPUs has
        MIG off (never offered whole)."""
        return {key: len(self._free.get(key, ())) if self._off[key] else None
                for key, count in self._count.items() if count}
