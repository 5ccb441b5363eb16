"""MIGSpawnerMixin: one MIG slice per notebook server, for any JupyterHub Spawner.

The mixin adds, on top of a concrete spawner (``LocalProcessSpawner`` in
``local.py``): the spawn form, server-side validation of ``user_options``, the
lease (claimed in the ledger before the server starts, released on every way a
server can end), the environment that points CUDA at the slice, persisted
state, and progress events. Where JupyterHub calls what (see MIG.md):

* ``start``: validate, claim, (dynamic) create the instance, start, activate.
  Any failure or timeout releases what was claimed before it propagates.
* ``stop``: after the server stopped, release.
* ``poll``: a dead server releases its lease at once. JupyterHub skips ``stop()``
  when ``poll()`` says the server is gone, and after a hub restart it polls every
  server it had (``load_state`` restored the lease id), so a server that died
  while the hub was down frees its slice and a live one keeps it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from jupyterhub.spawner import Spawner, SpawnException
from sqlalchemy.engine import make_url
from traitlets import Enum, TraitError, Unicode, default, validate

from mig_spawner.config import MIGPolicyConfig
from mig_spawner.core.catalog import GpuModel, find_model_for_product, model
from mig_spawner.core.inventory import Gpu, Inventory
from mig_spawner.core.policy import Offer, PolicyError, PolicySet, UserPolicy
from mig_spawner.giveback import give_back
from mig_spawner.gpu.errors import GpuError
from mig_spawner.ledger import (
    Lease,
    LeaseRequest,
    LedgerError,
    ServerHasLease,
    url_beside_hub_db,
)

from . import form, options
from .decide import ClaimRefused, free_now, make_decide, quota_problem
from .environment import slice_environment
from .errors import refusal, spawn_error
from .progress import ProgressLog
from .runtime import RuntimeKey, SpawnerRuntime, runtime_for

STATE_KEY = "mig_lease_id"


async def _options_form(spawner: MIGSpawnerMixin) -> str:
    """``Spawner.options_form`` as a callable: JupyterHub calls it with the spawner."""
    return await spawner.render_options_form()


class MIGSpawnerMixin(Spawner):
    """Gives each server exactly one NVIDIA MIG slice that the user's groups allow.

    Mix in before a concrete Spawner: ``class X(MIGSpawnerMixin, LocalProcessSpawner)``.
    Group policies come from ``c.MIGPolicyConfig`` (shared with the slice service).
    """

    mig_mode = Enum(
        ["pool", "dynamic"],
        default_value="pool",
        help="""How slices are made.

        ``pool``: lease MIG instances that an admin created beforehand (``nvidia-smi mig``
        or mig-parted); needs no privilege. ``dynamic``: create a GPU + compute instance
        at spawn, at the placement that keeps the GPU least fragmented, and destroy it
        when the server stops; the hub needs root or the MIG ``config`` capability.
        """,
    ).tag(config=True)

    strategy = Enum(
        ["pack", "spread"],
        default_value="pack",
        help="""Which GPU a new server goes to when several could serve it.

        ``pack`` fills the GPU that is already most used, so whole GPUs stay free for
        big slices; ``spread`` uses the least used GPU first.
        """,
    ).tag(config=True)

    ledger_url = Unicode(
        "",
        help="""SQLAlchemy URL of the lease ledger, shared with the slice service.

        Empty (default): a SQLite file ``mig_spawner_ledger.sqlite`` beside the hub's
        own SQLite database (or in the hub's working directory when the hub's database
        is not a SQLite file). Use a PostgreSQL URL for a hub with many users.
        """,
    ).tag(config=True)

    simulate = Unicode(
        None,
        allow_none=True,
        help="""Use the NVML simulator instead of the real driver (demos and tests).

        A spec such as ``h200x2:layout=1g.18gb*4,2g.35gb,1g.35gb`` (docs/simulator.md).
        None (default): the real driver through NVML.
        """,
    ).tag(config=True)

    sim_state_file = Unicode(
        None,
        allow_none=True,
        help="""JSON file holding the simulated GPUs' state, so that the hub, the slice
        service and the CLI see one simulated host. Only used with ``simulate``.""",
    ).tag(config=True)

    # The lease this server holds; persisted (get_state) so a restarted hub knows it.
    lease_id = Unicode(None, allow_none=True)

    @validate("ledger_url")
    def _check_ledger_url(self, proposal: dict) -> str:
        url = proposal["value"].strip()
        if url:
            try:
                make_url(url)
            except Exception as e:
                raise TraitError(
                    f"ledger_url {url!r} is not a SQLAlchemy URL ({e}); "
                    "use e.g. 'sqlite:////srv/jupyterhub/mig_ledger.sqlite' or "
                    "'postgresql://user@db/mig'"
                ) from None
        return url

    @validate("simulate")
    def _check_simulate(self, proposal: dict) -> str | None:
        spec = proposal["value"]
        if spec is None or not spec.strip():
            return None
        from mig_spawner.gpu.simulator.spec import SpecError, parse_spec

        try:
            parse_spec(spec)
        except SpecError as e:
            raise TraitError(f"simulate: {e}") from None
        return spec.strip()

    @validate("sim_state_file")
    def _check_sim_state_file(self, proposal: dict) -> str | None:
        path = proposal["value"]
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise TraitError(
                f"sim_state_file {path!r}: its folder does not exist; create it or pick "
                "a file in an existing folder"
            )
        return path or None

    @default("options_form")
    def _default_options_form(self) -> Any:
        return _options_form

    @default("options_from_form")
    def _default_options_from_form(self) -> Any:
        return self._options_from_form

    def _options_from_form(self, form_data: dict) -> dict:
        """Form post or ``?opt-`` query -> ``user_options``, refused here already when
        invalid so that the form comes back with the reason (start() checks again)."""
        user_options = options.options_from_form(form_data)
        self._validate(user_options)
        return user_options

    # --- shared runtime, policy -----------------------------------------------------

    def _default_ledger_location(self) -> str:
        hub = getattr(self.user, "settings", {}).get("app")
        return url_beside_hub_db(hub.db_url if hub is not None else None)

    @property
    def runtime(self) -> SpawnerRuntime:
        """The ledger, GPU adapter and worker thread shared by this hub's spawners."""
        return runtime_for(
            RuntimeKey(
                self.ledger_url or self._default_ledger_location(),
                self.simulate,
                self.sim_state_file if self.simulate else None,
            )
        )

    def policies(self) -> PolicySet:
        """The hub's group policies, checked; an admin's mistake stops the spawn."""
        try:
            return MIGPolicyConfig(parent=self).build()
        except PolicyError as e:
            raise spawn_error(
                "The hub's GPU policy configuration is wrong; tell a hub admin.",
                reason="policy_config",
                log_message=str(e),
                status_code=500,
            ) from None

    def user_policy(self, policies: PolicySet) -> UserPolicy:
        return policies.for_user([g.name for g in self.user.groups])

    async def _snapshot(self) -> tuple[Inventory, list[Lease]]:
        """The GPUs and the held leases, read on the worker thread."""

        def read() -> tuple[Inventory, list[Lease]]:
            return self.runtime.gpu().inventory(), self.runtime.ledger().active()

        try:
            return await self.runtime.run(read)
        except (GpuError, LedgerError) as e:
            raise self._backend_error(e) from None

    def _backend_error(self, e: Exception) -> SpawnException:
        hint = getattr(e, "hint", "")
        return spawn_error(
            "The hub cannot read the GPUs or the lease ledger right now; tell a hub admin.",
            reason="mig_backend",
            log_message=f"{type(e).__name__}: {e}" + (f" (hint: {hint})" if hint else ""),
            status_code=500,
        )

    # --- the form -------------------------------------------------------------------

    def last_choice(self) -> str | None:
        """The offer this server was last started with (JupyterHub keeps user_options)."""
        saved = self.user_options or (self.orm_spawner.user_options if self.orm_spawner else None)
        value = (saved or {}).get(options.PROFILE)
        return value if isinstance(value, str) else None

    async def render_options_form(self) -> str:
        """The spawn form for this user: allowed offers, what each gives, what is free."""
        policies = self.policies()
        mine = self.user_policy(policies)
        inventory, held = await self._snapshot()
        free = free_now(inventory, held, self.mig_mode)
        models = [
            m for g in inventory.gpus if g.mig_supported and (m := _model_of(g)) is not None
        ]
        held_tuple = tuple(held)

        def quota(offer: Offer, compute: int) -> str | None:
            refusal = quota_problem(mine, offer, compute, held_tuple, self.user.name)
            return None if refusal is None else refusal.message

        choices = form.build_choices(mine, models, free, quota)
        return form.render_form(choices, self.last_choice())

    # --- start ----------------------------------------------------------------------

    def _refuse(self, reason: str, message: str) -> SpawnException:
        return refusal(reason, message)

    def _validate(self, user_options: Any) -> tuple[Offer, UserPolicy]:
        """The offer ``user_options`` asks for and the user's policy, or SpawnException."""
        policies = self.policies()
        mine = self.user_policy(policies)
        try:
            return options.requested_offer(user_options, mine, policies), mine
        except options.OptionsError as e:
            raise self._refuse(e.reason, e.message) from None

    @property
    def progress_log(self) -> ProgressLog:
        log = getattr(self, "_progress_log", None)
        if log is None:
            log = self._progress_log = ProgressLog()
        return log

    async def start(self) -> Any:
        """Claim a slice, start the server on it, and give the slice back if that fails."""
        self._progress_log = ProgressLog()
        try:
            offer, mine = self._validate(self.user_options)
            await self._drop_stale_lease()
            lease = await self._claim(offer, mine)
            try:
                if self.mig_mode == "dynamic":
                    lease = await self._create_instance(lease)
                await self.prepare_slice(lease)
                self.progress_log.add(70, "Starting your server")
                url = await super().start()
                await self.runtime.run(lambda: self.runtime.ledger().activate(lease.id))
                return url
            except BaseException as e:
                # Includes CancelledError: JupyterHub cancels start() at start_timeout.
                self.log.warning("Start of %s failed, giving its slice back", self._log_name)
                await self._release(f"start-failed: {type(e).__name__}")
                raise
        finally:
            self.progress_log.finish()

    async def _drop_stale_lease(self) -> None:
        """A lease still recorded for this server although it is starting belongs to a
        server that is gone (e.g. the hub died mid-start): release it first."""
        name = self.name or ""
        stale = await self.runtime.run(
            lambda: self.runtime.ledger().active_for_server(self.user.name, name)
        )
        if stale is not None:
            self.lease_id = stale.id
            await self._release("stale: server was not running when it started again")

    async def _claim(self, offer: Offer, mine: UserPolicy) -> Lease:
        self.progress_log.add(10, f"Reserving a {offer.display_name or offer.key} slice")
        tic = time.perf_counter()
        request = LeaseRequest(self.user.name, self.name or "")

        def claim() -> tuple[Inventory, Lease]:
            # Read the GPUs and claim in one trip to the worker thread.
            inventory = self.runtime.gpu().inventory()
            decide = make_decide(mine, offer, inventory, self.mig_mode, self.strategy)
            return inventory, self.runtime.ledger().claim(request, decide)

        try:
            inventory, lease = await self.runtime.run(claim)
        except ClaimRefused as e:
            raise self._refuse(e.reason, e.message) from None
        except ServerHasLease as e:
            # Left "releasing" by the last stop: processes still use its instance.
            raise self._refuse(
                "previous_lease",
                f"the slice of this server's last run is not given back yet "
                f"({e.lease.release_reason}); stop the processes still using it or ask a "
                "hub admin, then start again",
            ) from None
        except (GpuError, LedgerError) as e:
            raise self._backend_error(e) from None
        self.lease_id = lease.id
        self._lease = lease
        self.log.info(
            "Lease %s: %s (%s) on GPU %s for %s, charged to %s, claimed in %.0f ms",
            lease.id, lease.profile, lease.mig_uuid or "to be created", lease.gpu_index,
            self._log_name, lease.group, (time.perf_counter() - tic) * 1000,
        )
        self.progress_log.add(
            30, f"Reserved a {lease.profile} slice on GPU {lease.gpu_index} "
            f"({_gpu_name(inventory, lease)})"
        )
        return lease

    async def _create_instance(self, lease: Lease) -> Lease:
        """Dynamic mode: create the reserved instance and record it in the lease at once,
        so that whoever releases the lease (this spawner or the slice service) knows
        which instance to destroy, even if the hub dies before the server starts."""
        self.progress_log.add(40, f"Creating the {lease.profile} instance on GPU {lease.gpu_index}")

        def create() -> Lease:
            gpu = self.runtime.gpu()
            device = gpu.create_instance(lease.gpu_index, lease.profile, lease.start)
            try:
                return self.runtime.ledger().record_instance(
                    lease.id, mig_uuid=device.uuid, gi_id=device.gi_id, ci_id=device.ci_id
                )
            except LedgerError:
                # The lease ended meanwhile: nobody else knows this instance exists.
                gpu.destroy_instance(lease.gpu_index, device.gi_id)
                raise

        try:
            lease = await self.runtime.run(create)
        except GpuError as e:
            raise spawn_error(
                f"Could not create the {lease.profile} instance on GPU {lease.gpu_index}; "
                "try again, or tell a hub admin if it keeps failing.",
                reason="mig_create",
                log_message=str(e),
                status_code=503,
            ) from None
        except LedgerError as e:
            raise self._backend_error(e) from None
        self._lease = lease
        self.progress_log.add(60, f"Created instance {lease.mig_uuid}")
        return lease

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
            env.update(slice_environment(lease))
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
        if status is not None and self.lease_id:
            await self._release("stopped" if self._stopping else f"server-exited (status {status})")
        return status

    async def stop(self, now: bool = False) -> None:
        self._stopping = True
        try:
            await super().stop(now=now)
        finally:
            self._stopping = False
        if self.lease_id:
            await self._release("stopped")

    async def _release(self, reason: str) -> None:
        """Give the slice back: destroy a dynamic instance, then release the lease.

        An instance that still runs processes is not destroyed: its lease is left
        ``releasing`` (still holding the slice) for the slice service to finish, and
        the PIDs are logged.
        """
        lease_id, self.lease_id = self.lease_id, None
        if not lease_id:
            return

        def release() -> str:
            ledger = self.runtime.ledger()
            lease = ledger.get(lease_id)
            if lease is None or not lease.held:
                return "already released"
            gpus = self.runtime.gpu() if lease.mode == "dynamic" else None
            return give_back(ledger, gpus, lease, reason)

        try:
            outcome = await self.runtime.run(release)
        except (GpuError, LedgerError) as e:
            # Keep the id so that the next poll or stop tries again.
            self.lease_id = lease_id
            self.log.error("Could not release lease %s of %s: %s", lease_id, self._log_name, e)
            return
        self.log.info("Lease %s of %s: %s (%s)", lease_id, self._log_name, outcome, reason)


def _model_of(gpu: Gpu) -> GpuModel | None:
    if gpu.model_key:
        return model(gpu.model_key)
    return find_model_for_product(gpu.product)


def _gpu_name(inventory: Inventory, lease: Lease) -> str:
    gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
    return gpu.product if gpu else "unknown GPU"
