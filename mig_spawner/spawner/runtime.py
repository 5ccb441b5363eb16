"""What every MIG spawner of one hub process shares: the ledger, the GPU adapter, threads.

JupyterHub makes one Spawner object per server, but there is one ledger and one
GPU per host, so spawners get them from :func:`runtime_for`, keyed by their
configuration. Blocking calls (SQL, NVML) run on a small pool of threads, off the
hub's event loop: claims, activations and releases of different servers do not wait
behind each other (each thread takes its own database connection from SQLAlchemy's
pool; the claim's serialised transaction is the database's business). The GPU
adapter (NVML handles, the simulator's state file) is used by one thread at a time
(:class:`_OneAtATime`), and ledger work never waits for it. Inventory reads that
arrive while one is under way share the next one (:meth:`SpawnerRuntime.inventory`):
a burst of claims costs two reads of the driver, not one per claim.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, TypeVar, cast

from mig_spawner.core.allocator import SliceIndex
from mig_spawner.core.answer import RECENT
from mig_spawner.core.inventory import Inventory
from mig_spawner.gpu import GpuAdapter, connect
from mig_spawner.ledger import Ledger

from .metrics import WORKER_WAIT

T = TypeVar("T")

#: Threads for ledger (and GPU) calls: enough that a slow one (a release that waits for
#: a holder) does not hold up the others, few enough for SQLAlchemy's pool (5 + 10).
THREADS = 8
#: The request history dynamic placement weighs (docs/allocator.md: "demand")...
DEMAND_WINDOW = timedelta(days=7)
#: ...re-read at most this often: a week's mix hardly moves in a minute, and a claim
#: should not pay for a history query each time.
DEMAND_TTL_SECONDS = 60.0


def _timed(job: Callable[[], T]) -> Callable[[], T]:
    """``job``, observing on ``mig_spawner_worker_wait_seconds`` how long it waited for
    a worker thread: the one figure that says whether :data:`THREADS` is too few."""
    queued = time.perf_counter()

    def timed() -> T:
        WORKER_WAIT.observe(time.perf_counter() - queued)
        return job()

    return timed


@dataclass(frozen=True)
class RuntimeKey:
    """The settings that decide which ledger and which GPU a spawner talks to."""

    ledger_url: str
    simulate: str | None
    sim_state_file: str | None


class _OneAtATime:
    """The GPU adapter, its calls made one at a time from whichever thread calls."""

    def __init__(self, adapter: GpuAdapter) -> None:
        self._adapter = adapter
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._adapter, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)

        return call


@dataclass
class SpawnerRuntime:
    """The ledger, the GPU adapter and the worker threads for one :class:`RuntimeKey`."""

    key: RuntimeKey
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(THREADS, thread_name_prefix="mig-spawner")
    )
    _ledger: Ledger | None = None
    _gpu: GpuAdapter | None = None
    #: Seconds the last servers took to answer after their start (core.answer).
    answers: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    _demand: tuple[float, dict[str, int]] | None = None
    _opening: threading.Lock = field(default_factory=threading.Lock)
    # The shared GPU reads (see inventory_here()): how many have started, and the last
    # one's number and result (or error). One is under way while the two numbers differ.
    _reads: threading.Condition = field(default_factory=threading.Condition)
    _reads_started: int = 0
    _last_read: tuple[int, Inventory | None, Exception | None] = (0, None, None)
    # The allocator's index of this host, told every newer read (see index_here()).
    _index: SliceIndex | None = None
    _newest: Inventory | None = None
    _indexing: threading.Lock = field(default_factory=threading.Lock)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on a worker thread and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, _timed(partial(fn, *args, **kwargs)))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on a worker thread without waiting for it."""
        return self.executor.submit(_timed(partial(fn, *args)))

    async def inventory(self) -> Inventory:
        """A read of the GPUs that started after this call (:meth:`inventory_here`), in
        one trip to a worker thread."""
        return await self.run(self.inventory_here)

    # The accessors below run on a worker thread (called from inside ``run``).

    def inventory_here(self) -> Inventory:
        """A read of the GPUs that started after this call; the callers that arrive
        while one read is under way share the next one, so a class start reads the GPUs
        a few times, not once per spawn. On a worker thread: a claim reads its fleet in
        the same trip as it claims (``waiting.claim``)."""
        with self._reads:
            wanted = self._reads_started + 1  # the next read to start is new enough
            while self._last_read[0] < wanted:
                if self._reads_started == self._last_read[0]:  # none under way: read now
                    self._reads_started = wanted
                    break
                self._reads.wait()
            else:
                _, inventory, error = self._last_read
                if error is not None:
                    raise error
                assert inventory is not None
                return inventory
        inventory, error = None, None
        try:
            inventory = self.gpu().inventory()
            return inventory
        except Exception as e:
            error = e
            raise
        finally:
            if inventory is None and error is None:  # interrupted: the others must not wait
                error = RuntimeError("the GPU read was interrupted")
            with self._reads:
                self._last_read = (wanted, inventory, error)
                if inventory is not None:
                    self._newest = inventory
                self._reads.notify_all()

    def index_here(self) -> SliceIndex:
        """The allocator's index of this host after a read of the GPUs
        (:meth:`inventory_here`). One index for the runtime, kept across claims and grant
        passes: each decision tells it the ledger's held leases and applies only what
        changed, and a newer read recounts only the GPUs that changed (a layout change,
        a fault), so a decision's cost does not grow with the fleet."""
        self.inventory_here()
        with self._indexing:
            with self._reads:
                newest = self._newest  # never older than the read above
            assert newest is not None
            if self._index is None:
                self._index = SliceIndex(newest)
            else:
                with self._index.lock:
                    self._index.refresh(newest)
            return self._index

    def ledger(self) -> Ledger:
        """The ledger, opened (and its schema migrated) on first use."""
        if self._ledger is None:
            with self._opening:
                if self._ledger is None:
                    self._ledger = Ledger.open(self.key.ledger_url)
        self._ledger.usage.budget_horizon = self.budget_horizon
        return self._ledger

    #: How far back claims read past leases for budgets (the policies' longest budget
    #: window, set each time a spawner reads the policies); ``None``: no budgets.
    budget_horizon: float | None = None

    def gpu(self) -> GpuAdapter:
        """The GPU adapter: real NVML, or the simulator when ``simulate`` is set; its
        calls are made one at a time."""
        if self._gpu is None:
            with self._opening:
                if self._gpu is None:
                    adapter = connect(simulate=self.key.simulate,
                                      state_file=self.key.sim_state_file)
                    self._gpu = cast(GpuAdapter, _OneAtATime(adapter))
        return self._gpu

    def demand(self) -> dict[str, int]:
        """Requests per profile over the last :data:`DEMAND_WINDOW` (leases claimed and
        refusals recorded), from one ledger query at most every :data:`DEMAND_TTL_SECONDS`."""
        now = time.monotonic()
        cached = self._demand
        if cached is None or now - cached[0] > DEMAND_TTL_SECONDS:
            since = datetime.now(UTC) - DEMAND_WINDOW
            cached = self._demand = (now, self.ledger().refusals.request_counts(since))
        return cached[1]


_RUNTIMES: dict[RuntimeKey, SpawnerRuntime] = {}
_LOCK = threading.Lock()


def runtime_for(key: RuntimeKey) -> SpawnerRuntime:
    """The one shared runtime for these settings in this process."""
    with _LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = SpawnerRuntime(key)
        return runtime
