"""Waiting for a slice inside JupyterHub's own spawn: join, wait in line, start when granted.

The mixin's claim goes through :func:`claim`. With nobody waiting it is a plain claim.
When no slice is free and the charged group has ``queue`` on, or when others already
wait (a plain claim would jump their line), the spawn joins the ledger's wait list and
stays *pending*: its progress events say its place in line, an estimate and what is
free instead, and it goes on by itself once the grant step gives it a slice.

One :class:`WaitRoom` per hub process (per ledger) runs the grant step
(``Ledger.grant_next``, until nobody more can be served) right after every release
made in this process (:func:`released`), after every join, and at least every
:data:`POLL_SECONDS` for releases made elsewhere (the slice service). Each waiter's
own backend hook (``claim_decide``) decides for it, so local pool, local dynamic and
Kubernetes waiters are granted by the same allocator their claim uses.

Timeouts (docs/operations.md, "Waiting and start_timeout"): JupyterHub reads
``spawner.start_timeout`` once, when it wraps ``start()`` in ``asyncio.wait_for``, after
``run_pre_spawn_hook``. :func:`allow_wait` (called from there) raises it by the
group's ``max_wait`` for a spawn that may wait; the wait itself ends at ``max_wait``
(the entry's deadline), and from the grant on :func:`within_start_timeout` holds the
server's start to the configured ``start_timeout`` again.

A JupyterHub cancel of the pending spawn (stop, or DELETE on the server) cancels the
task: the entry is cancelled, and a slice granted in the same instant is given back.
Entries left ``waiting`` by an earlier hub process (killed or restarted) are ended
``abandoned`` when this process first opens the wait list: JupyterHub does not resume
a pending spawn after a restart, so nobody would ever start them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from html import escape
from typing import TYPE_CHECKING, Any

from mig_spawner.core.policy import GroupPolicy, Offer, UserPolicy
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
    WaitEntry,
    WaitRequest,
)

from . import options
from .backend import ClaimPlan
from .metrics import ABANDONED_WAITS, CLAIM_DURATION, RELEASE_TO_GRANT, WAIT_SECONDS, WAITERS

if TYPE_CHECKING:
    from .mixin import MIGSpawnerMixin
    from .runtime import SpawnerRuntime

log = logging.getLogger(__name__)

#: How often the grant step runs while anyone waits, for releases made by another
#: process (the slice service's culls): a release is seen within this.
POLL_SECONDS = 0.5
#: Past holds are re-read for estimates at most this often.
HISTORY_TTL_SECONDS = 60.0
HISTORY_WINDOW = timedelta(days=30)
#: Progress (0..100) shown while waiting in line.
WAIT_PROGRESS = 5
ABANDONED_REASON = "the hub restarted while this spawn waited; start it again"


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
    """A lease was released in this process: run the grant step now."""
    for room in _ROOMS.values():
        room.wake()


@dataclass
class Waiting:
    """One spawn in line, as the room sees it."""

    spawner: MIGSpawnerMixin
    offer: Offer
    mine: UserPolicy
    entry: WaitEntry
    #: The backend's plan of the latest grant step: the one that grants is what the
    #: spawn goes on with (Kubernetes: it knows the nodes chosen).
    plan: ClaimPlan
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    position: int | None = None
    estimate: Estimate | None = None
    drained: bool = False

    def update(self, entry: WaitEntry | None = None, position: int | None = None,
               estimate: Estimate | None = None) -> None:
        if entry is not None:
            self.entry = entry
        self.position, self.estimate, self.drained = position, estimate, True
        self.changed.set()


@dataclass
class WaitRoom:
    """The waits of one hub process on one ledger, and the loop that grants them."""

    runtime: SpawnerRuntime
    waiters: dict[int, Waiting] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None
    _history: tuple[float, list[tuple[str, str, float]]] | None = None
    _ghosts_cleared: bool = False

    def wake(self) -> None:
        self._wake.set()

    async def clear_ghosts(self) -> None:
        """End the waits an earlier hub process left behind (see the module doc)."""
        if self._ghosts_cleared:
            return
        self._ghosts_cleared = True

        def clear() -> int:
            ledger = self.runtime.ledger()
            ghosts = [e for e in ledger.waiting() if e.id not in self.waiters]
            for entry in ghosts:
                ledger.cancel_wait(entry.id, ABANDONED_REASON, state="abandoned")
                ABANDONED_WAITS.labels(profile=entry.offer, group=entry.group).inc()
            return len(ghosts)

        if count := await self.runtime.run(clear):
            log.warning("Ended %d wait(s) left by an earlier hub process as abandoned", count)

    def join(self, waiting: Waiting) -> None:
        self.waiters[waiting.entry.id] = waiting
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        self.wake()

    def leave(self, entry_id: int) -> None:
        self.waiters.pop(entry_id, None)
        # Its place frees a position: the others hear their new one.
        self.wake()

    async def _loop(self) -> None:
        while self.waiters:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_SECONDS)
            self._wake.clear()
            try:
                await self.drain()
            except Exception:
                log.exception("The wait list's grant step failed; retrying")
        WAITERS.clear()  # nobody of this process waits any more

    async def drain(self) -> None:
        """Grant what can be granted, then tell every waiter of this process where it is."""
        if not self.waiters:
            return
        waiters = [w for w in self.waiters.values() if w.entry.waiting]
        if not waiters:
            return
        delegate = waiters[0].spawner
        plans: dict[int, ClaimPlan] = {}
        for w in waiters:
            # A fresh read of the GPUs or nodes, as a claim makes.
            plans[w.entry.id] = w.plan = await w.spawner.claim_decide(w.offer, w.mine)
        supply = await delegate.slice_supply()
        capacity = len(supply.held) + sum(
            max(counts.values(), default=0) for counts in supply.free.values()
        )
        quotas = {name: g.quota_slices for name, g in delegate.policies().groups.items()}
        guard = delegate.wait_guard()

        def decide(entry: WaitEntry, view: LedgerView) -> Any:
            plan = plans.get(entry.id)
            if plan is None:
                # Joined after this drain began (or by another process): next round.
                raise Refused(Reason.PREVIOUS_LEASE, "not known to this drain")
            return plan.decide(view)

        def grant_all() -> tuple[list[WaitEntry], list[WaitEntry], list[WaitEntry], list[Lease]]:
            ledger = self.runtime.ledger()
            granted = []
            while (entry := ledger.grant_next(decide, quotas=quotas, capacity=capacity,
                                              guard=guard)) is not None:
                granted.append(entry)
            line = ledger.waiting()
            open_ids = {e.id for e in line} | {e.id for e in granted}
            ended = [e for w in waiters if w.entry.id not in open_ids
                     and (e := ledger.wait_entry(w.entry.id)) is not None]
            return granted, line, ended, ledger.active()

        granted, line, ended, held = await self.runtime.run(grant_all)
        if granted:
            await self._observe_grants(granted)
        history = await self._holds()
        for entry in [*granted, *ended]:
            if (w := self.waiters.get(entry.id)) is not None:
                w.update(entry)
        shares = group_shares(_held_by_group(held), quotas, capacity)
        skipped = [w.entry.user for w in waiters if _at_user_limit(w.mine, w.entry.user, held)]
        places = positions([e.waiter for e in line], shares, skipped)
        now = datetime.now(UTC)
        for entry in line:
            if (w := self.waiters.get(entry.id)) is None:
                continue
            plan = plans[entry.id]
            profiles = set(plan.wants.values())
            holders = [_holder(lease, now) for lease in held if lease.profile in profiles]
            past = history_for(history, plan.profile or entry.offer, entry.group)
            place = places.get(entry.id, 1)
            w.update(entry, place, estimate_wait(
                place, holders, past, limits=HoldLimits.of(charged_group(w.mine, w.offer))))
        WAITERS.clear()
        for entry in line:
            WAITERS.labels(profile=entry.offer, group=entry.group).inc()

    async def _observe_grants(self, granted: list[WaitEntry]) -> None:
        """Release-to-grant time: from the latest release before each grant to it."""
        first = min(e.closed_at for e in granted if e.closed_at) - timedelta(hours=1)
        leases = await self.runtime.run(lambda: self.runtime.ledger().history(first))
        releases = sorted(lease.released_at for lease in leases if lease.released_at)
        for entry in granted:
            before = [at for at in releases if entry.closed_at and at <= entry.closed_at]
            if before and entry.closed_at:
                gap = (entry.closed_at - before[-1]).total_seconds()
                RELEASE_TO_GRANT.observe(gap)
                log.info("Wait %d of %s granted %.2f s after the latest release", entry.id,
                         entry.user, gap)

    async def line_texts(self, spawner: MIGSpawnerMixin, mine: UserPolicy) -> dict[str, str]:
        """Offer key -> ``"2 waiting, usually 5-15 min"`` for the offers ``mine`` may
        wait for (the spawn form's wait-list choice)."""
        keys = [o for o in mine.offers if may_wait(mine, o)]
        if not keys:
            return {}
        line, held = await self.runtime.run(
            lambda: (self.runtime.ledger().waiting(), self.runtime.ledger().active()))
        history = await self._holds()
        now = datetime.now(UTC)
        texts = {}
        for offer in keys:
            ahead = sum(1 for e in line if e.offer == offer.key)
            group = charged_group(mine, offer)
            holders = [_holder(lease, now) for lease in held if _means(offer, lease.profile)]
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
            leases = await self.runtime.run(lambda: self.runtime.ledger().history(since))
            holds = [(lease.profile, lease.group,
                      (lease.released_at - lease.claimed_at).total_seconds())
                     for lease in leases if lease.released_at is not None]
            self._history = (now, holds)
        return self._history[1]


def _means(offer: Offer, profile: str) -> bool:
    """Whether a slice of ``profile`` serves ``offer`` (the profile, or one its class means)."""
    return profile == offer.key or profile in offer.profiles.values()


async def form_lines(spawner: MIGSpawnerMixin, mine: UserPolicy) -> dict[str, str]:
    """The wait list's state per offer ``mine`` may wait for, for the spawn form."""
    room = room_for(spawner.runtime)
    await room.clear_ghosts()
    return await room.line_texts(spawner, mine)


#: How long the form tells of a wait that ended without the user there.
NOTICE_WINDOW = timedelta(hours=1)


async def ended_notice(spawner: MIGSpawnerMixin) -> str | None:
    """What the form tells a user whose last wait for this server ended while they
    were not watching (the hub restarted), or ``None``."""
    since = datetime.now(UTC) - NOTICE_WINDOW
    runtime = spawner.runtime
    mine = [e for e in await runtime.run(lambda: runtime.ledger().waits(since))
            if e.user == spawner.user.name and e.server_name == (spawner.name or "")]
    if not mine or mine[-1].state != "abandoned":
        return None
    return (f"Your wait for a {mine[-1].offer} slice ended when the hub restarted; start "
            "again to join the wait list.")


def _held_by_group(held: Iterable[Lease]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for lease in held:
        counts[lease.group] = counts.get(lease.group, 0) + 1
    return counts


def _at_user_limit(mine: UserPolicy, user: str, held: Iterable[Lease]) -> bool:
    return sum(1 for lease in held if lease.user == user) >= mine.max_slices


def _holder(lease: Lease, now: datetime) -> Holder:
    ends = (lease.expires_at - now).total_seconds() if lease.expires_at else None
    return Holder((now - lease.claimed_at).total_seconds(), ends)


_ROOMS: dict[int, WaitRoom] = {}


def room_for(runtime: SpawnerRuntime) -> WaitRoom:
    """The one room of this process for ``runtime``'s ledger."""
    room = _ROOMS.get(id(runtime))
    if room is None:
        room = _ROOMS[id(runtime)] = WaitRoom(runtime)
    return room


# --- the spawner's side ---------------------------------------------------------------


def allow_wait(spawner: MIGSpawnerMixin) -> None:
    """Before JupyterHub reads ``start_timeout``: raise it by ``max_wait`` for a spawn
    that may wait, so the hub's timeout does not end the wait (see the module doc)."""
    configured = spawner.__dict__.setdefault("_configured_start_timeout", spawner.start_timeout)
    spawner.start_timeout = configured
    spawner._granted_at = None
    try:
        policies = spawner.policies()
        mine = spawner.user_policy(policies)
        offer = options.requested_offer(spawner.user_options, mine, policies)
    except Exception:
        return  # start() refuses it with the reason (and records the refusal once)
    group = charged_group(mine, offer)
    if group is not None and group.queue:
        spawner.start_timeout = int(configured + (group.max_wait or 24 * 3600) + 2 * POLL_SECONDS)


async def within_start_timeout(spawner: MIGSpawnerMixin, start: Any) -> Any:
    """Await the backend's start, bounded by the configured ``start_timeout`` counted
    from the grant when JupyterHub's own bound was raised for a possible wait."""
    configured = spawner.__dict__.get("_configured_start_timeout")
    if configured is None or spawner.start_timeout == configured:
        return await start  # JupyterHub's own timeout is the configured one
    # Raised for a wait (allow_wait); a claim granted at once counts from now.
    granted = getattr(spawner, "_granted_at", None) or time.monotonic()
    spawner.start_timeout = configured  # what JupyterHub's timeout message names
    left = configured - (time.monotonic() - granted)
    try:
        return await asyncio.wait_for(start, max(left, 1.0))
    except TimeoutError:
        spawner.log.warning("%s did not start within %ss of its grant", spawner._log_name,
                            configured)
        raise


@contextlib.contextmanager
def claim_timer(spawner: MIGSpawnerMixin) -> Iterator[None]:
    """Observe ``mig_spawner_claim_duration_seconds`` for the claim inside, leaving out
    the time spent in line (that is ``mig_spawner_wait_seconds``)."""
    spawner._in_line = 0.0
    tic = time.perf_counter()
    try:
        yield
    finally:
        CLAIM_DURATION.observe(max(0.0, time.perf_counter() - tic - spawner._in_line))


async def claim(
    spawner: MIGSpawnerMixin, offer: Offer, mine: UserPolicy, plan: ClaimPlan
) -> tuple[Lease, ClaimPlan]:
    """A lease for this spawn, claimed at once or granted after waiting in line, and
    the backend's plan that granted it.

    Raises ``Refused`` as the claim does; a wait that reaches ``max_wait`` is refused
    with what is free instead.
    """
    runtime = spawner.runtime
    room = room_for(runtime)
    await room.clear_ghosts()
    request = LeaseRequest(spawner.user.name, spawner.name or "")
    group = charged_group(mine, offer)
    queue = group is not None and group.queue
    others = await runtime.run(lambda: runtime.ledger().waiting())
    if not others:
        try:
            lease = await runtime.run(lambda: runtime.ledger().claim(request, plan.decide))
            return lease, plan
        except Refused as e:
            if e.reason not in FIT_REASONS or not queue:
                raise
    else:
        # Others wait: join the line rather than jump it; only "nothing free" is queued.
        held = await runtime.run(lambda: runtime.ledger().active())
        try:
            plan.decide(LedgerView(request=request, leases=tuple(held), now=datetime.now(UTC)))
        except Refused as e:
            if e.reason not in FIT_REASONS:
                raise
    assert group is not None  # validated: some group allows the offer
    entry = await runtime.run(lambda: runtime.ledger().join_wait(
        WaitRequest(request.user, request.server_name, group.name, group.priority, offer.key,
                    group.max_wait if queue else None),
        max_waiting=group.max_waiting_per_user,
    ))
    waiting = Waiting(spawner, offer, mine, entry, plan)
    room.join(waiting)
    joined = time.perf_counter()
    try:
        return await _wait(spawner, waiting, queue), waiting.plan
    except BaseException:
        # Cancelled by JupyterHub (stop, start_timeout) or refused: end the entry; a
        # grant that won the race is this server's to give back.
        ended = await asyncio.shield(runtime.run(
            lambda: runtime.ledger().cancel_wait(entry.id, "cancelled by the user")))
        if ended is not None and ended.state == "granted" and ended.lease_id:
            spawner.lease_id = ended.lease_id
            await spawner._release(ReleaseCode.CANCELLED, "while waiting")
        raise
    finally:
        room.leave(entry.id)
        spawner._in_line = time.perf_counter() - joined


async def _wait(spawner: MIGSpawnerMixin, waiting: Waiting, queue: bool) -> Lease:
    runtime = spawner.runtime
    offer = waiting.offer
    joined = time.monotonic()
    last = None
    while True:
        await waiting.changed.wait()
        waiting.changed.clear()
        entry = waiting.entry
        if entry.state == "granted" and (lease_id := entry.lease_id):
            lease = await runtime.run(lambda: runtime.ledger().get(lease_id))
            if lease is None or not lease.held:
                raise Refused(Reason.LEASE_ENDED,
                              "The slice given to this server ended before it started; "
                              "start it again")
            spawner._granted_at = time.monotonic()
            WAIT_SECONDS.labels(profile=offer.key, group=entry.group).observe(
                spawner._granted_at - joined)
            if last is not None:
                spawner.progress_log.add(WAIT_PROGRESS + 5,
                                         f"Your turn: a {offer.key} slice was released")
            return lease
        if entry.state == "expired":
            raise Refused(Reason.NONE_FREE, await _expired_message(spawner, waiting))
        if entry.state != "waiting":
            raise Refused(Reason.NONE_FREE, f"Your wait for a {offer.key} slice ended "
                          f"({entry.reason or entry.state}); start it again")
        if not waiting.drained:
            continue
        if not queue:
            others = (waiting.position or 1) - 1
            raise Refused(Reason.NONE_FREE,
                          f"No {offer.key} slice is free right now"
                          + (f" and {others} spawn(s) wait for one" if others > 0 else "")
                          + "; your group cannot wait for one: try again later")
        message = await _place_message(spawner, waiting)
        if message != last:
            if last is None:
                log.info("%s waits for a %s slice (entry %d)", spawner._log_name, offer.key,
                         entry.id)
            spawner.progress_log.add(WAIT_PROGRESS, message[0], html=message[1])
            last = message


async def _free_instead(spawner: MIGSpawnerMixin, waiting: Waiting) -> list[str]:
    """Keys of the user's other offers that are free to take right now."""
    try:
        choices = await spawner.current_choices(waiting.mine)
    except tuple(spawner.backend_errors):
        return []
    return [c.key for c in choices if c.key != waiting.offer.key and c.available and c.free]


async def _place_message(spawner: MIGSpawnerMixin, waiting: Waiting) -> tuple[str, str]:
    """What the pending page says: place, estimate, and what is free instead (text and
    HTML, the latter with a link that starts the server with the free offer)."""
    place = waiting.position or 1
    guess = waiting.estimate.said("estimated") if waiting.estimate else "no estimate yet"
    text = f"{ordinal(place)} in line for a {waiting.offer.key} slice; {guess}"
    html = escape(text)
    free = await _free_instead(spawner, waiting)
    if free:
        other = free[0]
        text += f". {other} is free now: stop this wait and start with {other} instead"
        html += (f". {escape(other)} is free now: stop this wait, then "
                 f'<a href="{escape(spawner.switch_url(other))}">start with {escape(other)} '
                 "instead</a>")
    return text, html


async def _expired_message(spawner: MIGSpawnerMixin, waiting: Waiting) -> str:
    entry = waiting.entry
    seconds = (entry.deadline - entry.joined_at).total_seconds() if entry.deadline else 0
    waited = f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
    free = await _free_instead(spawner, waiting)
    instead = (f"{free[0]} is free now: start with it instead" if free
               else "try again later")
    return (f"Waited {waited} (the longest your group may wait) and no "
            f"{waiting.offer.key} slice was released; {instead}")

