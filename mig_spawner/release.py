"""The one release path: every lease that ends is given back through :class:`Releaser`.

The spawner (a start that failed, a stale lease, a poll that found the server dead, a
stop, a wait cancelled as it was granted, and the retry of any of these) and the slice
service (orphan repair) all call :meth:`Releaser.release`, which does the same steps in
the same order:

1. read the lease; a released one is :attr:`GiveBack.ALREADY_RELEASED`;
2. ask the backend's holder probe (:class:`LocalProcesses`: this host's processes, by
   the rule in :mod:`mig_spawner.holder`; :class:`KubePods`: the lease's pod by name and
   UID) what still holds the slice, and stop what runs (TERM, then KILL after the
   grace; a pod is deleted);
3. anything still holding it, or a holder that cannot be checked: the lease is left
   ``releasing`` with what holds it (``held_by``, plain words for its user) and the
   outcome is :attr:`GiveBack.HELD`, with why;
4. the kind's steps before the release (:meth:`SliceKind.before_release
   <mig_spawner.kinds.SliceKind.before_release>`): a dynamic instance is destroyed, so
   the ledger never shows a slice free that still exists on the GPU; an instance that
   still runs processes is never forced (held, as in 3);
5. the lease is released with its :class:`~mig_spawner.core.lifecycle.ReleaseCode`;
6. the kind's steps after it (:meth:`SliceKind.after_release
   <mig_spawner.kinds.SliceKind.after_release>`): the server's device cgroup and
   capability nodes are undone, whichever path released it.

:meth:`Releaser.retry_later` retries a held give-back with backoff until it is done.
Who counts what (the hub's and the service's metrics differ) is the caller's
:class:`ReleaseEvents`. docs/architecture.md, "Who releases".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from mig_spawner import holder
from mig_spawner.device_cgroup import pids_in_slice_cgroup
from mig_spawner.gpu.errors import GpuError
from mig_spawner.kinds import NO_GPU_ACCESS as NO_GPU_ACCESS
from mig_spawner.kinds import Confinement, SliceGpus, kind_of, on_device_words
from mig_spawner.kube import ClusterReadError
from mig_spawner.ledger import Lease, LeaseState, Ledger, LedgerError, ReleaseCode

T = TypeVar("T")
#: Runs a blocking call off the event loop (the hub's worker, ``asyncio.to_thread``).
Run = Callable[[Callable[[], T]], Awaitable[T]]

#: A held give-back is retried after this many seconds, doubling up to RETRY_MAX, so
#: that the slice is free within seconds of what held it going away.
RETRY_FIRST = 0.5
RETRY_MAX = 4.0

#: What ``held_by`` says (users read it when they start that server again).
UNCHECKABLE = "a process of its last run that the hub cannot check or stop"
GPU_REFUSED = "the GPU did not let the hub destroy its instance yet; the hub keeps trying"
LEDGER_DOWN = "the hub could not record yet that it was given back; it keeps trying"


__all__ = ["GiveBack", "HolderProbes", "KubePods", "LocalProcesses", "Outcome",
           "ReleaseEvents", "Releaser", "SliceGpus", "on_device_words", "still_holding"]


class GiveBack(StrEnum):
    """What a give-back did."""

    RELEASED = "released"
    ALREADY_RELEASED = "already_released"
    #: Something still holds the slice (or could not be checked): left ``releasing``.
    HELD = "held"


@dataclass(frozen=True)
class Outcome:
    """A give-back's result; ``why`` (HELD) says in plain words what holds the slice,
    ``error`` is the GPU or ledger error that stopped it, if one did. ``lease``
    (RELEASED): the lease as released, with the code the ledger kept (the first
    given, e.g. ``budget`` recorded by the slice service before the hub's stop)."""

    result: GiveBack
    why: str = ""
    error: Exception | None = None
    lease: Lease | None = None

    @property
    def done(self) -> bool:
        """Nothing is held any more: released now or before."""
        return self.result is not GiveBack.HELD


def still_holding(lease: Lease) -> str:
    """In plain words, what keeps ``lease``'s slice from being free (for users)."""
    if lease.held_by:
        return lease.held_by
    if lease.state == LeaseState.RELEASING:
        return "the hub is still giving it back"
    return LEDGER_DOWN


class HolderProbe(Protocol):
    """One backend's view of what holds a lease's slice (see the module doc)."""

    async def check(self, lease: Lease) -> holder.HolderCheck:
        """What holds the slice now."""

    async def stop(self, lease: Lease, found: holder.HolderCheck, grace: float
                   ) -> holder.HolderCheck:
        """Stop what ``found`` runs (``grace`` seconds from TERM to KILL) and say what
        holds the slice after that."""


class LocalProcesses:
    """The processes on this host (:func:`mig_spawner.holder.check`), with the PIDs the
    GPU lists on the device the lease's kind names, its MIG device or its whole GPU
    (``gpus``: the adapter, read through ``run`` because NVML handles stay on their
    thread; ``None``: no GPU here).

    ``cgroup_members`` is the hook for kernel-enforced isolation: lease -> the PIDs in
    the slice's device cgroup, each a holder whatever its environment says.
    """

    def __init__(self, run: Run, gpus: Callable[[], SliceGpus | None] | None = None, *,
                 cgroup_members: Callable[[Lease], Iterable[int]] | None = pids_in_slice_cgroup
                 ) -> None:
        self.run = run
        self.gpus = gpus
        self.cgroup_members = cgroup_members

    async def check(self, lease: Lease) -> holder.HolderCheck:
        try:
            on_device = await self._on_device(lease)
        except GpuError as e:
            return holder.HolderCheck(holder.UNKNOWN, why=f"the GPU's process list of its "
                                      f"device cannot be read: {e}")
        members = tuple(self.cgroup_members(lease)) if self.cgroup_members else ()
        return await asyncio.to_thread(holder.check, lease, on_device=on_device,
                                       members=members)

    async def stop(self, lease: Lease, found: holder.HolderCheck, grace: float
                   ) -> holder.HolderCheck:
        stopped = await asyncio.to_thread(holder.stop, found, grace)
        # What the device lists now, after the stop, is what still holds it.
        return await self.check(lease) if stopped.state == holder.GONE else stopped

    async def _on_device(self, lease: Lease) -> tuple[int, ...]:
        # The device the lease's kind names: its MIG device, or its whole GPU.
        device = kind_of(lease).device_name(lease)
        if self.gpus is None or not device or lease.gpu_index is None:
            return ()

        def listed() -> tuple[int, ...]:
            gpus = self.gpus() if self.gpus else None
            if gpus is None:
                return ()
            # A list the driver refused or garbled adds nothing: the environment rule
            # still applies, and a dynamic instance is not destroyed while processes run
            # on it.
            return gpus.gpu(lease.gpu_index).pids_on(device)

        return await self.run(listed)


class KubePods:
    """The lease's pod, by name and UID, through the Kubernetes API (``api``: an async
    callable that returns a connected ``CoreV1Api``)."""

    def __init__(self, api: Callable[[], Awaitable[Any]]) -> None:
        self.api = api

    async def check(self, lease: Lease) -> holder.HolderCheck:
        try:
            api = await self.api()
        except ClusterReadError as e:
            return holder.HolderCheck(holder.UNKNOWN, why=f"{e} ({e.hint})")
        return await holder.check_pod(api, lease)

    async def stop(self, lease: Lease, found: holder.HolderCheck, grace: float
                   ) -> holder.HolderCheck:
        return await holder.stop_pod(await self.api(), lease, found, grace)


@dataclass(frozen=True)
class HolderProbes:
    """The probe for each kind of lease: this host's processes for the kinds held on
    this host, pods for the others (``None``: this process cannot reach a cluster)."""

    local: HolderProbe
    pods: HolderProbe | None = None

    def for_lease(self, lease: Lease) -> HolderProbe | None:
        return self.local if kind_of(lease).rules.on_host else self.pods


def untracked_words(lease: Lease, found: holder.HolderCheck) -> str:
    """Which running holder of ``lease`` the release stops, for the log: its pod, the
    server process the lease records, other processes on its slice (left by its server,
    or started beside it), or both."""
    if found.pod:
        return f"its pod {found.pod}"
    server = [pid for pid in found.pids if pid == lease.holder_pid]
    others = [pid for pid in found.pids if pid != lease.holder_pid]
    said = [f"its recorded server process (PID {server[0]})"] if server else []
    if others:
        said.append(f"other processes on its slice (PIDs {others})")
    return " and ".join(said)


class ReleaseEvents:
    """What a caller counts and reports about give-backs; every hook does nothing here."""

    def stopping(self, lease: Lease, found: holder.HolderCheck) -> None:
        """A holder the hub does not track is being stopped before the release."""

    def holder_unknown(self, lease: Lease, found: holder.HolderCheck, retry: bool) -> None:
        """The holder could not be checked or stopped: the slice stays held."""

    def retrying(self, lease_id: str) -> None:
        """A held give-back will be retried in the background."""

    def freed(self, lease: Lease) -> None:
        """On the worker thread that released ``lease``, the moment the ledger committed
        it (before the event loop hears): its slice may be granted now."""

    def released(self, lease: Lease, code: ReleaseCode) -> None:
        """The lease was released."""


#: This host's own confinement (cgroups and capability nodes where the kernel has them).
_HOST = Confinement()

# Retry tasks by lease id: one per lease in this process, referenced so that the event
# loop does not lose them.
_RETRIES: dict[str, asyncio.Task[Outcome]] = {}


class Releaser:
    """Gives leases back (see the module doc). ``ledger``/``gpus`` return the adapters
    (called through ``run``); ``probes`` says what holds a lease; ``grace``: seconds
    from TERM to KILL for a holder; ``events``: the caller's counters; ``log``: where
    it says what it did; ``confinement``: where this host confines servers (the
    host's defaults unless the spawner configured others; ``None``: nothing to undo)."""

    def __init__(
        self, ledger: Callable[[], Ledger], gpus: Callable[[], SliceGpus | None],
        probes: HolderProbes, *, run: Run, grace: float = holder.STOP_GRACE,
        events: ReleaseEvents | None = None, log: logging.Logger | logging.LoggerAdapter | None
        = None, confinement: Confinement | None = _HOST,
    ) -> None:
        self.ledger = ledger
        self.gpus = gpus
        self.probes = probes
        self.run = run
        self.grace = grace
        self.events = events or ReleaseEvents()
        self.log = log or logging.getLogger(__name__)
        self.confinement = confinement

    async def release(self, lease: Lease | str, code: ReleaseCode, detail: str = "", *,
                      retry: bool = False) -> Outcome:
        """Give ``lease`` (or the lease of that id) back, or say what holds it.

        Never raises for the GPU or the ledger: their errors come back in a
        :attr:`GiveBack.HELD` outcome (``error``), to be tried again. ``retry``: a
        background retry, which logs what is still held at debug level only.
        """
        try:
            if isinstance(lease, str):
                lease_id = lease
                found = await self.run(lambda: self.ledger().leases.get(lease_id))
                if found is None:
                    return Outcome(GiveBack.ALREADY_RELEASED)
                lease = found
            if not lease.held:
                return Outcome(GiveBack.ALREADY_RELEASED)
            held = await self._holder(lease, code, detail, retry)
            if held is not None:
                return held
            outcome = await self.run(lambda: self._give_back(lease, code, detail))
            if outcome.result is GiveBack.RELEASED:
                await self.run(lambda: kind_of(lease).after_release(
                    lease, self.gpus, self.confinement))
        except GpuError as e:
            self.log.error("Lease %s of %s: the GPU refused to give its slice back (%s); "
                           "retrying", lease if isinstance(lease, str) else lease.id,
                           getattr(lease, "server", "?"), e)
            return Outcome(GiveBack.HELD, GPU_REFUSED, e)
        except LedgerError as e:
            (self.log.debug if retry else self.log.error)(
                "Could not release lease %s: %s", getattr(lease, "id", lease), e)
            return Outcome(GiveBack.HELD, LEDGER_DOWN, e)
        if outcome.result is GiveBack.RELEASED:
            if outcome.lease is not None and outcome.lease.release_code is not None:
                # Count and log the why the ledger kept, not the one asked for now.
                lease, code = outcome.lease, ReleaseCode(outcome.lease.release_code)
                detail = outcome.lease.release_detail or ""
            self.events.released(lease, code)
        self.log.info("Lease %s of %s: %s (%s%s)", lease.id, lease.server, outcome.result,
                      code, f": {detail}" if detail else "")
        return outcome

    async def _holder(self, lease: Lease, code: ReleaseCode, detail: str, retry: bool
                      ) -> Outcome | None:
        """Check (and stop) what holds ``lease``; an outcome when the slice stays held."""
        probe = self.probes.for_lease(lease)
        if probe is None:
            found = holder.HolderCheck(holder.UNKNOWN, why=f"its server is pod {lease.pod}, "
                                       "and there is no Kubernetes API here to check it")
        else:
            found = await probe.check(lease)
            if found.state == holder.RUNNING:
                # Only what the hub does not track comes here: a server whose stop went
                # through the hub is gone by now, and the slice service stops servers
                # through the hub too. The log says which holder it is.
                self.log.warning("Lease %s of %s: stopping %s, which the hub does not "
                                 "track, before releasing it", lease.id, lease.server,
                                 untracked_words(lease, found))
                self.events.stopping(lease, found)
                # Why first: once its process dies, the hub's poll may give the lease
                # back as server_exited before this release does; the first code stays.
                await self.run(lambda: self.ledger().leases.end_for(lease.id, code, detail))
                found = await probe.stop(lease, found, self.grace)
        if found.state == holder.GONE:
            return None
        self.events.holder_unknown(lease, found, retry)
        (self.log.debug if retry else self.log.error)(
            "Lease %s of %s NOT released: its holder cannot be checked or stopped (%s); it "
            "keeps its slice", lease.id, lease.server, found.why or found.pids)
        why = on_device_words(found.on_device) if found.on_device else UNCHECKABLE
        await self.run(lambda: self.ledger().leases.begin_release(lease.id, code, detail,
                                                                  held_by=why))
        return Outcome(GiveBack.HELD, why)

    def _give_back(self, lease: Lease, code: ReleaseCode, detail: str) -> Outcome:
        """The kind's steps before the release (destroy a dynamic instance), then the
        release. Blocking."""
        ledger = self.ledger()
        try:
            held_by = kind_of(lease).before_release(lease, self.gpus)
        except GpuError:
            # Said in the lease (the slice map, the user's next start), then retried.
            ledger.leases.begin_release(lease.id, code, detail, held_by=GPU_REFUSED)
            raise
        if held_by is not None:
            ledger.leases.begin_release(lease.id, code, detail, held_by=held_by)
            return Outcome(GiveBack.HELD, held_by)
        released = ledger.leases.release(lease.id, code, detail)
        if released is None:
            return Outcome(GiveBack.ALREADY_RELEASED)
        self.events.freed(released)
        return Outcome(GiveBack.RELEASED, lease=released)

    def retry_later(self, lease_id: str, code: ReleaseCode, detail: str = "",
                    done: Callable[[Outcome], None] | None = None) -> None:
        """Retry giving ``lease_id`` back in the background (backoff from
        :data:`RETRY_FIRST` to :data:`RETRY_MAX` seconds) until nothing holds it; then
        call ``done``. One retry per lease in this process: a second call is a no-op."""
        if lease_id in _RETRIES:
            return
        self.events.retrying(lease_id)
        task = asyncio.ensure_future(self._retry(lease_id, code, detail))
        _RETRIES[lease_id] = task

        def finished(task: asyncio.Task[Outcome]) -> None:
            _RETRIES.pop(lease_id, None)
            if done is not None and not task.cancelled() and task.exception() is None:
                done(task.result())

        task.add_done_callback(finished)

    async def _retry(self, lease_id: str, code: ReleaseCode, detail: str) -> Outcome:
        delay = RETRY_FIRST
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)
            outcome = await self.release(lease_id, code, detail, retry=True)
            if outcome.done:
                self.log.info("Lease %s given back on a retry", lease_id)
                return outcome
