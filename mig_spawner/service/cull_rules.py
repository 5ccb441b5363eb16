"""What one sweep of the slice service decides, as pure functions.

Given the time, one server as the hub lists it, the limits of the group its
slice is charged to, and what the server itself reported (its kernels and
status), say which kernels to shut down and whether to stop the server, and
why. Given the ledger's held leases and the servers the hub runs, say which
leases are orphans. No I/O here: :mod:`mig_spawner.service.app` gathers the
inputs and carries the decisions out, so every rule can be tested with tables.

Rules (see docs/culling.md):

* ``max_session_age``: a server is stopped at its lease's ``expires_at``, busy or
  not. The spawner sets it at claim from the group's limit; the ledger keeps it
  across hub restarts, and it is the one deadline the culler, the slice map and the
  metrics read. A server without a lease is stopped at its start plus the limit.
* ``server_idle_timeout``: a server with no activity for this long is stopped, after
  a warning (below). Activity is what people do, not what an open tab does: on a
  server a JupyterLab page has reported from (mig-spawner's single-user extension), the
  latest of its start, the page's interaction (typing, clicks, scrolling; running and
  saving come with them), terminal input or output and its kernels' activity. A server
  no page reported from (VS Code, API clients), and every server of a group with
  ``open_tab_counts``, is judged as jupyterhub-idle-culler does: the hub's
  ``last_activity``, the server's ``/api/status`` (any API request) and its kernels.
  A busy kernel makes the server active unless the group sets ``cull_busy_kernels``.
  Pressure: the limit is ``server_idle_timeout_when_waited`` while someone waits for
  the server's size, ``server_idle_timeout_when_unwaited`` while nobody does (either
  falls back to ``server_idle_timeout``); the sweeper puts the one that applies in
  ``server_idle_timeout`` (:func:`mig_spawner.core.idle.idle_limit`).
* Warnings (``warn_before``): a server that can be warned (it has a lease) is never
  stopped for idleness before a warning with the time of the stop: its deadline is
  its idle deadline, or the warned one, or ``warn_before`` from now, whichever is
  latest (:func:`idle_deadline`). A warning is due only when a deadline that the rules
  would apply is within ``warn_before``; activity or a Keep moves the deadline out of
  reach and the warning is withdrawn, as is one whose stop did not come. Each stop has
  its own warning (the lease's ``stops``): a kernel's, a budget's or a drain's never
  moves the idle stop's time, and every limit keeps applying whatever else is pending;
  the soonest stop comes first (:func:`warnings_due`).
* ``kernel_idle_timeout``: a kernel with no activity for this long (nor a Keep since)
  is shut down (its server and slice stay). A busy kernel only with
  ``cull_busy_kernels``. A kernel with a connected client (an open notebook tab) too,
  unless the group sets ``cull_connected_kernels`` False: it holds the slice's memory
  however idle; its user is warned first, as of a stop (:func:`kernel_stop_at`), the
  lead being ``warn_before`` or half the kernel limit, whichever is shorter.
* GPU work (``gpu_activity_counts``, on by default): a server whose slice ran
  compute processes with SM activity above ``GPU_WORK_SM_SHARE`` (any compute
  process where the GPU has no GPM, or when its processes cannot be read) is
  active then: the lease's ``gpu_active_at``. Memory held with no process and no
  SM activity is not work.
* A server the service could not reach is never stopped for idleness: it might
  be running a busy kernel we cannot see. Only ``max_session_age`` applies to it.
* Servers still starting or stopping (``pending``) are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from mig_spawner.core.idle import idle_deadline
from mig_spawner.core.lifecycle import LeaseState, StopRule
from mig_spawner.hub.models import HubServer, Kernel, PeopleActivity, ServerStatus

if TYPE_CHECKING:
    from mig_spawner.core.inventory import Inventory
    from mig_spawner.ledger.holds import GpuFault
    from mig_spawner.ledger.records import Lease


class CullLimits(Protocol):
    """The limits the sweep applies; :class:`mig_spawner.core.policy.GroupPolicy` has them.

    Durations are seconds; ``None`` means no limit.
    """

    @property
    def server_idle_timeout(self) -> float | None: ...
    @property
    def kernel_idle_timeout(self) -> float | None: ...
    @property
    def max_session_age(self) -> float | None: ...
    @property
    def cull_busy_kernels(self) -> bool: ...
    @property
    def cull_connected_kernels(self) -> bool: ...
    @property
    def gpu_activity_counts(self) -> bool: ...
    @property
    def warn_before(self) -> float | None: ...
    @property
    def open_tab_counts(self) -> bool: ...
    @property
    def server_idle_timeout_when_waited(self) -> float | None: ...
    @property
    def server_idle_timeout_when_unwaited(self) -> float | None: ...


@dataclass(frozen=True)
class Probe:
    """What the service learned from the server itself this sweep.

    ``reachable=False`` means the server (or the proxy in front of it) did not
    answer; ``kernels`` and ``status`` are then empty. ``people``: what mig-spawner's
    single-user extension saw people do (``None``: the server has no such extension).
    """

    reachable: bool = True
    kernels: tuple[Kernel, ...] = ()
    status: ServerStatus | None = None
    people: PeopleActivity | None = None


UNREACHABLE = Probe(reachable=False)
#: The service does not look inside servers (``probe_servers`` off): it judges by the
#: hub's data alone, as jupyterhub-idle-culler does.
HUB_DATA_ONLY = Probe()

#: Share of a slice's SMs busy (NVML GPM's SM utilisation) above which its
#: processes count as GPU work; below it, a process only holds a context and memory.
GPU_WORK_SM_SHARE = 0.05


@dataclass(frozen=True)
class SliceActivity:
    """What one sweep sampled on a leased device (a MIG device or a whole GPU)."""

    processes: int
    memory_used_mib: int
    #: Share of SMs busy since the last sample; ``None`` where GPM is missing.
    sm_active: float | None = None
    #: The driver would not list the processes: the slice may be in use.
    processes_unknown: bool = False
    #: The slice's memory (0: unknown).
    memory_total_mib: int = 0

    @property
    def working(self) -> bool:
        """Whether the slice did GPU work: processes with SM activity (any process
        where SM activity is unknown), or processes that cannot be read."""
        if self.processes_unknown:
            return True
        if not self.processes:
            return False
        return self.sm_active is None or self.sm_active > GPU_WORK_SM_SHARE


def gpu_facts_to_record(
    now: datetime, lease: Lease, activity: SliceActivity
) -> dict[str, object]:
    """The ``gpu_active_at`` / ``peak_memory_mib`` to write on the lease (only changes)."""
    facts: dict[str, object] = {}
    if activity.working:
        facts["gpu_active_at"] = now
    if activity.memory_used_mib > (lease.peak_memory_mib or 0):
        facts["peak_memory_mib"] = activity.memory_used_mib
    return facts


@dataclass(frozen=True)
class Decision:
    """One thing to cull: a kernel (``kernel_id`` set) or a whole server."""

    rule: StopRule
    user: str
    server: str
    group: str
    idle_seconds: float | None
    age_seconds: float | None
    limit_seconds: float
    kernel_id: str | None = None

    @property
    def stops_server(self) -> bool:
        """True when the decision stops the server (and so frees its slice)."""
        return self.kernel_id is None

    def describe(self) -> str:
        """One log line: what, whose, which rule, measured against which limit."""
        where = f"{self.user}/{self.server}" if self.server else self.user
        what = f"kernel {self.kernel_id} of {where}" if self.kernel_id else f"server {where}"
        if self.rule is StopRule.BUDGET:
            return f"{what} (group {self.group}): budget spent, age {_fmt(self.age_seconds)}"
        if self.rule is StopRule.GPU_FAULT:
            return (f"{what} (group {self.group}): its GPU reported a fault "
                    f"{_fmt(self.age_seconds)} ago >= grace {_fmt(self.limit_seconds)}")
        measured = self.age_seconds if self.rule is StopRule.MAX_SESSION_AGE else self.idle_seconds
        kind = "age" if self.rule is StopRule.MAX_SESSION_AGE else "idle"
        return (
            f"{what} (group {self.group}): {self.rule.value}, {kind} "
            f"{_fmt(measured)} >= limit {_fmt(self.limit_seconds)}"
        )


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    whole = int(seconds)
    return f"{whole // 3600:02}:{whole % 3600 // 60:02}:{whole % 60:02}"


def _since(now: datetime, when: datetime | None) -> float | None:
    return None if when is None else max(0.0, (now - when).total_seconds())


def _latest(times: Iterable[datetime | None]) -> datetime | None:
    return max((t for t in times if t is not None), default=None)


def is_cullable(server: HubServer) -> bool:
    """Only ready servers with nothing pending are considered."""
    return server.ready and not server.pending


def session_deadline(
    server: HubServer, limits: CullLimits, lease: Lease | None
) -> datetime | None:
    """When ``server`` must stop for its session age: its lease's ``expires_at``; for a
    server without a lease, its start plus ``max_session_age``. ``None``: never."""
    if lease is not None:
        return lease.expires_at
    if limits.max_session_age is None or server.started is None:
        return None
    return server.started + timedelta(seconds=limits.max_session_age)


def needs_probe(
    now: datetime, server: HubServer, limits: CullLimits, lease: Lease | None,
    by_hub_data: Decision | None,
) -> bool:
    """Whether the sweep must look inside the server before deciding.

    ``by_hub_data`` is :func:`decide_server`'s verdict without a probe, computed once
    per server per sweep. It looks when kernel limits apply, or when what is known
    without looking would stop the server for idleness or warn of it
    (:func:`idle_by_hub_data`): later activity may prove otherwise. Not when max age
    stops it anyway: that needs no look inside.
    """
    if by_hub_data is None and is_cullable(server) and limits.kernel_idle_timeout is not None:
        return True
    return idle_by_hub_data(now, server, limits, lease, by_hub_data)


def idle_by_hub_data(
    now: datetime, server: HubServer, limits: CullLimits, lease: Lease | None,
    by_hub_data: Decision | None,
) -> bool:
    """Whether what is known without looking inside (``by_hub_data``,
    :func:`decide_server`'s verdict without a probe) would stop the server for
    idleness, or warn of it; only then is what its people did worth reading."""
    if by_hub_data is not None:
        return by_hub_data.rule is StopRule.SERVER_IDLE
    return any(w.rule is StopRule.SERVER_IDLE
               for w in warnings_due(now, server, limits, None, lease))


def judged_by_people(probe: Probe | None, open_tab_counts: bool) -> bool:
    """Whether the server's idleness is judged by what people did in its JupyterLab
    pages rather than by every request: a page reported from it, and the group does
    not let open tabs count."""
    people = probe.people if probe is not None else None
    return not open_tab_counts and people is not None and people.page_seen is not None


def last_activity(
    server: HubServer, probe: Probe | None, open_tab_counts: bool = False,
    lease: Lease | None = None,
) -> datetime | None:
    """The server's latest known activity; ``None`` if nothing is known.

    Judged by people (:func:`judged_by_people`): the latest of its start, their
    interaction, terminal activity and its kernels'. Otherwise the hub's
    ``last_activity`` (else its start), its own ``/api/status`` and its kernels'. Not
    looked inside (``probe`` ``None``) while it holds a ``lease``: what the service last
    recorded on it (``last_activity_at``, only what a look found), since the hub's
    time moves with every request an open tab makes.
    """
    kernels = [k.last_activity for k in (probe.kernels if probe else ())]
    # The hub's ``started`` is when the spawn began: for a spawn that waited in line,
    # minutes before its server ran. The server itself started at its lease's start.
    began = lease.started_at if lease is not None else None
    if judged_by_people(probe, open_tab_counts):
        people = probe.people
        return _latest([server.started, began, people.interaction, people.terminal, *kernels])
    if probe is None and lease is not None and not open_tab_counts:
        return _latest([server.started, began, lease.last_activity_at])
    status = probe.status if probe else None
    return _latest(
        [server.last_activity or server.started, began,
         status.last_activity if status else None, *kernels]
    )


def has_busy_kernel(probe: Probe | None) -> bool:
    """Whether the probe saw a kernel computing right now."""
    return probe is not None and any(k.execution_state == "busy" for k in probe.kernels)


def server_active_at(
    now: datetime, server: HubServer, limits: CullLimits, probe: Probe | None,
    lease: Lease | None,
) -> datetime | None:
    """When the server was last active: :func:`last_activity`, its lease's activity
    (:func:`lease_activity`: a Keep, GPU work), and now while a kernel is busy (unless
    busy kernels may be culled); ``None`` when nothing is known."""
    if not limits.cull_busy_kernels and has_busy_kernel(probe):
        return now
    return _latest([last_activity(server, probe, limits.open_tab_counts, lease),
                    lease_activity(lease, limits)])


def activity_to_record(
    now: datetime, server: HubServer, limits: CullLimits, probe: Probe | None,
    recorded: datetime | None, resolution: float,
) -> datetime | None:
    """The activity time to write on the server's lease, or ``None`` to write nothing.

    Only what a look inside found (``probe``; :data:`HUB_DATA_ONLY` where the service
    never looks): a busy kernel is activity now. Nothing is written unless activity
    moved on by ``resolution`` seconds or more since ``recorded`` (the lease's
    ``last_activity_at``): one write per server per sweep at most, and only when it
    changes what the slice map, the usage report and the next sweep read.
    """
    if probe is None or not probe.reachable:
        return None
    active = now if has_busy_kernel(probe) else last_activity(
        server, probe, limits.open_tab_counts)
    if active is None or (
        recorded is not None and (active - recorded).total_seconds() < resolution
    ):
        return None
    return active


def decide_server(
    now: datetime, server: HubServer, group: str, limits: CullLimits, probe: Probe | None,
    lease: Lease | None = None, warns: bool = True,
) -> Decision | None:
    """Whether to stop ``server``, and why. ``probe`` is ``None`` when the service
    judges on what it knows without looking inside the server; ``lease`` is the lease
    it holds, whose ``expires_at`` is its session deadline. ``warns=False`` (a dry run,
    which records no warning): an idle stop is not held back for one."""
    if not is_cullable(server):
        return None
    age = _since(now, server.started)
    deadline = session_deadline(server, limits, lease)
    if deadline is not None and now >= deadline:
        began = lease.claimed_at if lease is not None else server.started
        return Decision(
            StopRule.MAX_SESSION_AGE, server.user, server.name, group,
            idle_seconds=_since(now, server.last_activity), age_seconds=_since(now, began),
            limit_seconds=(deadline - began).total_seconds() if began else 0.0,
        )
    deadline = _idle_deadline(now, server, limits, probe, lease, warns)
    if deadline is not None and now >= deadline:
        active = server_active_at(now, server, limits, probe, lease)
        return Decision(
            StopRule.SERVER_IDLE, server.user, server.name, group,
            idle_seconds=_since(now, active), age_seconds=age,
            limit_seconds=limits.server_idle_timeout or 0.0,
        )
    return None


def _idle_deadline(
    now: datetime, server: HubServer, limits: CullLimits, probe: Probe | None,
    lease: Lease | None, warns: bool = True,
) -> datetime | None:
    """:func:`idle_deadline` of the server, or ``None``: no idle limit, nothing
    known, or the server could not be reached (it may be running a busy kernel)."""
    limit = limits.server_idle_timeout
    if limit is None or (probe is not None and not probe.reachable):
        return None
    active = server_active_at(now, server, limits, probe, lease)
    if active is None:
        return None
    if not warns or lease is None:  # no warning to wait for: none is recorded
        return idle_deadline(now, active, limit, None, None)
    return idle_deadline(now, active, limit, limits.warn_before,
                         _warned_for(lease, StopRule.SERVER_IDLE))


def _warned_for(lease: Lease, rule: StopRule) -> datetime | None:
    """The deadline the user was told for ``rule``'s stop, while that warning is pending:
    each stop's own, whatever other warnings the lease has."""
    stop = lease.pending_stop(rule)
    return None if stop is None else stop.deadline


def lease_activity(lease: Lease | None, limits: CullLimits) -> datetime | None:
    """Activity the lease knows of: the user's last "Keep my server", and the slice's
    last GPU work where the group counts it."""
    if lease is None:
        return None
    gpu = lease.gpu_active_at if limits.gpu_activity_counts else None
    return _latest([gpu, lease.kept_at])


@dataclass(frozen=True)
class StopWarning:
    """A stop the user must be told of: which rule, and when it is due (``None``: not
    stopped, only told: a GPU fault where the group leaves servers to finish). ``why``:
    what happened, for the ledger's event and the log (a GPU fault's words)."""

    rule: StopRule
    deadline: datetime | None
    why: str = ""

    def describe(self, now: datetime) -> str:
        """For logs and the ledger: the rule, the time left and why."""
        when = "not stopped" if self.deadline is None else \
            f"in {_fmt(_until(now, self.deadline))}"
        return f"{self.rule.value} {when}{': ' + self.why if self.why else ''}"


def _until(now: datetime, when: datetime) -> float:
    return max(0.0, (when - now).total_seconds())


def warnings_due(
    now: datetime, server: HubServer, limits: CullLimits, probe: Probe | None,
    lease: Lease | None, budget: StopWarning | None = None,
) -> list[StopWarning]:
    """The stops to warn the user of now, soonest first: each one the rules will apply,
    due within the group's ``warn_before``, with its own warning and time (an idle limit
    and a kernel limit keep applying whatever else is pending: a session's end, a
    budget, a layout change's drain). A pending warning of a rule not listed is
    withdrawn, unless the server could not be read (the sweeper keeps it then). Call it
    when ``decide_server`` stops nothing; a server that cannot be reached is warned only
    of its session age. ``budget``: a budget stop due to be warned of
    (:func:`budget_warning`)."""
    if not is_cullable(server):
        return []
    due: list[StopWarning] = [budget] if budget is not None else []
    warn = limits.warn_before
    if warn is None:
        return due
    deadline = session_deadline(server, limits, lease)
    if deadline is not None and _until(now, deadline) <= warn:
        due.append(StopWarning(StopRule.MAX_SESSION_AGE, deadline))
    idle = _idle_deadline(now, server, limits, probe, lease)
    if idle is not None and _until(now, idle) <= warn:
        due.append(StopWarning(StopRule.SERVER_IDLE, idle))
    kernel = _kernel_warning(now, limits, probe, lease)
    if kernel is not None:
        due.append(kernel)
    return sorted(due, key=lambda w: (w.deadline or now, w.rule))  # None: told now


def budget_warning(
    now: datetime, runs_out: datetime | None, share_used: float,
    warn_share: float | None, warn_before: float | None,
) -> StopWarning | None:
    """The warning of a budget stop at ``runs_out`` (when the budget the lease spends is
    spent if its servers run on; ``None``: never), due once ``share_used`` reaches
    ``warn_share`` or the stop is within ``warn_before``; else ``None``."""
    if runs_out is None:
        return None
    near = warn_before is not None and _until(now, runs_out) <= warn_before
    if near or (warn_share is not None and share_used >= warn_share):
        return StopWarning(StopRule.BUDGET, runs_out)
    return None


def fault_of(lease: Lease, faults: Iterable[GpuFault]) -> GpuFault | None:
    """The earliest fault held on ``lease``'s slice (its GPU, or its MIG device's memory
    slices), or None."""
    return next((f for f in faults if lease.host == f.host and lease.gpu_uuid == f.gpu_uuid
                 and f.holds(lease.memory_slices)), None)


def fault_stop(now: datetime, server: HubServer, lease: Lease | None,
               fault: GpuFault | None, grace: float | None
               ) -> tuple[Decision | None, StopWarning | None]:
    """Whether a server whose slice is on a faulty GPU (``fault``) is stopped now, or
    else the warning its user gets at once: the stop ``grace`` seconds after the fault
    was seen (the group's ``fault_grace``; ``None``: never, the user is told and the
    server left to finish). Starting and stopping servers are left alone."""
    if lease is None or fault is None or not is_cullable(server):
        return None, None
    why = f"{fault.where}: {fault.detail}"
    if grace is None:
        return None, StopWarning(StopRule.GPU_FAULT, None, why)
    deadline = fault.seen_at + timedelta(seconds=grace)
    if now >= deadline:
        return Decision(StopRule.GPU_FAULT, server.user, server.name, lease.group,
                        idle_seconds=None, age_seconds=_since(now, fault.seen_at),
                        limit_seconds=grace), None
    return None, StopWarning(StopRule.GPU_FAULT, deadline, why)


def kernel_is_cullable(kernel: Kernel, cull_busy: bool, cull_connected: bool) -> bool:
    """Busy kernels only with ``cull_busy``, connected ones only with ``cull_connected``;
    any other state may go: the same test Jupyter Server's own kernel culler makes.

    That includes ``starting``: Jupyter Server reports a kernel nobody has talked to
    as starting for as long as it lives, and its activity is its start time.
    """
    busy_ok = cull_busy or kernel.execution_state != "busy"
    return busy_ok and (cull_connected or kernel.connections == 0)


def kernel_lead(limits: CullLimits) -> float | None:
    """How long before shutting down a connected kernel its user is warned:
    ``warn_before``, but at most half the kernel limit (a 2-minute limit with a 3-minute
    warning would warn at every pause); ``None``: no warning."""
    limit, warn = limits.kernel_idle_timeout, limits.warn_before
    return None if warn is None or limit is None else min(warn, limit / 2)


def kernel_stop_at(now: datetime, kernel: Kernel, limits: CullLimits, lease: Lease | None,
                   warns: bool = True) -> datetime | None:
    """When ``kernel`` is shut down for ``kernel_idle_timeout``, or ``None``: never (no
    limit, busy, or connected where the group keeps connected kernels). Its activity is
    its own or the user's last Keep; a connected kernel, whose user has it open, is shut
    down no sooner than its warning says (:func:`kernel_lead`), as an idle server is
    (:func:`idle_deadline`); ``warns=False`` (a dry run): not held back for one."""
    limit = limits.kernel_idle_timeout
    if limit is None or not kernel_is_cullable(kernel, limits.cull_busy_kernels,
                                               limits.cull_connected_kernels):
        return None
    active = _latest([kernel.last_activity, lease.kept_at if lease else None])
    if active is None:
        return None
    if not kernel.connections or not warns or lease is None:
        return active + timedelta(seconds=limit)
    return idle_deadline(now, active, limit, kernel_lead(limits),
                         _warned_for(lease, StopRule.KERNEL_IDLE))


def _kernel_warning(now: datetime, limits: CullLimits, probe: Probe | None,
                    lease: Lease | None) -> StopWarning | None:
    """The warning of the first connected kernel to be shut down, when it is due within
    its lead: the user has it open and loses what it holds in memory."""
    lead = kernel_lead(limits)
    if lead is None or lease is None or probe is None or not probe.reachable:
        return None
    stops = [at for k in probe.kernels if k.connections
             and (at := kernel_stop_at(now, k, limits, lease)) is not None]
    first = min(stops, default=None)
    if first is None or _until(now, first) > lead:
        return None
    return StopWarning(StopRule.KERNEL_IDLE, first)


@dataclass(frozen=True)
class KernelRecheck:
    """How a server sorts the kernels the service decided to shut down (by id)."""

    #: Still as the service saw them: shut them down.
    shut_down: tuple[str, ...]
    #: In use since the look: left running.
    kept: tuple[str, ...]
    #: None of the server's kernels: gone since the look, or never this server's.
    unknown: tuple[str, ...]


def recheck_kernels(
    running: Mapping[str, Kernel], asked: Iterable[tuple[str, datetime | None]],
    cull_busy: bool, cull_connected: bool,
) -> KernelRecheck:
    """What a server (mig-spawner's single-user extension) does with the kernels the
    service decided to shut down, ``asked`` as ``(id, the last_activity it judged)``,
    given its ``running`` kernels now: a kernel with activity since, or that the rules
    now spare (:func:`kernel_is_cullable`: busy, a client connected), is kept, so that
    the time between the look and the shutdown changes no decision."""
    shut_down: list[str] = []
    kept: list[str] = []
    unknown: list[str] = []
    for kernel_id, judged in asked:
        kernel = running.get(kernel_id)
        if kernel is None:
            unknown.append(kernel_id)
            continue
        active_since = kernel.last_activity is not None and (
            judged is None or kernel.last_activity > judged)
        if active_since or not kernel_is_cullable(kernel, cull_busy, cull_connected):
            kept.append(kernel_id)
        else:
            shut_down.append(kernel_id)
    return KernelRecheck(tuple(shut_down), tuple(kept), tuple(unknown))


def decide_kernels(
    now: datetime,
    server: HubServer,
    group: str,
    limits: CullLimits,
    kernels: Sequence[Kernel],
    lease: Lease | None = None,
    warns: bool = True,
) -> list[Decision]:
    """The kernels of ``server`` to shut down for ``kernel_idle_timeout``
    (:func:`kernel_stop_at`)."""
    limit = limits.kernel_idle_timeout
    if limit is None or not is_cullable(server):
        return []
    decisions = []
    for kernel in kernels:
        stop_at = kernel_stop_at(now, kernel, limits, lease, warns)
        if stop_at is not None and now >= stop_at:
            decisions.append(
                Decision(
                    StopRule.KERNEL_IDLE, server.user, server.name, group,
                    idle_seconds=_since(now, kernel.last_activity),
                    age_seconds=_since(now, server.started),
                    limit_seconds=limit, kernel_id=kernel.id,
                )
            )
    return decisions


def decide(
    now: datetime,
    server: HubServer,
    group: str,
    limits: CullLimits,
    probe: Probe | None,
    stop: Decision | None,
    lease: Lease | None = None,
    warns: bool = True,
) -> list[Decision]:
    """Everything to cull on one server: the server itself (``stop``, the verdict of
    :func:`decide_server` on the same ``probe``, passed in so that it runs once), or
    else its idle kernels (``lease``: the Keep and the warning they count)."""
    if stop is not None:
        return [stop]
    if probe is None or not probe.reachable:
        return []
    return decide_kernels(now, server, group, limits, probe.kernels, lease, warns)


def find_orphans(
    now: datetime,
    leases: Iterable[Lease],
    running: set[tuple[str, str]],
    missing_since: Mapping[str, datetime],
    grace: float,
) -> tuple[list[Lease], dict[str, datetime]]:
    """Held leases whose server the hub does not run, past ``grace`` seconds.

    ``running`` holds ``(user, server_name)`` of every server the hub lists as
    active (running or pending). A lease counts as missing from the first sweep
    that did not see its server (``missing_since``, carried between sweeps) and
    is an orphan once missing for ``grace`` seconds *and* claimed ``grace``
    seconds ago, so that a spawn the hub has not recorded yet is not one. A
    ``releasing`` lease (its stop began the give-back, which failed) needs no grace:
    it is retried at every sweep. The caller checks each orphan's holder first.
    Returns the orphans and the ``missing_since`` map for the next sweep.
    """
    orphans: list[Lease] = []
    still_missing: dict[str, datetime] = {}
    for lease in leases:
        if not lease.held or (lease.user, lease.server_name) in running:
            continue
        first_missed = missing_since.get(lease.id, now)
        still_missing[lease.id] = first_missed
        missed_for = _since(now, first_missed) or 0.0
        claimed_for = _since(now, lease.claimed_at) or 0.0
        if lease.state == LeaseState.RELEASING or (missed_for >= grace and claimed_for >= grace):
            orphans.append(lease)
    return orphans, still_missing


@dataclass(frozen=True)
class UnleasedDevice:
    """A device running processes that no held lease accounts for."""

    uuid: str  # what CUDA_VISIBLE_DEVICES names: MIG-... or, with MIG off, GPU-...
    what: str  # its profile ("1g.18gb"), or "whole GPU"
    gpu_index: int
    pids: tuple[int, ...]


def unleased_busy_devices(inventory: Inventory, leased: Iterable[str]) -> list[UnleasedDevice]:
    """The devices running processes that none of ``leased`` (the devices the held
    leases name, as their kinds say) accounts for: MIG devices, and MIG-capable GPUs
    with MIG off (a whole GPU, leased or not). A GPU that waits for a reset to change
    mode is left out: its processes are the ones the change waits for.

    Someone is using a slice or a GPU outside the hub (or a lease was lost). The
    service reports these; it never kills the processes.
    """
    held = set(leased)
    found = [UnleasedDevice(d.uuid, d.profile, d.gpu_index, d.pids)
             for d in inventory.mig_devices if d.busy and d.uuid not in held]
    found += [UnleasedDevice(g.uuid, "whole GPU", g.index, g.pids_on(g.uuid))
              for g in inventory.gpus
              if g.mig_supported and not g.mig_current and not g.mig_pending
              and (g.processes or g.processes_unknown) and g.uuid not in held]
    return found
