"""MIGSpawnerMixin: one MIG slice per notebook server, for any JupyterHub Spawner.

The mixin adds, on top of a concrete spawner (``LocalProcessSpawner`` in
``local.py``): the spawn form, server-side validation of ``user_options``, the
lease (claimed in the ledger before the server starts, released on every way a
server can end), the environment that points CUDA at the slice, persisted
state, and progress events. Where JupyterHub calls what:

* ``start``: validate, claim, make the slice (``after_claim``), start, activate.
  Any failure or timeout releases what was claimed before it propagates.
* ``stop``: after the server stopped, release.
* ``poll``: a dead server releases its lease at once. JupyterHub skips ``stop()``
  when ``poll()`` says the server is gone, and after a hub restart it polls every
  server it had (``load_state`` restored the lease id), so a server that died
  while the hub was down frees its slice and a live one keeps it. A server whose
  state the hub never saved (killed mid-spawn) is found by its name in the ledger.

Every release goes through the one release path (``mig_spawner.release.Releaser``):
it checks the lease's holder (``mig_spawner.holder``: the recorded server process, and
any process whose environment names the slice's device or the lease, or that the GPU
lists on it). What still runs untracked is stopped (TERM, then KILL) before the slice
is freed; a holder that cannot be checked keeps its slice and is reported. A give-back
that is held back is marked in the lease and retried within seconds.

Every refusal is counted on the hub's ``/hub/metrics`` (``metrics.py``) and, when it
names an offer, kept in the ledger for ``mig-spawner report``. A backend that cannot
be read gives a spawn form that says so instead of an error page.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar
from urllib.parse import quote, urlencode, urlsplit

from jupyterhub.spawner import Spawner, SpawnException
from jupyterhub.utils import AnyTimeoutError, wait_for_http_server
from sqlalchemy import inspect
from traitlets import Bool, Unicode, default

from mig_spawner import holder
from mig_spawner.config import RightsizeConfig
from mig_spawner.core.budget import form_line, spans_of
from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.core.purpose import PURPOSE, clean_purpose
from mig_spawner.core.refusal import Reason, Refused
from mig_spawner.core.waitlist import StarvationGuard
from mig_spawner.gpu.errors import GpuError
from mig_spawner.kinds import Confinement, kind_of
from mig_spawner.ledger import (
    Lease,
    LeaseRequest,
    LeaseStateError,
    LedgerError,
    LedgerView,
    ReleaseCode,
    ServerHasLease,
)
from mig_spawner.release import (
    HolderProbes,
    LocalProcesses,
    Outcome,
    ReleaseEvents,
    Releaser,
    SliceGpus,
    still_holding,
)

from . import form, options, progress, rightsize, waiting
from .backend import ClaimPlan, SliceSupply
from .decide import quota_problem
from .errors import refusal, spawn_error
from .metrics import (
    HOLDERS_STOPPED,
    LEASES_CLAIMED,
    LEASES_RELEASED,
    RELEASES_HELD_BACK,
    SERVER_ANSWER,
    SPAWN_REFUSALS,
)
from .progress import ProgressLog
from .settings import MIGSpawnerSettings
from .warnings import warning_environment

STATE_KEY = "mig_lease_id"


class HubReleaseEvents(ReleaseEvents):
    """What the hub counts of its give-backs (``/hub/metrics``), and the grant step it
    runs on the releasing thread and wakes on the event loop after each release."""


    def stopping(self, lease: Lease, found: holder.HolderCheck) -> None:
        HOLDERS_STOPPED.inc()

    def holder_unknown(self, lease: Lease, found: holder.HolderCheck, retry: bool) -> None:
        if not retry:
            RELEASES_HELD_BACK.labels(why="holder_unknown").inc()

    def retrying(self, lease_id: str) -> None:
        RELEASES_HELD_BACK.labels(why="giveback_failed").inc()

    def freed(self, lease: Lease) -> None:
        waiting.freed()

    def released(self, lease: Lease, code: ReleaseCode) -> None:
        LEASES_RELEASED.labels(reason=code).inc()
        waiting.released()


async def _options_form(spawner: MIGSpawnerMixin) -> str:
    """``Spawner.options_form`` as a callable: JupyterHub calls it with the spawner."""
    return await spawner.render_options_form()


class MIGSpawnerMixin(MIGSpawnerSettings, Spawner):
    """Gives each server exactly one NVIDIA MIG slice that the user's groups allow.

    Mix in before a concrete Spawner: ``class X(MIGSpawnerMixin, LocalProcessSpawner)``.
    Group policies come from ``c.MIGPolicyConfig`` (shared with the slice service).

    Each backend (``local.py``: this host's GPUs; ``kube.py``: a cluster) answers what
    only it knows through these hooks, in the order ``start`` calls them:

    * :meth:`read_fleet` (required): one read of the GPUs or nodes, from which
      :meth:`supply_from` (required) gives the models and free slices for the form, and
      :meth:`plan_claim` (required) how the ledger claims a slice now.
    * :meth:`after_claim`: make the claimed slice (local dynamic mode creates it).
    * :meth:`prepare_slice`: make it usable by the server (device cgroup, pod request).
    * :meth:`slice_environment`: the variables that point the server at its slice.
    * :meth:`activation_details` and :meth:`address_details`: what the lease records
      once the server runs, and where the slice service reaches it.
    """

    #: Where this backend's GPUs are, in the words of the spawn form.
    supply_scope: ClassVar[str] = "on this host"
    #: Errors that mean a backend cannot be read now -> what it is, for messages.
    backend_errors: ClassVar[dict[type[Exception], str]] = {
        GpuError: "The GPU inventory",
        LedgerError: "The lease ledger",
    }

    # The lease this server holds; persisted (get_state) so a restarted hub knows it.
    lease_id = Unicode(None, allow_none=True)

    show_unavailable_offers = Bool(
        False,
        help="""Show offers that no GPU here can serve at all on the spawn form.

        By default a size the user's groups allow but that no GPU (no node) has, and,
        with a fixed layout (pool mode, Kubernetes), one with no instance at all, is left
        off the form: users cannot get it by waiting. ``mig-spawner doctor`` and the
        start-up check tell admins about it. True shows it greyed out with the reason
        (*this host has no such slice (ask a hub admin)*).
        """,
    ).tag(config=True)

    @default("options_form")
    def _default_options_form(self) -> Any:
        return _options_form

    @default("options_from_form")
    def _default_options_from_form(self) -> Any:
        return self._options_from_form

    @default("apply_user_options")
    def _default_apply_user_options(self) -> Any:
        # JupyterHub calls it before start(): the options are handled (no "unhandled
        # user_options" warning) and a REST body without any is refused, not replaced.
        return lambda spawner, sent: spawner._apply_options(
            options.as_requested(spawner.handler, sent))

    def _options_from_form(self, form_data: dict) -> dict:
        """Form post or ``?opt-`` query -> ``user_options``, refused here already when
        invalid so that the form comes back with the reason, in a sentence (start()
        checks again)."""
        user_options = options.options_from_form(form_data)
        self._validate(user_options, for_form=True)
        return user_options

    def _apply_options(self, sent: Any) -> None:
        """JupyterHub's ``apply_user_options``: a start that names no slice (an admin's
        "Start Server" or "Start All", a REST spawn without options) gets the user's
        default offer, or is refused naming the missing choice; then validate.

        A refusal is raised from :meth:`run_pre_spawn_hook`, which JupyterHub calls next:
        JupyterHub logs every error of ``apply_user_options`` with a traceback, where an
        expected refusal is one line ("Not starting ...: <reason>"), and the API answers
        it alike (the admin page shows it)."""
        self._refused_options = None
        try:
            self._default_and_validate(sent)
        except SpawnException as e:
            self._refused_options = e

    #: A refusal of the options JupyterHub applied (:meth:`_apply_options`), not raised yet.
    _refused_options: SpawnException | None = None

    def _default_and_validate(self, sent: Any) -> None:
        mine = self.user_policy(self.policies())
        chosen = options.with_default(sent, mine)
        if chosen is not sent:
            self.log.info("Start of %s names no slice: it gets its group's default_offer %r",
                          self._log_name, chosen[options.PROFILE])
        elif (isinstance(sent, dict) and not sent.get(options.PROFILE)
              and mine.has_gpu_access):
            refused = options.no_default_refusal(mine)
            raise self._refuse(refused.reason, refused.message, mine)
        self.user_options = chosen
        self._validate(chosen)

    async def held_leases(self) -> list[Lease]:
        """The ledger's held leases, read on a worker thread."""
        return await self.runtime.run(lambda: self.runtime.ledger().leases.active())

    def backend_problem(self, e: Exception) -> str:
        """What the user hears when a backend cannot be read: what, why, what to do.

        The error itself names database URLs, device paths or files, which are the
        admin's business (it is logged); users only hear what is unavailable.
        """
        return (
            f"{self._backend_name(e)} cannot be read right now. Try again in a "
            "minute; if it persists, tell a hub admin."
        )

    def _backend_error(self, e: Exception) -> SpawnException:
        """503 (try again later) with the plain message; the details go to the hub log."""
        self.log.error("Spawn of %s: %s", self._log_name, _log_detail(e))
        return spawn_error(
            self.backend_problem(e), Reason.MIG_BACKEND, log_message=_log_detail(e)
        )

    def _backend_name(self, e: Exception) -> str:
        return next(
            (name for kind, name in self.backend_errors.items() if isinstance(e, kind)),
            "The GPU inventory",
        )

    # --- the backend hooks (local.py answers them for this host, kube.py for a cluster) --

    #: Whether :meth:`fleet_here` reads the fleet on a worker thread, without awaits
    #: (a local host's GPUs; a cluster's API is read with awaits): then a grant pass
    #: may run wholly on the thread that released a slice.
    reads_fleet_here: ClassVar[bool] = False

    def fleet_here(self) -> Any:
        """On a worker thread: what :meth:`read_fleet` reads, where
        :attr:`reads_fleet_here`."""
        raise NotImplementedError

    async def read_fleet(self) -> Any:
        """One read of what this backend has (this host's GPUs, the cluster's nodes):
        :meth:`plan_claim` and :meth:`supply_from` answer from it without reading again,
        so that a wait-list pass reads the fleet once for all its waiters.

        May raise any error in :attr:`backend_errors`.
        """
        raise NotImplementedError

    def plan_claim(self, fleet: Any, offer: Offer, mine: UserPolicy) -> ClaimPlan:
        """How to claim one slice of ``offer`` for a user with policy ``mine`` on
        ``fleet`` (a :meth:`read_fleet`); no I/O."""
        raise NotImplementedError

    def supply_from(self, fleet: Any, held: Sequence[Lease]) -> SliceSupply:
        """What the form shows of ``fleet`` with ``held`` leased; no I/O."""
        raise NotImplementedError

    async def slice_supply(self) -> SliceSupply:
        """The GPU models present, the free slices per model and profile, the held leases.

        May raise any error in :attr:`backend_errors`; the form then says so.
        """
        fleet, held = await asyncio.gather(self.read_fleet(), self.held_leases())
        return self.supply_from(fleet, held)

    async def claim_decide(self, offer: Offer, mine: UserPolicy) -> ClaimPlan:
        """How to claim one slice of ``offer`` for a user with policy ``mine`` now, on a
        fresh read of the fleet. May raise any error in :attr:`backend_errors`."""
        return self.plan_claim(await self.read_fleet(), offer, mine)

    def plan_here(self, offer: Offer, mine: UserPolicy
                  ) -> Callable[[dict[Any, Any]], ClaimPlan] | None:
        """A way to plan the claim on the worker thread that claims, so that the plan
        and the claim take one trip (each trip waits for a turn of the hub's event loop,
        which a class start keeps busy), from the fleet read its claim pass shares (the
        argument: each read of the pass, by what it is a read of; ``waiting.ClaimPasses``);
        ``None`` when the fleet is read with awaits (a cluster's API):
        :meth:`claim_decide` plans first."""
        return None

    async def after_claim(self, lease: Lease) -> Lease:
        """Make the claimed slice (e.g. create the instance) and return the lease as
        recorded then; by default the slice exists already. Raise SpawnException to
        refuse (the lease is then released)."""
        return lease

    def wait_guard(self) -> StarvationGuard | None:
        """How long a larger waiter may be passed over by smaller ones that fit
        (docs/policies.md, "Waiting"); ``None``: never passed over, because the slices
        exist beforehand and a smaller one never fits where a larger one would."""
        return None

    def slice_environment(self, lease: Lease) -> dict[str, str]:
        """Variables that point the server at its slice (its kind's); they win over
        ``environment``."""
        return kind_of(lease).environment(lease)

    def activation_details(self, lease: Lease) -> dict[str, Any]:
        """What the lease records once the server runs (``ledger.leases.activate`` keywords).
        A local dynamic instance is recorded as soon as it is created, so nothing."""
        return {}

    def address_details(self, started: Any) -> dict[str, Any]:
        """The server's internal URL, for the lease: the slice service reads the server
        there, not through the proxy, whose routes would count its reads as the user's
        activity. ``started`` is what the backend's ``start`` returned: ``(ip, port)``
        or a URL (JupyterHub accepts both)."""
        if self.server is None:  # a spawner driven without a hub (tests)
            return {}
        if isinstance(started, tuple):
            ip, port = started
            host = f"[{ip}]" if ":" in str(ip) else str(ip)
            origin = f"{self.server.proto}://{host or '127.0.0.1'}:{port}"
        elif isinstance(started, str) and started:
            parts = urlsplit(started)
            origin = f"{parts.scheme}://{parts.netloc}"
        else:
            return {}
        return {"server_url": origin + self.server.base_url}

    # --- the form -------------------------------------------------------------------

    def last_choice(self, key: str = options.PROFILE) -> str | None:
        """The option ``key`` this server was last started with (JupyterHub keeps
        user_options): by default the offer, or its purpose (``PURPOSE``)."""
        saved = self.user_options or (self.orm_spawner.user_options if self.orm_spawner else None)
        value = (saved or {}).get(key)
        return value if isinstance(value, str) else None

    async def render_options_form(self) -> str:
        """The spawn form for this user: allowed offers, what each gives, what is free."""
        policies = self.policies()
        mine = self.user_policy(policies)
        try:
            supply = await self.slice_supply()
        except tuple(self.backend_errors) as e:
            # The form still comes, saying why nothing can be picked now, not a 500 page.
            self.log.error("Spawn form of %s shows no slices: %s", self._log_name,
                           _log_detail(e))
            return form.render_form(form.blocked_choices(mine), problem=self.backend_problem(e))

        choices = await self.current_choices(mine, supply)
        return form.render_form(choices, self.last_choice(),
                                notice=await waiting.ended_notice(self),
                                purpose=mine.purpose, last_purpose=self.last_choice(PURPOSE),
                                hint=await self._rightsize_hint(mine, supply, choices))

    async def _rightsize_hint(self, mine: UserPolicy, supply: SliceSupply,
                              choices: list[form.Choice]) -> str | None:
        """What the user's measured past sessions say about the size the form
        preselects (docs/analyst-guide.md, "Right-sizing"); none when the ledger
        cannot be read (logged: the form is more important than the hint)."""
        try:
            return await rightsize.form_hint(
                self.runtime.run, self.runtime.ledger, self.user.name, mine, supply.models,
                form.preselect(choices, self.last_choice()),
                RightsizeConfig(config=self.config).rule())
        except tuple(self.backend_errors) as e:
            self.log.warning("No right-sizing hint for %s: %s", self._log_name,
                             _log_detail(e))
            return None

    async def current_choices(
        self, mine: UserPolicy, supply: SliceSupply | None = None
    ) -> list[form.Choice]:
        """The form's choices for a user with policy ``mine`` now. May raise any error
        in :attr:`backend_errors`."""
        supply = supply or await self.slice_supply()
        return self.choices_from(mine, supply, await waiting.form_lines(self, mine),
                                 await self.budget_book(mine, supply))

    async def budget_book(self, mine: UserPolicy, supply: SliceSupply) -> LedgerView | None:
        """What the budgets of the user's groups count now (the leases released within
        the longest window and the extra hours), as a claim would see it; ``None``
        when none of their groups has a budget."""
        windows = [g.budget_window for g in mine.groups if g.has_budget]
        if not windows:
            return None
        now = datetime.now(UTC)
        since = now - timedelta(seconds=max(windows))
        leases, extras = await self.runtime.run(
            lambda: self.runtime.ledger().usage.budget(since))
        return LedgerView(LeaseRequest(self.user.name, self.name or ""), supply.held, now,
                          past=tuple(x for x in leases if not x.held), extras=tuple(extras))

    def choices_from(
        self, mine: UserPolicy, supply: SliceSupply, lines: dict[str, str] | None = None,
        book: LedgerView | None = None,
    ) -> list[form.Choice]:
        """The form's choices for a user with policy ``mine`` on ``supply`` (also what a
        waiting spawn offers instead); ``lines``: the wait list's state per offer;
        ``book``: what budgets count (:meth:`budget_book`), to show where they stand."""

        def quota(offer: Offer, compute: int) -> str | None:
            refusal = quota_problem(mine, offer, compute, supply.held, self.user.name, book)
            if refusal is None:
                return None
            # A spent budget says when it can succeed: that is in its hint.
            return refusal.sentence if refusal.retry_at else refusal.message

        def budget_line(offer: Offer, compute: int) -> str | None:
            groups = mine.charge_candidates(offer.key)
            if book is None or not groups:
                return None
            spans = spans_of(book.leases, book.past)
            return form_line(groups[0], self.user.name, compute, spans, book.extras, book.now)

        return form.build_choices(
            mine, supply.models, supply.free, quota, scope=self.supply_scope, waits=lines,
            in_use=Counter(lease.profile for lease in supply.held),
            fixed_layout=supply.fixed_layout, hide_absent=not self.show_unavailable_offers,
            budget_line=budget_line,
            recut=supply.recut, unhealthy=supply.unhealthy,
        )

    def switch_url(self, offer_key: str, purpose: str | None = None) -> str:
        """The hub page that starts this server with ``offer_key`` (and ``purpose``, what
        it was for), as the form's ``?opt-`` query does."""
        server = f"/{quote(self.name)}" if self.name else ""
        query = {f"opt-{options.PROFILE}": offer_key}
        if purpose:
            query[f"opt-{PURPOSE}"] = purpose
        return f"{self.hub.base_url}spawn/{quote(self.user.name)}{server}?{urlencode(query)}"

    # --- start ----------------------------------------------------------------------

    def _refuse(
        self, reason: str, message: str, mine: UserPolicy, offer: Offer | None = None,
        plan: ClaimPlan | None = None,
    ) -> SpawnException:
        """The SpawnException for a refused spawn, counted and kept for ``mig-spawner
        report`` first. ``offer``: what was asked for, when it names an offer of the hub;
        ``plan``: the claim's plan, when the backend got that far."""
        group = refusal_group(mine, offer.key if offer else None)
        SPAWN_REFUSALS.labels(reason=reason, group=group or "").inc()
        if offer is not None:
            request = LeaseRequest(self.user.name, self.name or "")
            profile = plan.profile if plan else (None if offer.is_class else offer.key)
            host = plan.host if plan else None

            def record() -> None:
                self.runtime.ledger().refusals.record(
                    request, offer=offer.key, reason=reason, message=message,
                    profile=profile, group=group, host=host,
                )

            # Written on a worker thread without waiting: the user hears why at once,
            # and a ledger that cannot be written must not turn a refusal into an error.
            self.runtime.submit(record).add_done_callback(self._recorded)
        return refusal(reason, message)

    def _recorded(self, done: Future) -> None:
        if (e := done.exception()) is not None:
            self.log.warning("Could not record the refused spawn of %s: %s", self._log_name, e)

    def _validate(self, user_options: Any, for_form: bool = False) -> tuple[Offer, UserPolicy]:
        """The offer ``user_options`` asks for and the user's policy, or SpawnException
        (its purpose is checked too). ``for_form``: they came from the spawn page, so a
        refusal is a sentence for the person there."""
        policies = self.policies()
        mine = self.user_policy(policies)
        try:
            offer = options.requested_offer(user_options, mine, policies, for_form=for_form)
            clean_purpose(user_options.get(PURPOSE), mine.purpose, for_form=for_form)
            return offer, mine
        except Refused as e:
            offer = options.named_offer(user_options, policies)
            raise self._refuse(e.reason, e.message, mine, offer) from None

    @property
    def progress_log(self) -> ProgressLog:
        log = getattr(self, "_progress_log", None)
        if log is None:
            log = self._progress_log = ProgressLog()
        return log

    def run_pre_spawn_hook(self) -> Any:
        """Right after JupyterHub applied the options and before it reads
        ``start_timeout``: refuse options that :meth:`_apply_options` refused, let a
        queued spawn wait (``waiting.start_bounds``), then the admin's ``pre_spawn_hook``."""
        refused, self._refused_options = self._refused_options, None
        if refused is not None:
            raise refused
        if self._configured_timeouts is None:
            self._configured_timeouts = (self.start_timeout, self.http_timeout)
        bounds = waiting.start_bounds(self, *self._configured_timeouts)
        self.start_timeout, self.http_timeout = bounds.start_timeout, bounds.http_timeout
        return super().run_pre_spawn_hook()

    #: The admin's ``start_timeout`` and ``http_timeout``, read before the first spawn
    #: raised them (``run_pre_spawn_hook``): what the next spawn starts from again.
    _configured_timeouts: tuple[int, int] | None = None

    async def start(self) -> Any:
        """Claim a slice, start the server on it, and give the slice back if that fails."""
        self._progress_log = ProgressLog()
        try:
            offer, mine = self._validate(self.user_options)
            claimed = await self._claim(offer, mine)
            lease = claimed.lease
            assert lease is not None  # a claim that returns has its lease
            try:
                await self._record_purpose(lease, mine)
                lease = await self.after_claim(lease)
                await self.prepare_slice(lease)
                self.progress_log.add(70, "Starting your server")
                return await self._start_until_answering(lease, claimed.granted_at)
            except BaseException as e:
                # Includes CancelledError: JupyterHub cancels start() at start_timeout.
                self.log.warning("Start of %s failed, giving its slice back", self._log_name)
                await self._release(ReleaseCode.START_FAILED, type(e).__name__)
                raise
        except asyncio.CancelledError:
            # JupyterHub cancels a pending spawn that it is asked to stop (Stop on the
            # waiting page, DELETE of the server) and, unlike after a failed start, keeps
            # the server's record until that stop runs a second later. Its progress
            # stream would call the spawn ready in that gap, and the browser then loop
            # on a server that is not there. Without the record it is a cancelled spawn.
            self.log.info("Start of %s cancelled", self._log_name)
            self.server = None
            # Written at once: the next request handler that finishes with the hub's
            # session dirty rolls it back (JupyterHub's BaseHandler.finish), which brought
            # the record back, and with it a "ready" server that never started, which
            # the slice service then read through the proxy (a 424, counted as activity).
            record = inspect(self.orm_spawner, raiseerr=False)  # None: not a database row
            if record is not None and record.session is not None:
                record.session.commit()
            raise
        finally:
            self.progress_log.finish()

    #: How many times a server that exits or does not answer is started on its slice
    #: before the start fails (docs/operations.md, "Starting on a loaded host").
    answer_tries: ClassVar[int] = 1

    async def _start_until_answering(self, lease: Lease, granted_at: float | None) -> Any:
        """Start the server on its slice and wait for it to answer: JupyterHub gives it
        ``http_timeout`` (30 s by default) and then stops it, which a loaded host
        overran. The wait lasts while its process lives, up to ``http_timeout`` as
        ``start_bounds`` fitted it to the measured answers (``core.answer``). A server
        that exits or does not answer in time is started once more on the same slice
        (``answer_tries``), which it keeps meanwhile: it is not given back, nor is a
        waiter's place lost. The backend's start is held to ``start_timeout`` from
        ``granted_at`` (after a wait in line; ``None``: from now), then from each start
        again."""
        configured = (self._configured_timeouts or (self.start_timeout,))[0]
        for attempt in range(1, self.answer_tries + 1):
            tic = time.monotonic()
            url = await waiting.within_start_timeout(self, super().start(), configured,
                                                     granted_at)
            await self._activate(lease, url)
            failed = await self._until_answering(url, tic)
            if failed is None:
                return url
            self.log.warning("%s %s (start %d of %d on lease %s)", self._log_name, failed,
                             attempt, self.answer_tries, lease.id)
            if attempt == self.answer_tries:
                raise spawn_error(f"Your server {failed}; start it again, or tell a hub "
                                  "admin if it keeps failing.", Reason.SERVER_START)
            self.progress_log.add(70, f"Your server {failed}; starting it once more on "
                                  "the same slice")
            await self._stop_for_restart()
            granted_at = time.monotonic()  # the start timeout counts from here
        raise AssertionError("unreachable: the last try returns or raises")

    async def _stop_for_restart(self) -> None:
        """Stop the server's process, keeping its slice and its token for the next start
        (the concrete stop polls, which would give the lease back, and clears the
        token)."""
        token, self._restarting = self.api_token, True
        try:
            await super().stop(now=True)
        finally:
            self._restarting = False
            self.api_token = token

    #: Set while a server that did not answer is stopped to start again on its slice.
    _restarting = False

    async def _until_answering(self, started: Any, tic: float) -> str | None:
        """Wait until the server at ``started`` answers, as JupyterHub would check it
        (``api`` under its URL); ``None`` once it does, else what went wrong. Left to
        JupyterHub's own check where this cannot reach it (no server record, internal
        SSL)."""
        url = self.address_details(started).get("server_url")
        if url is None or self.internal_ssl:
            return None
        bound = self.http_timeout
        answer = asyncio.ensure_future(wait_for_http_server(url + "api", timeout=bound))
        try:
            while not (await asyncio.wait({answer}, timeout=1.0))[0]:
                if await super().poll() is not None:
                    return "stopped before it answered"
            answer.result()
        except AnyTimeoutError:
            return f"did not answer within {bound} s"
        finally:
            answer.cancel()
        took = time.monotonic() - tic
        self.runtime.answers.append(took)
        SERVER_ANSWER.observe(took)
        self.log.info("%s answered %.1f s after its start", self._log_name, took)
        return None

    async def _activate(self, lease: Lease, url: Any) -> None:
        """Record the server process in the lease (its holder) and mark it active.

        Right after the spawn: a hub that dies from here on leaves a lease that names
        the process, which whoever releases the lease stops first. (Before this, the
        process is found by ``MIG_SPAWNER_LEASE_ID`` in its environment.)
        """
        details = {**self.activation_details(lease), **self.address_details(url)}
        spawned = holder.current(getattr(self, "pid", 0) or 0)
        if spawned is not None:
            details.update(holder_host=holder.this_host(), holder_pid=spawned.pid,
                           holder_start=spawned.start)
        try:
            # One write: the process is recorded in the same transaction that makes
            # the lease active.
            await self.runtime.run(
                lambda: self.runtime.ledger().leases.activate(lease.id, **details))
        except LeaseStateError as e:
            raise spawn_error(
                "The slice reserved for this server was given back while it was starting; "
                "start it again.",
                reason=Reason.LEASE_ENDED, log_message=str(e),
            ) from None
        except tuple(self.backend_errors) as e:
            raise self._backend_error(e) from None

    async def _record_purpose(self, lease: Lease, mine: UserPolicy) -> None:
        """Write what the server is for on its lease (checked in ``_validate``), for the
        slice map, ``mig-spawner status`` and the report; never a metrics label."""
        purpose = clean_purpose((self.user_options or {}).get(PURPOSE), mine.purpose)
        if purpose is None:
            return
        try:
            await self.runtime.run(
                lambda: self.runtime.ledger().leases.record_purpose(lease.id, purpose))
        except tuple(self.backend_errors) as e:
            raise self._backend_error(e) from None

    async def drop_stale_lease(self, stale: Lease) -> None:
        """``stale``, a lease still recorded for this server although it is starting,
        belongs to a server that is gone (e.g. the hub died mid-start): stop what still
        runs for it and release it (``waiting.claim`` then claims again), or refuse in
        plain words when that cannot be done now."""
        code, detail = ReleaseCode.STALE, "server was not running when it started again"
        outcome = await self.releaser().release(stale, code, detail)
        if outcome.done:
            return
        self.releaser().retry_later(stale.id, code, detail)
        try:
            held = await self.runtime.run(lambda: self.runtime.ledger().leases.get(stale.id))
        except tuple(self.backend_errors) as e:
            raise self._backend_error(e) from None
        raise refusal(Reason.PREVIOUS_LEASE, _previous_lease(held or stale))

    async def _claim(self, offer: Offer, mine: UserPolicy) -> waiting.Claim:
        self.progress_log.add(10, progress.reserving(offer.named))
        tic = time.perf_counter()
        claimed = waiting.Claim()
        try:
            # A plain claim, or a place in line when nothing is free (waiting.py).
            await waiting.claim(self, offer, mine, claimed)
        except Refused as e:
            raise self._refuse(e.reason, e.message, mine, offer, claimed.plan) from None
        except ServerHasLease as e:
            # Still held by the last run (a concurrent start got it back meanwhile).
            raise self._refuse(
                Reason.PREVIOUS_LEASE, _previous_lease(e.lease), mine, offer, claimed.plan
            ) from None
        except tuple(self.backend_errors) as e:
            raise self._backend_error(e) from None
        lease, plan = claimed.lease, claimed.plan
        assert lease is not None and plan is not None  # a claim that returns made both
        LEASES_CLAIMED.labels(profile=lease.profile, group=lease.group,
                              mode=kind_of(lease).rules.kind).inc()
        self.lease_id = lease.id
        self._lease = lease
        where = plan.granted(lease)
        self.log.info(
            "Lease %s: %s on %s (%s) for %s, charged to %s, claimed in %.0f ms "
            "(the claim's trip: %.0f ms waiting for a worker thread, %.0f ms there, %.0f ms "
            "waiting for the event loop)",
            lease.id, lease.profile, where, lease.mig_uuid or lease.pod or "to be created",
            self._log_name, lease.group, (time.perf_counter() - tic) * 1000,
            *(seconds * 1000 for seconds in claimed.trip),
        )
        self.progress_log.add(30, progress.reserved(lease.profile, plan.memory(lease), where))
        return claimed

    async def prepare_slice(self, lease: Lease) -> None:
        """Hook for concrete spawners: make the slice usable (device cgroup, nodes) after it
        is reserved and before the server starts. Raise SpawnException to refuse."""

    async def progress(self) -> AsyncIterator[dict]:
        """The steps of the current start, as they happen."""
        async for event in self.progress_log.follow():
            yield event

    # --- environment and state ------------------------------------------------------

    def get_env(self) -> dict[str, str]:
        """The server's environment; the slice variables win over ``Spawner.environment``."""
        env = super().get_env()
        lease = getattr(self, "_lease", None)
        if lease is not None and lease.id == self.lease_id:
            env.update(self.slice_environment(lease))
        env.update(warning_environment(env))
        return env

    def get_state(self) -> dict:
        state = super().get_state()
        if self.lease_id:
            state[STATE_KEY] = self.lease_id
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.lease_id = state.get(STATE_KEY) or None

    # clear_state is deliberately not overridden: JupyterHub calls it in the middle of
    # poll() (LocalProcessSpawner) before the mixin has released the lease. The lease id
    # is dropped only once the lease is released, so it can never be forgotten.

    # --- the end of a server --------------------------------------------------------

    # Set while stop() runs: the concrete stop() polls too, and the lease should say
    # that it ended because it was stopped, not because the server died.
    _stopping = False

    async def poll(self) -> int | None:
        status = await super().poll()
        if status is None or self._restarting:
            return status
        # A cancelled wait's grant is given back as cancelled, not found here as lost.
        await waiting.wait_ended(self)
        if self.lease_id is None and self.pending != "spawn":
            # A hub killed before it saved this server's state (pid, lease id) polls it
            # after its restart as "stopped while the Hub was down": the lease, and
            # the process it may have left running, are found by the server's name.
            try:
                lost = await self.runtime.run(
                    lambda: self.runtime.ledger().leases.active_for_server(
                        self.user.name, self.name or "")
                )
            except tuple(self.backend_errors) as e:
                self.log.error("Poll of %s could not read the ledger: %s", self._log_name,
                               _log_detail(e))
                return status
            if lost is not None:
                self.log.warning("%s has lease %s that the hub did not know of (hub restarted "
                                 "mid-spawn?); releasing it once its holder is gone",
                                 self._log_name, lost.id)
                self.lease_id = lost.id
        if self.lease_id:
            if self._stopping:
                await self._release(ReleaseCode.STOPPED)
            else:
                await self._release(ReleaseCode.SERVER_EXITED, f"status {status}")
        return status

    async def stop(self, now: bool = False) -> None:
        await waiting.wait_ended(self)
        self._stopping = True
        try:
            await super().stop(now=now)
        finally:
            self._stopping = False
        if self.lease_id:
            await self._release(ReleaseCode.STOPPED)

    async def _release(self, code: ReleaseCode, detail: str = "") -> None:
        """Give the slice back through the one release path; what is held back is
        retried within seconds in the background (the releaser owns the retry), and
        the lease id is kept for the next poll or stop until it is done."""
        lease_id, self.lease_id = self.lease_id, None
        if not lease_id:
            return
        outcome = await self.releaser().release(lease_id, code, detail)
        if outcome.done:
            return
        self.lease_id = lease_id

        def done(outcome: Outcome) -> None:
            if self.lease_id == lease_id:
                self.lease_id = None

        self.releaser().retry_later(lease_id, code, detail, done)

    def releaser(self) -> Releaser:
        """This server's way to the one release path (made on first use)."""
        releaser = getattr(self, "_releaser", None)
        if releaser is None:
            releaser = self._releaser = Releaser(
                self.runtime.ledger, self.gpu_access(), self.holder_probes(),
                run=self.runtime.run, grace=self._term_grace(), events=HubReleaseEvents(),
                log=self.log, confinement=self.confinement(),
            )
        return releaser

    def confinement(self) -> Confinement | None:
        """Backend hook: where the servers' confinement is undone once their lease is
        released (the kind's release steps). Here: this host's default places
        (``local.py``: the configured ones; ``kube.py``: none)."""
        return Confinement()

    def gpu_access(self) -> Callable[[], SliceGpus | None]:
        """Backend hook: how the releaser reaches this host's GPUs (called on the
        runtime's worker thread), to destroy a dynamic instance and list a slice's
        processes. Here: the runtime's adapter (``kube.py``: none)."""
        return self.runtime.gpu

    def holder_probes(self) -> HolderProbes:
        """Backend hook: what tells the releaser what holds a lease's slice. Here: the
        processes on this host (``kube.py`` adds the pods)."""
        return HolderProbes(local=LocalProcesses(self.runtime.run, self.gpu_access()))

    def _term_grace(self) -> float:
        """Seconds from SIGTERM to SIGKILL for a holder: the concrete spawner's own."""
        return float(getattr(self, "term_timeout", holder.STOP_GRACE))


def _previous_lease(lease: Lease) -> str:
    """What the user hears while the slice of this server's last run is still held."""
    return (
        f"The slice of this server's last run is not given back yet: {still_holding(lease)}. "
        "Try again in a minute; if it persists, tell a hub admin."
    )


def refusal_group(mine: UserPolicy, offer_key: str | None) -> str | None:
    """The group a refused spawn concerns: the one it would have been charged to, else
    the user's policy groups (e.g. those that do not allow what was asked for)."""
    charged = mine.charge_candidates(offer_key) if offer_key else []
    return charged[0].name if charged else ",".join(mine.group_names) or None


def _log_detail(e: Exception) -> str:
    hint = getattr(e, "hint", "")
    return f"{type(e).__name__}: {e}" + (f" (hint: {hint})" if hint else "")

