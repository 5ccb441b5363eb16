"""MIG spawners for one GPU host: servers as local processes, one MIG slice each.

``LocalMIGSpawner`` (entry point ``mig``) runs each server as its user, like
JupyterHub's default ``LocalProcessSpawner``. ``SimpleLocalMIGSpawner``
(``mig-simple``) runs every server as the hub's own user with a per-user home
under a template path: for demos and tests, as JupyterHub's ``simple`` spawner.

With ``isolation = True`` each server starts inside a transient systemd scope
whose device cgroup admits only its own slice's device nodes (isolation.py).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Bool, Enum, Unicode

from mig_spawner.core.inventory import Inventory
from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.core.refusal import Reason
from mig_spawner.core.waitlist import StarvationGuard
from mig_spawner.gpu.errors import GpuError
from mig_spawner.ledger import Lease, LeaseStateError, LedgerError

from .backend import ClaimPlan, SliceSupply
from .decide import free_now, make_decide, wanted_profiles
from .errors import admin_error, spawn_error
from .isolation import capability_paths, device_rules, systemd_run_args
from .mixin import MIGSpawnerMixin


@dataclass(frozen=True)
class LocalFleet:
    """One read of this host: its GPUs, and the request mix dynamic placement weighs."""

    inventory: Inventory
    demand: dict[str, int] | None


class LocalMIGSpawner(MIGSpawnerMixin, LocalProcessSpawner):
    """A local-process spawner that gives each server one MIG slice."""

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

    isolation = Bool(
        False,
        help="""Confine each server to its slice with the device cgroup (needs systemd).

        The server starts under ``systemd-run --scope -p DevicePolicy=closed
        -p DeviceAllow=...`` allowing only /dev/nvidiactl, /dev/nvidia-uvm(-tools), its
        GPU's /dev/nvidia<N> and its GI/CI capability nodes, which the hub creates first
        with ``nvidia-modprobe -f``. Without it, ``CUDA_VISIBLE_DEVICES`` only asks CUDA
        to use the slice: a user can change it. See docs/admin-install.md.
        """,
    ).tag(config=True)

    nvidia_modprobe = Unicode(
        "nvidia-modprobe",
        help="Command that creates the MIG capability device nodes (with isolation on).",
    ).tag(config=True)

    _configured_cmd: list[str] | None = None

    # --- the backend hooks (see MIGSpawnerMixin) -------------------------------------

    async def read_fleet(self) -> LocalFleet:
        """One read of this host's GPUs (shared with the reads under way; see
        ``SpawnerRuntime.inventory``), and in dynamic mode the recent request mix."""
        inventory = await self.runtime.inventory()
        # Dynamic placement keeps room for the sizes users ask for most.
        demand = (await self.runtime.run(self.runtime.demand)
                  if self.mig_mode == "dynamic" else None)
        return LocalFleet(inventory, demand)

    def supply_from(self, fleet: LocalFleet, held: Sequence[Lease]) -> SliceSupply:
        """The GPU models present, the free slices per model and profile, the held leases."""
        inventory = fleet.inventory
        free = free_now(inventory, held, self.mig_mode)
        # The driver's figures (memory, SMs) win over the catalog's in the form.
        return SliceSupply(tuple(inventory.model(key) for key in free), free, tuple(held),
                           fixed_layout=self.mig_mode == "pool")

    def plan_claim(self, fleet: LocalFleet, offer: Offer, mine: UserPolicy) -> ClaimPlan:
        """How to claim one slice of ``offer`` for a user with policy ``mine`` on ``fleet``."""
        inventory = fleet.inventory
        decide = make_decide(mine, offer, inventory, self.mig_mode, self.strategy,
                             fleet.demand)

        def granted(lease: Lease) -> str:
            return f"GPU {lease.gpu_index} ({_gpu_name(inventory, lease)})"

        def memory(lease: Lease) -> str | None:
            gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
            gpu_model = inventory.model(gpu.model_key) if gpu and gpu.model_key else None
            ok = gpu_model is not None and gpu_model.has_profile(lease.profile)
            return gpu_model.profile(lease.profile).memory_text if ok else None

        return ClaimPlan(
            decide, granted, wanted_profiles(offer, inventory), inventory.host, memory
        )

    def wait_guard(self) -> StarvationGuard | None:
        """Dynamic mode: a smaller request that fits may start before a larger one that
        does not, within the guard's bound."""
        return StarvationGuard() if self.mig_mode == "dynamic" else None

    async def after_claim(self, lease: Lease) -> Lease:
        """Dynamic mode creates the reserved instance; pool mode's slice exists."""
        if self.mig_mode == "dynamic":
            return await self._create_instance(lease)
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
                reason=Reason.MIG_CREATE,
                log_message=str(e),
            ) from None
        except LeaseStateError as e:
            raise spawn_error(
                "The slice reserved for this server was given back while it was starting "
                f"({e.lease.release_reason}); start it again.",
                reason=Reason.LEASE_ENDED,
                log_message=str(e),
            ) from None
        except LedgerError as e:
            raise self._backend_error(e) from None
        self._lease = lease
        # The instance's UUID is for the log; the user hears the size again.
        self.progress_log.add(60, f"Created the {lease.profile} instance on GPU {lease.gpu_index}")
        return lease


    async def prepare_slice(self, lease: Lease) -> None:
        """With isolation on: create the slice's capability nodes, wrap the command."""
        if self._configured_cmd is None:
            self._configured_cmd = list(self.cmd)
        if not self.isolation:
            self.cmd = list(self._configured_cmd)
            return
        inventory = await self.runtime.inventory()
        gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
        if gpu is None or lease.gi_id is None or lease.ci_id is None:
            raise admin_error(
                "The hub could not find the reserved slice to isolate it",
                Reason.ISOLATION,
                f"lease {lease.id}: GPU {lease.gpu_uuid} gi={lease.gi_id} "
                f"ci={lease.ci_id} not in the inventory",
            )
        await self.runtime.run(self._make_capability_nodes, lease)
        rules = device_rules(gpu.minor, lease.gi_id, lease.ci_id)
        self.cmd = [*systemd_run_args(rules), *self._configured_cmd]

    def _make_capability_nodes(self, lease: Lease) -> None:
        tool = shutil.which(self.nvidia_modprobe)
        if tool is None or shutil.which("systemd-run") is None:
            raise admin_error(
                "GPU isolation is on but this host cannot apply it",
                Reason.ISOLATION,
                f"isolation needs {self.nvidia_modprobe!r} and 'systemd-run' "
                "in the hub's PATH (set LocalMIGSpawner.isolation = False to run without)",
            )
        args = [tool]
        for path in capability_paths(lease.gpu_index or 0, lease.gi_id or 0, lease.ci_id or 0):
            args += ["-f", path]
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode:
            raise admin_error(
                "The hub could not prepare the GPU slice's device nodes",
                Reason.ISOLATION,
                f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}",
            )


class SimpleLocalMIGSpawner(LocalMIGSpawner, SimpleLocalProcessSpawner):
    """Like ``LocalMIGSpawner`` but every server runs as the hub's user (demos, tests).

    Provides no isolation between users beyond the MIG slice itself, exactly like
    JupyterHub's ``SimpleLocalProcessSpawner``; never use it on a shared host.
    """


def _gpu_name(inventory: Inventory, lease: Lease) -> str:
    gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
    return gpu.product if gpu else "unknown GPU"
