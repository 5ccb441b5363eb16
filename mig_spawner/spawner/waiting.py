"""Waiting for a slice inside JupyterHub's own spawn: join, wait in line, start when granted.

The mixin's claim goes through :func:`claim`. With nobody waiting for what it could take
it is a plain claim (``ClaimPlan.contends``: in pool mode a waiter for another size is
no line of its own). When no slice is free and the charged group has ``queue`` on, or
when others already wait for what it could take (a plain claim would jump their line),
the spawn joins the ledger's wait list and
stays *pending*: its progress events say its place in line, an estimate and what is
free instead, and it goes on by itself once the grant loop gives it a slice.

One :class:`GrantLoop` per hub process (per ledger) grants. Each waiting spawn holds a
:class:`Ticket` (an awaitable) that the loop resolves. The loop runs a *pass* when
something happened: a release made in this process (:func:`released`), a join or a
cancel here, a release, join or cancel by another process (``Ledger.watch_changes``:
PostgreSQL ``NOTIFY``, SQLite's data version checked every
:data:`CHANGE_CHECK_SECONDS`, a cheap read that does not grow with the line), or the
nearest wait's deadline. A pass reads the fleet ONCE (the backend's ``read_fleet``),
plans each waiter's claim from that read without I/O (``plan_claim``), grants in ONE
ledger transaction (``ledger.waits.grant``, the order rule's
``core.waitlist.next_grants`` inside the claim lock, which is what keeps several hub
processes on one PostgreSQL ledger from granting one slice twice), and tells every
waiter of this process its place, estimate and what is free instead from that same
read. Nothing runs per waiter while nothing happens. docs/architecture.md, "Grant loop".

The spawner and the wait talk through values: :func:`claim` returns a :class:`Claim`
(the lease, the plan that granted it, when it was granted, the claim's trip to a worker
thread, the time in line), and reads the spawner only through :class:`WaitingSpawner`.

Timeouts (docs/operations.md, "Waiting and start_timeout"): JupyterHub reads
``spawner.start_timeout`` once, when it wraps ``start()`` in ``asyncio.wait_for``, after
``run_pre_spawn_hook``. :func:`start_bounds` (called from there) gives what to raise it
to: what ``start()`` does beyond the backend's start, the wait for the server to answer,
and the group's ``max_wait`` for a spawn that may wait; the wait itself ends at
``max_wait`` (the entry's deadline), and from the grant on :func:`within_start_timeout`
holds the backend's start to the configured ``start_timeout``.

A JupyterHub cancel of the pending spawn (stop, or DELETE on the server) cancels the
task, which ends at once: the entry is cancelled in the background, and a slice granted
in the same instant is given back (the server's poll, stop and next start wait for
that).
Entries left ``waiting`` by an earlier hub process (killed or restarted) are ended
``abandoned`` when this process first opens the wait list: JupyterHub does not resume
a pending spawn after a restart, so nobody would ever start them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from html import escape
from logging import Logger
from typing import TYPE_CHECKING, Any, Protocol

from mig_spawner.core.answer import answer_timeout, start_bound
from mig_spawner.core.lifecycle import StopRule, WaitState
from mig_spawner.core.policy import GroupPolicy, Offer, PolicySet, UserPolicy
from mig_spawner.core.purpose import PURPOSE
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import (
    FIT_REASONS,
    Estimate,
    Holder,
    HoldLimits,
    estimate_wait,
    group_shares,
    history_for,
    positions,
)
from mig_spawner.ledger import (
    Lease,
    LeaseRequest,
    LedgerView,
    ReleaseCode,
    ServerHasLease,
    WaitEntry,
    WaitRequest,
)

from . import form, options
from .backend import ClaimPlan, SliceSupply
from .metrics import ABANDONED_WAITS, CLAIM_DURATION, RELEASE_TO_GRANT, WAIT_SECONDS, WAITERS
from .progress import ProgressLog

if TYPE_CHECKING:
    from jupyterhub.user import User

    from mig_spawner.ledger import Ledger
    from mig_spawner.ledger.waitlist import GrantRound

    from .form import Choice
    from .runtime import SpawnerRuntime

log = logging.getLogger(__name__)

#: How often, while anyone of this process waits on a SQLite ledger, the loop reads the
#: database's data version for changes made by other processes (the slice service's
#: culls): one cheap read, whatever the length of the line. PostgreSQL notifies instead.
CHANGE_CHECK_SECONDS = 0.1
#: A pass that failed (ledger or GPU not readable) is tried again after this.
RETRY_SECONDS = 1.0
#: Added to ``start_timeout`` beyond ``max_wait``: the loop ends an expired wait at once.
DEADLINE_SLACK_SECONDS = 1.0
#: Past holds are re-read for estimates at most this often.
HISTORY_TTL_SECONDS = 60.0
HISTORY_WINDOW = timedelta(days=30)
#: Progress (0..100) shown while waiting in line.
WAIT_PROGRESS = 5
ABANDONED_REASON = "the hub restarted while this spawn waited; start it again"


class WaitingSpawner(Protocol):
    """What the wait asks of the spawner whose spawn waits (``MIGSpawnerMixin``): its
    identity, policies, backend's plans and progress log; and, for a grant that a cancel
    came too late for, its release."""

    runtime: SpawnerRuntime
    user: User
    name: str
    user_options: dict[str, Any]
    log: Logger
    lease_id: str | None
    answer_tries: int
    start_timeout: int

    @property
    def _log_name(self) -> str: ...

    @property
    def progress_log(self) -> ProgressLog: ...

    def policies(self) -> PolicySet: ...

    def user_policy(self, policies: PolicySet) -> UserPolicy: ...

    def plan_here(self, offer: Offer, mine: UserPolicy
                  ) -> Callable[[dict[Any, Any]], ClaimPlan] | None: ...

    async def claim_decide(self, offer: Offer, mine: UserPolicy) -> ClaimPlan: ...

    def plan_claim(self, fleet: Any, offer: Offer, mine: UserPolicy) -> ClaimPlan: ...

    reads_fleet_here: bool

    def fleet_here(self) -> Any: ...

    async def read_fleet(self) -> Any: ...

    def supply_from(self, fleet: Any, held: Sequence[Lease]) -> SliceSupply: ...

    def wait_guard(self) -> Any: ...

    def choices_from(self, mine: UserPolicy, supply: SliceSupply, *args: Any,
                     **kwargs: Any) -> list[Choice]: ...

    def switch_url(self, offer_key: str, purpose: str | None = None) -> str: ...

    async def drop_stale_lease(self, stale: Lease) -> None: ...

    async def _release(self, code: ReleaseCode, detail: str = "") -> None: ...


@dataclass
class Claim:
    """What a spawn's claim gives its start: filled by :func:`claim` as it goes, so that
    a refusal still finds the plan it was refused on."""

    #: The backend's plan of the first try (what a refusal records beside its reason);
    #: after a wait, the plan of the pass that granted.
    plan: ClaimPlan | None = None
    #: The lease claimed or granted.
    lease: Lease | None = None
    #: ``time.monotonic()`` at the grant, after a wait in line (the backend's start is
    #: held to ``start_timeout`` from there); ``None``: claimed at once.
    granted_at: float | None = None
    #: The first try's trip to a worker thread (on Kubernetes the cluster is read in trips
    #: before it): seconds it waited for a thread, worked there, and waited for the hub's
    #: event loop to take the result back.
    trip: tuple[float, ...] = (0.0, 0.0, 0.0)
    #: Seconds spent in line (left out of ``mig_spawner_claim_duration_seconds``).
    in_line: float = 0.0


def charged_group(mine: UserPolicy, offer: Offer) -> GroupPolicy | None:
    """The group a wait for ``offer`` is charged to (and whose queue keys apply)."""
    candidates = mine.charge_candidates(offer.key)
    return candidates[0] if candidates else None


def may_wait(mine: UserPolicy, offer: Offer) -> bool:
    """Whether a spawn of ``offer`` may join the wait list (its group has ``queue``)."""
    group = charged_group(mine, offer)
    return group is not None and group.queue


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def released() -> None:
    """A lease was released in this process: run a grant pass now."""
    for grant_loop in _LOOPS.values():
        grant_loop.wake()


def freed() -> None:
    """On the worker thread whose release has just committed: grant the slice there
    (:meth:`GrantLoop.grant_here`), for each ledger this process waits on."""
    for grant_loop in list(_LOOPS.values()):
        grant_loop.grant_here()


@dataclass(eq=False)
class Ticket:
    """One spawn in line: awaited, it gives the entry once the wait ended (``granted``,
    ``expired``, ...); until then each pass tells it its place, estimate and what is
    free instead (:meth:`news`)."""

    spawner: WaitingSpawner
    offer: Offer
    mine: UserPolicy
    entry: WaitEntry
    #: The backend's plan of the latest pass: the one that grants is what the spawn
    #: goes on with (Kubernetes: it knows the nodes chosen).
    plan: ClaimPlan
    position: int | None = None
    estimate: Estimate | None = None
    #: The user's other offers free to take now.
    free: tuple[Offer, ...] = ()
    #: Slices of its size are held by an admin's layout change (docs/layout.md).
    recut: bool = False
    #: Its group's budget cannot pay for it now: why, and when it can (it is passed over
    #: until then, and counts as ahead of nobody).
    budget: Refused | None = None
    _ended: asyncio.Future[WaitEntry] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    _news: asyncio.Event = field(default_factory=asyncio.Event)

    def __await__(self) -> Generator[Any, None, WaitEntry]:
        return asyncio.shield(self._ended).__await__()

    @property
    def done(self) -> bool:
        return self._ended.done()

    def tell(self, entry: WaitEntry, position: int, estimate: Estimate | None,
             free: tuple[Offer, ...], budget: Refused | None = None,
             recut: bool = False) -> None:
        """A pass's word: still waiting, at ``position`` (``budget``: but its budget
        cannot pay for it yet; ``recut``: its size is held by a layout change)."""
        self.entry, self.position, self.estimate, self.free = entry, position, estimate, free
        self.budget, self.recut = budget, recut
        self._news.set()

    def end(self, entry: WaitEntry, plan: ClaimPlan, free: tuple[Offer, ...]) -> None:
        """The wait ended (granted, expired, cancelled): resolve the ticket."""
        self.entry, self.plan, self.free = entry, plan, free
        if not self._ended.done():
            self._ended.set_result(entry)
        self._news.set()

    async def news(self) -> None:
        """Until the next pass told this ticket something."""
        await self._news.wait()
        self._news.clear()


class GrantLoop:
    """The waits of one hub process on one ledger, and the one loop that grants them."""

    def __init__(self, runtime: SpawnerRuntime) -> None:
        self.runtime = runtime
        self.tickets: dict[int, Ticket] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        #: The event loop the waiting spawns run on (set at the first join): a grant
        #: pass made on a worker thread (:meth:`grant_here`) tells them through it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._history: tuple[float, list[tuple[str, str, float]]] | None = None
        self._ghosts_cleared = False
        self._retry_at: float | None = None
        #: When the first waiter held back by its budget can be served (a deadline).
        self._budget_at: datetime | None = None
        #: (user, server name) -> the ending of the wait that server's last spawn left
        #: (:func:`_end_wait`), until it has ended.
        self.endings: dict[tuple[str, str], asyncio.Future] = {}

    def ending(self, server: tuple[str, str], ending: asyncio.Future) -> None:
        """``server``'s spawn left its wait: its poll, stop and next start await
        ``ending`` (:func:`wait_ended`)."""
        self.endings[server] = ending

        def forget(done: asyncio.Future) -> None:
            if self.endings.get(server) is done:
                del self.endings[server]

        ending.add_done_callback(forget)

    def wake(self) -> None:
        self._wake.set()

    async def clear_ghosts(self) -> None:
        """End the waits an earlier hub process left behind (see the module doc)."""
        if self._ghosts_cleared:
            return
        self._ghosts_cleared = True

        def clear() -> int:
            ledger = self.runtime.ledger()
            ghosts = [e for e in ledger.waits.waiting() if e.id not in self.tickets]
            for entry in ghosts:
                ledger.waits.cancel(entry.id, ABANDONED_REASON, state=WaitState.ABANDONED)
                ABANDONED_WAITS.labels(profile=entry.offer, group=entry.group).inc()
            return len(ghosts)

        if count := await self.runtime.run(clear):
            log.warning("Ended %d wait(s) left by an earlier hub process as abandoned", count)

    def join(self, ticket: Ticket) -> None:
        self.tickets[ticket.entry.id] = ticket
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()  # of this event loop
            self._task = asyncio.ensure_future(self._run())
        self.wake()

    def leave(self, entry_id: int) -> None:
        self.tickets.pop(entry_id, None)
        # Its place frees a position: the others hear their new one.
        self.wake()

    async def _run(self) -> None:
        watch = asyncio.ensure_future(self._watch())
        try:
            while self.tickets:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._until_due())
                self._wake.clear()
                self._retry_at = None
                try:
                    await self.grant_pass()
                except Exception:
                    log.exception("The wait list's grant pass failed; retrying in %.0f s",
                                  RETRY_SECONDS)
                    self._retry_at = time.monotonic() + RETRY_SECONDS
        finally:
            watch.cancel()
            WAITERS.clear()  # nobody of this process waits any more

    def _until_due(self) -> float | None:
        """Seconds to the nearest deadline of this process's waits or retry (``None``:
        none): the one timer of the loop."""
        now = datetime.now(UTC)
        due = [(t.entry.deadline - now).total_seconds() for t in self.tickets.values()
               if t.entry.deadline is not None and not t.done]
        if self._retry_at is not None:
            due.append(self._retry_at - time.monotonic())
        if self._budget_at is not None:
            due.append((self._budget_at - now).total_seconds())
        return max(min(due), 0.0) + 0.01 if due else None

    async def _watch(self) -> None:
        """Wake the loop when another process released a slice or changed the line."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                watch = await self.runtime.run(lambda: self.runtime.ledger().watch_changes())
            except Exception as e:
                log.warning("Cannot watch the ledger for releases by other processes (%s); "
                            "trying again in %.0f s", e, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            try:
                fd = watch.fileno()
                if fd is None:
                    while True:
                        await asyncio.sleep(CHANGE_CHECK_SECONDS)
                        if await self.runtime.run(watch.changed):
                            self.wake()
                readable = asyncio.Event()
                loop.add_reader(fd, readable.set)
                try:
                    while True:
                        await readable.wait()
                        readable.clear()
                        if watch.changed():
                            self.wake()
                finally:
                    loop.remove_reader(fd)
            except Exception as e:
                log.warning("Lost the ledger's change notes (%s); reopening", e)
                self.wake()  # a change may have been missed
            finally:
                watch.close()
            await asyncio.sleep(RETRY_SECONDS)

    async def grant_pass(self) -> None:
        """Grant what can be granted, then tell every waiter of this process where it
        stands: one read of the fleet, one ledger transaction, whatever the line."""
        tickets = [t for t in self.tickets.values() if not t.done]
        if not tickets:
            return
        delegate = tickets[0].spawner
        # A local host's GPUs are read on the thread that grants (one trip, not two).
        fleet = None if delegate.reads_fleet_here else await delegate.read_fleet()
        fleet, plans, done = await self.runtime.run(self._grant, tickets, fleet)
        policies = delegate.policies()
        quotas = {name: g.quota_slices for name, g in policies.groups.items()}
        supply = delegate.supply_from(fleet, done.held)
        history = await self._holds()
        shares = group_shares(_held_by_group(done.held), quotas, done.capacity)
        now = datetime.now(UTC)
        spent = self._budget_spent(done.refused)
        skipped = [t.entry.user for t in tickets if _at_user_limit(t.mine, t.entry.user,
                                                                   done.held)
                   or t.entry.id in spent]
        places = positions([e.waiter for e in done.line], shares, skipped)
        for ticket in tickets:
            entry = done.watched.get(ticket.entry.id, ticket.entry)
            plan = plans[entry.id]
            free = _free_instead(ticket, supply)
            if not entry.waiting:
                ticket.end(entry, plan, free)
                continue
            ticket.plan = plan
            profiles = set(plan.wants.values())
            holders = [_holder(lease, now, policies) for lease in done.held
                       if lease.profile in profiles]
            past = history_for(history, plan.profile or entry.offer, entry.group)
            place = places.get(entry.id, 1)
            limits = HoldLimits.of(charged_group(ticket.mine, ticket.offer))
            ticket.tell(entry, place, estimate_wait(place, holders, past, limits=limits), free,
                        spent.get(entry.id), _recut(ticket, plan, supply))
        WAITERS.clear()
        for entry in done.line:
            WAITERS.labels(profile=entry.offer, group=entry.group).inc()

    def grant_here(self) -> None:
        """On the worker thread that has just released a slice (``freed``): a grant pass
        at once, on that thread, so that the next waiter's grant commits without waiting
        for the hub's event loop, which JupyterHub's stop handler holds at that moment
        (its database commits and the proxy's route, once ``stop()`` has returned); then
        the loop's own pass tells the waiters. Only where the fleet is read without
        awaits (a local host); a failure here is left to the loop's pass, woken too."""
        tickets = [t for t in list(self.tickets.values()) if not t.done]
        if not tickets or self._loop is None or not tickets[0].spawner.reads_fleet_here:
            return
        try:
            self._grant(tickets, None)
        except Exception as e:
            log.warning("A grant pass on the releasing thread failed (%s); the event "
                        "loop's pass tries again", e)
        finally:
            self._loop.call_soon_threadsafe(self.wake)

    def _grant(self, tickets: list[Ticket], fleet: Any
               ) -> tuple[Any, dict[int, ClaimPlan], GrantRound]:
        """On a worker thread: the waiters' plans on ``fleet`` (read here when
        ``None``) and the grant transaction; its grants' release-to-grant times
        observed."""
        delegate = tickets[0].spawner
        if fleet is None:
            fleet = delegate.fleet_here()
        plans = {t.entry.id: t.spawner.plan_claim(fleet, t.offer, t.mine) for t in tickets}
        policies = delegate.policies()
        quotas = {name: g.quota_slices for name, g in policies.groups.items()}
        guard = delegate.wait_guard()

        def capacity(held: tuple[Lease, ...]) -> int:
            supply = delegate.supply_from(fleet, held)
            return len(supply.held) + sum(
                max(counts.values(), default=0) for counts in supply.free.values())

        def decide(entry: WaitEntry, view: LedgerView) -> Any:
            plan = plans.get(entry.id)
            if plan is None:
                # Another process's waiter (its own loop serves it), or one that joined
                # after this pass began (the join woke the loop): skipped.
                raise Refused(Reason.PREVIOUS_LEASE, "not known to this pass")
            return plan.decide(view)

        ledger = self.runtime.ledger()
        done = ledger.waits.grant(decide, quotas=quotas, capacity=capacity, guard=guard,
                                  watch=list(plans))
        if done.granted:
            _observe_grants(ledger, done.granted)
        return fleet, plans, done

    def _budget_spent(self, refused: dict[int, Refused]) -> dict[int, Refused]:
        """The waits whose budget cannot pay for them now: entry id -> the refusal,
        with its retry time, that the grant transaction's own check gave (the grant
        step passed them over). The earliest retry time becomes a deadline of the
        loop, when they may be served."""
        spent = {i: r for i, r in refused.items() if r.reason is Reason.BUDGET_SPENT}
        self._budget_at = min((r.retry_at for r in spent.values() if r.retry_at is not None),
                              default=None)
        return spent

    async def line_texts(self, spawner: WaitingSpawner, mine: UserPolicy) -> dict[str, str]:
        """Offer key -> ``"2 waiting, usually 5-15 min"`` for the offers ``mine`` may
        wait for (the spawn form's wait-list choice)."""
        keys = [o for o in mine.offers if may_wait(mine, o)]
        if not keys:
            return {}
        policies = spawner.policies()
        line, held = await self.runtime.run(
            lambda: (self.runtime.ledger().waits.waiting(), self.runtime.ledger().leases.active()))
        history = await self._holds()
        now = datetime.now(UTC)
        texts = {}
        for offer in keys:
            ahead = sum(1 for e in line if e.offer == offer.key)
            group = charged_group(mine, offer)
            holders = [_holder(lease, now, policies) for lease in held
                       if _means(offer, lease.profile)]
            past = history_for([(offer.key, g, seconds) for p, g, seconds in history
                                if _means(offer, p)], offer.key, group.name if group else "")
            guess = estimate_wait(ahead + 1, holders, past, limits=HoldLimits.of(group))
            texts[offer.key] = (f"{ahead} waiting, "
                                + (guess.said("usually") if guess else "no estimate yet"))
        return texts

    async def _holds(self) -> list[tuple[str, str, float]]:
        """``(profile, group, seconds held)`` of recently ended leases, cached."""
        now = time.monotonic()
        if self._history is None or now - self._history[0] > HISTORY_TTL_SECONDS:
            since = datetime.now(UTC) - HISTORY_WINDOW
            leases = await self.runtime.run(lambda: self.runtime.ledger().leases.history(since))
            holds = [(lease.profile, lease.group,
                      (lease.released_at - lease.claimed_at).total_seconds())
                     for lease in leases if lease.released_at is not None]
            self._history = (now, holds)
        return self._history[1]


def _means(offer: Offer, profile: str) -> bool:
    """Whether a slice of ``profile`` serves ``offer`` (the profile, or one its class means)."""
    return profile == offer.key or profile in offer.profiles.values()


async def form_lines(spawner: WaitingSpawner, mine: UserPolicy) -> dict[str, str]:
    """The wait list's state per offer ``mine`` may wait for, for the spawn form."""
    grant_loop = loop_for(spawner.runtime)
    await grant_loop.clear_ghosts()
    return await grant_loop.line_texts(spawner, mine)


#: How long the form tells of a wait that ended without the user there.
NOTICE_WINDOW = timedelta(hours=1)


async def ended_notice(spawner: WaitingSpawner) -> str | None:
    """What the form tells a user whose last wait for this server ended while they
    were not watching (the hub restarted), or ``None``."""
    since = datetime.now(UTC) - NOTICE_WINDOW
    runtime = spawner.runtime
    mine = [e for e in await runtime.run(lambda: runtime.ledger().waits.joined(since))
            if e.user == spawner.user.name and e.server_name == (spawner.name or "")]
    if not mine or mine[-1].state is not WaitState.ABANDONED:
        return None
    offer = spawner.policies().offers.get(mine[-1].offer)
    name = offer.named if offer else mine[-1].offer
    return f"Your wait for {name} ended when the hub restarted; start again to join the wait list."


def _held_by_group(held: Iterable[Lease]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for lease in held:
        counts[lease.group] = counts.get(lease.group, 0) + 1
    return counts


def _at_user_limit(mine: UserPolicy, user: str, held: Iterable[Lease]) -> bool:
    return sum(1 for lease in held if lease.user == user) >= mine.max_slices


def _holder(lease: Lease, now: datetime, policies: PolicySet) -> Holder:
    """``lease`` as the estimates see it: its age, its session's end, and when its idle
    limit stops it if nobody uses it from now on (the limit in force while others wait,
    from its last recorded activity, never before the warning that comes first)."""
    ends = (lease.expires_at - now).total_seconds() if lease.expires_at else None
    group = policies.group(lease.group)
    limits = HoldLimits.of(group)
    idle = None
    if limits is not None and limits.idle is not None:
        active = lease.last_activity_at or lease.started_at or lease.claimed_at
        warned = lease.pending_stop(StopRule.SERVER_IDLE)  # whatever else is pending
        lead = ((warned.deadline - now).total_seconds() if warned is not None
                else group.warn_before or 0.0)
        idle = max((active - now).total_seconds() + limits.idle, lead)
    return Holder((now - lease.claimed_at).total_seconds(), ends, idle)


_LOOPS: dict[int, GrantLoop] = {}


def _observe_grants(ledger: Ledger, granted: list[WaitEntry]) -> None:
    """Release-to-grant time: from the latest release before each grant to it."""
    first = min(e.closed_at for e in granted if e.closed_at) - timedelta(hours=1)
    releases = sorted(lease.released_at for lease in ledger.leases.history(first)
                      if lease.released_at)
    for entry in granted:
        before = [at for at in releases if entry.closed_at and at <= entry.closed_at]
        if before and entry.closed_at:
            gap = (entry.closed_at - before[-1]).total_seconds()
            RELEASE_TO_GRANT.observe(gap)
            log.info("Wait %d of %s granted %.2f s after the latest release", entry.id,
                     entry.user, gap)


def loop_for(runtime: SpawnerRuntime) -> GrantLoop:
    """The one grant loop of this process for ``runtime``'s ledger."""
    grant_loop = _LOOPS.get(id(runtime))
    if grant_loop is None:
        grant_loop = _LOOPS[id(runtime)] = GrantLoop(runtime)
    return grant_loop


# --- the spawner's side ---------------------------------------------------------------


@dataclass(frozen=True)
class StartBounds:
    """JupyterHub's bounds on one spawn: ``start_timeout`` and ``http_timeout`` as the
    admin configured them, and as raised for it (:func:`start_bounds`)."""

    configured_start: int
    configured_http: int
    start_timeout: int
    http_timeout: int


def start_bounds(spawner: WaitingSpawner, configured_start: int, configured_http: int
                 ) -> StartBounds:
    """Before JupyterHub reads ``start_timeout``, which bounds all of ``start()``: what to
    raise it to, to cover what ``start()`` does beyond the backend's start, which
    :func:`within_start_timeout` holds to the configured ``start_timeout`` itself: the
    wait for the server to answer (``core.answer``, also JupyterHub's ``http_timeout``
    then) on each try, and ``max_wait`` for a spawn that may wait (see the module doc)."""
    answer = answer_timeout(configured_http, spawner.runtime.answers)
    wait = 0.0
    try:
        policies = spawner.policies()
        mine = spawner.user_policy(policies)
        offer = options.requested_offer(spawner.user_options, mine, policies)
    except Exception:
        offer = None  # start() refuses it with the reason (and records the refusal once)
    group = charged_group(mine, offer) if offer is not None else None
    if group is not None and group.queue:
        wait = (group.max_wait or 24 * 3600) + DEADLINE_SLACK_SECONDS
    return StartBounds(configured_start, configured_http,
                       start_bound(configured_start, answer, spawner.answer_tries, wait),
                       int(answer))


async def within_start_timeout(spawner: WaitingSpawner, start: Any, configured: int,
                               since: float | None) -> Any:
    """Await the backend's start, bounded by the ``configured`` ``start_timeout``, counted
    from ``since`` (``time.monotonic()`` at the grant after a wait, or at a start again
    on the same slice; ``None``: from now). JupyterHub's own bound covers more
    (:func:`start_bounds`)."""
    left = configured - (time.monotonic() - (since if since is not None else time.monotonic()))
    try:
        return await asyncio.wait_for(start, max(left, 1.0))
    except TimeoutError:
        spawner.start_timeout = configured  # what JupyterHub's timeout message names
        spawner.log.warning("%s did not start within %ss of its grant", spawner._log_name,
                            configured)
        raise


async def claim(spawner: WaitingSpawner, offer: Offer, mine: UserPolicy,
                into: Claim | None = None) -> Claim:
    """A lease for this spawn, claimed at once or granted after waiting in line, with
    the backend's plan that granted it and what the start needs of the wait (``into``,
    filled as the claim goes, so that a caller that meets a refusal reads the plan it
    was refused on). Observes ``mig_spawner_claim_duration_seconds``, leaving out the
    time spent in line (that is ``mig_spawner_wait_seconds``).

    The first try is one trip to a worker thread: the plan (where the backend can read
    its fleet there, ``plan_here``), a stale lease of this server, the line, and the
    claim. A stale lease is released (``drop_stale_lease``) and the try made again.
    Raises ``Refused`` as the claim does; a wait that reaches ``max_wait`` is refused
    with what is free instead.
    """
    made = into if into is not None else Claim()
    tic = time.perf_counter()
    try:
        return await _claim(spawner, offer, mine, made)
    finally:
        CLAIM_DURATION.observe(max(0.0, time.perf_counter() - tic - made.in_line))


async def _claim(spawner: WaitingSpawner, offer: Offer, mine: UserPolicy, made: Claim
                 ) -> Claim:
    runtime = spawner.runtime
    grant_loop = loop_for(runtime)
    await asyncio.gather(grant_loop.clear_ghosts(), wait_ended(spawner))
    request = LeaseRequest(spawner.user.name, spawner.name or "")
    group = charged_group(mine, offer)
    queue = group is not None and group.queue
    tried = await _first_try(spawner, offer, mine, request, made)
    if tried.stale is not None:
        # Released (or refused in words), then tried again on a fresh plan: the release
        # may have destroyed a dynamic instance.
        await spawner.drop_stale_lease(tried.stale)
        tried = await _first_try(spawner, offer, mine, request, made)
        if tried.stale is not None:  # a concurrent start got one meanwhile
            raise ServerHasLease(tried.stale)
    plan = tried.plan
    assert plan is not None  # planned whenever no stale lease was found
    if tried.lease is not None:
        made.lease = tried.lease
        return made
    if tried.refused is not None and (tried.refused.reason not in FIT_REASONS or not queue):
        raise tried.refused
    assert group is not None  # validated: some group allows the offer
    entry = await runtime.run(lambda: runtime.ledger().waits.join(
        WaitRequest(request.user, request.server_name, group.name, group.priority, offer.key,
                    group.max_wait if queue else None),
        max_waiting=group.max_waiting_per_user,
    ))
    ticket = Ticket(spawner, offer, mine, entry, plan)
    grant_loop.join(ticket)
    joined = time.perf_counter()
    try:
        made.lease = await _wait(spawner, ticket, queue, made)
        made.plan = ticket.plan
        return made
    except BaseException as e:
        # Cancelled by JupyterHub (stop, DELETE, start_timeout) or refused: end the
        # entry; a grant that won the race is this server's to give back. A cancel
        # returns at once and the entry ends in the background: JupyterHub's DELETE of
        # a pending spawn gives the cancel one second, then answers 500 ("pending
        # spawn") if the spawn still runs, which a give-back on a loaded host overran.
        ending = asyncio.ensure_future(_end_wait(spawner, entry.id))
        grant_loop.ending((request.user, request.server_name), ending)
        if not isinstance(e, asyncio.CancelledError):
            await asyncio.shield(ending)
        raise
    finally:
        grant_loop.leave(entry.id)
        made.in_line = time.perf_counter() - joined


async def _end_wait(spawner: WaitingSpawner, entry_id: int) -> None:
    """End a wait that its spawn left (cancelled or refused); the slice of a grant that
    came first is given back (code ``cancelled``). The spawner's poll, stop and next
    start await it (:func:`wait_ended`), so none of them takes that lease for its own."""
    runtime = spawner.runtime
    try:
        ended = await runtime.run(
            lambda: runtime.ledger().waits.cancel(entry_id, "cancelled by the user"))
        if ended is not None and ended.state is WaitState.GRANTED and ended.lease_id:
            spawner.lease_id = ended.lease_id
            await spawner._release(ReleaseCode.CANCELLED, "while waiting")
    except Exception as e:  # the next sweep's orphan repair gives such a lease back
        spawner.log.error("Could not end the wait of %s (entry %d): %s", spawner._log_name,
                          entry_id, e)


async def wait_ended(spawner: WaitingSpawner) -> None:
    """Until the wait this server's last spawn left has ended (:func:`_end_wait`)."""
    server = (spawner.user.name, spawner.name or "")
    ending = loop_for(spawner.runtime).endings.get(server)
    if ending is not None:
        await asyncio.shield(ending)


@dataclass(frozen=True)
class _FirstTry:
    """What a claim's first trip found: its plan, and a lease, or this server's stale
    lease, or the claim's refusal, or none of them (others wait in line)."""

    plan: ClaimPlan | None  # None only beside a stale lease found before planning
    lease: Lease | None = None
    stale: Lease | None = None
    refused: Refused | None = None


async def _first_try(spawner: WaitingSpawner, offer: Offer, mine: UserPolicy,
                     request: LeaseRequest, made: Claim) -> _FirstTry:
    runtime = spawner.runtime
    plan_here = spawner.plan_here(offer, mine)
    if plan_here is None:
        # The plan reads the cluster with awaits: a stale lease first, which says more
        # than a cluster that cannot be read (its release needs the cluster too).
        stale = await runtime.run(lambda: runtime.ledger().leases.active_for_server(
            request.user, request.server_name))
        if stale is not None:
            return _FirstTry(None, stale=stale)
        planned = await spawner.claim_decide(offer, mine)

        def plan_here(fleets: dict[Any, Any]) -> ClaimPlan:
            return planned  # read already, with awaits

    tried = await passes_for(runtime).claim(_Pending(
        spawner, request, plan_here, spawner.policies().offers, time.perf_counter(), made))
    made.plan = tried.plan  # for a refusal's record (MIGSpawnerMixin._claim)
    return tried


def _joins_line(ledger: Ledger, offers: Any, request: LeaseRequest, plan: ClaimPlan,
                waiting: Iterable[WaitEntry]) -> _FirstTry | None:
    """The try of a claim that others wait for what it could take: it joins the line
    rather than jump it, unless the claim would be refused for a reason that waiting does
    not cure (a spent budget, a quota: the claim's own check on the ledger's view, writing
    nothing). ``None``: nobody waits for what it could take (waits for sizes it cannot
    take are no line of its own), so it claims at once."""
    if not any(plan.contends(offers.get(e.offer)) for e in waiting):
        return None
    try:
        ledger.leases.would_claim(request, plan.decide)
    except Refused as e:
        if e.reason not in FIT_REASONS:
            return _FirstTry(plan, refused=e)
    return _FirstTry(plan)


@dataclass
class _Pending:
    """A local spawner's claim waiting for its pass: who, how it plans on the pass's
    fleet, the offers it may contend with, and when it asked (``perf_counter``)."""

    spawner: WaitingSpawner
    request: LeaseRequest
    plan: Callable[[dict[Any, Any]], ClaimPlan]
    offers: Any
    asked: float
    #: The claim the trip's times are told to (:attr:`Claim.trip`).
    made: Claim


class ClaimPasses:
    """The claims of this process's local spawners on one runtime, made in passes: the
    claims that arrive while a pass is under way make the next one, which takes ONE trip
    to a worker thread, reads the held leases (each server's stale lease), the line and
    the GPUs (``plan_here``'s fleet) once for all of them, and claims them in one
    transaction (``Leases.claim_many``: each decision counts the pass's grants before it
    as held, without reading them back). A class start's 100 claims then cost a few
    reads and transactions, not 100 of each, and none waits for 99 others' commits."""

    def __init__(self, runtime: SpawnerRuntime) -> None:
        self.runtime = runtime
        self._pending: list[tuple[_Pending, asyncio.Future[_FirstTry]]] = []
        self._draining: asyncio.Future[None] | None = None

    async def claim(self, pending: _Pending) -> _FirstTry:
        """``pending``'s first try, made in the next pass."""
        future: asyncio.Future[_FirstTry] = asyncio.get_running_loop().create_future()
        self._pending.append((pending, future))
        if self._draining is None or self._draining.done():
            self._draining = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            times = [0.0, 0.0]  # the pass began and ended on the thread
            try:
                results = await self.runtime.run(self._timed_pass,
                                                 [p for p, _ in batch], times)
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as e:  # the ledger or the GPUs: every claim of it hears
                results = [e] * len(batch)
            back = time.perf_counter()
            for (pending, future), result in zip(batch, results, strict=True):
                pending.made.trip = (times[0] - pending.asked, times[1] - times[0],
                                     back - times[1])
                if future.done():
                    continue  # its spawn was cancelled: the orphan repair gives back a lease
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _timed_pass(self, batch: list[_Pending], times: list[float]
                    ) -> list[_FirstTry | Exception]:
        times[0] = time.perf_counter()
        try:
            return self.run_pass(batch)
        finally:
            times[1] = time.perf_counter()

    def run_pass(self, batch: list[_Pending]) -> list[_FirstTry | Exception]:
        """On a worker thread: each claim's first try, in order (see the class)."""
        ledger = self.runtime.ledger()
        holding = {(lease.user, lease.server_name): lease for lease in ledger.leases.active()}
        waiting = ledger.waits.waiting()
        fleets: dict[Any, Any] = {}
        results: list[_FirstTry | Exception | None] = [None] * len(batch)
        claims: list[tuple[int, ClaimPlan]] = []
        for n, pending in enumerate(batch):
            request = pending.request
            try:
                if (stale := holding.get((request.user, request.server_name))) is not None:
                    results[n] = _FirstTry(None, stale=stale)
                    continue
                plan = pending.plan(fleets)
                joined = _joins_line(ledger, pending.offers, request, plan, waiting)
            except Exception as e:  # this claim's plan (its GPUs unreadable): its own
                results[n] = e
                continue
            if joined is not None:
                results[n] = joined
            else:
                claims.append((n, plan))
        if claims:
            made = ledger.leases.claim_many([(batch[n].request, plan.decide)
                                             for n, plan in claims])
            for (n, plan), outcome in zip(claims, made, strict=True):
                results[n] = (_FirstTry(plan, lease=outcome) if isinstance(outcome, Lease)
                              else _FirstTry(plan, refused=outcome)
                              if isinstance(outcome, Refused) else outcome)
        return [result for result in results if result is not None]


_PASSES: dict[int, ClaimPasses] = {}


def passes_for(runtime: SpawnerRuntime) -> ClaimPasses:
    """The one claim pass queue of this process for ``runtime``."""
    passes = _PASSES.get(id(runtime))
    if passes is None:
        passes = _PASSES[id(runtime)] = ClaimPasses(runtime)
    return passes


async def _wait(spawner: WaitingSpawner, ticket: Ticket, queue: bool, made: Claim) -> Lease:
    runtime = spawner.runtime
    offer = ticket.offer
    joined = time.monotonic()
    last = None
    while True:
        await ticket.news()
        if ticket.done:
            entry = await ticket
            if entry.state is WaitState.GRANTED and (lease_id := entry.lease_id):
                lease = await runtime.run(lambda: runtime.ledger().leases.get(lease_id))
                if lease is None or not lease.held:
                    raise Refused(Reason.LEASE_ENDED,
                                  "The slice given to this server ended before it started; "
                                  "start it again")
                made.granted_at = time.monotonic()
                WAIT_SECONDS.labels(profile=offer.key, group=entry.group).observe(
                    made.granted_at - joined)
                if last is not None:
                    spawner.progress_log.add(WAIT_PROGRESS + 5,
                                             f"Your turn: a slice of {offer.named} was released")
                return lease
            if entry.state is WaitState.EXPIRED:
                raise Refused(Reason.NONE_FREE, _expired_message(ticket))
            raise Refused(Reason.NONE_FREE, f"Your wait for {offer.named} ended "
                          f"({entry.reason or entry.state}); start it again")
        if not queue:
            others = (ticket.position or 1) - 1
            raise Refused(Reason.NONE_FREE,
                          f"None of {offer.named} is free right now"
                          + (f" and {others} spawn(s) wait for one" if others > 0 else "")
                          + "; your group cannot wait for one: try again later")
        message = _place_message(spawner, ticket)
        if message != last:
            if last is None:
                log.info("%s waits for a %s slice (entry %d)", spawner._log_name, offer.key,
                         ticket.entry.id)
            spawner.progress_log.add(WAIT_PROGRESS, message[0], html=message[1])
            last = message


def _free_instead(ticket: Ticket, supply: SliceSupply) -> tuple[Offer, ...]:
    """The user's other offers that are free to take on ``supply``."""
    choices = ticket.spawner.choices_from(ticket.mine, supply)
    free = {c.key for c in choices if c.key != ticket.offer.key and c.available and c.free}
    return tuple(o for o in ticket.mine.offers if o.key in free)


def _recut(ticket: Ticket, plan: ClaimPlan, supply: SliceSupply) -> bool:
    """Whether slices of the size ``ticket`` waits for are held by an admin's layout
    change (docs/layout.md): then it is not free for a while, whatever the estimate."""
    return any(supply.recut.get(profile, 0) for profile in set(plan.wants.values()))


def _place_message(spawner: WaitingSpawner, ticket: Ticket) -> tuple[str, str]:
    """What the pending page's headline says: place, estimate, maintenance, and what is
    free instead (text and HTML, the latter with a link that stops this wait and starts
    the server with the free offer, keeping its purpose)."""
    place = ticket.position or 1
    name = ticket.offer.named
    if ticket.budget is not None:
        text = f"Waiting for {name}, but {ticket.budget.sentence}"
        return text, escape(text)
    guess = ticket.estimate.said("estimated") if ticket.estimate else "no estimate yet"
    text = f"{ordinal(place)} in line for {name}; " + (
        f"{form.RECUT} ({guess})" if ticket.recut else guess)
    html = escape(text)
    if ticket.free:
        other = ticket.free[0]
        text += f". {other.named} is free now: stop this wait and start with it instead"
        url = spawner.switch_url(other.key, (spawner.user_options or {}).get(PURPOSE))
        html += (f". {escape(other.named)} is free now: "
                 f'<a class="mig-instead" href="{escape(url)}">stop this wait and start with '
                 "it instead</a>")
    return text, html


def _expired_message(ticket: Ticket) -> str:
    entry = ticket.entry
    seconds = (entry.deadline - entry.joined_at).total_seconds() if entry.deadline else 0
    waited = f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
    instead = (f"{ticket.free[0].named} is free now: start with it instead" if ticket.free
               else "try again later")
    return (f"Waited {waited} (the longest your group may wait) and no slice of "
            f"{ticket.offer.named} was released; {instead}")
