"""Pool mode: hand out a free MIG device that an admin made beforehand.

A device is free when no lease holds it and it runs no process (a process no lease
accounts for means someone uses the slice outside mig-spawner). ``pack`` takes a free
device on the GPU with the most memory slices in use, ``spread`` on the one with the
fewest; ties go to the lowest GPU index, then the lowest start. :class:`PoolView` keeps,
per model and profile, the GPUs that have a free device bucketed by how much of them is
in use, so a choice looks at a few buckets, never at every device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from mig_spawner.core.inventory import Gpu, MigDevice
from mig_spawner.core.refusal import Refused

from .minset import MinSet
from .refusals import GpuView, none_free, precheck
from .request import Placement, gpu_view


@dataclass(frozen=True)
class PoolGrant:
    """Pool mode: the existing MIG device given to the server."""

    device: MigDevice

    @property
    def uuid(self) -> str:
        return self.device.uuid

    @property
    def placement(self) -> Placement:
        d = self.device
        return Placement(d.gpu_index, d.gpu_uuid, d.profile, d.start, d.size)


@dataclass(frozen=True)
class _Counted:
    """What one GPU adds to a :class:`PoolView`."""

    view: tuple[str | None, str]  # (catalog model key or None, MIG state) for refusals
    member: tuple[int, int]  # (GPU index, position in the inventory)
    key: str | None = None  # set when MIG is on: the model key, and the counts below
    taken: int = 0  # memory slices of devices leased, held or running processes
    free: Mapping[str, int] | None = None  # free devices per profile
    exist: Mapping[str, int] | None = None  # devices per profile
    leased: Mapping[str, int] | None = None  # devices per profile that leases or holds take


class PoolView:
    """Free pool devices of a :class:`~.index.SliceIndex`'s GPUs, kept as leases come and
    go. ``taken(device)`` says whether a lease or a layout change's hold takes a device."""

    def __init__(self, size: int) -> None:
        # (model key, profile) -> memory slices in use -> GPUs with a free device of it
        self._buckets: dict[tuple[str, str], dict[int, MinSet[tuple[int, int]]]] = {}
        self._free: Counter[tuple[str | None, str]] = Counter()
        self._exist: Counter[tuple[str, str]] = Counter()
        self._leased: Counter[tuple[str, str]] = Counter()
        self._views: Counter[tuple[str | None, str]] = Counter()
        self._records: list[_Counted | None] = [None] * size

    def add(self, n: int, gpu: Gpu, taken: Callable[[MigDevice], bool]) -> None:
        """Count GPU ``n``."""
        view = gpu_view(gpu)
        self._views[view.model_key, view.mig] += 1
        record = _Counted((view.model_key, view.mig), (gpu.index, n))
        # MIG on and no mode change waiting (Gpu.mig_enabled).
        if gpu.mig_current and gpu.mig_pending:
            used = 0
            free: Counter[str] = Counter()
            exist: Counter[str] = Counter()
            leased: Counter[str] = Counter()
            for d in gpu.mig_devices:
                exist[d.profile] += 1
                held = taken(d)
                if held:
                    leased[d.profile] += 1
                if held or d.processes:
                    used += d.size
                else:
                    free[d.profile] += 1
            record = _Counted(record.view, record.member, gpu.model_key, used, free, exist,
                              leased)
            self._count(record, +1)
        self._records[n] = record

    def remove(self, n: int) -> None:
        """Stop counting GPU ``n`` (as :meth:`add` counted it)."""
        record = self._records[n]
        if record is None:
            return
        self._records[n] = None
        self._views[record.view] -= 1
        if record.free is not None:
            self._count(record, -1)

    def _count(self, record: _Counted, sign: int) -> None:
        key, member = record.key, record.member
        assert record.free is not None and record.exist is not None
        assert record.leased is not None
        for profile, count in record.free.items():
            self._free[key, profile] += sign * count
            if key is None:
                continue
            buckets = self._buckets.setdefault((key, profile), {})
            members = buckets.get(record.taken)
            if sign > 0:
                if members is None:
                    members = buckets[record.taken] = MinSet()
                members.add(member)
            elif members is not None:
                members.discard(member)
                if not members:
                    del buckets[record.taken]
        if key is not None:
            for profile, count in record.exist.items():
                self._exist[key, profile] += sign * count
            for profile, count in record.leased.items():
                self._leased[key, profile] += sign * count

    def pick(self, wants: Mapping[str, str], spread: bool, taken: Callable[[MigDevice], bool],
             gpus: Sequence[Gpu]) -> PoolGrant | None:
        """The device to give (see the module's rules), or ``None`` when none is free
        (``gpus``: the inventory's, by position)."""
        best: tuple[tuple[int, int, int], int] | None = None
        for key, name in wants.items():
            buckets = self._buckets.get((key, name))
            if not buckets:
                continue
            used = min(buckets) if spread else max(buckets)
            index, n = buckets[used].least()
            # The GPU index last: among equals the lowest wins, whatever the inventory order.
            rank = (used if spread else -used, index, n)
            if best is None or rank < best[0]:
                best = (rank, n)
        if best is None:
            return None
        gpu = gpus[best[1]]
        name = wants[gpu.model_key or ""]
        found: MigDevice | None = None
        for d in gpu.mig_devices:
            if (d.profile == name and not d.processes and not taken(d)
                    and (found is None or d.start < found.start)):
                found = d
        assert found is not None  # the bucket holds only GPUs with a free device of it
        return PoolGrant(found)

    def free(self) -> dict[str | None, dict[str, int]]:
        """Free devices per model key (``None``: a model the catalog does not know), per
        profile, on GPUs with MIG on."""
        out: dict[str | None, dict[str, int]] = {}
        for (key, profile), count in self._free.items():
            if count:
                out.setdefault(key, {})[profile] = count
        return out

    def refuse(self, wants: Mapping[str, str], views: Callable[[], Iterable[GpuView]]
               ) -> Refused:
        """Why no free device of ``wants`` exists. ``views`` (every GPU, read only when no
        GPU of a wanted model has MIG on) names the GPUs in that refusal."""
        free: Counter[str] = Counter()
        for (_, profile), count in self._free.items():
            if count:
                free[profile] += count
        usable = sum(self._views[key, "on"] for key in wants)
        if not usable:
            _, refusal = precheck(views(), wants, dict(free))
            assert refusal is not None  # precheck refuses whenever no GPU is usable
            return refusal
        eligible = sum(n for (key, _), n in self._views.items() if key in wants)
        exist = sum(self._exist[key, name] for key, name in wants.items())
        leased = sum(self._leased[key, name] for key, name in wants.items())
        return none_free(wants, usable, eligible, exist, leased, exist - leased, dict(free))
