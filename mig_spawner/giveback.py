"""Giving a slice back: the one order of steps the spawner and the slice service share.

A dynamic lease's instance is destroyed *before* the lease is released, so the ledger
never shows a slice free that still exists on the GPU. An instance that still runs
processes is never forced: the lease stays ``releasing`` (still holding its memory
slices) and the PIDs are reported, to be tried again later.
"""

from __future__ import annotations

from mig_spawner.gpu import GpuAdapter
from mig_spawner.gpu.errors import GpuError, InstanceInUse, InstanceNotFound
from mig_spawner.ledger import Lease, Ledger

RELEASED = "released"
#: What precedes, in a ``releasing`` lease's reason, the plain words saying what still
#: holds its slice (shown to the user who starts that server again).
HOLDS_PREFIX = "held by: "


def still_holding(lease: Lease) -> str:
    """In plain words, what keeps ``lease``'s slice from being free (for users)."""
    reason = lease.release_reason or ""
    if HOLDS_PREFIX in reason:
        return reason.split(HOLDS_PREFIX, 1)[1]
    if lease.state == "releasing":
        return "the hub is still giving it back"
    return "the hub could not record yet that it was given back; it keeps trying"


def give_back(ledger: Ledger, gpus: GpuAdapter | None, lease: Lease, reason: str) -> str:
    """Destroy ``lease``'s dynamic instance if it has one, then release the lease.

    Blocking (NVML, SQL): call it off the event loop. Returns :data:`RELEASED`, or a
    sentence saying why the slice is still held.
    """
    if lease.mode == "dynamic" and lease.gi_id is not None and lease.gpu_index is not None:
        if gpus is None:
            ledger.begin_release(lease.id, reason)
            return "its dynamic instance must be destroyed, but there is no GPU access here"
        try:
            gpus.destroy_instance(lease.gpu_index, lease.gi_id)
        except InstanceNotFound:
            pass  # destroyed already (by the other party, or out of band)
        except InstanceInUse as e:
            ledger.begin_release(
                lease.id, f"{reason}; {HOLDS_PREFIX}processes still run on its GPU instance "
                f"(PIDs {', '.join(map(str, e.pids))})",
            )
            return f"instance still runs PIDs {list(e.pids)}; left releasing, not killed"
        except GpuError as e:
            # Said in the lease (the slice map, the user's next start) and retried by the
            # spawner within seconds and by the slice service at each sweep.
            ledger.begin_release(
                lease.id, f"{reason}; {HOLDS_PREFIX}the GPU did not let the hub destroy its "
                "instance yet; the hub keeps trying",
            )
            raise e
    if ledger.release(lease.id, reason) is None:
        return "already released"
    return RELEASED
