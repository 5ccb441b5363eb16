"""MIG spawners for one GPU host: servers as local processes, one MIG slice each.

``LocalMIGSpawner`` (entry point ``mig``) runs each server as its user, like
JupyterHub's default ``LocalProcessSpawner``. ``SimpleLocalMIGSpawner``
(``mig-simple``) runs every server as the hub's own user with a per-user home
under a template path: for demos and tests, as JupyterHub's ``simple`` spawner.

With isolation on (the default with the real driver, where the host can apply it)
each server can open only its own slice's device nodes: its process joins a cgroup
v1 ``devices`` group before it runs (``mig_spawner.device_cgroup``), or starts in a
transient systemd scope on a cgroup v2 host (rules from core/isolation.py), or, with no
device cgroup, is the only user who may read its slice's capability nodes.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Bool, Enum, Integer, Unicode

from mig_spawner import device_cgroup
from mig_spawner.config import where_set
from mig_spawner.core.allocator import SliceIndex
from mig_spawner.core.isolation import (
    CAPS,
    PSEUDO_DEVICES,
    DeviceNumber,
    DeviceRule,
    IsolationError,
    capability_paths,
    cgroup_v1_rules,
    device_rules,
    driver_majors,
    driver_numbers,
    systemd_run_args,
)
from mig_spawner.core.kinds import DEFAULT_MIG_MODE, MIG_MODE_KINDS, RULES, KindRules, offer_kind
from mig_spawner.core.policy import Offer, UserPolicy
from mig_spawner.core.refusal import Reason
from mig_spawner.core.waitlist import StarvationGuard
from mig_spawner.gpu.errors import GpuError
from mig_spawner.kinds import Confinement, kind_of
from mig_spawner.ledger import GpuFault, Lease, LeaseStateError, LedgerError

from .backend import ClaimPlan, SliceSupply, held_back
from .decide import faulty_models, free_now, make_decide, wanted_profiles
from .errors import admin_error, spawn_error
from .mixin import MIGSpawnerMixin


@dataclass(frozen=True)
class LocalFleet:
    """One read of this host: its GPUs, and the request mix dynamic placement weighs."""

    #: The host's allocator index (``SpawnerRuntime.index_here``), told this read.
    index: SliceIndex
    demand: dict[str, int] | None
    #: Slices held from new grants: a layout change's (docs/layout.md), a fault's.
    holds: Mapping[tuple[str, str], frozenset[int]] = field(default_factory=dict)
    #: The GPU faults held on this host (docs/health.md): part of :attr:`holds`.
    faults: Sequence[GpuFault] = ()


class LocalMIGSpawner(MIGSpawnerMixin, LocalProcessSpawner):
    """A local-process spawner that gives each server one MIG slice."""

    mig_mode = Enum(
        list(MIG_MODE_KINDS),
        default_value=DEFAULT_MIG_MODE,
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
        None,
        allow_none=True,
        help="""Confine each server to its slice with the kernel's device cgroup.

        The server and everything it starts can open only /dev/nvidiactl,
        /dev/nvidia-uvm(-tools), its GPU's /dev/nvidia<N>, its GI/CI capability nodes
        (which the hub creates first with ``nvidia-modprobe -f``) and the pseudo devices
        (/dev/null, terminals). On a cgroup v1 host the server joins a ``devices`` group
        of its own before it runs; on a cgroup v2 host it starts under ``systemd-run
        --scope -p DevicePolicy=closed -p DeviceAllow=...``; on a host with no device
        cgroup, its slice's capability nodes belong to its user alone while it runs.
        Needs the hub to run as root; protects servers that do not run as root (root
        can leave its cgroup).
        Without it, ``CUDA_VISIBLE_DEVICES`` only asks CUDA to use the slice: a user
        can change it.

        ``None`` (default): on with the real driver where this host can apply it (else
        off, with a warning in the log; ``mig-spawner doctor`` says why), off with
        simulated GPUs. ``True``: on; a spawn fails when the host cannot apply it.
        ``False``: off. See docs/admin-install.md.
        """,
    ).tag(config=True)

    device_dir = Unicode(
        "/dev",
        help="""Where the NVIDIA device nodes are (with isolation on). With the real
        driver the rules' device numbers come from the driver (/proc/devices); with
        simulated GPUs, from the nodes here: stand-ins, as ``mig-spawner demo
        --simulate --isolation`` makes them.""",
    ).tag(config=True)

    nvidia_modprobe = Unicode(
        "nvidia-modprobe",
        help="Command that creates the MIG capability device nodes (with isolation on).",
    ).tag(config=True)

    nice = Integer(
        0,
        min=0,
        max=19,
        help="""The servers' CPU nice value (0 to 19): how far behind the hub they come
        when the CPU is short, for the server and everything it starts.

        When a class presses Start at once, the servers starting use every core, and on
        Linux each one (in a session of its own) gets as much CPU as the whole hub: the
        hub's pages and API then answer in seconds, and every spawn waits for the hub.
        10 keeps the hub ahead of the servers while they compete; it costs the servers
        nothing while the host is not busy. It is applied to the server's scheduling
        group too (``/proc/self/autogroup``), where a plain nice would change nothing
        against other sessions. 0 (default): the same priority as the hub, as JupyterHub's
        own spawner. See docs/admin-install.md ("A class starts at once").
        """,
    ).tag(config=True)

    #: What a confined server may open besides its slice: the pseudo devices, as
    #: systemd's ``DevicePolicy=closed`` admits them (cgroup v1 only; tests narrow it).
    device_baseline: tuple[str, ...] = PSEUDO_DEVICES
    #: Where the cgroup v1 groups are made (tests may point elsewhere).
    cgroups = device_cgroup.SliceCgroups()
    #: How this host confines servers (tests stand in other kinds of host).
    host_support = staticmethod(device_cgroup.host_support)

    #: A server that exits or does not answer is started once more on its slice.
    answer_tries = 2

    _configured_cmd: list[str] | None = None
    _join: device_cgroup.CgroupJoin | None = None
    _scope_user: str | None = None
    _warned = False

    # --- the backend hooks (see MIGSpawnerMixin) -------------------------------------

    reads_fleet_here = True

    async def read_fleet(self) -> LocalFleet:
        """One read of this host's GPUs (:meth:`fleet_here`), in one trip to a worker
        thread."""
        return await self.runtime.run(self.fleet_here)

    def fleet_here(self) -> LocalFleet:
        """On a worker thread: this host's GPUs (a read shared with the ones under way;
        see ``SpawnerRuntime.inventory_here``), the layout holds, and in dynamic mode the
        recent request mix."""
        # Dynamic placement keeps room for the sizes users ask for most.
        demand = self.runtime.demand() if self.slice_kind.made_per_lease else None
        ledger = self.runtime.ledger()
        index = self.runtime.index_here()
        return LocalFleet(index, demand, ledger.holds.held(),
                          ledger.holds.faults(index.inventory.host))

    def plan_here(self, offer: Offer, mine: UserPolicy
                  ) -> Callable[[dict[Any, Any]], ClaimPlan]:
        """The claim's plan is read on the worker thread that claims (one trip), on the
        fleet its claim pass read for this kind of slice (read here if none did yet)."""

        def plan(fleets: dict[Any, Any]) -> ClaimPlan:
            kind = self.slice_kind
            if kind not in fleets:
                fleets[kind] = self.fleet_here()
            return self.plan_claim(fleets[kind], offer, mine)

        return plan

    def supply_from(self, fleet: LocalFleet, held: Sequence[Lease]) -> SliceSupply:
        """The GPU models present, the free slices per model and profile, the held leases."""
        index = fleet.index
        free = free_now(index, held, self.slice_kind.kind, fleet.holds)
        faulted = {(f.host, f.gpu_uuid) for f in fleet.faults}
        recut = (held_back(free_now(index, held, self.slice_kind.kind), free)
                 if fleet.holds.keys() - faulted else {})
        # The driver's figures (memory, SMs) win over the catalog's in the form.
        return SliceSupply(tuple(index.inventory.model(key) for key in free), free, tuple(held),
                           fixed_layout=self.slice_kind.fixed_layout, recut=recut,
                           unhealthy=faulty_models(index, fleet.faults))

    def plan_claim(self, fleet: LocalFleet, offer: Offer, mine: UserPolicy) -> ClaimPlan:
        """How to claim one slice of ``offer`` for a user with policy ``mine`` on ``fleet``."""
        index = fleet.index
        decide = make_decide(mine, offer, index, self.slice_kind.kind, self.strategy,
                             fleet.demand)

        def granted(lease: Lease) -> str:
            gpu = index.gpu(lease.gpu_uuid or "")
            return f"GPU {lease.gpu_index} ({gpu.product if gpu else 'unknown GPU'})"

        def memory(lease: Lease) -> str | None:
            gpu = index.gpu(lease.gpu_uuid or "")
            gpu_model = index.inventory.model(gpu.model_key) if gpu and gpu.model_key else None
            ok = gpu_model is not None and gpu_model.has_profile(lease.profile)
            return gpu_model.profile(lease.profile).memory_text if ok else None

        return ClaimPlan(
            decide, granted, wanted_profiles(offer, index), index.inventory.host, memory,
            carved=offer_kind(offer.whole, self.slice_kind.kind).rules.made_per_lease,
        )

    def wait_guard(self) -> StarvationGuard | None:
        """Dynamic mode: a smaller request that fits may start before a larger one that
        does not, within the guard's bound."""
        return StarvationGuard() if self.slice_kind.passes_over else None

    @property
    def slice_kind(self) -> KindRules:
        """The kind of slice :attr:`mig_mode` makes (the one place it is mapped)."""
        return RULES[MIG_MODE_KINDS[self.mig_mode]]

    def confinement(self) -> Confinement:
        """This spawner's cgroups and capability nodes (:attr:`device_dir`)."""
        return Confinement(self.cgroups, self._caps_dir)

    async def after_claim(self, lease: Lease) -> Lease:
        """A dynamic lease's instance is created now; other kinds' slices exist."""
        if kind_of(lease).rules.made_per_lease:
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
                return self.runtime.ledger().leases.record_instance(
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
                "The slice reserved for this server was given back while it was starting"
                f"{_why_ended(e.lease)}; start it again.",
                reason=Reason.LEASE_ENDED,
                log_message=str(e),
            ) from None
        except LedgerError as e:
            raise self._backend_error(e) from None
        self._lease = lease
        # The instance's UUID is for the log; the user hears the size again.
        self.progress_log.add(60, f"Created the {lease.profile} instance on GPU {lease.gpu_index}")
        return lease


    # --- isolation ---------------------------------------------------------------

    def config_problems(self) -> list[str]:
        """What the isolation settings refuse on this host, one line each (the hub's
        start-up check and ``mig-spawner doctor`` ask): isolation on (``True``) where the
        host cannot confine servers; on without the folder of device nodes
        (``device_dir``), or, with the real driver, without ``nvidia_modprobe``. Every
        spawn would fail on them."""
        simulated = bool(self.shared.simulate)
        if self.isolation is False or (self.isolation is None and simulated):
            return []  # off: nothing else of it is read

        def setting(name: str) -> str:
            return where_set(self.config, type(self), name)

        if not Path(self.device_dir).is_dir():
            return [f"{setting('device_dir')} = {self.device_dir!r}: no such folder; "
                    f"isolation ({setting('isolation')} = {self.isolation}) reads the NVIDIA "
                    "device nodes there"]
        support = self.host_support(caps_dir=self._caps_dir)
        try:
            plan = device_cgroup.isolation_plan(self.isolation, simulated, support)
        except device_cgroup.IsolationUnavailable as e:
            return [f"{setting('isolation')} = True: this host cannot confine servers "
                    f"({e}); set it to None (confined where the host can) or False "
                    "(mig-spawner doctor, docs/admin-install.md)"]
        if plan.mechanism and not simulated and shutil.which(self.nvidia_modprobe) is None:
            return [f"{setting('nvidia_modprobe')} = {self.nvidia_modprobe!r}: not found in "
                    "the hub's PATH; isolation needs it to create the slices' capability "
                    "nodes (give its full path)"]
        return []

    @property
    def simulated(self) -> bool:
        """Whether the GPUs are the NVML simulator's (``c.MIGSettings.simulate``)."""
        return bool(self.runtime.key.simulate)

    def isolation_mechanism(self) -> str | None:
        """How this server is confined (``device_cgroup.CGROUP_V1`` or ``SYSTEMD``), or
        ``None`` when it is not (``device_cgroup.isolation_plan``). Raises
        SpawnException when isolation is on (``True``) and the host cannot apply it."""
        support = self.host_support(caps_dir=self._caps_dir)
        try:
            plan = device_cgroup.isolation_plan(self.isolation, self.simulated, support)
        except device_cgroup.IsolationUnavailable as e:
            raise admin_error("GPU isolation is on but this host cannot apply it",
                              Reason.ISOLATION, f"{e} (see mig-spawner doctor; "
                              "LocalMIGSpawner.isolation = False runs without)") from None
        if plan is support and plan.mechanism is None and not LocalMIGSpawner._warned:
            LocalMIGSpawner._warned = True  # once per hub, not once per spawn
            self.log.warning("Servers are NOT confined to their GPU slice: %s "
                             "(mig-spawner doctor, docs/admin-install.md)", support.why)
        return plan.mechanism

    def device_numbers(self) -> DeviceNumber:
        """Each rule's device number: the driver's with the real GPUs, the stand-in
        node's with simulated ones (:attr:`device_dir`)."""
        if self.simulated:
            return lambda rule: device_cgroup.node_number(rule.path)
        return driver_numbers(driver_majors(device_cgroup.read_proc_devices()))

    async def prepare_slice(self, lease: Lease) -> None:
        """With isolation on: create the slice's capability nodes, then its device cgroup
        (v1) or the ``systemd-run`` command around the server's (v2)."""
        if self._configured_cmd is None:
            self._configured_cmd = list(self.cmd)
        self.cmd = list(self._configured_cmd)
        self._scope_user = None
        mechanism = self.isolation_mechanism()
        if mechanism is None:
            return
        rules = await self._slice_rules(lease)
        if not self.simulated:
            await self.runtime.run(self._make_capability_nodes, lease, rules)
        if mechanism == device_cgroup.SYSTEMD:
            self._scope_user = self.user.name if self.runs_as_user else None
            self.cmd = [*systemd_run_args(rules, device_cgroup.scope_unit(lease.id),
                                          self._scope_user), *self._configured_cmd]
            return
        try:
            if mechanism == device_cgroup.CAPABILITY_NODES:
                uid, gid = self._server_ids()
                held = await self.runtime.run(self._held_capability_nodes, lease.id)
                await asyncio.to_thread(device_cgroup.own_capabilities, self._caps_dir,
                                        _capability_nodes(rules), uid, gid, held)
                return
            allow = cgroup_v1_rules(rules, self.device_numbers(), self.device_baseline)
            await self.runtime.run(self._make_cgroup, lease.id, allow)
        except (IsolationError, OSError, ValueError, KeyError) as e:
            raise admin_error("The hub could not confine the server to its GPU slice",
                              Reason.ISOLATION, f"lease {lease.id}: {e!r}") from None

    @property
    def _caps_dir(self) -> Path:
        return Path(self.device_dir) / "nvidia-caps"

    async def _slice_rules(self, lease: Lease) -> tuple[DeviceRule, ...]:
        """The device rules of the lease's slice (its GPU's minor read from the GPUs)."""
        inventory = await self.runtime.inventory()
        gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
        try:
            if gpu is None:
                raise ValueError("GPU not in the inventory")
            return kind_of(lease).device_rules(lease, gpu.minor, self.device_dir)
        except ValueError as e:
            raise admin_error(
                "The hub could not find the reserved slice to isolate it",
                Reason.ISOLATION,
                f"lease {lease.id}: GPU {lease.gpu_uuid} gi={lease.gi_id} "
                f"ci={lease.ci_id}: {e}",
            ) from None

    def _held_capability_nodes(self, lease_id: str) -> list[str]:
        """The capability nodes of the slices other leases hold on this host (runtime
        thread): their servers keep them."""
        inventory = self.runtime.gpu().inventory()
        nodes = []
        for other in self.runtime.ledger().leases.active():
            gpu = inventory.gpu_by_uuid(other.gpu_uuid or "")
            if other.id != lease_id and gpu and other.gi_id is not None and (
                    other.ci_id is not None):
                nodes += _capability_nodes(device_rules(gpu.minor, other.gi_id, other.ci_id,
                                                        self.device_dir))
        return nodes

    def _server_ids(self) -> tuple[int, int]:
        """The user and group IDs the server runs as (``KeyError``: no such account)."""
        if not self.runs_as_user:
            return os.geteuid(), os.getegid()
        account = pwd.getpwnam(self.user.name)
        return account.pw_uid, account.pw_gid

    def _make_cgroup(self, lease_id: str, allow: list[str]) -> None:
        """Make the lease's group and open it for the child to join; remove the empty
        groups of leases this ledger knows ended (released by the slice service, or
        by a hub that died before it removed them). On the runtime's thread."""
        for old in self.cgroups.leftovers():
            ended = self.runtime.ledger().leases.get(old) if old != lease_id else None
            if ended is not None and not ended.held:
                self.cgroups.remove(old)
        self.cgroups.create(lease_id, allow)
        self._join = self.cgroups.joiner(lease_id)

    #: Whether servers run as their user's Unix account (``SimpleLocalMIGSpawner``: no).
    runs_as_user = True

    def make_preexec_fn(self, name: str) -> Callable[[], None]:
        """Lower the server's priority (``nice``) and join the slice's cgroup first
        (still root), then become the user."""
        then = self._become(name)
        steps = [lower_priority(self.nice)] if self.nice else []
        if self._join is not None:
            steps.append(self._join)
        if not steps:
            return then

        def preexec() -> None:
            for step in steps:
                step()
            then()

        return preexec

    def _become(self, name: str) -> Callable[[], None]:
        """The child's last step: JupyterHub's (become the user). In a systemd scope,
        systemd-run becomes the user itself (it must start as root): only go home."""
        if self._scope_user is None:
            return super().make_preexec_fn(name)
        home = pwd.getpwnam(name).pw_dir
        return lambda: os.chdir(home) if os.path.isdir(home) else None

    async def start(self) -> Any:
        try:
            return await super().start()
        finally:
            if self._join is not None:
                self._join.close()  # the child has joined (or was never started)
                self._join = None

    def _make_capability_nodes(self, lease: Lease, rules: tuple[DeviceRule, ...]) -> None:
        if all(os.path.exists(rule.path) for rule in rules if rule.access == "r"):
            return  # made already (by an earlier server on this slice, or at boot)
        tool = shutil.which(self.nvidia_modprobe)
        if tool is None:
            raise admin_error(
                "GPU isolation is on but this host cannot apply it",
                Reason.ISOLATION,
                f"isolation needs {self.nvidia_modprobe!r} in the hub's PATH to create "
                "the slice's capability nodes (LocalMIGSpawner.isolation = False runs "
                "without)",
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
    JupyterHub's ``SimpleLocalProcessSpawner``; never use it on a shared host. (A
    server confined to its slice's device cgroup is confined only while it does not
    run as root.)
    """

    runs_as_user = False


def lower_priority(nice: int) -> Callable[[], None]:
    """What a child runs before it execs the server: take nice value ``nice`` (or keep a
    higher one it inherited), for itself and for its session's scheduling group. The
    child runs in a new session (``start_new_session``), so Linux's autogroup scheduling
    puts it in a group of its own, which shares the CPU with the hub's group as an equal
    whatever the processes' nice values: the group's value is the one that counts.
    Before the child becomes the user: a process that changed user cannot write its own
    ``/proc`` files."""

    def lower() -> None:
        now = os.nice(0)
        if now < nice:
            os.nice(nice - now)
        try:
            with open("/proc/self/autogroup", "w") as group:
                group.write(str(nice))
        except OSError:
            pass  # no autogroup scheduling in this kernel: the nice value is enough

    return lower


def _capability_nodes(rules: tuple[DeviceRule, ...]) -> list[str]:
    return [rule.path for rule in rules if rule.driver == CAPS]


def _why_ended(lease: Lease | None) -> str:
    """`` (its server was stopped)``: why a lease ended, for the user; "" if unknown."""
    code = lease.release_code if lease is not None else None
    return f" ({code.words})" if code is not None else ""
