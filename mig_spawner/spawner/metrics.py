"""The MIG spawner's Prometheus metrics, served by the hub itself on ``/hub/metrics``.

JupyterHub exports prometheus_client's default registry there (admins, or tokens with
the ``read:metrics`` scope), so these are defined once, at import, in that registry:
one hub process has one set. The slice service keeps its own (``service/metrics.py``).
Labels stay few-valued: refusal and release codes, group and profile names, modes.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from mig_spawner.core.refusal import Reason

SPAWN_REFUSALS = Counter(
    "mig_spawner_spawn_refusals",
    f"Spawns that got no MIG slice, by refusal code ({Reason.NONE_FREE}, {Reason.USER_LIMIT}, "
    f"{Reason.NOT_ALLOWED}, ...) and the group concerned.",
    ["reason", "group"],
)
LEASES_CLAIMED = Counter(
    "mig_spawner_leases_claimed",
    "Leases granted by the hub, by profile, charged group and mode (pool, dynamic, kube).",
    ["profile", "group", "mode"],
)
LEASES_RELEASED = Counter(
    "mig_spawner_leases_released",
    "Leases the hub gave back, by the release code the ledger kept (stopped, "
    "server_exited, start_failed, stale, cancelled; budget or drain when the slice "
    "service recorded why before the hub's stop).",
    ["reason"],
)
CLAIM_DURATION = Histogram(
    "mig_spawner_claim_duration_seconds",
    "Time from asking the backend for a slice to the lease being granted or refused.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
WORKER_WAIT = Histogram(
    "mig_spawner_worker_wait_seconds",
    "Time a ledger or GPU call of the hub waited for one of the spawners' worker threads "
    "before it ran: high while every thread is busy (a class start), near zero otherwise.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RELEASES_HELD_BACK = Counter(
    "mig_spawner_releases_held_back",
    "Releases the hub did not do, by why: holder_unknown (its server process could not "
    "be checked or stopped, so the slice stays held) or giveback_failed (retried).",
    ["why"],
)
HOLDERS_STOPPED = Counter(
    "mig_spawner_holders_stopped",
    "Server processes of a lease that the hub no longer tracked and stopped before "
    "releasing the lease (e.g. left running by a hub killed mid-spawn).",
)
WAITERS = Gauge(
    "mig_spawner_waiters",
    "Spawns waiting in line for a slice now, by offer and the group they are charged to.",
    ["profile", "group"],
)
WAIT_SECONDS = Histogram(
    "mig_spawner_wait_seconds",
    "Time a spawn waited in line until it was granted a slice, by offer and group.",
    ["profile", "group"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600),
)
SERVER_ANSWER = Histogram(
    "mig_spawner_server_answer_seconds",
    "Time from a server's start on its slice to its first answer (the spawner waits for "
    "it: docs/operations.md, 'Starting on a loaded host').",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
RELEASE_TO_GRANT = Histogram(
    "mig_spawner_release_to_grant_seconds",
    "Time from the release that freed a slice to its grant to the first waiter.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
)
ABANDONED_WAITS = Counter(
    "mig_spawner_abandoned_waits",
    "Waits ended because the hub restarted while they waited, by offer and group.",
    ["profile", "group"],
)
