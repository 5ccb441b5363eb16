"""What every MIG spawner of one hub process shares: the ledger, the GPU adapter, a thread.

JupyterHub makes one Spawner object per server, but there is one ledger and one
GPU per host, so spawners get them from :func:`runtime_for`, keyed by their
configuration. All blocking calls (SQL, NVML) run on ONE worker thread: that
keeps them off the hub's event loop, and NVML handles and the simulator's
state file are only ever touched from that thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, TypeVar

from mig_spawner.gpu import GpuAdapter, connect
from mig_spawner.ledger import Ledger

T = TypeVar("T")

#: The request history dynamic placement weighs (docs/allocator.md: "demand")...
DEMAND_WINDOW = timedelta(days=7)
#: ...re-read at most this often: a week's mix hardly moves in a minute, and a claim
#: should not pay for a history query each time.
DEMAND_TTL_SECONDS = 60.0


@dataclass(frozen=True)
class RuntimeKey:
    """The settings that decide which ledger and which GPU a spawner talks to."""

    ledger_url: str
    simulate: str | None
    sim_state_file: str | None


@dataclass
class SpawnerRuntime:
    """The ledger, the GPU adapter and the worker thread for one :class:`RuntimeKey`."""

    key: RuntimeKey
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="mig-spawner")
    )
    _ledger: Ledger | None = None
    _gpu: GpuAdapter | None = None
    _demand: tuple[float, dict[str, int]] | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the worker thread and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, partial(fn, *args, **kwargs))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn`` on the worker thread without waiting for it (after what is queued
        already, before what comes next)."""
        return self.executor.submit(fn, *args)

    # The accessors below run on the worker thread (called from inside ``run``).

    def ledger(self) -> Ledger:
        """The ledger, opened (and its schema migrated) on first use."""
        if self._ledger is None:
            self._ledger = Ledger.open(self.key.ledger_url)
        return self._ledger

    def gpu(self) -> GpuAdapter:
        """The GPU adapter: real NVML, or the simulator when ``simulate`` is set."""
        if self._gpu is None:
            self._gpu = connect(simulate=self.key.simulate, state_file=self.key.sim_state_file)
        return self._gpu

    def demand(self) -> dict[str, int]:
        """Requests per profile over the last :data:`DEMAND_WINDOW` (leases claimed and
        refusals recorded), from one ledger query at most every :data:`DEMAND_TTL_SECONDS`."""
        now = time.monotonic()
        if self._demand is None or now - self._demand[0] > DEMAND_TTL_SECONDS:
            since = datetime.now(UTC) - DEMAND_WINDOW
            self._demand = (now, self.ledger().request_counts(since))
        return self._demand[1]


_RUNTIMES: dict[RuntimeKey, SpawnerRuntime] = {}
_LOCK = threading.Lock()


def runtime_for(key: RuntimeKey) -> SpawnerRuntime:
    """The one shared runtime for these settings in this process."""
    with _LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = SpawnerRuntime(key)
        return runtime
