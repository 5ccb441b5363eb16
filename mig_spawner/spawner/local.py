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

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Bool, Unicode

from mig_spawner.ledger import Lease

from .errors import admin_error
from .isolation import capability_paths, device_rules, systemd_run_args
from .mixin import MIGSpawnerMixin


class LocalMIGSpawner(MIGSpawnerMixin, LocalProcessSpawner):
    """A local-process spawner that gives each server one MIG slice."""

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

    async def prepare_slice(self, lease: Lease) -> None:
        """With isolation on: create the slice's capability nodes, wrap the command."""
        if self._configured_cmd is None:
            self._configured_cmd = list(self.cmd)
        if not self.isolation:
            self.cmd = list(self._configured_cmd)
            return
        inventory = await self.runtime.run(lambda: self.runtime.gpu().inventory())
        gpu = inventory.gpu_by_uuid(lease.gpu_uuid or "")
        if gpu is None or lease.gi_id is None or lease.ci_id is None:
            raise admin_error(
                "The hub could not find the reserved slice to isolate it",
                "isolation",
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
                "isolation",
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
                "isolation",
                f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}",
            )


class SimpleLocalMIGSpawner(LocalMIGSpawner, SimpleLocalProcessSpawner):
    """Like ``LocalMIGSpawner`` but every server runs as the hub's user (demos, tests).

    Provides no isolation between users beyond the MIG slice itself, exactly like
    JupyterHub's ``SimpleLocalProcessSpawner``; never use it on a shared host.
    """
