"""Where the slice map comes from in a running service: the GPU adapter, the ledger, the policy.

One :class:`SliceSource` serves the Prometheus collector and the admin map alike. It
keeps the last snapshot for ``max_age`` seconds, so a dashboard refreshing every few
seconds plus a Prometheus scrape do not each walk NVML and query the ledger.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from mig_spawner.core.clock import utcnow
from mig_spawner.core.inventory import Inventory
from mig_spawner.core.policy import PolicySet
from mig_spawner.gpu import GpuAdapter
from mig_spawner.ledger import Ledger
from mig_spawner.observe.slice_state import DEFAULT_IDLE_AFTER, SliceMap, slice_map

#: The inventory of a host without GPUs.
NO_GPUS = Inventory(host="", driver_version="", nvml_version="", cuda_driver_version=0)


class SliceSource:
    """Builds (and briefly caches) the :class:`SliceMap` of this host."""

    def __init__(
        self,
        gpus: GpuAdapter | None,
        ledger: Ledger,
        policy: PolicySet | None = None,
        *,
        idle_after: float = DEFAULT_IDLE_AFTER,
        max_age: float = 2.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``max_age``: seconds a snapshot is reused (0: a fresh one every call).
        ``gpus`` None: a service off the GPU hosts (a Kubernetes hub's, whose map draws
        the cluster's nodes): no GPU of its own, the ledger's leases still listed."""
        if max_age < 0:
            raise ValueError(f"max_age must be 0 or more seconds, got {max_age}")
        self.gpus = gpus
        self.ledger = ledger
        self.policy = policy
        self.idle_after = idle_after
        self.max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()  # the hub's executor and the IOLoop may both ask
        self._cached: tuple[float, SliceMap] | None = None

    def snapshot(self) -> SliceMap:
        """The slice map now (or at most ``max_age`` seconds old)."""
        with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.max_age:
                return self._cached[1]
            now = self._clock()
            horizon = self.policy.budget_horizon if self.policy is not None else None
            book = (self.ledger.usage.budget(now - timedelta(seconds=horizon))
                    if horizon is not None else None)
            view = slice_map(
                self.gpus.inventory() if self.gpus is not None else NO_GPUS,
                self.ledger.leases.active(), now, self.policy,
                idle_after=self.idle_after, waits=self.ledger.waits.waiting(), budgets=book,
                changes=self.ledger.holds.changes(), faults=self.ledger.holds.faults(),
            )
            self._cached = (time.monotonic(), view)
            return view
