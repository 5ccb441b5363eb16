"""One sweep of the slice service: gather what the hub, the servers, the ledger and the
GPUs say, let :mod:`mig_spawner.service.cull_rules` decide, carry the decisions out.

Order of a sweep:

1. read the held leases (ledger), sample each leased device's GPU activity (a MIG
   device's or a whole GPU's processes and memory; a MIG device's SM activity where
   NVML GPM exists) onto its lease, and
   list every active server (hub, paged);
2. per server, as the pages arrive: pick the limits of the group its lease is
   charged to, look inside it when that can change the outcome, decide, act;
3. only after a *complete* listing: release orphan leases past their grace and
   report busy MIG devices no lease accounts for. A listing cut short by a hub
   outage proves nothing about which servers run, so nothing is released then.

Every decision and repair is logged and counted; errors are counted by kind and
end the sweep, never the service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from mig_spawner import holder
from mig_spawner.core import budget
from mig_spawner.core.budget import Extra
from mig_spawner.core.clock import utcnow
from mig_spawner.core.idle import idle_limit
from mig_spawner.core.inventory import Inventory
from mig_spawner.core.layout import HOLDING_STATES
from mig_spawner.core.lifecycle import STOP_CODES, StopRule
from mig_spawner.core.policy import GroupPolicy, PolicySet
from mig_spawner.core.rightsize import UsageSample
from mig_spawner.gpu.errors import GpuError
from mig_spawner.gpu.gpm import GpmSampler
from mig_spawner.health import FaultWatch
from mig_spawner.hub.client import ACTIVE_USERS, HubClient, HubError
from mig_spawner.hub.models import HubServer, HubUser
from mig_spawner.kinds import kind_of
from mig_spawner.layout import KubeLayout, LayoutApplier
from mig_spawner.layout import Pass as LayoutPass
from mig_spawner.ledger import GpuFault, Lease, Ledger, LedgerError, ReleaseCode
from mig_spawner.release import (
    GiveBack,
    HolderProbes,
    KubePods,
    LocalProcesses,
    ReleaseEvents,
    Releaser,
    SliceGpus,
)
from mig_spawner.service.cull_rules import (
    HUB_DATA_ONLY,
    UNREACHABLE,
    Decision,
    Probe,
    SliceActivity,
    StopWarning,
    activity_to_record,
    budget_warning,
    decide,
    decide_server,
    fault_of,
    fault_stop,
    find_orphans,
    gpu_facts_to_record,
    idle_by_hub_data,
    is_cullable,
    needs_probe,
    unleased_busy_devices,
    warnings_due,
)
from mig_spawner.service.metrics import ServiceMetrics


async def _nothing() -> None:
    return None


_UNSEEN = object()


def _device_of(lease: Lease) -> str:
    """The device whose samples are ``lease``'s: the one its kind names ("": none here)."""
    return kind_of(lease).device_name(lease) or ""


class GpuSource(SliceGpus, Protocol):
    """What the sweeper needs from the GPU adapter (:class:`mig_spawner.gpu.GpuAdapter`)."""

    def inventory(self) -> Inventory: ...


class _ServiceEvents(ReleaseEvents):
    """What the slice service counts of the give-backs it does (orphan repair)."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def stopping(self, lease: Lease, found: holder.HolderCheck) -> None:
        self.metrics.holders_stopped.inc()

    def holder_unknown(self, lease: Lease, found: holder.HolderCheck, retry: bool) -> None:
        self.metrics.holders_unknown.inc()


@dataclass
class SweepReport:
    """What one sweep saw and did."""

    servers: int = 0
    decisions: list[Decision] = field(default_factory=list)
    carried_out: list[Decision] = field(default_factory=list)
    #: ``(user/server, warning)`` sent this sweep (in dry-run: that would be sent).
    warnings: list[tuple[str, StopWarning]] = field(default_factory=list)
    orphans_released: list[Lease] = field(default_factory=list)
    unleased_devices: list[str] = field(default_factory=list)
    #: What the layout changes under way did (None: none ran).
    layout: LayoutPass | None = None
    #: Leases whose servers were stopped (through the hub) because their GPU is re-cut
    #: and their drain notice ended.
    drained: list[Lease] = field(default_factory=list)
    #: GPU faults found and held this sweep (docs/health.md).
    faults: list[GpuFault] = field(default_factory=list)
    complete: bool = False
    error: str | None = None


class SweepLeases:
    """The held leases of one sweep, by server: read at its start, and read once more
    (at most, the read shared by every server that asks) when a server the hub lists as
    running has no lease there, or one without its internal URL: the lease of a spawn
    granted from the wait list while the sweep listed the hub. Without it that server
    was read through the proxy, each read counted as its user's activity, and one still
    starting answered 424."""

    def __init__(self, leases: Iterable[Lease],
                 read_again: Callable[[], Awaitable[list[Lease]]] | None) -> None:
        self._by_server = _by_server(leases)
        self._read_again = read_again
        self._again: asyncio.Future[dict[tuple[str, str], Lease]] | None = None

    async def of(self, server: HubServer) -> Lease | None:
        """The lease ``server`` holds, as fresh as the sweep needs it."""
        lease = self._by_server.get(server.key)
        if (lease is not None and lease.server_url) or self._read_again is None \
                or not is_cullable(server):
            return lease
        if self._again is None:
            self._again = asyncio.ensure_future(_by_server_of(self._read_again))
        return (await asyncio.shield(self._again)).get(server.key, lease)


def _by_server(leases: Iterable[Lease]) -> dict[tuple[str, str], Lease]:
    return {(lease.user, lease.server_name): lease for lease in leases}


async def _by_server_of(read: Callable[[], Awaitable[list[Lease]]]
                        ) -> dict[tuple[str, str], Lease]:
    return _by_server(await read())


#: Seconds between two prunes of old usage samples (``usage_retention``).
PRUNE_EVERY = 3600.0


class Sweeper:
    """Runs sweeps; keeps between them only the orphan clocks (``missing_since``)."""

    def __init__(
        self,
        client: HubClient,
        policy: PolicySet,
        metrics: ServiceMetrics,
        *,
        ledger: Ledger | None = None,
        gpus: GpuSource | None = None,
        dry_run: bool = False,
        probe_servers: bool = True,
        orphan_grace: float = 300.0,
        holder_grace: float = holder.STOP_GRACE,
        connect_kube: Callable[[], Awaitable[Any]] | None = None,
        layout: LayoutApplier | None = None,
        layout_notice: Callable[[str], float | None] | None = None,
        activity_resolution: float = 60.0,
        usage_interval: float = 60.0,
        faults: FaultWatch | None = None,
        usage_retention: float | None = 30 * 86400.0,
        log: logging.Logger | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.client = client
        self.policy = policy
        self.metrics = metrics
        self.ledger = ledger
        self.gpus = gpus
        self.dry_run = dry_run
        self.probe_servers = probe_servers
        self.orphan_grace = orphan_grace
        self.holder_grace = holder_grace
        # Kubernetes leases' pods are checked through this API (a CoreV1Api), connected
        # on the first such lease: a local hub never needs it.
        self.connect_kube = connect_kube
        self._kube_api: Any = None
        # Orphans are given back by the one release path; the next sweep is its retry.
        self.releaser = Releaser(
            lambda: self.ledger, lambda: self.gpus,
            HolderProbes(local=LocalProcesses(asyncio.to_thread, lambda: self.gpus),
                         pods=KubePods(self._kube) if connect_kube is not None else None),
            run=asyncio.to_thread, grace=holder_grace, events=_ServiceEvents(metrics),
            log=log or logging.getLogger(__name__),
        )
        self.layout = layout
        # Kubernetes nodes' layout changes (MIG Manager), read through the same API.
        self.kube_layout = (KubeLayout(lambda: self.ledger, self._kube, layout_notice)
                            if layout_notice is not None and connect_kube is not None
                            and ledger is not None else None)
        self.activity_resolution = activity_resolution
        # Finds this host's GPU faults and holds them (docs/health.md); None: the
        # faults other processes recorded still stop their servers.
        self.faults = faults
        self._held_faults: list[GpuFault] = []
        # Right-sizing samples (docs/ledger.md, "Usage samples"): one per lease at most
        # every usage_interval seconds, whatever the sweep's pace.
        self.usage_interval = usage_interval
        self._sampled_at: dict[str, datetime] = {}
        # Raw samples older than usage_retention (None: kept) are pruned, at most every
        # PRUNE_EVERY seconds, in the background: the first prune of a long history
        # must not hold up a sweep.
        self.usage_retention = usage_retention
        self._pruned_at: datetime | None = None
        self._pruning: asyncio.Future[None] | None = None
        self.log = log or logging.getLogger(__name__)
        self.clock = clock
        self.missing_since: dict[str, datetime] = {}
        # Keeps each GPU instance's previous GPM sample between sweeps.
        self.gpm = GpmSampler() if gpus is not None else None
        self._warned_proxied: set[tuple[str, str]] = set()
        # Servers that answered that they have no single-user extension, with their
        # start time: not asked again until they restart (one request fewer a sweep).
        self._no_extension: dict[tuple[str, str], datetime | None] = {}
        # The limits each group and pressure gives, worked out once a sweep.
        self._limits: dict[tuple[Any, ...], GroupPolicy] = {}

    async def close(self) -> None:
        """Close the hub client, the ledger and the GPU adapter (after a prune under
        way, which is a series of short writes)."""
        if self._pruning is not None:
            await self._pruning
        await self.client.close()
        if self.ledger is not None:
            self.ledger.close()
        if self.gpm is not None:
            self.gpm.close()
        close_gpus = getattr(self.gpus, "close", None)
        if close_gpus is not None:
            close_gpus()

    # -- policy -------------------------------------------------------------------

    def limits_for(self, user: HubUser, lease: Lease | None) -> GroupPolicy:
        """The group whose limits apply: the one the slice is charged to; for a
        server without a lease, the user's highest-priority group (or the default).
        Its ``server_idle_timeout`` is the one that applies now (:func:`idle_limit`):
        while someone waits for the lease's size, an idle holder makes room sooner."""
        if lease is not None:
            key: tuple[Any, ...] = (lease.group, lease.profile in self._waited_for)
        else:
            key = (user.groups,)
        limits = self._limits.get(key)
        if limits is None:  # once per group and pressure a sweep, not once per server
            if lease is not None:
                group, waited = self.policy.group(lease.group), key[1]
            else:
                groups = self.policy.for_user(user.groups).groups
                group, waited = min(groups, key=lambda g: (-g.priority, g.name)), False
            limits = self._limits[key] = replace(
                group, server_idle_timeout=idle_limit(group, waited))
        return limits

    # -- one sweep ----------------------------------------------------------------

    async def sweep(self) -> SweepReport:
        """One full pass. Never raises for hub, server or ledger trouble: it is
        logged, counted, and put in the report's ``error``."""
        report = SweepReport()
        started = time.monotonic()
        now = self.clock()
        self._limits = {}
        try:
            leases = await self._leases()
            await self._check_faults(leases, report)
            await self._keep_history(now, leases)
            leases = await self._gpu_activity(now, leases)
            running = await self._list_and_handle(now, leases, report)
            report.servers = len(running)
            self._no_extension = {k: v for k, v in self._no_extension.items() if k in running}
            report.complete = True
            self.metrics.servers_seen.set(report.servers)
            await self._repair_orphans(now, leases, running, report)
            await self._report_unleased(leases, report)
            await self._apply_layouts(report)
            self.metrics.last_sweep.set(time.time())
        except HubError as e:
            self._error("hub", f"hub unavailable, sweep cut short: {e}", report)
        except Exception as e:
            # The service must outlive any one bad sweep (a ledger outage, a bug).
            self.log.exception("sweep failed")
            self._error("internal", f"sweep failed: {e!r}", report)
        finally:
            self.metrics.sweep_duration.observe(time.monotonic() - started)
        self.log.info(
            "sweep: %d servers, %d decisions, %d carried out, %d orphans released%s",
            report.servers, len(report.decisions), len(report.carried_out),
            len(report.orphans_released), " (dry run)" if self.dry_run else "",
        )
        return report

    async def _list_and_handle(
        self, now: datetime, leases: list[Lease], report: SweepReport
    ) -> set[tuple[str, str]]:
        """Handle every server the hub lists as active; return their ``(user, name)``.

        Servers are probed as their page arrives, while the next page loads.
        Raises :class:`HubError` when the listing fails, after the servers already
        listed have been handled.
        """
        found = SweepLeases(leases, self._held_now if self.ledger is not None else None)
        running: set[tuple[str, str]] = set()
        tasks: list[asyncio.Future[None]] = []
        listed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        try:
            async for user in self.client.iter_users(state=ACTIVE_USERS):
                for server in user.servers:
                    running.add(server.key)
                    tasks.append(asyncio.ensure_future(self._handle_found(
                        now, user, server, found, report, listed
                    )))
        except BaseException:
            listed.set_result(False)
            raise
        else:
            listed.set_result(True)
        finally:
            await asyncio.gather(*tasks)
        return running

    async def _handle_found(
        self, now: datetime, user: HubUser, server: HubServer, found: SweepLeases,
        report: SweepReport, listed: asyncio.Future[bool],
    ) -> None:
        await self._handle_server(now, user, server, await found.of(server), report, listed)

    async def _held_now(self) -> list[Lease]:
        """The held leases now (:class:`SweepLeases` reads them again)."""
        assert self.ledger is not None
        return await asyncio.to_thread(self.ledger.leases.active)

    def _error(self, kind: str, message: str, report: SweepReport) -> None:
        self.metrics.errors.labels(kind=kind).inc()
        self.log.error(message)
        report.error = message

    async def _leases(self) -> list[Lease]:
        if self.ledger is None:
            return []
        horizon = self.policy.budget_horizon
        since = self.clock() - timedelta(seconds=horizon) if horizon is not None else None

        def read() -> tuple[list[Lease], list[Any], tuple[list[Lease], list[Extra]]]:
            usage = self.ledger.usage.budget(since) if since is not None else ([], [])
            return self.ledger.leases.active(), self.ledger.waits.waiting(), usage

        # SQLAlchemy is blocking; keep the event loop (and /health) responsive.
        held, waits, (counted, extras) = await asyncio.to_thread(read)
        self._waited_for = self.policy.profiles_meant(w.offer for w in waits)
        self._spans = budget.spans_of([lease for lease in counted if lease.held],
                                      [lease for lease in counted if not lease.held])
        self._extras = extras
        self._runs_out = None
        self._count_budgets()
        pending = Counter(s.rule for lease in held for s in lease.stops)
        for rule in StopRule:
            self.metrics.pending_stops.labels(rule.value).set(pending[rule])
        return held

    def _count_budgets(self) -> None:
        """The budget gauges, per group with a budget (no per-member label)."""
        now = self.clock()
        for group in (*self.policy.groups.values(), self.policy.default):
            if group.budget is None:
                continue
            standing = budget.standings(group, "", self._spans, self._extras, now)[0]
            self.metrics.budget_used.labels(group.name).set(standing.used / 3600)
            self.metrics.budget_total.labels(group.name).set(
                (standing.amount + standing.extra) / 3600)

    # What budgets count, read with the leases at each sweep.
    _spans: list[budget.Span] = []
    _extras: list[Extra] = []
    #: When each member's budgets run out, worked out once per sweep (at its ``now``).
    _runs_out: budget.Exhaustion | None = None

    def budget_stop(self, now: datetime, server: HubServer, lease: Lease | None
                    ) -> tuple[Decision | None, StopWarning | None]:
        """Whether the budget ``lease`` spends is spent (a stop, where its group's
        ``budget_action`` is ``stop``), or else the budget warning due now, if any."""
        if lease is None or not is_cullable(server):  # starting or stopping: left alone
            return None, None
        group = self.policy.group(lease.group)
        if not group.has_budget or group.budget_action != "stop":
            return None, None
        standing = budget.standings(group, lease.user, self._spans, self._extras, now)
        if any(s.remaining <= 0 for s in standing):
            began = lease.claimed_at
            return Decision(StopRule.BUDGET, server.user, server.name, group.name,
                            idle_seconds=None, age_seconds=(now - began).total_seconds(),
                            limit_seconds=0.0), None
        if self._runs_out is None or self._runs_out.now != now:
            self._runs_out = budget.Exhaustion(self._spans, self._extras, now)
        runs_out = self._runs_out.at(group, lease.user)
        share = max((s.share_used for s in standing), default=0.0)
        return None, budget_warning(now, runs_out, share, group.budget_warn_share,
                                    group.warn_before)

    def fault_stop(self, now: datetime, server: HubServer, lease: Lease | None
                   ) -> tuple[Decision | None, StopWarning | None]:
        """Whether ``lease``'s slice lies on a faulty GPU: a stop once its group's
        ``fault_grace`` has passed since the fault was seen, else the warning due at once
        (:func:`~mig_spawner.service.cull_rules.fault_stop`)."""
        if lease is None:
            return None, None
        group = self.policy.group(lease.group)
        grace = None if group.fault_action == "finish" else group.fault_grace or 0.0
        return fault_stop(now, server, lease, fault_of(lease, self._held_faults), grace)

    async def _check_faults(self, leases: list[Lease], report: SweepReport) -> None:
        """Find this host's GPU faults and hold them (under the claim lock, before this
        sweep decides anything), then read every fault held, which the servers on them
        are warned and stopped by. A GPU that cannot be read is counted and logged; the
        faults held stay."""
        if self.ledger is None:
            return
        if self.faults is not None and not self.dry_run:
            try:
                report.faults = await asyncio.to_thread(self.faults.check, leases)
            except (GpuError, LedgerError) as e:
                self._error("gpu" if isinstance(e, GpuError) else "ledger",
                            f"cannot check the GPUs' health: {e}", report)
            for fault in report.faults:
                self.metrics.gpu_faults.labels(str(fault.gpu_index), fault.kind.value).inc()
        self._held_faults = await asyncio.to_thread(self.ledger.holds.faults)
        self.metrics.withheld_slices.set(len({
            (f.host, f.gpu_uuid, s) for f in self._held_faults for s in f.held_slices}))

    # Profiles someone waits for, read with the leases at each sweep.
    _waited_for: frozenset[str] = frozenset()

    async def _gpu_activity(self, now: datetime, leases: list[Lease]) -> list[Lease]:
        """Sample each leased device (the one its kind names: a MIG device, or a whole
        GPU) and record its GPU work and peak memory on the lease (in the ledger unless
        dry-run); return the leases as updated, which is what this sweep's decisions
        read. A GPU that cannot be read changes nothing."""
        if self.gpus is None or not any(map(_device_of, leases)):
            return leases
        started = time.monotonic()
        try:
            sampled = await asyncio.to_thread(self.sample_slices)
        except Exception as e:
            self.metrics.errors.labels(kind="gpu").inc()
            self.log.error("cannot sample GPU activity: %s", e)
            return leases
        finally:
            self.metrics.gpu_sample_duration.observe(time.monotonic() - started)
        await self._record_usage(now, leases, sampled)
        updated = []
        for lease in leases:
            activity = sampled.get(_device_of(lease))
            facts = gpu_facts_to_record(now, lease, activity) if activity else {}
            if facts:
                if not self.dry_run and self._worth_writing(lease, facts):
                    await asyncio.to_thread(self.ledger.usage.record_gpu, lease.id, **facts)
                lease = replace(lease, **facts)
            if activity is not None and activity.working:
                self.metrics.gpu_working.labels(lease.group).inc()
            updated.append(lease)
        return updated

    async def _record_usage(self, now: datetime, leases: list[Lease],
                            sampled: dict[str, SliceActivity]) -> None:
        """Store a usage sample of each leased slice whose last one is ``usage_interval``
        old, all in one ledger transaction (for right-sizing: peak, p95, time active)."""
        due = {}
        for lease in leases:
            activity = sampled.get(_device_of(lease))
            last = self._sampled_at.get(lease.id)
            if activity is None or activity.processes_unknown or (
                    last is not None and (now - last).total_seconds() < self.usage_interval):
                continue
            due[lease.id] = UsageSample(
                at=now, memory_used_mib=activity.memory_used_mib,
                memory_total_mib=activity.memory_total_mib, sm_active=activity.sm_active,
                processes=activity.processes)
        if not due or self.dry_run:
            return
        try:
            await asyncio.to_thread(self.ledger.usage.record_samples, due)
        except LedgerError as e:
            self.metrics.errors.labels(kind="ledger").inc()
            self.log.error("cannot record usage samples: %s", e)
            return
        self._sampled_at.update(dict.fromkeys(due, now))

    async def _keep_history(self, now: datetime, leases: list[Lease]) -> None:
        """Keep the usage summary of each lease sampled that has ended since the last
        sweep, and start pruning old samples when due (docs/ledger.md, "Usage
        samples"). A ledger that fails is logged and counted; the next sweep tries
        again."""
        held = {lease.id for lease in leases}
        ended = [k for k in self._sampled_at if k not in held]
        if self.ledger is None or self.dry_run:
            return
        try:
            if ended:
                await asyncio.to_thread(self.ledger.usage.summarize_released, ended)
        except LedgerError as e:
            self.metrics.errors.labels(kind="ledger").inc()
            self.log.error("cannot keep the usage summaries of ended leases: %s", e)
            return
        self._sampled_at = {k: v for k, v in self._sampled_at.items() if k in held}
        if self.usage_retention is None or (self._pruning is not None
                                            and not self._pruning.done()):
            return
        if self._pruned_at is None or (now - self._pruned_at).total_seconds() >= PRUNE_EVERY:
            self._pruned_at = now
            self._pruning = asyncio.ensure_future(
                self.prune_samples(now - timedelta(seconds=self.usage_retention)))

    async def prune_samples(self, before: datetime) -> None:
        """Delete released leases' samples taken before ``before``, their summaries
        kept first (``Usage.prune``); logged, never raised."""
        assert self.ledger is not None
        started = time.monotonic()
        try:
            written, deleted = await asyncio.to_thread(self.ledger.usage.prune, before)
        except LedgerError as e:
            self.metrics.errors.labels(kind="ledger").inc()
            self.log.error("cannot prune old usage samples: %s", e)
            return
        if deleted:
            self.log.info("pruned %d usage samples from before %s (%d summaries kept) in "
                          "%.1fs", deleted, f"{before:%Y-%m-%d %H:%M}", written,
                          time.monotonic() - started)

    def _worth_writing(self, lease: Lease, facts: dict[str, object]) -> bool:
        """A new peak, or GPU work ``activity_resolution`` past the recorded time: one
        write per busy slice a minute, not one per sweep (decisions use the fresh time)."""
        if "peak_memory_mib" in facts:
            return True
        active = facts.get("gpu_active_at")
        return isinstance(active, datetime) and (
            lease.gpu_active_at is None
            or (active - lease.gpu_active_at).total_seconds() >= self.activity_resolution
        )

    def sample_slices(self) -> dict[str, SliceActivity]:
        """Device name -> processes, memory and SM activity of every MIG device now (by
        its UUID), and processes and memory of every GPU with MIG off (by the GPU's
        UUID: what a whole-GPU lease names)."""
        inventory = self.gpus.inventory()
        sm: dict[tuple[int, int], float] = {}
        if self.gpm is not None:
            for gpu in inventory.gpus:
                gi_ids = [d.gi_id for d in gpu.mig_devices]
                for gi_id, share in self.gpm.sm_activity(gpu.index, gi_ids).items():
                    sm[(gpu.index, gi_id)] = share
        sampled = {
            d.uuid: SliceActivity(
                processes=len(d.processes), memory_used_mib=d.memory_used_mib,
                sm_active=sm.get((d.gpu_index, d.gi_id)),
                processes_unknown=d.processes_unknown, memory_total_mib=d.memory_total_mib,
            )
            for d in inventory.mig_devices
        }
        # A whole GPU: no GPM sample here, so any process on it counts as work.
        sampled.update({
            g.uuid: SliceActivity(
                processes=len(g.processes), memory_used_mib=g.memory_used_mib,
                processes_unknown=g.processes_unknown, memory_total_mib=g.memory_total_mib,
            )
            for g in inventory.gpus if not g.mig_current
        })
        return sampled

    async def _handle_server(
        self, now: datetime, user: HubUser, server: HubServer, lease: Lease | None,
        report: SweepReport, listed: asyncio.Future[bool],
    ) -> None:
        """Probe, decide and act on one server.

        Stops wait for the whole list (``listed``): stopping a server while the
        hub's list is being paged shifts the later pages (``offset`` counts
        active servers), and users would be skipped. A list cut short means the
        hub is failing: stops are left to the next sweep.
        """
        limits = self.limits_for(user, lease)
        warns = not self.dry_run
        # The rules run once on what is known without looking; again only on what a
        # probe brought. Without probes, on the hub's data as the idle culler does.
        probe = None if self.probe_servers else HUB_DATA_ONLY
        stop = decide_server(now, server, limits.name, limits, probe, lease, warns)
        if probe is None and needs_probe(now, server, limits, lease, stop):
            probe = await self._probe(
                server, lease, idle_by_hub_data(now, server, limits, lease, stop)
            )
            stop = decide_server(now, server, limits.name, limits, probe, lease, warns)
        await self._record_activity(now, server, limits, lease, probe)
        spent, budget_warns = self.budget_stop(now, server, lease)
        faulted, fault_warns = self.fault_stop(now, server, lease)
        decisions = decide(now, server, limits.name, limits, probe, faulted or stop or spent,
                           lease, warns)
        if not any(d.stops_server for d in decisions):
            await self._warn(now, server, limits, probe, lease, report, budget_warns,
                             fault_warns)
        if self.log.isEnabledFor(logging.DEBUG):  # spare 5,000 f-strings a sweep otherwise
            seen = "not probed" if probe is None else [
                (k.execution_state, k.last_activity) for k in probe.kernels
            ]
            self.log.debug("%s: group %s, last activity %s, kernels %s, %d to cull",
                           server.label, limits.name, server.last_activity, seen,
                           len(decisions))
        kernels = []
        for decision in decisions:
            report.decisions.append(decision)
            kind = "server" if decision.stops_server else "kernel"
            self.metrics.decisions.labels(kind, decision.rule.value, decision.group).inc()
            if self.dry_run:
                self.log.info("would cull %s (dry run)", decision.describe())
                continue
            if not decision.stops_server:
                kernels.append(decision)
                continue
            if not await listed:
                self.log.warning("not culling %s now: the hub is failing", decision.describe())
                continue
            self.log.info("culling %s", decision.describe())
            if await self._carry_out(server, decision, lease):
                report.carried_out.append(decision)
                self.metrics.culls.labels(kind, decision.rule.value, decision.group).inc()
        if kernels and probe is not None:
            for decision in await self._shut_down_kernels(server, kernels, lease, probe,
                                                          limits):
                report.carried_out.append(decision)
                self.metrics.culls.labels("kernel", decision.rule.value, decision.group).inc()

    async def _warn(
        self, now: datetime, server: HubServer, limits: GroupPolicy, probe: Probe | None,
        lease: Lease | None, report: SweepReport, budget_warns: StopWarning | None = None,
        fault_warns: StopWarning | None = None,
    ) -> None:
        """Warn the user of each stop due within ``warn_before`` (or a budget stop due to
        be warned of: ``budget_warns``; a GPU fault's, at once: ``fault_warns``), each
        with its own warning and time (the ledger keeps them, the user's pages read the
        soonest), and withdraw the warning of a stop no longer due (activity, a Keep, a
        fault cleared, or a stop that did not come). A drain's warning is the layout
        change's, which ends it (:meth:`_apply_layouts`). A server that could not be read
        keeps its warnings: not knowing is not activity, and a withdrawn warning given
        again would put the stop off by ``warn_before`` and show the user a second one."""
        if lease is None or self.ledger is None:
            return  # no lease, nowhere to show it: the stop comes unannounced
        # A GPU fault is told at once, with its own warning: the GPU may fail any time.
        due = [*filter(None, [fault_warns]),
               *warnings_due(now, server, limits, probe, lease, budget_warns)]
        unread = probe is not None and not probe.reachable
        if not unread and not self.dry_run:
            for gone in {s.rule for s in lease.stops} - {w.rule for w in due} - {StopRule.DRAIN}:
                await asyncio.to_thread(self.ledger.warnings.withdraw, lease.id, gone)
        for warning in due:
            known = lease.pending_stop(warning.rule)
            if known is not None and known.deadline == warning.deadline:
                continue
            if known is not None:
                # The same stop, at another time (the limit that applies changed): the
                # pages show the new time; no new warning.
                if not self.dry_run:
                    await asyncio.to_thread(self.ledger.warnings.warn, lease.id,
                                            warning.rule, warning.deadline,
                                            warning.describe(now))
                continue
            report.warnings.append((server.label, warning))
            what = f"{server.label} (group {limits.name}): {warning.describe(now)}"
            if self.dry_run:
                self.log.info("would warn %s (dry run)", what)
                continue
            recorded = await asyncio.to_thread(
                self.ledger.warnings.warn, lease.id, warning.rule, warning.deadline,
                warning.describe(now),
            )
            if recorded is not None:
                self.log.info("warned %s", what)
                self.metrics.warnings.labels(warning.rule.value, limits.name).inc()

    async def _record_activity(
        self, now: datetime, server: HubServer, limits: GroupPolicy, lease: Lease | None,
        probe: Probe | None,
    ) -> None:
        """Write the server's latest activity on its lease, which is where the slice
        map's idle time, the usage report's idle share and the next sweep's look come
        from."""
        if lease is None or self.ledger is None or self.dry_run:
            return
        active = activity_to_record(
            now, server, limits, probe, lease.last_activity_at, self.activity_resolution
        )
        if active is not None:
            # ``touch`` only moves forward and skips released leases: safe against a
            # stop racing this sweep.
            await asyncio.to_thread(self.ledger.usage.touch, lease.id, active)

    async def _probe(self, server: HubServer, lease: Lease | None, needs_status: bool) -> Probe:
        """Read the server's kernels, what its people did, and its status when server
        idleness is at stake, directly at the internal URL its lease recorded, so that
        looking never counts as the user's activity: one request to a server with
        mig-spawner's single-user extension; its kernels (and status) to one without,
        which is asked for the extension again only once it has restarted."""
        internal = self._internal_url(server, lease)
        try:
            if self._no_extension.get(server.key, _UNSEEN) != server.started:
                look = await self.client.look(server, internal=internal)
                if look is not None:
                    # The status is what decides only where idleness is at stake.
                    return Probe(kernels=look.kernels,
                                 status=look.status if needs_status else None,
                                 people=look.people)
                self._no_extension[server.key] = server.started
            kernels, status = await asyncio.gather(
                self.client.kernels(server, internal=internal),
                self.client.server_status(server, internal=internal) if needs_status
                else _nothing(),
            )
        except HubError as e:
            self.metrics.errors.labels(kind="server_unreachable").inc()
            self.log.warning("cannot read %s (%s); not culling it for idleness", server.label, e)
            return UNREACHABLE
        return Probe(kernels=tuple(kernels), status=status)

    async def _shut_down_kernels(
        self, server: HubServer, decisions: list[Decision], lease: Lease | None,
        probe: Probe, limits: GroupPolicy,
    ) -> list[Decision]:
        """Carry out the kernel decisions of one server; return those carried out (a
        kernel already gone counts). A server with the single-user extension (the probe
        saw what its people did) takes them in one request and keeps any kernel in use
        since the look; one without gets a DELETE per kernel."""
        internal = lease.server_url if lease else None
        for decision in decisions:
            self.log.info("culling %s", decision.describe())
        if probe.people is None:
            done = await asyncio.gather(*(self._shut_down_kernel(server, d, internal)
                                          for d in decisions))
            return [d for d, ok in zip(decisions, done, strict=True) if ok]
        seen = {k.id: k for k in probe.kernels}
        try:
            answer = await self.client.shutdown_kernels(
                server, [seen[d.kernel_id] for d in decisions],
                cull_busy=limits.cull_busy_kernels,
                cull_connected=limits.cull_connected_kernels, internal=internal)
        except HubError as e:
            self.metrics.errors.labels(kind="cull_failed").inc(len(decisions))
            self.log.error("could not cull the kernels of %s: %s", server.label, e)
            return []
        if answer.kept:
            self.log.info("%s: kept kernels in use since the look: %s", server.label,
                          ", ".join(answer.kept))
        if answer.failed:
            self.metrics.errors.labels(kind="cull_failed").inc(len(answer.failed))
            self.log.error("%s: shutting kernels down failed (its log says why): %s",
                           server.label, ", ".join(answer.failed))
        gone = {*answer.shut_down, *answer.unknown}
        return [d for d in decisions if d.kernel_id in gone]

    async def _shut_down_kernel(self, server: HubServer, decision: Decision,
                                internal: str | None) -> bool:
        """One kernel, by the kernels API (a server without the single-user extension)."""
        try:
            await self.client.shutdown_kernel(server, decision.kernel_id, internal=internal)
        except HubError as e:
            self.metrics.errors.labels(kind="cull_failed").inc()
            self.log.error("could not cull %s: %s", decision.describe(), e)
            return False
        return True

    def _internal_url(self, server: HubServer, lease: Lease | None) -> str | None:
        url = lease.server_url if lease is not None else None
        if url is None and server.key not in self._warned_proxied:
            # A lease from before the internal URL was recorded, or a server without
            # a slice: through the proxy, where our reads look like the user's.
            self._warned_proxied.add(server.key)
            self.log.warning(
                "%s: its lease records no internal URL; reading it through the proxy, "
                "where each read counts as the user's activity",
                server.label,
            )
        return url

    async def _carry_out(
        self, server: HubServer, decision: Decision, lease: Lease | None
    ) -> bool:
        try:
            stopped = await self.stop_server(server.user, server.name, lease, decision.rule,
                                             "stopped by the slice service")
        except HubError as e:
            self.metrics.errors.labels(kind="cull_failed").inc()
            self.log.error("could not cull %s: %s", decision.describe(), e)
            return False
        if not stopped:
            self.log.warning("%s is slow to stop; its slice returns when it has", server.label)
        if lease is not None:
            # The spawner's stop releases the lease; a stop that never completes
            # is caught later by the orphan check.
            self.metrics.slices_reclaimed.labels(decision.rule.value, decision.group).inc()
        return True

    async def stop_server(self, user: str, server_name: str, lease: Lease | None,
                          rule: StopRule, detail: str) -> bool:
        """The one way the service stops a server: the release code of ``rule``
        (:data:`~mig_spawner.core.lifecycle.STOP_CODES`) recorded first, then the hub asked
        to stop it; the spawner's stop releases the lease through its Releaser, which keeps
        the first code given. Then a warning pending for it is carried out. True once
        stopped, False while the stop is pending; raises :class:`HubError`."""
        code = STOP_CODES.get(rule)
        if lease is not None and self.ledger is not None and code is not None:
            await asyncio.to_thread(self.ledger.leases.end_for, lease.id, code, detail)
        stopped = await self.client.stop_server(user, server_name)
        if lease is not None and self.ledger is not None:
            await asyncio.to_thread(self.ledger.warnings.carry_out, lease.id, rule)
        return stopped

    # -- layout changes (docs/layout.md) ---------------------------------------------

    async def _apply_layouts(self, report: SweepReport) -> None:
        """One pass of the layout changes under way; then the servers whose drain
        notice ended are stopped the one way the service stops a server
        (:meth:`stop_server`: code ``drain`` first, then the hub)."""
        if self.dry_run or (self.layout is None and self.kube_layout is None):
            return
        try:
            done = LayoutPass()
            if self.layout is not None:
                done = await asyncio.to_thread(self.layout.step)
            if self.kube_layout is not None:
                on_nodes = await self.kube_layout.step()
                done.gpus += on_nodes.gpus
                done.due += on_nodes.due
        except Exception as e:
            self._error("layout", f"cannot apply the layout changes: {e}", report)
            return
        report.layout = done
        for state in HOLDING_STATES:
            self.metrics.layout_gpus.labels(state).set(
                sum(1 for g in done.gpus if g.state is state))
        for lease in done.due:
            try:
                stopped = await self.stop_server(
                    lease.user, lease.server_name, lease, StopRule.DRAIN,
                    f"GPU {lease.gpu_index} is re-cut; the drain notice ended")
            except HubError as e:
                # A server the hub no longer runs is an orphan: the orphan repair gives
                # its slice back, and keeps the code recorded here.
                self.metrics.errors.labels(kind="cull_failed").inc()
                self.log.warning("drain of %s: the hub could not stop it (%s); trying "
                                 "again at the next sweep", lease.server, e)
                continue
            if not stopped:
                self.log.warning("drain of %s: slow to stop; its slice returns when it has",
                                 lease.server)
            report.drained.append(lease)
            self.metrics.slices_reclaimed.labels(StopRule.DRAIN, lease.group).inc()
        if report.drained and self.layout is not None:
            # Their room is free now: the steps that waited for them need not wait a sweep.
            report.layout = await asyncio.to_thread(self.layout.step)

    # -- repairs ------------------------------------------------------------------

    async def _repair_orphans(
        self, now: datetime, leases: list[Lease], running: set[tuple[str, str]],
        report: SweepReport,
    ) -> None:
        if self.ledger is None:
            return
        orphans, self.missing_since = find_orphans(
            now, leases, running, self.missing_since, self.orphan_grace
        )
        for lease in orphans:
            if self.dry_run:
                self.log.warning("would release orphan lease %s of %s (dry run)", lease.id,
                                 lease.server)
                continue
            # A lease left releasing keeps the code it was given first (the ledger's rule).
            outcome = await self.releaser.release(
                lease, ReleaseCode.ORPHAN, f"the hub has not run its server for "
                f"{self.orphan_grace:.0f}s or more; released by the slice service")
            if outcome.error is not None:
                kind = "gpu" if isinstance(outcome.error, GpuError) else "ledger"
                self._error(kind, f"orphan lease {lease.id} of {lease.server}: "
                            f"{outcome.error}; retrying at the next sweep", report)
                continue
            if outcome.result is GiveBack.HELD:
                self.log.warning("orphan lease %s of %s: %s", lease.id, lease.server,
                                 outcome.why)
                continue
            self.missing_since.pop(lease.id, None)
            if outcome.result is GiveBack.ALREADY_RELEASED:
                continue
            self.log.warning(
                "released orphan lease %s of %s (%s %s, group %s)",
                lease.id, lease.server, lease.profile, lease.mig_uuid or "", lease.group,
            )
            report.orphans_released.append(lease)
            self.metrics.orphans_repaired.labels(lease.group).inc()
            self.metrics.slices_reclaimed.labels(ReleaseCode.ORPHAN, lease.group).inc()

    async def _kube(self) -> Any:
        """The Kubernetes API (a CoreV1Api), connected on the first Kubernetes lease: a
        local hub never needs it. Raises ``ClusterReadError``."""
        if self._kube_api is None:
            assert self.connect_kube is not None
            self._kube_api = await self.connect_kube()
        return self._kube_api

    async def _report_unleased(self, leases: list[Lease], report: SweepReport) -> None:
        if self.gpus is None:
            return
        try:
            inventory = await asyncio.to_thread(self.gpus.inventory)
        except Exception as e:
            self._error("gpu", f"cannot read the GPU inventory: {e}", report)
            return
        devices = unleased_busy_devices(
            inventory, (_device_of(lease) for lease in leases if lease.held))
        self.metrics.unleased_devices.set(len(devices))
        for device in devices:
            self.log.warning(
                "%s (%s, GPU %d) runs processes %s but no lease holds it; not killing "
                "them", device.uuid, device.what, device.gpu_index, list(device.pids),
            )
        report.unleased_devices = [d.uuid for d in devices]
